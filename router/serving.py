"""How uvicorn serves the app: the options every server of Waybill's app uses.

One change to uvicorn's HTTP protocol (httptools): the bytes it writes in one turn of the
event loop go out in one system call at the end of that turn. uvicorn writes a response's
status line and headers, then its body, each with its own ``transport.write``; on loopback
each write is a ``send`` that also wakes the reader, and the pair was most of the ~6% of
the gateway's CPU that uvicorn's ``send`` took at c16 (``bench/README.md``). A stream's
chunks written in one turn are joined the same way.

And one addition: the ``waybill.hangup`` extension in each request's scope
(:data:`HANGUP_EXTENSION`), which calls back when the client's connection is lost, so that
the app needs no task of its own waiting on ``receive`` to notice (about 2% of the CPU of a
streamed request, which had two such waits).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["HANGUP_EXTENSION", "UVICORN_OPTIONS", "CoalescingTransport", "Hangup"]

HANGUP_EXTENSION = "waybill.hangup"
"""``scope["extensions"][HANGUP_EXTENSION]["watch"]`` is a :data:`Hangup`."""

Hangup = Callable[[Callable[[], None]], Callable[[], None]]
"""``watch(callback)`` calls ``callback`` once, if the client's connection is lost before
the returned function is called (which unwatches)."""


class CoalescingTransport:
    """A transport whose writes wait for the end of the event loop's turn, then go out
    together; everything else is the wrapped transport's. Closing sends what is waiting
    first; aborting drops it."""

    __slots__ = ("_loop", "_pending", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(bytes(data))

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._pending = []
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _Protocol(HttpToolsProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._hangups: set[Callable[[], None]] = set()
        coalescing = CoalescingTransport(transport, self.loop)
        super().connection_made(coalescing)  # type: ignore[arg-type]

    def on_message_begin(self) -> None:
        super().on_message_begin()
        extensions = self.scope.setdefault("extensions", {})
        extensions[HANGUP_EXTENSION] = {"watch": self._watch}

    def _watch(self, callback: Callable[[], None]) -> Callable[[], None]:
        self._hangups.add(callback)
        return functools.partial(self._hangups.discard, callback)

    def connection_lost(self, exc: Exception | None) -> None:
        hangups, self._hangups = self._hangups, set()
        super().connection_lost(exc)
        for callback in hangups:
            callback()


UVICORN_OPTIONS: dict[str, Any] = {
    "http": _Protocol,
    "log_level": "warning",
    "access_log": False,
    "lifespan": "on",
    # Nothing reads the client's address, so X-Forwarded-* need no rewriting (a layer of
    # middleware on every request), and the answer need not name the server.
    "proxy_headers": False,
    "server_header": False,
    "ws": "none",  # no WebSocket routes: an Upgrade is answered as plain HTTP
}
"""For ``uvicorn.run`` / ``uvicorn.Config`` (``waybill serve``, the demo, the tests)."""
