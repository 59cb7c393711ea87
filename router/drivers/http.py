"""The drivers' HTTP/1.1 client: the wire to a provider, and nothing more.

One keep-alive pool per origin (and proxy), each request written in one piece, responses
parsed by httptools (llhttp) inside an asyncio Protocol and read as an async iterator of
bytes. No cookies, redirects, HTTP/2 or compression: an upstream call needs none of them, and
httpx's general-purpose layers were a large part of the request path's CPU (bench/README.md,
"Decisions").

Through an HTTP proxy (:class:`Proxy`), every connection is a CONNECT tunnel, for http
upstreams as for https ones (TLS to the upstream then runs inside it, checked against the
upstream's name). Never an absolute-form request to the proxy: then a proxy's own 403 or 502
would read as the upstream's, while every answer to a CONNECT is the proxy's and every answer
inside the tunnel the upstream's. The proxy's credentials go in the CONNECT only.

Failures are :class:`HTTPError` subclasses split by what they prove about the request, the
evidence contract §5 asks for: :class:`ConnectFailed` (:class:`TunnelFailed` when the proxy
would not open the tunnel) means its bytes were never written (not started); after they were
written, every failure (:class:`ReadTimeout`, :class:`ConnectionBroken`,
:class:`ProtocolError`) leaves the upstream maybe started.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
import re
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Final, TypeVar, cast, overload
from urllib.parse import urlsplit

import httptools

from router.support.unread import unread_bytes

__all__ = [
    "ConnectFailed",
    "ConnectionBroken",
    "HTTPClient",
    "HTTPError",
    "Headers",
    "PreparedRequest",
    "ProtocolError",
    "Proxy",
    "ReadTimeout",
    "Response",
    "TunnelFailed",
    "prepare_request",
]

log = logging.getLogger("waybill.http")

_HIGH_WATER: Final = 256 * 1024  # unread body bytes buffered before reading pauses
_MANAGED: Final = frozenset({"host", "content-length", "transfer-encoding"})
_USER_AGENT: Final = "waybill"
_MAX_TUNNEL_HEAD: Final = 64 * 1024  # a proxy's answer to CONNECT, up to its blank line
_STATUS_LINE: Final = re.compile(rb"HTTP/1\.[01] ([0-9]{3})[ \r]")
_T = TypeVar("_T")


class HTTPError(Exception):
    """Base of every failure of an upstream exchange."""


class ConnectFailed(HTTPError):
    """No connection (DNS, refused, connect timeout, TLS handshake): nothing was sent."""


class TunnelFailed(ConnectFailed):
    """The proxy did not open a tunnel: unreachable, closed, silent past the connect timeout,
    or it answered CONNECT with ``status`` (not 2xx). Nothing reached the upstream.

    ``detail`` says which, in words fit to show a client (no address, no credentials).
    """

    def __init__(self, proxy: Proxy, detail: str, *, status: int | None = None) -> None:
        self.detail = detail
        self.status = status
        super().__init__(f"proxy {proxy.address}: {detail}")


class ReadTimeout(HTTPError):
    """No response bytes within ``read_timeout`` after the request was written, or by the
    response's ``read_deadline`` (then ``deadline`` is True).

    Deliberately not a :class:`TimeoutError`: callers tell their own deadlines
    (``asyncio.timeout``) from this one by the type.
    """

    def __init__(
        self, message: str = "no response bytes in time", *, deadline: bool = False
    ) -> None:
        super().__init__(message)
        self.deadline = deadline


class ConnectionBroken(HTTPError):
    """Closed or reset after the request was written, before the response ended.

    Also what a pooled connection that the server had already closed gives: the request was
    written to it, so the upstream may have started (as httpx reports it too).
    """


class ProtocolError(HTTPError):
    """The response is not HTTP/1.1 we can read; the request was written."""


class Headers(Mapping[str, str]):
    """Read-only, case-insensitive headers (a response's here; a request's in the fake
    provider).

    A repeated header's values are joined with ", " in arrival order (RFC 9110 §5.3), so
    :meth:`get` returns all of them as one string. Names iterate as first received.
    """

    __slots__ = ("_items",)

    def __init__(self, pairs: Iterable[tuple[str, str]] = ()) -> None:
        items: dict[str, tuple[str, str]] = {}
        for name, value in pairs:
            key = name.lower()
            prior = items.get(key)
            items[key] = (name, value) if prior is None else (prior[0], f"{prior[1]}, {value}")
        self._items = items

    def __getitem__(self, name: str) -> str:
        return self._items[name.lower()][1]

    @overload
    def get(self, name: str, /) -> str | None: ...
    @overload
    def get(self, name: str, /, default: str | _T) -> str | _T: ...
    def get(self, name: str, /, default: object = None) -> object:
        item = self._items.get(name.lower())
        return default if item is None else item[1]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._items

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Headers({dict(self)!r})"


@dataclass(frozen=True)
class _Target:
    origin: tuple[str, str, int]  # scheme, host, port: what a pooled connection is for
    host_header: str
    path: str  # path and query, the request target


@functools.lru_cache(maxsize=256)
def _target(url: str) -> _Target:
    # Cached: a driver calls the same few URLs over and over, and urlsplit is not free.
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    host = parts.hostname
    default_port = 443 if scheme == "https" else 80
    port = parts.port or default_port
    host_header = f"[{host}]" if ":" in host else host
    if port != default_port:
        host_header = f"{host_header}:{port}"
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return _Target((scheme, host, port), host_header, path)


@dataclass(frozen=True, slots=True)
class Proxy:
    """An HTTP proxy to tunnel through, and the ``Proxy-Authorization`` to open it with."""

    host: str
    port: int
    authorization: str | None = field(default=None, repr=False)

    @classmethod
    def basic(cls, host: str, port: int, username: str, password: str) -> Proxy:
        token = base64.b64encode(f"{username}:{password}".encode()).decode("ascii")
        return cls(host, port, f"Basic {token}")

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


_PoolKey = tuple[tuple[str, str, int], Proxy | None]  # what a pooled connection is for


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A request's bytes, ready to write, and where they go (through ``proxy``, if any)."""

    target: _Target
    data: bytes
    proxy: Proxy | None = None


def prepare_request(
    method: str,
    url: str,
    *,
    headers: Mapping[str, str] | None = None,
    body: bytes = b"",
    proxy: Proxy | None = None,
) -> PreparedRequest:
    """The bytes of one request. ``Host``, ``Content-Length`` and ``User-Agent`` (unless
    given) are written here; a caller's ``Host``, ``Content-Length`` or
    ``Transfer-Encoding`` is ignored. ``ValueError`` for a URL that is not http(s), for
    HEAD (its response framing differs) and for a CR or LF in a header."""
    if method == "HEAD":
        raise ValueError("HEAD is not supported")
    target = _target(url)
    return PreparedRequest(target, _request_bytes(method, target, headers or {}, body), proxy)


def _request_bytes(method: str, target: _Target, headers: Mapping[str, str], body: bytes) -> bytes:
    lines = [f"{method} {target.path} HTTP/1.1\r\nHost: {target.host_header}\r\n"]
    has_agent = False
    for name, value in headers.items():
        lowered = name.lower()
        if lowered in _MANAGED:
            continue  # the framing is ours to write
        has_agent = has_agent or lowered == "user-agent"
        lines.append(f"{name}: {value}\r\n")
    if not has_agent:
        lines.append(f"User-Agent: {_USER_AGENT}\r\n")
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}\r\n")
    lines.append("\r\n")
    head = "".join(lines)
    # Every element ends in exactly one CRLF, the first in two: any other CR or LF came from
    # a method, path, name or value and would let it forge headers.
    expected = len(lines) + 1
    if head.count("\n") != expected or head.count("\r") != expected:
        raise ValueError("CR or LF in the request line or a header")
    return head.encode("latin-1") + body


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection and the one exchange in flight on it (no pipelining).

    The protocol callbacks and the httptools callbacks fill the exchange's state; the task
    that reads the response waits on :meth:`wait` and is woken by every change.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.closed = False  # the peer closed it, it failed, or we closed it
        self.idle_since = 0.0
        # The read timeout of the wait in progress: its deadline (the response's own, if
        # that comes first: `_absolute`), and one timer that may be due earlier than it
        # (then it re-arms) but never later (see `wait`).
        self._read_timeout: float | None = None
        self._deadline: float | None = None
        self._absolute = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._begin(in_flight=False)

    def _begin(self, *, in_flight: bool) -> None:
        self.in_flight = in_flight
        self.status_code = 0
        self.headers: dict[str, str] = {}
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.error: HTTPError | None = None
        self._close_delimited = False
        self._interim = False
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._on_end: Callable[[], None] | None = None  # set while the rest is discarded
        self._drain_timer: asyncio.TimerHandle | None = None
        self.tap: Callable[[bytes], bool] | None = None  # see Response.tap
        self._tapped: list[bytes] = []  # the read being parsed, for the tap

    # --- the exchange, driven by the client ---

    def discard_rest(self, on_end: Callable[[], None], within_s: float) -> None:
        """Drop the rest of the body as it arrives and call ``on_end`` when the response
        ends; if it has not ended within ``within_s``, drop the connection instead."""
        self.chunks, self.buffered = [], 0
        if self._paused and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        if self.complete:
            on_end()
            return
        self._on_end = on_end
        self._drain_timer = self._loop.call_later(within_s, self.abort)

    def send(self, data: bytes) -> None:
        assert self._transport is not None
        self._begin(in_flight=True)
        self._transport.write(data)

    async def wait(self, read_timeout: float | None, deadline: float | None = None) -> None:
        """Until the next change of the exchange, or :class:`ReadTimeout` when it does not
        come within ``read_timeout`` or by ``deadline`` (the loop's time).

        A stream waits once per read of its body: rather than a timer per wait (made and
        cancelled each time, most of a read's timer cost), the connection keeps one, armed
        for the first deadline and moved on when it fires early (`_on_timer`)."""
        waiter = self._waiter = self._loop.create_future()
        self._read_timeout = read_timeout
        at = None if read_timeout is None else self._loop.time() + read_timeout
        self._absolute = deadline is not None and (at is None or deadline < at)
        if self._absolute:
            at = deadline
        self._deadline = at
        if at is not None and (self._timer is None or self._timer_at > at):
            self._arm(at)
        try:
            await waiter
        finally:
            self._waiter = None

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = self._loop.call_at(at, self._on_timer), at

    def _on_timer(self) -> None:
        self._timer = None
        waiter, deadline, timeout = self._waiter, self._deadline, self._read_timeout or 0.0
        if waiter is None or waiter.done() or deadline is None:
            return  # not waiting: the next wait arms it again
        now = self._loop.time()
        if now < deadline:
            self._arm(deadline)
        elif unread_bytes(self._transport):
            # The response's bytes are here, the loop has not read them yet (router.support.unread):
            # not a silence of the upstream's. They are read before this fires again.
            later = now if self._absolute else now + timeout
            self._deadline = later
            self._arm(later)
        elif self._absolute:
            waiter.set_exception(ReadTimeout("no response bytes by the deadline", deadline=True))
        else:
            waiter.set_exception(ReadTimeout("no response bytes within the read timeout"))

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def take(self) -> bytes:
        """The body bytes buffered so far (there are some), reading resumed if paused."""
        chunks = self.chunks
        piece = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.chunks = []
        self.buffered = 0
        if self._paused and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        return piece

    def close(self) -> None:
        self.closed, self.in_flight = True, False
        self._disarm()
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        """Drop the connection now: whatever is left of its exchange must never be read."""
        self.closed, self.in_flight = True, False
        self._disarm()
        self._on_end = None
        self.tap = None
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        if self._transport is not None:
            self._transport.abort()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: HTTPError) -> None:
        if self.error is None and not self.complete:
            self.error = error
        self.abort()
        self._wake()

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport, though uvloop's do not subclass asyncio.Transport.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self.in_flight:
            # Bytes nobody asked for on an idle connection: its framing is lost.
            self.abort()
            return
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if self.complete:
                # Bytes after a whole response: it stands, the connection is not reused.
                self.keep_alive = False
            else:
                self._fail(ProtocolError(f"malformed response: {exc}"))
        if self._tapped:
            self._offer()

    def _offer(self) -> None:
        """The body pieces of the read just parsed, to the tap together, as the reader
        would have taken them together (one parse and one write for several events)."""
        pieces, self._tapped = self._tapped, []
        piece = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        tap, taken = self.tap, False
        if tap is not None:
            try:
                taken = tap(piece)
            except Exception:  # a bug in the taker: the reader gets the piece instead
                log.exception("a tap of an upstream body failed")
        if taken:
            # Taken as it came: the reader's wait goes on, its silence starts again.
            if self._read_timeout is not None and not self._absolute:
                self._deadline = self._loop.time() + self._read_timeout
            return
        self.tap = None
        self._buffer(piece)

    def eof_received(self) -> bool | None:
        self._peer_closed(None)
        return None  # let the transport close itself

    def connection_lost(self, exc: Exception | None) -> None:
        self._peer_closed(exc)

    def _peer_closed(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.in_flight or self.complete or self.error is not None:
            return
        if self.headers_done and self._close_delimited and exc is None:
            # RFC 9112 §6.3: without Content-Length or chunking, the close ends the body.
            self.complete = True
        else:
            how = "reset" if exc is not None else "closed"
            when = "mid-body" if self.headers_done else "before the response headers"
            self.error = ConnectionBroken(f"connection {how} by the upstream {when}")
        self._wake()

    # --- httptools callbacks ---

    def on_message_begin(self) -> None:
        if self.complete:
            raise ProtocolError("bytes after the end of the response")

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        prior = self.headers.get(key)
        self.headers[key] = text if prior is None else f"{prior}, {text}"

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:
            self._interim = True  # 100 Continue, 103 Early Hints: the real one follows
            self.headers = {}
            return
        self.status_code = status
        self._close_delimited = (
            "content-length" not in self.headers
            and "chunked" not in self.headers.get("transfer-encoding", "").lower()
            and status not in (204, 304)
        )
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self._on_end is not None:
            return  # the reader is gone; the rest is only read to free the connection
        if self.tap is not None and not self.chunks:  # behind buffered pieces: not tapped
            self._tapped.append(body)  # offered once the whole read is parsed
            return
        self._buffer(body)

    def _buffer(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.complete = True
        # False for HTTP/1.0 and for "Connection: close" (llhttp's reading of both).
        self.keep_alive = self._parser.should_keep_alive()
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            if self._drain_timer is not None:
                self._drain_timer.cancel()
            on_end()
        self._wake()


class Response:
    """A response whose headers have arrived. Read its body once, with :meth:`aiter_bytes`.

    Reading to the end hands the connection back to the pool (if the server keeps it alive);
    :meth:`aclose` before the end closes it instead: the unread rest would otherwise be read
    as the next exchange's response. A failure or a cancellation while reading closes it too.
    """

    def __init__(
        self,
        client: HTTPClient,
        pool_key: _PoolKey,
        conn: _Connection,
        read_timeout: float | None,
    ) -> None:
        self.status_code = conn.status_code
        self.headers = Headers(conn.headers.items())
        conn.headers = {}  # now the response's: a stream holds one copy for its life
        self._client = client
        self._pool_key = pool_key
        self._conn: _Connection | None = conn
        self.read_timeout = read_timeout
        """Bounds each wait for body bytes from now on (None: unbounded)."""
        self.read_deadline: float | None = None
        """No wait for body bytes goes past it (the loop's time; None: none)."""
        self._ended = False
        if conn.complete and not conn.chunks:
            self._release()  # no body (204, Content-Length: 0): nothing left to read

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body as it arrives; raises :class:`HTTPError` if it is cut or stalls."""
        return _Body(self)

    async def aread(self) -> bytes:
        """The whole body."""
        return b"".join([piece async for piece in self.aiter_bytes()])

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()

    def tap(self, taker: Callable[[bytes], bool] | None) -> None:
        """Hand the body, a read at a time as it arrives, to ``taker`` (synchronously, in
        the connection's callback) instead of to the reader: a piece it takes (True) never
        wakes the reader, whose wait goes on (its read timeout counting from that piece).
        The first piece it leaves (False) and every one after it go to the reader as
        usual, and the tap is off until set again. Pieces already buffered are the
        reader's first, so a tap never reorders the body. ``taker`` must not raise."""
        conn = self._conn
        if conn is not None and not conn.closed:
            conn.tap = taker

    def release_after_end(self, within_s: float = 1.0) -> None:
        """Done reading, though the body has not ended on the wire (an SSE stream read up
        to ``[DONE]``, whose terminating chunk follows): let the rest arrive and be
        discarded, then hand the connection back to the pool; if it does not end within
        ``within_s``, drop it. Saves a new connection per stream."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        conn.tap = None
        if conn.error is not None or conn.closed:
            conn.abort()
            return
        self._ended = True
        conn.discard_rest(lambda: self._client._release(self._pool_key, conn), within_s)

    async def _next(self) -> bytes | None:
        conn = self._conn
        if conn is None:
            if self._ended:
                return None
            raise RuntimeError("the response was closed before its end")
        while True:
            if conn.chunks:
                piece = conn.take()
                if conn.complete:
                    self._release()  # the last bytes are in hand: the wire is free
                return piece
            if conn.complete:
                self._release()
                return None
            if conn.error is not None:
                await self.aclose()
                raise conn.error
            try:
                await conn.wait(self.read_timeout, self.read_deadline)
            except BaseException:
                # A timeout or a cancellation leaves the rest of the body on the wire.
                await self.aclose()
                raise

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        self._ended = True
        if conn is not None:
            conn.tap = None
            self._client._release(self._pool_key, conn)


class _Body:
    """What :meth:`Response.aiter_bytes` returns: an iterator object, not an async generator,
    so that one left unfinished (an SSE stream read up to ``[DONE]``) costs nothing: the
    event loop closes each abandoned async generator in a task of its own."""

    __slots__ = ("_response",)

    def __init__(self, response: Response) -> None:
        self._response = response

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        piece = await self._response._next()
        if piece is None:
            raise StopAsyncIteration
        return piece


class HTTPClient:
    """Upstream HTTP/1.1 calls over pooled keep-alive connections.

    Each origin (scheme, host, port) keeps at most ``max_idle_per_origin`` idle connections,
    each for at most ``idle_expiry_s``; requests beyond them open new connections (no limit).
    Through a proxy, the pool is per (origin, proxy): a tunnel leads to one origin only.
    ``ssl_context`` replaces the default (the system's defaults with certifi's CA bundle
    when installed, as httpx had it), for tests with a private CA.
    """

    def __init__(
        self,
        *,
        max_idle_per_origin: int = 32,
        idle_expiry_s: float = 30.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if max_idle_per_origin < 0:
            raise ValueError("max_idle_per_origin must be >= 0")
        self._max_idle = max_idle_per_origin
        self._idle_expiry_s = idle_expiry_s
        self._ssl_context = ssl_context
        # Per pool key, idle connections oldest first: reuse takes the newest (the one least
        # likely to have been closed by the server), expiry trims from the oldest.
        self._idle: dict[_PoolKey, deque[_Connection]] = {}
        self._closed = False

    async def request(
        self,
        method: str,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        body: bytes = b"",
        proxy: Proxy | None = None,
        connect_timeout: float | None = 10.0,
        read_timeout: float | None = None,
        headers_timeout: float | None = None,
    ) -> Response:
        """Send one request and wait for its response headers: :meth:`send` of
        :func:`prepare_request`."""
        prepared = prepare_request(method, url, headers=headers, body=body, proxy=proxy)
        return await self.send(
            prepared,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            headers_timeout=headers_timeout,
        )

    async def send(
        self,
        request: PreparedRequest,
        *,
        connect_timeout: float | None = 10.0,
        read_timeout: float | None = None,
        headers_timeout: float | None = None,
    ) -> Response:
        """Send a prepared request and wait for its response headers.

        ``connect_timeout`` bounds the TCP and TLS connect (and a proxy's tunnel);
        ``read_timeout`` every wait for response bytes, the headers included.
        ``headers_timeout`` bounds the whole call, connecting included, as an
        ``asyncio.timeout`` around it would, except that running out before the request is
        written raises :class:`ConnectFailed`, not :class:`TimeoutError`: what the caller may
        conclude about the request turns on whether it was written.
        """
        if self._closed:
            raise RuntimeError("the HTTP client is closed")
        loop = asyncio.get_running_loop()
        deadline = None if headers_timeout is None else loop.time() + headers_timeout
        key: _PoolKey = (request.target.origin, request.proxy)
        conn = self._reuse(key)
        if conn is None:
            if headers_timeout is not None and (
                connect_timeout is None or headers_timeout < connect_timeout
            ):
                connect_timeout = headers_timeout
            conn = await self._connect(request, connect_timeout)
        try:
            conn.send(request.data)
            async with asyncio.timeout_at(deadline):
                while not conn.headers_done:
                    if conn.error is not None:
                        raise conn.error
                    await conn.wait(read_timeout)
        except BaseException:
            conn.abort()  # a cancelled or failed exchange never goes back to the pool
            raise
        return Response(self, key, conn, read_timeout)

    async def aclose(self) -> None:
        """Close every idle connection; connections still reading close when done."""
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()

    def _reuse(self, key: _PoolKey) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = asyncio.get_running_loop().time()
        while idle:
            conn = idle.pop()
            if conn.closed:
                continue  # the server closed it while it sat idle
            if now - conn.idle_since >= self._idle_expiry_s:
                conn.close()  # the newest is expired, so all older ones are too
                while idle:
                    idle.pop().close()
                return None
            return conn
        return None

    async def _connect(
        self, request: PreparedRequest, connect_timeout: float | None
    ) -> _Connection:
        scheme, host, port = request.target.origin
        context = None
        if scheme == "https":
            context = self._ssl_context or _default_ssl_context()
        proxy = request.proxy
        if proxy is not None:
            return await _connect_through(proxy, request.target, context, connect_timeout)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop),
                    host,
                    port,
                    ssl=context,
                    server_hostname=host if context is not None else None,
                )
        except (OSError, TimeoutError) as exc:  # DNS, refused, TLS (ssl.SSLError), timeout
            raise ConnectFailed(f"cannot connect to {host}:{port}: {exc!r}") from exc
        return conn

    def _release(self, key: _PoolKey, conn: _Connection) -> None:
        if conn.closed or not conn.keep_alive or self._closed or self._max_idle == 0:
            conn.close()
            return
        conn.in_flight = False
        conn.idle_since = asyncio.get_running_loop().time()
        idle = self._idle.setdefault(key, deque())
        if len(idle) >= self._max_idle:
            idle.popleft().close()
        idle.append(conn)


# --- proxies: a CONNECT tunnel, then the upstream's connection inside it ---


async def _connect_through(
    proxy: Proxy,
    target: _Target,
    context: ssl.SSLContext | None,
    connect_timeout: float | None,
) -> _Connection:
    """A connection to ``target`` through a tunnel ``proxy`` opened, TLS inside it for https
    (checked against the upstream's name, never the proxy's)."""
    _, host, port = target.origin
    loop = asyncio.get_running_loop()
    transport: asyncio.Transport | None = None
    tunnelled = False
    try:
        async with asyncio.timeout(connect_timeout):
            transport, setup = await loop.create_connection(
                lambda: _TunnelSetup(loop, proxy), proxy.host, proxy.port
            )
            transport.write(_connect_request(host, port, proxy))
            status = await setup.answered
            if not 200 <= status < 300:
                detail = f"the proxy answered CONNECT with {status}"
                raise TunnelFailed(proxy, detail, status=status)
            tunnelled = True
            conn = _Connection(loop)
            if context is None:
                transport.set_protocol(conn)
                conn.connection_made(transport)
                transport.resume_reading()
            else:
                # start_tls leaves connection_made to the caller (call_connection_made=False).
                tls = await loop.start_tls(transport, conn, context, server_hostname=host)
                assert tls is not None  # None only for a transport already closing
                conn.connection_made(tls)
            return conn
    except BaseException as exc:
        if transport is not None:
            transport.abort()
        if isinstance(exc, TunnelFailed) or not isinstance(exc, OSError | TimeoutError):
            raise
        if tunnelled:  # TLS with the upstream, inside the tunnel
            raise ConnectFailed(
                f"cannot connect to {host}:{port} through proxy {proxy.address}: {exc!r}"
            ) from exc
        if isinstance(exc, TimeoutError):
            raise TunnelFailed(proxy, "no tunnel within the connect timeout") from exc
        why = exc.strerror or type(exc).__name__
        raise TunnelFailed(proxy, f"cannot connect to the proxy ({why})") from exc


def _connect_request(host: str, port: int, proxy: Proxy) -> bytes:
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    lines = [f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n"]
    if proxy.authorization is not None:
        lines.append(f"Proxy-Authorization: {proxy.authorization}\r\n")
    lines.append(f"User-Agent: {_USER_AGENT}\r\n\r\n")
    return "".join(lines).encode("latin-1")


class _TunnelSetup(asyncio.Protocol):
    """A connection to a proxy until it answers our CONNECT: ``answered`` holds the status,
    and reading stops there, for the connection then carries the tunnel."""

    def __init__(self, loop: asyncio.AbstractEventLoop, proxy: Proxy) -> None:
        self.answered: asyncio.Future[int] = loop.create_future()
        self._proxy = proxy
        self._head = bytearray()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.answered.done():
            return
        self._head += data
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) > _MAX_TUNNEL_HEAD:
                self._fail("the proxy's answer to CONNECT has no end")
            return
        assert self._transport is not None
        self._transport.pause_reading()
        status = _STATUS_LINE.match(self._head)
        if status is None:
            self._fail("the proxy's answer to CONNECT is not HTTP/1.x")
        elif len(self._head) > end + 4 and status.group(1).startswith(b"2"):
            # The upstream speaks only once spoken to: these bytes cannot be its.
            self._fail("the proxy sent bytes after its answer to CONNECT")
        else:
            self.answered.set_result(int(status.group(1)))

    def eof_received(self) -> bool | None:
        self._fail("the proxy closed the connection before answering CONNECT")
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail("the proxy closed the connection before answering CONNECT")

    def _fail(self, detail: str) -> None:
        if not self.answered.done():
            self.answered.set_exception(TunnelFailed(self._proxy, detail))


@functools.cache
def _default_ssl_context() -> ssl.SSLContext:
    # Built once per process: loading a CA bundle takes milliseconds.
    try:
        import certifi
    except ImportError:
        context = ssl.create_default_context()
    else:
        context = ssl.create_default_context(cafile=certifi.where())
    context.set_alpn_protocols(["http/1.1"])
    return context
