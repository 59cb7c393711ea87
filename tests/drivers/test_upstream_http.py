"""The drivers' HTTP client against raw servers on 127.0.0.1 that misbehave on purpose."""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
import trustme

from router.drivers.http import (
    ConnectFailed,
    ConnectionBroken,
    HTTPClient,
    ProtocolError,
    ReadTimeout,
)

# --- a raw server: every byte on the wire is the test's ---


@dataclass(frozen=True)
class Request:
    head: bytes
    body: bytes

    def header(self, name: str) -> str | None:
        for line in self.head.decode("latin-1").split("\r\n")[1:]:
            key, _, value = line.partition(":")
            if key.strip().lower() == name:
                return value.strip()
        return None


class Peer:
    """The server's side of one accepted connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def read_request(self) -> Request | None:
        """The next request, or None once the client closed (or reset) the connection."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
            request = Request(head, b"")
            body = await self.reader.readexactly(int(request.header("content-length") or 0))
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        return Request(head, body)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    def reset(self) -> None:
        """Close with a TCP RST instead of a FIN."""
        sock = self.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()


Handler = Callable[[Peer], Awaitable[None]]


class RawServer:
    """Runs ``handle`` for each accepted connection; counts connections opened and ended."""

    def __init__(self, handle: Handler, *, tls: ssl.SSLContext | None = None) -> None:
        self._handle = handle
        self._tls = tls
        self.connections = 0
        self.ended = 0
        self._changed = asyncio.Condition()
        self._tasks: set[asyncio.Task[None]] = set()
        self._peers: list[Peer] = []

    @property
    def url(self) -> str:
        scheme = "https" if self._tls else "http"
        return f"{scheme}://127.0.0.1:{self.port}/v1/chat/completions?x=1"

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0, ssl=self._tls)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        for peer in self._peers:
            peer.writer.transport.abort()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def wait_ended(self, count: int) -> None:
        """Until ``count`` connections have ended (the client closed them, or the handler)."""
        async with asyncio.timeout(5), self._changed:
            await self._changed.wait_for(lambda: self.ended >= count)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        peer = Peer(reader, writer)
        self._peers.append(peer)
        self.connections += 1
        try:
            await self._handle(peer)
        except ConnectionError:
            pass
        finally:
            writer.transport.abort()
            self.ended += 1
            async with self._changed:
                self._changed.notify_all()


def reply(body: bytes = b"ok", *, status: str = "200 OK", headers: str = "") -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{headers}\r\n"
    return head.encode() + body


def chunked(*pieces: bytes) -> bytes:
    framed = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + framed + b"0\r\n\r\n"


async def echo(peer: Peer) -> None:
    """Keep-alive: answer every request with its own body."""
    while (request := await peer.read_request()) is not None:
        await peer.send(reply(request.body or b"ok"))


@pytest.fixture
async def client() -> AsyncIterator[HTTPClient]:
    c = HTTPClient()
    yield c
    await c.aclose()


async def call(client: HTTPClient, url: str, body: bytes = b"hi") -> bytes:
    response = await client.request("POST", url, body=body)
    try:
        return await response.aread()
    finally:
        await response.aclose()


async def settle() -> None:
    """Let the loop deliver what the kernel already holds (a FIN on loopback is immediate)."""
    for _ in range(3):
        await asyncio.sleep(0)


# --- the request ---


async def test_the_request_is_http11_with_host_length_and_no_compression(client):
    seen: list[Request] = []

    async def capture(peer: Peer) -> None:
        while (request := await peer.read_request()) is not None:
            seen.append(request)
            await peer.send(reply())

    async with RawServer(capture) as server:
        headers = {"Authorization": "Bearer k", "host": "evil", "Content-Length": "99"}
        await client.request("POST", server.url, headers=headers, body=b"{}")
    request = seen[0]
    lines = request.head.decode().split("\r\n")
    assert lines[0] == "POST /v1/chat/completions?x=1 HTTP/1.1"
    assert request.header("host") == f"127.0.0.1:{server.port}"
    assert request.header("content-length") == "2" and request.body == b"{}"
    assert request.header("authorization") == "Bearer k"
    assert request.header("accept-encoding") is None and request.header("cookie") is None
    assert sum(line.lower().startswith("host:") for line in lines) == 1


@pytest.mark.parametrize("name, value", [("X-A", "1\r\nX-B: 2"), ("X-A\n", "1")])
async def test_a_header_with_cr_or_lf_is_refused_before_connecting(client, name, value):
    with pytest.raises(ValueError, match="CR or LF"):
        await client.request("POST", "http://127.0.0.1:9/", headers={name: value})


# --- bodies and keep-alive ---


async def test_one_connection_serves_sequential_requests(client):
    async with RawServer(echo) as server:
        assert await call(client, server.url, b"first") == b"first"
        assert await call(client, server.url, b"second") == b"second"
    assert server.connections == 1


async def test_chunked_body_is_decoded_and_the_connection_reused(client):
    async def serve(peer: Peer) -> None:
        while await peer.read_request() is not None:
            await peer.send(chunked(b"hel", b"lo ", b"world"))

    async with RawServer(serve) as server:
        assert await call(client, server.url) == b"hello world"
        assert await call(client, server.url) == b"hello world"
    assert server.connections == 1


async def test_close_delimited_body_ends_at_eof_and_is_not_reused(client):
    async def serve(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end")
        peer.writer.close()

    async with RawServer(serve) as server:
        assert await call(client, server.url) == b"until the end"
        assert await call(client, server.url) == b"until the end"
    assert server.connections == 2


async def test_a_body_written_one_byte_at_a_time_arrives_whole(client):
    body = bytes(range(256)) * 8

    async def serve(peer: Peer) -> None:
        while await peer.read_request() is not None:
            for i, byte in enumerate(chunked(body[:1000], body[1000:])):
                await peer.send(bytes([byte]))
                if i % 4 == 0:
                    await asyncio.sleep(0)  # let the client read most bytes on their own

    async with RawServer(serve) as server:
        assert await call(client, server.url) == body
        assert await call(client, server.url) == body
    assert server.connections == 1


async def test_a_body_larger_than_the_buffer_limit_streams_through(client):
    body = b"x" * (3 * 1024 * 1024 + 7)

    async with RawServer(echo) as server:
        response = await client.request("POST", server.url, body=body)
        pieces = [piece async for piece in response.aiter_bytes()]
    assert b"".join(pieces) == body
    assert server.connections == 1


async def test_reading_pauses_while_the_body_is_not_consumed(client):
    total = 256 * 1024 * 1024
    written = 0

    async def serve(peer: Peer) -> None:
        nonlocal written
        await peer.read_request()
        await peer.send(f"HTTP/1.1 200 OK\r\nContent-Length: {total}\r\n\r\n".encode())
        piece = b"y" * (1024 * 1024)
        while written < total:
            await peer.send(piece)
            written += len(piece)

    async with RawServer(serve) as server:
        response = await client.request("POST", server.url)
        # No event says "nothing more happens"; give an unpaused reader ample time to pull
        # hundreds of MiB over loopback, then check the server was held back instead.
        await asyncio.sleep(0.3)
        assert written < 64 * 1024 * 1024
        await response.aclose()


async def test_interim_100_continue_is_skipped(client):
    async def serve(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 100 Continue\r\n\r\n" + reply(b"final"))

    async with RawServer(serve) as server:
        response = await client.request("POST", server.url)
        assert response.status_code == 200
        assert await response.aread() == b"final"


async def test_headers_are_case_insensitive_and_repeats_are_joined(client):
    async def serve(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(
            reply(status="429 Too Many", headers="Retry-After: 2\r\nX-A: 1\r\nx-a: 2\r\n")
        )

    async with RawServer(serve) as server:
        response = await client.request("POST", server.url)
        await response.aclose()
    assert response.status_code == 429
    assert response.headers.get("retry-after") == response.headers["RETRY-AFTER"] == "2"
    assert response.headers.get("x-a") == "1, 2"
    assert response.headers.get("missing") is None and "X-A" in response.headers


@pytest.mark.parametrize(
    "answer",
    [
        reply(headers="Connection: close\r\n"),
        b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
        reply() + b"HTTP/1.1 200 OK\r\n",  # bytes after the response nobody asked for
    ],
    ids=["connection_close", "http10", "trailing_bytes"],
)
async def test_a_connection_the_server_will_not_keep_is_not_reused(client, answer):
    async def serve(peer: Peer) -> None:
        while await peer.read_request() is not None:
            await peer.send(answer)

    async with RawServer(serve) as server:
        assert await call(client, server.url) == b"ok"
        assert await call(client, server.url) == b"ok"
    assert server.connections == 2


async def test_an_empty_body_returns_the_connection_without_reading(client):
    async def serve(peer: Peer) -> None:
        while await peer.read_request() is not None:
            await peer.send(b"HTTP/1.1 204 No Content\r\n\r\n")

    async with RawServer(serve) as server:
        for _ in range(2):
            response = await client.request("POST", server.url)
            await response.aclose()
    assert server.connections == 1


# --- the pool ---


async def test_a_pooled_connection_the_server_closed_is_replaced(client):
    async def serve_once(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(reply())  # keep-alive by default, then close it while idle

    async with RawServer(serve_once) as server:
        assert await call(client, server.url) == b"ok"
        await server.wait_ended(1)
        await settle()
        assert await call(client, server.url) == b"ok"
    assert server.connections == 2


async def test_an_expired_idle_connection_is_not_reused():
    client = HTTPClient(idle_expiry_s=0.0)
    async with RawServer(echo) as server:
        await call(client, server.url)
        await call(client, server.url)
        await server.wait_ended(1)  # the expired one was closed, not left open
        await client.aclose()
    assert server.connections == 2


async def test_fifty_concurrent_requests_then_at_most_32_idle_are_kept(client):
    barrier = asyncio.Barrier(50)  # every round holds its 50 requests in flight together

    async def serve(peer: Peer) -> None:
        while (request := await peer.read_request()) is not None:
            await barrier.wait()
            await peer.send(reply(request.body))

    async with RawServer(serve) as server:
        for _ in range(2):
            bodies = [str(i).encode() for i in range(50)]
            answers = await asyncio.gather(*(call(client, server.url, b) for b in bodies))
            assert answers == bodies
        # Round one opened 50; 32 stayed idle; round two reused them and opened 18.
        assert server.connections == 68
        await server.wait_ended(18)


async def test_closing_the_client_closes_its_idle_connections():
    client = HTTPClient()
    async with RawServer(echo) as server:
        await call(client, server.url)
        await client.aclose()
        await server.wait_ended(1)
        with pytest.raises(RuntimeError):
            await client.request("POST", server.url)


# --- failures, and what they prove about the request ---


async def test_connection_refused_is_connect_failed(client):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ConnectFailed):
        await client.request("POST", f"http://127.0.0.1:{port}/")


@pytest.mark.parametrize("reused", [False, True], ids=["fresh", "pooled"])
async def test_reset_after_the_request_before_headers_is_connection_broken(client, reused):
    async def serve(peer: Peer) -> None:
        if reused:
            await peer.read_request()
            await peer.send(reply())
        await peer.read_request()
        peer.reset()

    async with RawServer(serve) as server:
        if reused:
            await call(client, server.url)
        with pytest.raises(ConnectionBroken):
            await client.request("POST", server.url)
    assert server.connections == 1


async def test_reset_mid_body_raises_connection_broken_from_the_body(client):
    async def serve(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"a" * 100)
        peer.reset()

    async with RawServer(serve) as server:
        response = await client.request("POST", server.url)
        received = b""
        with pytest.raises(ConnectionBroken):
            async for piece in response.aiter_bytes():
                received += piece
    assert received == b"a" * 100


@pytest.mark.parametrize(
    "answer",
    [b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", chunked(b"abc")[:-7]],
    ids=["content_length", "chunked"],
)
async def test_eof_before_the_framed_end_is_connection_broken(client, answer):
    async def serve(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(answer)
        peer.writer.close()

    async with RawServer(serve) as server:
        response = await client.request("POST", server.url)
        with pytest.raises(ConnectionBroken):
            await response.aread()


async def test_headers_never_arriving_under_asyncio_timeout_drop_the_connection(client):
    async def serve(peer: Peer) -> None:
        if server.connections > 1:
            return await echo(peer)
        await peer.read_request()
        await peer.read_request()  # stay silent until the client gives up

    async with RawServer(serve) as server:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await client.request("POST", server.url)
        await server.wait_ended(1)  # the client closed the connection it gave up on
        assert await call(client, server.url, b"next") == b"next"
    assert server.connections == 2


async def test_headers_timeout_bounds_the_call_as_a_timeout_error_and_drops_the_connection(
    client,
):
    async def serve(peer: Peer) -> None:
        if server.connections > 1:
            return await echo(peer)
        await peer.read_request()
        await peer.read_request()  # stay silent past the call's bound

    async with RawServer(serve) as server:
        # The call's bound is the caller's deadline (a TimeoutError), not a read timeout.
        with pytest.raises(TimeoutError):
            await client.request("POST", server.url, read_timeout=30, headers_timeout=0.1)
        await server.wait_ended(1)
        assert await call(client, server.url, b"next") == b"next"
    assert server.connections == 2


async def test_a_cancelled_body_read_drops_the_connection(client):
    async def serve(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await peer.read_request()

    async with RawServer(serve) as server:
        response = await client.request("POST", server.url)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await response.aread()
        await server.wait_ended(1)
    assert server.connections == 1


async def test_a_partly_read_body_closed_early_is_not_reused(client):
    async def serve(peer: Peer) -> None:
        if server.connections > 1:
            return await echo(peer)
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await peer.read_request()  # until the client closes it

    async with RawServer(serve) as server:
        response = await client.request("POST", server.url)
        body = response.aiter_bytes()
        assert await anext(body) == b"abc"
        await response.aclose()
        await server.wait_ended(1)
        assert await call(client, server.url, b"again") == b"again"
    assert server.connections == 2


async def test_released_after_its_end_a_streamed_body_gives_its_connection_back(client):
    # An SSE stream read up to [DONE]: the terminating chunk arrives after the reader left.
    ended = asyncio.Event()

    async def serve(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await peer.send(b"e\r\ndata: [DONE]\n\n\r\n")
        await ended.wait()
        await peer.send(b"3\r\nxyz\r\n0\r\n\r\n")  # more bytes, then the end
        await echo(peer)

    async with RawServer(serve) as server:
        response = await client.request("POST", server.url)
        assert await anext(response.aiter_bytes()) == b"data: [DONE]\n\n"
        response.release_after_end(within_s=5)
        ended.set()
        for _ in range(50):
            await settle()
        assert await call(client, server.url, b"again") == b"again"
    assert server.connections == 1


async def test_released_after_its_end_a_body_that_never_ends_is_dropped(client):
    async def serve(peer: Peer) -> None:
        if server.connections > 1:
            return await echo(peer)
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await peer.read_request()  # until the client closes it

    async with RawServer(serve) as server:
        response = await client.request("POST", server.url)
        assert await anext(response.aiter_bytes()) == b"abc"
        response.release_after_end(within_s=0.05)
        await server.wait_ended(1)
        assert await call(client, server.url, b"again") == b"again"
    assert server.connections == 2


@pytest.mark.parametrize(
    "answer",
    [b"HTTX/1.1 200 OK\r\n\r\n", b"HTTP/1.1 2x0 OK\r\n\r\n", b"garbage\r\n\r\n"],
    ids=["version", "status", "garbage"],
)
async def test_a_malformed_status_line_is_a_protocol_error(client, answer):
    async def serve(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(answer)
        await peer.read_request()

    async with RawServer(serve) as server:
        with pytest.raises(ProtocolError):
            await client.request("POST", server.url)
        await server.wait_ended(1)


async def test_read_timeout_bounds_each_wait_for_response_bytes(client):
    async def serve(peer: Peer) -> None:
        await peer.read_request()
        if server.connections == 2:
            await peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await peer.read_request()  # then silence

    async with RawServer(serve) as server:
        with pytest.raises(ReadTimeout):
            await client.request("POST", server.url, read_timeout=0.05)
        response = await client.request("POST", server.url, read_timeout=0.05)
        with pytest.raises(ReadTimeout):
            await response.aread()
        await server.wait_ended(2)
    assert not isinstance(ReadTimeout(), TimeoutError)


async def test_a_read_deadline_bounds_the_waits_whatever_comes_before_it(client):
    async def serve(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while True:  # a byte now and then, never the end
            await peer.send(b"1\r\n.\r\n")
            await asyncio.sleep(0.02)

    async with RawServer(serve) as server:
        response = await client.request("POST", server.url, read_timeout=30)
        response.read_deadline = asyncio.get_running_loop().time() + 0.2
        with pytest.raises(ReadTimeout) as caught:
            await response.aread()
    assert caught.value.deadline
    assert not ReadTimeout().deadline


def _chunks(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)


async def test_a_tap_takes_the_pieces_it_wants_and_the_reader_the_rest_in_order(client):
    taken: list[bytes] = []
    took = asyncio.Event()

    async def serve(peer: Peer) -> None:
        await peer.read_request()
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        await peer.send(head + _chunks(b"first"))
        for piece in (b"b", b"c"):  # each its own read, taken before the next is sent
            await took.wait()
            took.clear()
            await peer.send(_chunks(piece))
        await took.wait()
        await peer.send(_chunks(b"STOP"))
        await peer.send(_chunks(b"d") + b"0\r\n\r\n")
        await peer.read_request()

    def tap(piece: bytes) -> bool:
        if b"STOP" in piece:
            return False
        taken.append(piece)
        took.set()
        return True

    async with RawServer(serve) as server:
        response = await client.request("POST", server.url, read_timeout=5)
        body = response.aiter_bytes()
        assert await anext(body) == b"first"
        response.tap(tap)
        took.set()
        rest = b"".join([piece async for piece in body])
    assert (taken, rest) == ([b"b", b"c"], b"STOPd")  # after the first left, none is taken


async def test_a_tap_gets_a_reads_pieces_together(client):
    async def serve(peer: Peer) -> None:
        await peer.read_request()
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        await peer.send(head + _chunks(b"first"))
        await asyncio.sleep(0.05)
        await peer.send(_chunks(b"a", b"b", b"c"))  # one write: one read of three pieces
        await asyncio.sleep(0.05)
        await peer.send(b"0\r\n\r\n")
        await peer.read_request()

    taken: list[bytes] = []

    def tap(piece: bytes) -> bool:
        taken.append(piece)
        return True

    async with RawServer(serve) as server:
        response = await client.request("POST", server.url, read_timeout=5)
        body = response.aiter_bytes()
        assert await anext(body) == b"first"
        response.tap(tap)
        assert [piece async for piece in body] == []
    assert taken == [b"abc"]


async def test_pieces_a_tap_takes_keep_the_readers_wait_from_timing_out(client):
    async def serve(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(20):  # 0.4 s of pieces 20 ms apart, each well within the timeout
            await asyncio.sleep(0.02)
            await peer.send(_chunks(b"."))
        await peer.send(b"0\r\n\r\n")
        await peer.read_request()

    taken: list[bytes] = []

    def tap(piece: bytes) -> bool:
        taken.append(piece)
        return True

    async with RawServer(serve) as server:
        response = await client.request("POST", server.url, read_timeout=0.3)
        response.tap(tap)
        assert await response.aread() == b""
    assert taken == [b"."] * 20


def test_bytes_that_wait_unread_when_the_read_timeout_fires_are_read_not_a_timeout() -> None:
    # On uvloop, as the gateway runs: a loop full of work runs its due timers before it
    # reads its sockets again, so a read timeout can fire with the awaited bytes already in
    # the socket's buffer. The upstream was not silent: the wait goes on and gets them.
    uvloop = pytest.importorskip("uvloop")
    go, sent = threading.Event(), threading.Event()
    listener = socket.create_server(("127.0.0.1", 0))

    def upstream() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
            go.wait(20)
            time.sleep(0.7)  # while the loop is busy in its late timer
            conn.sendall(b"4\r\nlate\r\n0\r\n\r\n")
            sent.set()
            time.sleep(0.5)

    async def client_side() -> bytes:
        loop = asyncio.get_running_loop()
        client = HTTPClient()
        try:
            port = listener.getsockname()[1]
            response = await client.request("POST", f"http://127.0.0.1:{port}/", read_timeout=0.3)
            body = response.aiter_bytes()
            assert await anext(body) == b"first"
            waiting = asyncio.ensure_future(anext(body))
            await asyncio.sleep(0)  # its wait (and read timeout) has begun
            go.set()
            loop.call_later(0.05, time.sleep, 1.5)  # a late timer, due before the timeout
            loop.call_soon(time.sleep, 0.5)  # a busy loop: both are due when it gets to them
            return await waiting
        finally:
            await client.aclose()

    thread = threading.Thread(target=upstream)
    thread.start()
    try:
        assert uvloop.run(client_side()) == b"late"
        assert sent.is_set()
    finally:
        thread.join(20)
        listener.close()


# --- TLS ---


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def server_tls(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    return context


async def test_https_with_a_trusted_ca_keeps_its_connection_alive(
    ca: trustme.CA, server_tls: ssl.SSLContext
) -> None:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    client = HTTPClient(ssl_context=context)
    async with RawServer(echo, tls=server_tls) as server:
        assert await call(client, server.url, b"one") == b"one"
        assert await call(client, server.url, b"two") == b"two"
        await client.aclose()
    assert server.connections == 1


async def test_https_with_an_untrusted_certificate_is_connect_failed(client, server_tls):
    async with RawServer(echo, tls=server_tls) as server:
        with pytest.raises(ConnectFailed, match="CERTIFICATE_VERIFY_FAILED"):
            await client.request("POST", server.url)


# --- the same behaviour on uvloop, the loop the gateway serves on ---

_ON_UVLOOP = [
    test_one_connection_serves_sequential_requests,
    test_chunked_body_is_decoded_and_the_connection_reused,
    test_close_delimited_body_ends_at_eof_and_is_not_reused,
    test_a_body_written_one_byte_at_a_time_arrives_whole,
    test_a_body_larger_than_the_buffer_limit_streams_through,
    test_reading_pauses_while_the_body_is_not_consumed,
    test_a_pooled_connection_the_server_closed_is_replaced,
    test_fifty_concurrent_requests_then_at_most_32_idle_are_kept,
    test_reset_mid_body_raises_connection_broken_from_the_body,
    test_headers_never_arriving_under_asyncio_timeout_drop_the_connection,
    test_a_cancelled_body_read_drops_the_connection,
    test_a_partly_read_body_closed_early_is_not_reused,
    test_read_timeout_bounds_each_wait_for_response_bytes,
    test_a_read_deadline_bounds_the_waits_whatever_comes_before_it,
    test_headers_timeout_bounds_the_call_as_a_timeout_error_and_drops_the_connection,
    test_a_tap_takes_the_pieces_it_wants_and_the_reader_the_rest_in_order,
    test_a_tap_gets_a_reads_pieces_together,
    test_pieces_a_tap_takes_keep_the_readers_wait_from_timing_out,
]


@pytest.mark.parametrize("case", _ON_UVLOOP, ids=lambda case: case.__name__[5:])
def test_on_uvloop(case: Callable[[HTTPClient], Awaitable[None]]) -> None:
    uvloop = pytest.importorskip("uvloop")

    async def run() -> None:
        client = HTTPClient()
        try:
            await case(client)
        finally:
            await client.aclose()

    uvloop.run(run())


def test_https_on_uvloop(ca, server_tls) -> None:
    uvloop = pytest.importorskip("uvloop")
    uvloop.run(test_https_with_a_trusted_ca_keeps_its_connection_alive(ca, server_tls))
