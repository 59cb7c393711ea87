"""What the doors that speak another stream format share: the relay's committed stream
(``data:`` frames, then ``[DONE]`` or the gateway's in-band error) cut into whole frames and
handed to the door's renderer, and the count a usage field holds."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Mapping
from typing import Any

from router.drivers.sse import decode_relayed
from router.request.call import StreamingCompletion


class Renderer(ABC):
    """Canonical chunks in, a door's events out; the frames of the relay decoded alike."""

    def frames(self, frames: list[bytes]) -> bytes:
        """The door's events for these whole frames of the relay (b"" for none)."""
        out = b""
        for payload in decode_relayed(frames):
            out += self.end() if payload is None else self.chunk(payload)
        return out

    @abstractmethod
    def chunk(self, chunk: Mapping[str, Any]) -> bytes:
        """The events for one canonical chunk (or the gateway's in-band error)."""

    @abstractmethod
    def end(self) -> bytes:
        """The events that close the stream at ``[DONE]``."""

    def unfinished(self) -> bytes:
        """What the door says of a body that ended without ``[DONE]`` or an error (b"":
        nothing)."""
        return b""


async def rerendered(
    started: StreamingCompletion, renderer: Renderer
) -> AsyncGenerator[bytes, None]:
    body = started.body
    buffer = b""
    try:
        async for piece in body:
            buffer += piece
            frames = buffer.split(b"\n\n")
            buffer = frames.pop()
            out = renderer.frames(frames)
            if out:
                yield out
        out = renderer.frames([buffer]) if buffer.strip() else b""
        out += renderer.unfinished()
        if out:
            yield out
    finally:
        # Closed early (the client left), the relay's body is closed at once too: its own
        # cleanup records the request's end.
        await body.aclose()


def count(value: object) -> int:
    """A token count as a usage field holds it; anything else (absent, null, a bool) is 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
