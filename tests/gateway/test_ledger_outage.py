"""The ledger's database going away mid-load: requests fail fast with a clear 503 and no
upstream call (nothing may be sent without a durable reservation), and the gateway
recovers by itself when the database is back."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from tests.gateway.harness import Route, running_gateway
from tests.helpers import eventually

BODY: dict[str, Any] = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}


class TcpProxy:
    """A TCP relay to PostgreSQL that a test can cut (an outage) and restore."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        await self._server.wait_closed()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers -= {writer, up_writer}


@pytest.mark.postgres
async def test_database_outage_fails_fast_without_calling_upstream_then_recovers(
    postgres_url: str,
) -> None:
    target = make_url(postgres_url)
    proxy = TcpProxy(target.host or "127.0.0.1", target.port or 5432)
    await proxy.start()
    url = target.set(port=proxy.port).render_as_string(hide_password=False)
    async with running_gateway(url, ["east"], [Route("east")]) as gw, gw.http() as http:
        assert (await http.post("/v1/chat/completions", json=BODY)).status_code == 200
        await proxy.cut()
        started = time.monotonic()
        down = await http.post("/v1/chat/completions", json=BODY)
        assert time.monotonic() - started < 10
        assert down.status_code == 503, down.text
        error = down.json()["error"]
        assert error["code"] == "ledger_unavailable"
        assert down.headers["x-should-retry"] == "true" and down.headers["retry-after"] == "1"
        assert gw.upstreams["east"].hits == 1  # nothing was sent without a reservation
        await proxy.start()  # the database is back

        async def serving() -> bool:
            return (await http.post("/v1/chat/completions", json=BODY)).status_code == 200

        await eventually(serving, within_s=20, interval=0.2)
    await proxy.cut()
