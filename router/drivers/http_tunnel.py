"""Proxy tunnelling: a CONNECT to an HTTP proxy, then the upstream's connection inside the
tunnel (TLS to the upstream for https, checked against the upstream's name, never the
proxy's). Every answer to the CONNECT is the proxy's, every answer inside the tunnel the
upstream's; the proxy's credentials go in the CONNECT only."""

from __future__ import annotations

import asyncio
import re
import ssl
from typing import Final, cast

from router.drivers.http_connection import Connection
from router.drivers.http_messages import USER_AGENT, ConnectFailed, Proxy, Target, TunnelFailed

__all__ = ["connect_through"]

_MAX_TUNNEL_HEAD: Final = 64 * 1024  # a proxy's answer to CONNECT, up to its blank line
_STATUS_LINE: Final = re.compile(rb"HTTP/1\.[01] ([0-9]{3})[ \r]")


async def connect_through(
    proxy: Proxy,
    target: Target,
    context: ssl.SSLContext | None,
    connect_timeout: float | None,
) -> Connection:
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
            conn = Connection(loop)
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
    lines.append(f"User-Agent: {USER_AGENT}\r\n\r\n")
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
