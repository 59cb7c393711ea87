"""The served protocol's transport: a turn's writes leave in one system call, in order."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import weakref
from types import SimpleNamespace
from typing import Any

import httpx

from router.serving.server import KEEP_ALIVE_S, UVICORN_OPTIONS, CoalescingTransport
from tests.gateway.harness import Route, running_gateway


class _Recording:
    """What the wrapped transport was asked to do, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.calls.append(("write", data))

    def close(self) -> None:
        self.calls.append(("close", None))
        self.closing = True

    def abort(self) -> None:
        self.calls.append(("abort", None))
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 1)}.get(name, default)


async def _turn() -> None:
    await asyncio.sleep(0)


async def test_writes_in_one_turn_go_out_as_one_in_order() -> None:
    inner = _Recording()
    transport = CoalescingTransport(inner, asyncio.get_running_loop())  # type: ignore[arg-type]
    transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
    transport.write(b"")
    transport.write(bytearray(b"body"))
    assert inner.calls == []
    assert transport.get_write_buffer_size() == 23
    await _turn()
    assert inner.calls == [("write", b"HTTP/1.1 200 OK\r\n\r\nbody")]
    transport.write(b"next")
    await _turn()
    assert inner.calls[-1] == ("write", b"next")


async def test_a_piece_written_now_goes_out_at_once_unless_earlier_writes_wait() -> None:
    inner = _Recording()
    transport = CoalescingTransport(inner, asyncio.get_running_loop())  # type: ignore[arg-type]
    transport.write_now(b"chunk 1")
    assert inner.calls == [("write", b"chunk 1")]  # no turn waited for
    transport.write(b"head")
    transport.write_now(b"chunk 2")
    assert inner.calls == [("write", b"chunk 1")]  # after the head, in order
    await _turn()
    assert inner.calls == [("write", b"chunk 1"), ("write", b"headchunk 2")]
    inner.closing = True
    transport.write_now(b"too late")
    assert inner.calls[-1] == ("write", b"headchunk 2")


async def test_close_sends_what_waits_first_and_abort_drops_it() -> None:
    inner = _Recording()
    transport = CoalescingTransport(inner, asyncio.get_running_loop())  # type: ignore[arg-type]
    transport.write(b"last words")
    transport.close()
    await _turn()
    assert inner.calls == [("write", b"last words"), ("close", None)]
    dropped = _Recording()
    transport = CoalescingTransport(dropped, asyncio.get_running_loop())  # type: ignore[arg-type]
    transport.write(b"never sent")
    transport.abort()
    await _turn()
    assert dropped.calls == [("abort", None)]


async def test_nothing_is_written_to_a_transport_closed_meanwhile() -> None:
    inner = _Recording()
    transport = CoalescingTransport(inner, asyncio.get_running_loop())  # type: ignore[arg-type]
    transport.write(b"too late")
    inner.closing = True  # the peer went away before the turn ended
    await _turn()
    assert inner.calls == []
    assert transport.get_extra_info("peername") == ("127.0.0.1", 1)  # the rest is the inner's


async def test_the_served_app_answers_through_it(database_url: str) -> None:
    async with (
        running_gateway(database_url, ["east"], [Route("east")]) as gw,
        httpx.AsyncClient(base_url=gw.url) as http,
    ):
        answers = await asyncio.gather(*(http.get("/healthz") for _ in range(20)))
        upgrade = {"Upgrade": "websocket", "Connection": "Upgrade"}
        asked_to_upgrade = await http.get("/healthz", headers=upgrade)
    assert {a.status_code for a in answers} == {200}
    assert all(a.json()["status"] == "ok" and "server" not in a.headers for a in answers)
    assert asked_to_upgrade.status_code == 200  # no WebSocket routes: plain HTTP


async def _raw(url: str, chunks: list[bytes]) -> tuple[bytes, int]:
    """Send ``chunks`` on one connection, stopping when the server closes it: the answer
    (empty if the close reset the connection first) and how many chunks went out."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    sent = 0
    try:
        for chunk in chunks:
            writer.write(chunk)
            await writer.drain()
            sent += 1
        return await asyncio.wait_for(reader.read(), 30), sent
    except ConnectionError:
        try:
            return await asyncio.wait_for(reader.read(), 30), sent
        except ConnectionError:
            return b"", sent
    finally:
        writer.close()


def _json_error(answer: bytes) -> tuple[int, dict[str, Any]]:
    import orjson

    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"content-type: application/json" in head.lower()
    assert b"x-request-id: req_" in head
    return status, orjson.loads(body)["error"]


async def test_the_protocol_answers_bad_heads_in_the_error_shape(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url, ["east"], [Route("east")]) as gw:
        request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
        huge, _ = await _raw(gw.url, [request + b"X-Big: " + b"a" * 70_000 + b"\r\n\r\n"])
        status, error = _json_error(huge)
        assert (status, error["code"]) == (431, "invalid_request")
        # An endless header: refused after the bound, never read to its end (the answer
        # may be lost to the reset of a connection closed with bytes unread).
        endless = [request + b"X-Endless: "] + [b"b" * 16_384] * 4096  # 64 MiB offered
        answer, sent = await _raw(gw.url, endless)
        assert sent < 1024  # socket buffers take a few MiB; the server read no more
        assert not answer or _json_error(answer)[0] == 431
        for bad in (
            request + b"X-Nul: a\x00b\r\n\r\n",
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        ):
            status, error = _json_error((await _raw(gw.url, [bad]))[0])
            assert (status, error["code"]) == (400, "invalid_request")
        async with gw.http() as http:  # the bound is on the head, not on a body
            big_body = {"model": "chat", "messages": [{"role": "user", "content": "x" * 100_000}]}
            assert (await http.post("/v1/chat/completions", json=big_body)).status_code == 200
            many = {f"x-h{i}": "v" * 100 for i in range(300)}  # ~32 KiB of headers: fine
            assert (await http.get("/healthz", headers=many)).status_code == 200


async def test_a_client_leaving_mid_body_is_no_error_in_the_logs(
    sqlite_url: str, caplog: Any
) -> None:
    import logging

    async with running_gateway(sqlite_url, ["east"], [Route("east")]) as gw:
        caplog.set_level(logging.WARNING)
        for path in ("/v1/chat/completions", "/v1/reconciliations"):
            head = (
                f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {gw.secret}\r\n"
                "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
            ).encode()
            _, writer = await asyncio.open_connection(*gw.url.removeprefix("http://").split(":"))
            writer.write(head + b'{"model": "ch')
            await writer.drain()
            writer.close()
            await writer.wait_closed()
        async with gw.http() as http:  # the gateway carries on, and has had time to notice
            assert (await http.get("/v1/models")).status_code == 200
        assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
        assert "ClientDisconnect" not in caplog.text


class _Busy:
    """An app served by uvloop in a thread of its own, as ``waybill serve`` serves (its
    timers and its reads interleave as uvloop orders them), whose loop a test can keep busy."""

    def __init__(self, **options: Any) -> None:
        import uvicorn
        import uvloop

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            headers = [(b"content-length", b"2")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b"ok"})

        settings = {**UVICORN_OPTIONS, "lifespan": "off", **options}
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, **settings))
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._serve(),))

    async def _serve(self) -> None:
        await self.server.serve()

    def __enter__(self) -> int:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        port: int = self.server.servers[0].sockets[0].getsockname()[1]
        return port

    def __exit__(self, *exc_info: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
        self.loop.close()

    def run_late(self, busy_s: float, late_s: float) -> None:
        """Keep the server's loop busy for ``busy_s``, then for ``late_s`` more in a timer
        it runs then, as a loop full of work is late for everything; its other timers due
        by then run after that one, before the loop reads its sockets again."""

        def stall() -> None:
            self.loop.call_later(0.05, time.sleep, late_s)
            time.sleep(busy_s)

        self.loop.call_soon_threadsafe(stall)


def _exchange(sock: socket.socket) -> bytes:
    """One GET on a kept-alive connection: the answer, or what came before the close."""
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = b""
    try:
        while not answer.endswith(b"\r\n\r\nok"):
            piece = sock.recv(65536)
            if not piece:
                break
            answer += piece
    except ConnectionResetError:
        pass
    return answer


def test_a_request_on_a_kept_alive_connection_is_answered_when_the_loop_runs_late() -> None:
    busy = _Busy(timeout_keep_alive=0.3)
    with busy as port, socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        assert _exchange(sock).startswith(b"HTTP/1.1 200")
        # The loop is late: by the time it runs the keep-alive timer, the next request is
        # in the socket's buffer, not yet read. A connection with a request waiting is not
        # idle: it stays open and the request is answered.
        busy.run_late(0.5, 2.0)
        time.sleep(0.8)
        assert _exchange(sock).startswith(b"HTTP/1.1 200")


def test_the_keep_alive_timeout_outlasts_the_idle_timeouts_of_common_clients() -> None:
    from openai._constants import DEFAULT_CONNECTION_LIMITS

    # The client lets go of an idle connection first, and never writes into one we close.
    expiry = DEFAULT_CONNECTION_LIMITS.keepalive_expiry  # the OpenAI SDK's pool: 5 s
    assert expiry is not None and expiry < KEEP_ALIVE_S
    assert UVICORN_OPTIONS["timeout_keep_alive"] == KEEP_ALIVE_S > 60  # load balancers' 60 s


async def test_the_body_writer_writes_a_chunk_only_where_an_asgi_message_would_go_at_once() -> None:
    from router.serving.server import _write_body

    inner = _Recording()
    transport = CoalescingTransport(inner, asyncio.get_running_loop())  # type: ignore[arg-type]
    started = {
        "response_started": True,
        "response_complete": False,
        "disconnected": False,
        "chunked_encoding": True,
    }
    cycle = _Cycle(**started, flow=SimpleNamespace(write_paused=False), transport=transport)
    assert _write_body(weakref.ref(cycle), b"data: x\n\n")  # type: ignore[arg-type]
    assert inner.calls == [("write", b"9\r\ndata: x\n\n\r\n")]
    for state, value in [
        ("response_started", False),
        ("response_complete", True),
        ("disconnected", True),
        ("chunked_encoding", False),
    ]:
        refused = _Cycle(**{**started, state: value}, flow=cycle.flow, transport=transport)
        assert not _write_body(weakref.ref(refused), b"more")  # type: ignore[arg-type]
    cycle.flow.write_paused = True  # the client reads slowly: the ASGI send waits its turn
    assert not _write_body(weakref.ref(cycle), b"more")  # type: ignore[arg-type]
    gone = _Cycle(**started, flow=cycle.flow, transport=transport)
    writer = weakref.ref(gone)
    del gone  # the request is over
    assert not _write_body(writer, b"more")  # type: ignore[arg-type]
    assert len(inner.calls) == 1


class _Cycle(SimpleNamespace):
    """A stand-in for uvicorn's RequestResponseCycle (which can be weakly referenced)."""
