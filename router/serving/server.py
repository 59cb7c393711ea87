"""How uvicorn serves the app: the options every server of Waybill's app uses.

One change to uvicorn's HTTP protocol (httptools): the bytes it writes in one turn of the
event loop go out in one system call at the end of that turn. uvicorn writes a response's
status line and headers, then its body, each with its own ``transport.write``; on loopback
each write is a ``send`` that also wakes the reader, and the pair was most of what uvicorn's
``send`` cost the gateway (``bench/README.md``, "Decisions"). A stream's chunks written in
one turn are joined the same way; a relayed read written from the upstream connection's
callback, which nothing else of the turn joins, goes out at once (``write_now``: a flush
scheduled per chunk only added work to every relayed read, ``bench/README.md``,
"Instructions").

Three additions: the ``waybill.hangup`` extension in each request's scope
(:data:`HANGUP_EXTENSION`), which calls back when the client's connection is lost, so that
the app needs no task of its own waiting on ``receive`` to notice (a streamed request had
two such waits, each a task created, stepped and cancelled: ``bench/README.md``,
"Decisions"); the ``waybill.body`` extension
(:data:`BODY_EXTENSION`), which writes a piece of a started chunked response at once, from
any callback, without an ASGI message (a relayed stream's reads go out from the upstream
connection's callback: ``router.request.gateway``); and the answers the protocol gives itself
before any app runs, in the app's one error shape: a request head over
:data:`MAX_HEAD_BYTES` is ``431``, a request the HTTP parser refuses (NUL or CR in a header,
conflicting ``Content-Length`` and ``Transfer-Encoding``, ...) is ``400``, both
``invalid_request`` and the connection closed. A head is bounded while it arrives: bytes
fed to the parser while the head is still incomplete are counted, so an endless header costs
at most the bound and one read, never its own length.

Kept-alive connections: a request written on one is always answered. The server closes a
connection idle for :data:`KEEP_ALIVE_S` (uvicorn's ``timeout_keep_alive``), longer than the
idle timeouts of common clients (httpx, and so the OpenAI SDK: 5 s; Node's: 4 s) and load
balancers (60 s), so that the client lets go first and never writes into a connection being
closed. And the timer's expiry alone does not close it: on a loop busy with other work the
timer can run while the next request already waits in the socket's buffer (each turn of the
loop runs its due timers before it reads the sockets again), and closing then would drop that
request unanswered (and reset the connection); such a connection stays open and the request
is read (:func:`router.support.unread.unread_bytes`).
"""

from __future__ import annotations

import asyncio
import functools
import weakref
from collections.abc import Callable
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from router.errors import GatewayError, invalid_request
from router.support.ids import new_id
from router.support.unread import unread_bytes

__all__ = [
    "BODY_EXTENSION",
    "HANGUP_EXTENSION",
    "KEEP_ALIVE_S",
    "MAX_HEAD_BYTES",
    "UVICORN_OPTIONS",
    "CoalescingTransport",
    "Hangup",
]

MAX_HEAD_BYTES = 64 * 1024
"""The request line and headers together; beyond it: 431."""

KEEP_ALIVE_S = 65
"""How long an idle kept-alive connection stays open (see the module's docstring)."""

HANGUP_EXTENSION = "waybill.hangup"
"""``scope["extensions"][HANGUP_EXTENSION]["watch"]`` is a :data:`Hangup`."""

Hangup = Callable[[Callable[[], None]], Callable[[], None]]
"""``watch(callback)`` calls ``callback`` once, if the client's connection is lost before
the returned function is called (which unwatches)."""

BODY_EXTENSION = "waybill.body"
"""``scope["extensions"][BODY_EXTENSION]["write"]`` is a :data:`BodyWriter`."""

BodyWriter = Callable[[bytes], bool]
"""``write(piece)`` sends ``piece`` as the next chunk of the response's body and returns
True; or, when it cannot now (the response is not a started chunked one, is complete, its
client is gone or is not reading fast enough: the transport's writing is paused), writes
nothing and returns False: send it as an ASGI message instead, which waits its turn."""


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

    def write_now(self, data: bytes) -> None:
        """Write ``data`` now, unless earlier writes of this turn wait: then after them.
        For a piece written from a callback of its own (a relayed stream's read), which no
        other write of the turn would join."""
        if self._pending:
            self._pending.append(data)
        elif not self._transport.is_closing():
            self._transport.write(data)

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


class _HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing a head over the bound."""


class _Protocol(HttpToolsProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._hangups: set[Callable[[], None]] = set()
        self._in_head = True  # the parser is between messages or inside a head
        self._head_fed = 0  # bytes fed while the head was incomplete
        self._head_size = 0  # the current head's URL and header bytes, as parsed
        self._head_too_large = False
        self._completed = False  # a message completed in the read being parsed
        coalescing = CoalescingTransport(transport, self.loop)
        super().connection_made(coalescing)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        if self._in_head and self._head_fed > MAX_HEAD_BYTES:
            # Everything fed so far left the head incomplete: it is over the bound.
            self._head_too_large = True
            self.send_400_response("")
            return
        self._completed = False
        super().data_received(data)
        # Counted only when this read was all head: one that ended a message may hold the
        # next head's start too, uncounted (at most one read, so the bound still holds).
        if self._in_head and not self._completed:
            self._head_fed += len(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_size = 0
        extensions = self.scope.setdefault("extensions", {})
        extensions[HANGUP_EXTENSION] = {"watch": self._watch}

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def _count(self, size: int) -> None:
        self._head_size += size
        if self._head_size > MAX_HEAD_BYTES:
            self._head_too_large = True
            raise _HeadTooLarge  # the parser stops; data_received answers

    def on_headers_complete(self) -> None:
        self._in_head, self._head_fed = False, 0
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:
            # Weakly: the scope is the cycle's, and a cycle of references would outlive
            # the request until the collector's next full pass.
            write = functools.partial(_write_body, weakref.ref(cycle))
            self.scope["extensions"][BODY_EXTENSION] = {"write": write}

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_fed, self._completed = True, 0, True

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request it cannot parse, in the gateway's error shape."""
        if self._head_too_large:
            error = invalid_request(
                f"the request line and headers exceed {MAX_HEAD_BYTES} bytes", status=431
            )
        else:
            error = invalid_request("malformed HTTP request (refused by the HTTP parser)")
        self.transport.write(_error_bytes(error))
        self.transport.close()

    def timeout_keep_alive_handler(self) -> None:
        """The connection was idle for the keep-alive timeout, unless the loop is late and
        the next request is already here: then it stays open and that request is read."""
        if not self.transport.is_closing() and unread_bytes(self.transport):
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )
            return
        super().timeout_keep_alive_handler()

    def _watch(self, callback: Callable[[], None]) -> Callable[[], None]:
        self._hangups.add(callback)
        return functools.partial(self._hangups.discard, callback)

    def connection_lost(self, exc: Exception | None) -> None:
        hangups, self._hangups = self._hangups, set()
        super().connection_lost(exc)
        for callback in hangups:
            callback()


def _write_body(of: weakref.ref[RequestResponseCycle], piece: bytes) -> bool:
    """A :data:`BodyWriter` for a cycle: what its ``send`` does with a body message of a
    chunked response, when it would not have to wait or refuse."""
    cycle = of()
    if (
        cycle is None
        or not cycle.response_started
        or cycle.response_complete
        or cycle.disconnected
        or not cycle.chunked_encoding
        or cycle.flow.write_paused
    ):
        return False
    if piece:
        transport: CoalescingTransport = cycle.transport  # type: ignore[assignment]  # ours
        transport.write_now(b"%x\r\n%b\r\n" % (len(piece), piece))
    return True


_REASONS = {400: b"Bad Request", 431: b"Request Header Fields Too Large"}


def _error_bytes(error: GatewayError) -> bytes:
    request_id = new_id("req")
    body = orjson.dumps(error.body(request_id))
    head = [
        b"HTTP/1.1 %d %s" % (error.status, _REASONS.get(error.status, b"Error")),
        b"content-type: application/json",
        b"content-length: %d" % len(body),
        b"x-request-id: " + request_id.encode(),
        *(f"{name}: {value}".encode() for name, value in error.headers().items()),
        b"connection: close",
    ]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


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
    "timeout_keep_alive": KEEP_ALIVE_S,
}
"""For ``uvicorn.run`` / ``uvicorn.Config`` (``waybill serve``, the demo, the tests)."""
