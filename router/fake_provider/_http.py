"""A deliberately small HTTP/1.1 server connection with byte-level control over the socket.

Only what the fake upstream needs: keep-alive, Content-Length and chunked request bodies,
Content-Length and chunked responses, and the faults a framework would hide from us (RST,
half-written bodies, tiny writes, silence).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus

from router.drivers.http import Headers

__all__ = ["BadRequest", "Connection", "Headers", "HttpRequest"]

_MAX_HEAD = 64 * 1024
_MAX_BODY = 64 * 1024 * 1024
_READ_SIZE = 64 * 1024


class BadRequest(Exception):
    """The peer sent something that is not an HTTP/1.1 request we accept."""


@dataclass(frozen=True)
class HttpRequest:
    method: str
    path: str
    query: str
    version: str
    headers: Headers
    body: bytes

    @property
    def keep_alive(self) -> bool:
        tokens = {t.strip().lower() for t in self.headers.get("connection", "").split(",")}
        if self.version == "HTTP/1.0":
            return "keep-alive" in tokens
        return "close" not in tokens


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


class Connection:
    """One accepted client connection: read requests, write responses, misbehave on demand."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        # Bytes read ahead of the request parser, e.g. while watching for the client to leave.
        self._buffer = bytearray()
        self._eof = False
        self.closed = False
        self.body_sent = 0  # body bytes written since the response began (respond resets it)

    # Reading

    async def _fill(self) -> bool:
        """Read more bytes into the buffer; False at EOF (or when the peer reset us)."""
        if self._eof:
            return False
        try:
            data = await self._reader.read(_READ_SIZE)
        except ConnectionError:
            data = b""
        if not data:
            self._eof = True
            return False
        self._buffer += data
        return True

    async def _read_exactly(self, n: int) -> bytes:
        while len(self._buffer) < n:
            if not await self._fill():
                raise BadRequest("connection closed inside the request body")
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return data

    async def _read_line(self, limit: int = _MAX_HEAD) -> bytes:
        while (end := self._buffer.find(b"\r\n")) < 0:
            if len(self._buffer) > limit:
                raise BadRequest("line too long")
            if not await self._fill():
                raise BadRequest("connection closed inside a line")
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 2]
        return line

    async def read_request(self) -> HttpRequest | None:
        """The next request, or None when the client closed the connection between requests."""
        while (end := self._buffer.find(b"\r\n\r\n")) < 0:
            if len(self._buffer) > _MAX_HEAD:
                raise BadRequest("request head too large")
            if not await self._fill():
                if self._buffer.strip():
                    raise BadRequest("connection closed inside the request head")
                return None
        head = bytes(self._buffer[:end]).decode("latin-1")
        del self._buffer[: end + 4]
        request_line, *header_lines = head.lstrip("\r\n").split("\r\n")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise BadRequest(f"bad request line {request_line!r}")
        method, target, version = parts
        pairs: list[tuple[str, str]] = []
        for line in header_lines:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise BadRequest(f"bad header line {line!r}")
            pairs.append((name, value.strip()))
        headers = Headers(pairs)
        body = await self._read_body(headers)
        path, _, query = target.partition("?")
        return HttpRequest(method, path, query, version, headers, body)

    async def _read_body(self, headers: Headers) -> bytes:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            return await self._read_chunked_body()
        raw_length = headers.get("content-length", "0")
        if not raw_length.isdigit() or int(raw_length) > _MAX_BODY:
            raise BadRequest(f"bad content-length {raw_length!r}")
        return await self._read_exactly(int(raw_length))

    async def _read_chunked_body(self) -> bytes:
        body = bytearray()
        while True:
            size_line = (await self._read_line()).split(b";", 1)[0].strip()
            try:
                size = int(size_line, 16)
            except ValueError:
                raise BadRequest(f"bad chunk size {size_line!r}") from None
            if size == 0:
                while await self._read_line():  # trailers, up to the blank line
                    pass
                return bytes(body)
            body += await self._read_exactly(size)
            if len(body) > _MAX_BODY:
                raise BadRequest("request body too large")
            if await self._read_exactly(2) != b"\r\n":
                raise BadRequest("chunk not followed by CRLF")

    async def wait_client_gone(self, seconds: float | None) -> bool:
        """Stay silent for `seconds` (None: forever); True as soon as the client goes away.

        Whatever the client sends meanwhile is kept for the request parser.
        """

        async def until_eof() -> None:
            while await self._fill():
                pass

        if seconds is not None and seconds <= 0:
            return self._eof
        try:
            await asyncio.wait_for(until_eof(), seconds)
        except TimeoutError:
            return False
        return True

    # Writing

    async def send(self, data: bytes, *, body: int = 0) -> None:
        """Write and flush; raises ConnectionError if the client is gone. ``body``: how many
        of these bytes are the response's body (counted in :attr:`body_sent`)."""
        if self._writer.is_closing():
            raise ConnectionResetError("connection closed")
        self._writer.write(data)
        self.body_sent += body
        await self._writer.drain()

    @staticmethod
    def head(status: int, headers: Mapping[str, str]) -> bytes:
        lines = [f"HTTP/1.1 {status} {_reason(status)}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def send_response(
        self,
        status: int,
        headers: Mapping[str, str],
        body: bytes,
        *,
        keep_alive: bool,
    ) -> None:
        all_headers = {
            **headers,
            "content-length": str(len(body)),
            "connection": "keep-alive" if keep_alive else "close",
        }
        await self.send(self.head(status, all_headers) + body, body=len(body))

    async def start_chunked(
        self, status: int, headers: Mapping[str, str], *, keep_alive: bool
    ) -> None:
        all_headers = {
            **headers,
            "transfer-encoding": "chunked",
            "connection": "keep-alive" if keep_alive else "close",
        }
        await self.send(self.head(status, all_headers))

    async def send_chunk(self, data: bytes) -> None:
        if data:
            await self.send(b"%x\r\n%b\r\n" % (len(data), data), body=len(data))

    async def end_chunked(self) -> None:
        await self.send(b"0\r\n\r\n")

    # Ending

    async def close(self) -> None:
        """Close cleanly (FIN), whatever state the response is in."""
        if self.closed:
            return
        self.closed = True
        self._writer.close()
        with contextlib.suppress(ConnectionError):
            await self._writer.wait_closed()

    def reset(self) -> None:
        """Abort with a TCP RST: SO_LINGER on with a zero timeout makes close() send RST."""
        if self.closed:
            return
        self.closed = True
        sock = self._writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self._writer.transport.abort()
