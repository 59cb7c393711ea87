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

This module owns the pool, the client and response reading; the rest lives beside it:
:mod:`~router.drivers.http_messages` (failures, headers, proxies, request bytes),
:mod:`~router.drivers.http_connection` (one connection's protocol) and
:mod:`~router.drivers.http_tunnel` (CONNECT tunnels through a proxy).
"""

from __future__ import annotations

import asyncio
import functools
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping

from router.drivers.http_connection import Connection
from router.drivers.http_messages import (
    ConnectFailed,
    ConnectionBroken,
    Headers,
    HTTPError,
    PreparedRequest,
    ProtocolError,
    Proxy,
    ReadTimeout,
    TunnelFailed,
    prepare_request,
)
from router.drivers.http_tunnel import connect_through

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


_PoolKey = tuple[tuple[str, str, int], Proxy | None]  # what a pooled connection is for


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
        conn: Connection,
        read_timeout: float | None,
    ) -> None:
        self.status_code = conn.status_code
        self.headers = Headers(conn.headers.items())
        conn.headers = {}  # now the response's: a stream holds one copy for its life
        self._client = client
        self._pool_key = pool_key
        self._conn: Connection | None = conn
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
        self._idle: dict[_PoolKey, deque[Connection]] = {}
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

    def _reuse(self, key: _PoolKey) -> Connection | None:
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

    async def _connect(self, request: PreparedRequest, connect_timeout: float | None) -> Connection:
        scheme, host, port = request.target.origin
        context = None
        if scheme == "https":
            context = self._ssl_context or _default_ssl_context()
        proxy = request.proxy
        if proxy is not None:
            return await connect_through(proxy, request.target, context, connect_timeout)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: Connection(loop),
                    host,
                    port,
                    ssl=context,
                    server_hostname=host if context is not None else None,
                )
        except (OSError, TimeoutError) as exc:  # DNS, refused, TLS (ssl.SSLError), timeout
            raise ConnectFailed(f"cannot connect to {host}:{port}: {exc!r}") from exc
        return conn

    def _release(self, key: _PoolKey, conn: Connection) -> None:
        if conn.closed or not conn.keep_alive or self._closed or self._max_idle == 0:
            conn.close()
            return
        conn.in_flight = False
        conn.idle_since = asyncio.get_running_loop().time()
        idle = self._idle.setdefault(key, deque())
        if len(idle) >= self._max_idle:
            idle.popleft().close()
        idle.append(conn)


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
