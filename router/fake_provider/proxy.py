"""FakeProxy: an HTTP CONNECT proxy on 127.0.0.1 that misbehaves on demand.

It opens tunnels and nothing else (any other request gets 405): ``CONNECT host:port``, a TCP
connection to that address, then bytes relayed both ways until either side closes. Its mode
decides how a CONNECT is answered, so tests can prove what the gateway concludes from a
proxy that would not carry the request:

- ``open``: 200 and the tunnel (502 when the target cannot be reached);
- ``refuse``: ``refuse_status`` (403 by default; 502 is what a proxy says of a target it
  cannot reach), and the connection closed;
- ``drop``: the connection closed without an answer;
- ``silent``: no answer at all, the connection held open.

With ``credentials``, a CONNECT without the matching ``Proxy-Authorization: Basic`` gets 407
first, whatever the mode. Every CONNECT is recorded as received.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from dataclasses import dataclass
from typing import Literal, Self

from router.fake_provider._serving import Served

__all__ = ["FakeProxy", "ProxyMode", "RecordedConnect"]

ProxyMode = Literal["open", "refuse", "drop", "silent"]

_READ_SIZE = 64 * 1024


@dataclass(frozen=True)
class RecordedConnect:
    """One CONNECT as the proxy received it."""

    target: str  # host:port
    authorization: str | None  # the Proxy-Authorization header, as sent


class FakeProxy(Served):
    """A CONNECT proxy with a mode (see the module). ``async with FakeProxy() as proxy:``."""

    def __init__(
        self,
        mode: ProxyMode = "open",
        *,
        refuse_status: int = 403,
        credentials: tuple[str, str] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.mode: ProxyMode = mode
        self.refuse_status = refuse_status
        self.host = host
        self._requested_port = port
        self._expected = None
        if credentials is not None:
            token = base64.b64encode(":".join(credentials).encode()).decode("ascii")
            self._expected = f"Basic {token}"
        self.connects: list[RecordedConnect] = []
        self.tunnels = 0  # tunnels opened: CONNECTs answered 200
        self._server: asyncio.Server | None = None
        self._port = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def port(self) -> int:
        if not self._port:
            raise RuntimeError("FakeProxy is not running")
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def astart(self) -> Self:
        self._server = await asyncio.start_server(self._serve, self.host, self._requested_port)
        self._port = self._server.sockets[0].getsockname()[1]
        return self

    async def aclose(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await server.wait_closed()

    # Serving

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        try:
            await self._handle(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # the client left; nothing to answer
        finally:
            writer.transport.abort()
            self._writers.discard(writer)
            self._tasks.discard(task)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")  # at most the reader's 64 KiB limit
        lines = head.decode("latin-1").split("\r\n")
        method, _, rest = lines[0].partition(" ")
        target = rest.rpartition(" ")[0]
        headers = {
            name.strip().lower(): value.strip()
            for name, _, value in (line.partition(":") for line in lines[1:] if line)
        }
        if method != "CONNECT":
            return await _answer(writer, 405)
        authorization = headers.get("proxy-authorization")
        self.connects.append(RecordedConnect(target, authorization))
        if self._expected is not None and authorization != self._expected:
            challenge = 'Proxy-Authenticate: Basic realm="fake-proxy"\r\n'
            return await _answer(writer, 407, challenge)
        if self.mode == "refuse":
            return await _answer(writer, self.refuse_status)
        if self.mode == "drop":
            return None
        if self.mode == "silent":
            await reader.read()  # until the client gives up
            return None
        host, _, port = target.rpartition(":")
        try:
            up_reader, up_writer = await asyncio.open_connection(host.strip("[]"), int(port))
        except (OSError, ValueError):
            return await _answer(writer, 502)
        self._writers.add(up_writer)
        try:
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            self.tunnels += 1
            await _relay(reader, writer, up_reader, up_writer)
        finally:
            up_writer.transport.abort()
            self._writers.discard(up_writer)


async def _answer(writer: asyncio.StreamWriter, status: int, headers: str = "") -> None:
    writer.write(
        f"HTTP/1.1 {status} Fake Proxy\r\n{headers}Content-Length: 0\r\n"
        "Connection: close\r\n\r\n".encode("latin-1")
    )
    with contextlib.suppress(ConnectionError):
        await writer.drain()


async def _relay(
    client_reader: asyncio.StreamReader,
    client_writer: asyncio.StreamWriter,
    up_reader: asyncio.StreamReader,
    up_writer: asyncio.StreamWriter,
) -> None:
    """Copy both ways until either side closes; then the tunnel is over."""
    ways = [
        asyncio.create_task(_copy(client_reader, up_writer)),
        asyncio.create_task(_copy(up_reader, client_writer)),
    ]
    try:
        await asyncio.wait(ways, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for way in ways:
            way.cancel()
        await asyncio.gather(*ways, return_exceptions=True)


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(_READ_SIZE):
            writer.write(data)
            await writer.drain()
