"""The served protocol's transport: a turn's writes leave in one system call, in order."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from router.serving import CoalescingTransport
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
    assert all(a.content == b'{"status":"ok"}' and "server" not in a.headers for a in answers)
    assert asked_to_upgrade.status_code == 200  # no WebSocket routes: plain HTTP
