"""Byte-level Server-Sent-Events reader and writer for streamed completions.

This module owns the event-stream wire format of contract §5 ("Streaming") and nothing else:

* :class:`SSEParser` turns network chunks into :class:`SSEFrame` values by the WHATWG
  event-stream rules: LF, CRLF and CR line ends, multi-line ``data``, comments, ``event``,
  ``id`` and ``retry``. It decodes UTF-8 per complete line, so characters split across
  chunks survive; it refuses frames over 32 KiB and never dispatches a frame cut at EOF.
* :class:`SSEStream` layers JSON on top for drivers: it yields each event's JSON object
  (or, with :meth:`SSEStream.batches`, a network chunk's objects together), stops at
  ``data: [DONE]``, skips and records events that are not JSON objects, enforces the idle
  timeout (on the running loop's clock, or on the :class:`Deadline` source it is given) and
  reports how the body ended (:class:`EndReason`).
* The plain path: a network chunk of whole frames that are one ``data:`` line each (what
  providers send) is split at its blank lines and each payload handed to ``orjson`` as bytes,
  without the per-line machinery; such a batch also keeps the chunk's bytes
  (:attr:`SSEStream.raw`), so that a relay can pass them on unchanged. Anything else in the
  chunk (a comment, a field, CR, a frame cut between chunks, an event that is not a JSON
  object, bytes that are not UTF-8, a BOM) takes the general path for the whole chunk, which
  decides it as before. A stream's first chunk is plain too when it starts with ``data:``
  (which decides that it has no BOM).
* :func:`encode_json` and :data:`DONE_FRAME` write the gateway's own stream to its client;
  :func:`encode_data` writes any text as one event (line ends become ``data`` lines).

It is pure: no HTTP client and no I/O beyond consuming the async iterator of bytes it is
given. Whether an ``eof`` end is a complete stream (a final chunk was seen) is the driver's
decision, not this module's.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from types import TracebackType
from typing import Any, Final, Protocol, TypeAlias

import orjson

__all__ = [
    "DONE_FRAME",
    "MAX_FRAME_BYTES",
    "Deadline",
    "EndReason",
    "InvalidEvent",
    "JSONObject",
    "SSEDecodeError",
    "SSEError",
    "SSEFrame",
    "SSEFrameTooLarge",
    "SSEIdleTimeout",
    "SSEParser",
    "SSEStream",
    "decode_relayed",
    "encode_data",
    "encode_json",
]

JSONObject: TypeAlias = dict[str, Any]

MAX_FRAME_BYTES: Final = 32 * 1024
"""contract §5: frames over 32 KiB are rejected (counted as the bytes of their field lines)."""

DONE_FRAME: Final = b"data: [DONE]\n\n"
"""The OpenAI end-of-stream sentinel, as the gateway writes it to its client."""

_BOM: Final = b"\xef\xbb\xbf"
_CR_BYTE: Final = b"\r"
_DONE: Final = b"[DONE]"
_LINE_END: Final = re.compile(rb"\r\n|\r|\n")
_LF: Final = 0x0A
_CR: Final = 0x0D
_COLON: Final = 0x3A
_SAMPLE_CHARS: Final = 80
_MAX_SAMPLES: Final = 8


class SSEError(Exception):
    """Base of every error raised while reading an event stream."""


class SSEFrameTooLarge(SSEError):
    """A frame, or a single line still waiting for its line end, outgrew the limit."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"SSE frame exceeds {limit} bytes ({size} bytes buffered)")
        self.size = size
        self.limit = limit


class SSEDecodeError(SSEError):
    """A line of the stream is not valid UTF-8."""

    def __init__(self, offset: int, reason: str) -> None:
        super().__init__(f"SSE stream is not valid UTF-8 at byte {offset}: {reason}")
        self.offset = offset


class SSEIdleTimeout(SSEError):
    """The upstream sent nothing for longer than the idle timeout."""

    def __init__(self, idle_timeout_s: float) -> None:
        super().__init__(f"SSE stream idle for more than {idle_timeout_s:g} s")
        self.idle_timeout_s = idle_timeout_s


class EndReason(StrEnum):
    """How an event stream ended."""

    DONE = "done"
    """``data: [DONE]`` was seen."""
    EOF = "eof"
    """The body ended cleanly on a frame boundary, without ``[DONE]``."""
    EOF_MID_FRAME = "eof_mid_frame"
    """The body ended inside a frame or a line; that partial frame was not dispatched."""


@dataclass(frozen=True, slots=True)
class SSEFrame:
    """One dispatched event.

    ``id`` and ``retry`` are stream state at dispatch time, as in the WHATWG model: the
    last event ID persists until an ``id`` field changes it, and ``retry`` is the last
    valid reconnection time in milliseconds (``None`` until one is sent).
    """

    data: str
    event: str = "message"
    id: str = ""
    retry: int | None = None

    @property
    def is_done(self) -> bool:
        """Whether this is the OpenAI ``[DONE]`` end-of-stream sentinel."""
        return self.data == "[DONE]"


class SSEParser:
    """Incremental event-stream parser: bytes in, dispatched frames out.

    Once :meth:`feed` or :meth:`close` has raised an :class:`SSEError` the parser stays
    failed and raises that error again on every call. Frames completed earlier in the
    same chunk as the fault are still returned; the error is raised on the next call.
    """

    def __init__(self, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._max_frame_bytes = max_frame_bytes
        self._head: bytearray | None = bytearray()  # start of stream until the BOM is decided
        self._line = bytearray()
        self._line_start = 0  # stream offset of the first byte of _line
        self._offset = 0  # stream offset of the next byte fed to _consume
        self._skip_lf = False  # the last chunk ended in CR: a leading LF belongs to it
        self._frame_bytes = 0  # field-line bytes of the frame being built; 0 between frames
        self._data: list[str] = []
        self._event = ""
        self._last_event_id = ""
        self._retry: int | None = None
        self._error: SSEError | None = None
        self._closed = False

    def feed(self, chunk: bytes) -> list[SSEFrame]:
        """Consume the next network chunk; return the frames it completed, in order."""
        self._check_usable()
        frames: list[SSEFrame] = []
        try:
            self._consume(self._after_bom(chunk), frames)
        except SSEError as exc:
            self._error = exc
            if not frames:
                raise
        return frames

    def plain_frames(self, chunk: bytes) -> list[bytes] | None:
        """The ``data`` payloads of ``chunk`` if it is, from a frame boundary to one, only
        frames of one ``data:`` line each with LF line ends, none over the frame limit;
        else None. Consumes nothing: :meth:`skip` the chunk after taking its frames, or
        :meth:`feed` it instead."""
        if (
            # Bytes held while the BOM is undecided; none held (the stream's start) is plain
            # too: a chunk that starts with "data:" has no BOM (skip() decides it).
            self._head
            or self._line
            or self._skip_lf
            or self._frame_bytes
            or self._data
            or self._event
            or self._error is not None
            or self._closed
            or not chunk.endswith(b"\n\n")
            # find, not `in`: CPython 3.11 tries a bytes needle of `in` as an integer first,
            # formatting and dropping a TypeError each time, dearer than the search itself
            # (bench/README.md, "Instructions").
            or chunk.find(_CR_BYTE) != -1
        ):
            return None
        limit = self._max_frame_bytes
        end = len(chunk) - 2
        if chunk.find(b"\n", 0, end) == -1:  # one frame of one line: most reads
            if chunk[:5] != b"data:" or end > limit:
                return None
            return [chunk[6:end] if chunk[5:6] == b" " else chunk[5:end]]
        payloads = []
        for frame in chunk[:-2].split(b"\n\n"):
            if frame[:5] != b"data:" or frame.find(b"\n") != -1 or len(frame) > limit:
                return None
            payloads.append(frame[6:] if frame[5:6] == b" " else frame[5:])
        return payloads

    def skip(self, chunk: bytes) -> None:
        """Account for ``chunk``, whose frames :meth:`plain_frames` gave, as consumed."""
        self._head = None
        self._offset += len(chunk)
        self._line_start = self._offset

    def close(self) -> EndReason:
        """Signal EOF; report whether the stream ended on a frame boundary.

        A partial line or a frame without its terminating blank line is discarded, never
        dispatched (contract §5). Comment lines alone do not make a frame.
        """
        self._check_usable()
        self._closed = True
        if self._line or self._head or self._frame_bytes:
            return EndReason.EOF_MID_FRAME
        return EndReason.EOF

    def _check_usable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise RuntimeError("SSEParser is closed")

    def _after_bom(self, chunk: bytes) -> bytes:
        """Hold the first bytes until we know whether they are a UTF-8 BOM, then drop it."""
        if self._head is None:
            return chunk
        self._head += chunk
        if len(self._head) < len(_BOM) and _BOM.startswith(self._head):
            return b""
        head, self._head = bytes(self._head), None
        if not head.startswith(_BOM):
            return head
        self._offset = self._line_start = len(_BOM)
        return head[len(_BOM) :]

    def _consume(self, data: bytes, frames: list[SSEFrame]) -> None:
        if not data:
            return
        if not self._line and not self._skip_lf and _CR not in data:
            self._consume_lf_lines(data, frames)
            return
        base, pos = self._offset, 0
        if self._skip_lf:
            # CR then LF split across chunks is one line end, not a CR line end plus a
            # blank line (which would dispatch a frame early).
            pos = 1 if data[0] == _LF else 0
            self._line_start = base + pos
        for match in _LINE_END.finditer(data, pos):
            if self._line:  # the rest of a line an earlier chunk began
                self._append(data[pos : match.start()])
                raw = bytes(self._line)
                self._line.clear()
            else:
                raw = data[pos : match.start()]
                self._check_size(len(raw), raw)
            self._end_line(raw, frames)
            pos = match.end()
            self._line_start = base + pos
        self._append(data[pos:])
        # A CR as the last byte always matched alone; whether an LF follows is unknown yet.
        self._skip_lf = data[-1] == 0x0D
        self._offset = base + len(data)

    def _consume_lf_lines(self, data: bytes, frames: list[SSEFrame]) -> None:
        """``_consume`` for what providers send: whole lines ended by LF alone, no line of
        an earlier chunk to finish. The same rules, with a ``data`` line taken in place
        (one method call a line was most of a stream's parse: bench/README.md,
        "Decisions")."""
        base, pos = self._offset, 0
        lines = data.split(b"\n")
        rest = lines.pop()  # after the last LF: the start of a line, or nothing
        limit = self._max_frame_bytes
        for raw in lines:
            self._line_start = base + pos
            pos += len(raw) + 1
            if raw[:5] == b"data:":
                size = self._frame_bytes + len(raw)
                if size > limit:
                    raise SSEFrameTooLarge(size, limit)
                self._frame_bytes = size
                self._data.append(self._decode(raw)[6 if raw[5:6] == b" " else 5 :])
            elif not raw:
                frame = self._dispatch()
                if frame is not None:
                    frames.append(frame)
            else:
                self._check_size(len(raw), raw)
                self._end_line(raw, frames)
        self._line_start = base + pos
        self._append(rest)
        self._offset = base + len(data)

    def _append(self, piece: bytes) -> None:
        """Grow the current line, refusing to buffer past the frame limit."""
        self._line += piece
        self._check_size(len(self._line), self._line)

    def _check_size(self, size: int, line: bytes | bytearray) -> None:
        if not line.startswith(b":"):
            size += self._frame_bytes  # comments are dropped, so only their line counts
        if size > self._max_frame_bytes:
            raise SSEFrameTooLarge(size, self._max_frame_bytes)

    def _end_line(self, raw: bytes, frames: list[SSEFrame]) -> None:
        if not raw:
            frame = self._dispatch()
            if frame is not None:
                frames.append(frame)
        elif raw[0] != _COLON:
            self._frame_bytes += len(raw)
            self._apply_field(self._decode(raw))

    def _decode(self, raw: bytes) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SSEDecodeError(self._line_start + exc.start, exc.reason) from exc

    def _apply_field(self, line: str) -> None:
        name, _, value = line.partition(":")  # no colon: the whole line names the field
        value = value.removeprefix(" ")
        match name:
            case "data":
                self._data.append(value)
            case "event":
                self._event = value
            case "id" if "\0" not in value:
                self._last_event_id = value
            case "retry" if value.isascii() and value.isdigit():
                self._retry = int(value)
            case _:
                pass  # WHATWG: unknown fields (and invalid id/retry values) are ignored

    def _dispatch(self) -> SSEFrame | None:
        data, event = self._data, self._event
        self._data, self._event, self._frame_bytes = [], "", 0
        if not data:
            return None  # WHATWG: a frame with no data field is not dispatched
        return SSEFrame(
            data="\n".join(data),
            event=event or "message",
            id=self._last_event_id,
            retry=self._retry,
        )


class Deadline(Protocol):
    """What bounds one wait for a chunk: :class:`asyncio.Timeout`'s shape. Entered around the
    wait; once past its time it cancels the wait and its exit raises ``TimeoutError``;
    ``expired`` says whether it was this deadline that fired."""

    async def __aenter__(self) -> object: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None: ...

    def expired(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class InvalidEvent:
    """An event skipped because its data is not a JSON object (contract §5)."""

    frame_index: int
    """Position of the frame among all frames dispatched on the stream, from 0."""
    reason: str
    sample: str
    """The start of the event's data, truncated to a few dozen characters."""


class SSEStream:
    """The JSON objects carried by one upstream event-stream body.

    Iterate it once with ``async for``. Afterwards :attr:`end_reason` says how the body
    ended; it stays ``None`` if iteration raised or was abandoned.
    ``idle_timeout_s`` bounds every wait for the next chunk, the first one included; set
    between reads, it bounds the later ones. Each wait gets a deadline of its own from
    ``timeout``: the running loop's clock (:func:`asyncio.timeout`), or a test's.
    """

    def __init__(
        self,
        chunks: AsyncIterable[bytes],
        *,
        idle_timeout_s: float | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        timeout: Callable[[float | None], Deadline] = asyncio.timeout,
    ) -> None:
        self._chunks = chunks
        self.idle_timeout_s = idle_timeout_s
        self._timeout = timeout
        self._parser = SSEParser(max_frame_bytes=max_frame_bytes)
        self._started = False
        self._end_reason: EndReason | None = None
        self._raw: bytes | None = None
        self._bytes_read = 0
        self._frames = 0
        self._invalid_events = 0
        self._samples: list[InvalidEvent] = []

    @property
    def end_reason(self) -> EndReason | None:
        return self._end_reason

    @property
    def raw(self) -> bytes | None:
        """The batch :meth:`batches` just yielded as the upstream's bytes, exactly its
        events as plain ``data:`` frames; None when that chunk took the general path (and
        once the next batch is asked for)."""
        return self._raw

    @property
    def bytes_read(self) -> int:
        """Bytes received from the body so far."""
        return self._bytes_read

    @property
    def frames(self) -> int:
        """Frames dispatched so far, ``[DONE]`` and invalid ones included."""
        return self._frames

    @property
    def invalid_events(self) -> int:
        """How many events were skipped because their data is not a JSON object."""
        return self._invalid_events

    @property
    def invalid_samples(self) -> tuple[InvalidEvent, ...]:
        """The first few skipped events; the count above is exact, this list is capped."""
        return tuple(self._samples)

    async def __aiter__(self) -> AsyncIterator[JSONObject]:
        async for batch in self.batches():
            for payload in batch:
                yield payload

    async def batches(self) -> AsyncIterator[list[JSONObject]]:
        """The same objects, one non-empty list per network chunk that completed any: a
        relay handles a chunk's events together instead of passing each through every
        layer above (an upstream's events mostly arrive several to a read)."""
        if self._started:
            raise RuntimeError("an SSEStream can be iterated only once")
        self._started = True
        source = aiter(self._chunks)
        while True:
            if self.idle_timeout_s is None:  # the common case, without a frame of its own
                try:
                    chunk = await anext(source)
                except StopAsyncIteration:
                    break
            elif (timed := await self._next_chunk(source)) is not None:
                chunk, timed = timed, None
            else:
                break
            batch = self._read(chunk)
            del chunk
            if batch:
                yield batch
            # The next read is what a stream waits for most of its life: the reader has
            # this batch and its bytes, and nothing here holds them meanwhile.
            del batch
            self._raw = None
            if self._end_reason is EndReason.DONE:
                return
        self._end_reason = self._parser.close()

    def _read(self, chunk: bytes) -> list[JSONObject]:
        """The objects of one network chunk (maybe none), up to ``[DONE]``."""
        self._bytes_read += len(chunk)
        plain = self._plain(chunk)
        if plain is not None:
            batch, self._raw = plain
            return batch
        self._raw = None
        batch = []
        for frame in self._parser.feed(chunk):
            self._frames += 1
            if frame.is_done:
                self._end_reason = EndReason.DONE
                break
            payload = self._decode(frame)
            if payload is not None:
                batch.append(payload)
        return batch

    def plain(self, chunk: bytes) -> list[JSONObject] | None:
        """The objects of ``chunk`` if it takes the plain path (see the module's docstring)
        and does not end the stream, consuming nothing: a relay that handles the chunk
        outside :meth:`batches` says so with :meth:`took`. None: leave it to
        :meth:`batches` (which is then the next to read the body)."""
        if not self._started or self._end_reason is not None:
            return None
        read = self._read_plain(chunk)
        if read is None or read[1] < len(chunk):
            return None
        return read[0]

    def took(self, chunk: bytes, objects: list[JSONObject]) -> None:
        """Account for ``chunk``, whose ``objects`` :meth:`plain` gave, as read."""
        self._bytes_read += len(chunk)
        self._frames += len(objects)
        self._parser.skip(chunk)
        self._raw = chunk

    def _plain(self, chunk: bytes) -> tuple[list[JSONObject], bytes] | None:
        """The plain path: the chunk's objects and the bytes that carry exactly them (up to
        ``[DONE]``), or None for the general path."""
        read = self._read_plain(chunk)
        if read is None:
            return None
        batch, end = read
        self._parser.skip(chunk)
        if end < len(chunk):
            self._frames += len(batch) + 1
            self._end_reason = EndReason.DONE
            return batch, chunk[:end]
        self._frames += len(batch)
        return batch, chunk

    def _read_plain(self, chunk: bytes) -> tuple[list[JSONObject], int] | None:
        """The objects of a plain chunk, and where its ``[DONE]`` frame starts (its length
        if it has none); None if it is not plain or an event is not a JSON object."""
        payloads = self._parser.plain_frames(chunk)
        if payloads is None:
            return None
        batch: list[JSONObject] = []
        at = 0
        for payload in payloads:
            if payload == _DONE:
                return batch, at
            try:
                event = orjson.loads(payload)
            except orjson.JSONDecodeError:
                return None  # not JSON, or not UTF-8: the general path tells which
            if type(event) is not dict:
                return None
            batch.append(event)
            at += len(payload) + (8 if chunk[at + 5 : at + 6] == b" " else 7)
        return batch, len(chunk)

    async def _next_chunk(self, source: AsyncIterator[bytes]) -> bytes | None:
        limit = self.idle_timeout_s
        timeout = self._timeout(limit)
        try:
            async with timeout:
                return await anext(source)
        except StopAsyncIteration:
            return None
        except TimeoutError as exc:
            # Only our own deadline is idleness; a TimeoutError raised by the source is not.
            if limit is not None and timeout.expired():
                raise SSEIdleTimeout(limit) from exc
            raise

    def _decode(self, frame: SSEFrame) -> JSONObject | None:
        try:
            payload = orjson.loads(frame.data)
        except orjson.JSONDecodeError as exc:
            self._record_invalid(frame, f"invalid JSON: {exc}")
            return None
        if not isinstance(payload, dict):
            self._record_invalid(frame, f"JSON {type(payload).__name__}, not an object")
            return None
        return payload

    def _record_invalid(self, frame: SSEFrame, reason: str) -> None:
        self._invalid_events += 1
        if len(self._samples) < _MAX_SAMPLES:
            sample = frame.data[:_SAMPLE_CHARS]
            if len(frame.data) > _SAMPLE_CHARS:
                sample += "…"
            self._samples.append(InvalidEvent(self._frames - 1, reason, sample))


def encode_json(payloads: Iterable[JSONObject]) -> bytes:
    """Encode events for the gateway's client, one ``data`` line each: JSON as ``orjson``
    writes it has no raw line end (they are escaped in strings), so no splitting is due."""
    return b"".join([b"data: " + orjson.dumps(payload) + b"\n\n" for payload in payloads])


def decode_relayed(frames: Iterable[bytes]) -> Iterator[JSONObject | None]:
    """The payloads of frames the relay wrote (:func:`encode_json`, :data:`DONE_FRAME`), in
    order; None for ``[DONE]``. A door that speaks another stream format re-renders them."""
    for frame in frames:
        for line in frame.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                yield None
            elif payload:
                yield orjson.loads(payload)


def encode_data(payload: bytes | str) -> bytes:
    """Encode one event for the gateway's client: ``data: <payload>\\n\\n``.

    A payload with line ends becomes several ``data`` lines, which a reader joins with LF;
    CR and CRLF inside the payload therefore come back as LF.
    """
    raw = payload.encode("utf-8") if isinstance(payload, str) else payload
    return b"".join(b"data: " + line + b"\n" for line in _LINE_END.split(raw)) + b"\n"
