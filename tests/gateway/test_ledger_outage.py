"""The ledger's database going away mid-load: requests fail fast with a clear 503 and no
upstream call (nothing may be sent without a durable reservation), and the gateway
recovers by itself when the database is back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from ledger.books.balances import holds
from ledger.store import LedgerUnavailable
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


def _one_outage_told(caplog: pytest.LogCaptureFixture, refused: int) -> None:
    """The log tells the outage once and its end once, with the count of requests it
    refused, and holds no traceback (not one per request refused or unrecorded)."""
    said = [r.getMessage() for r in caplog.records if r.name == "waybill.ledger"]
    down = [line for line in said if line.startswith("the ledger is unavailable")]
    back = [line for line in said if line.startswith("the ledger is available again")]
    assert len(down) == 1 and len(back) == 1, said
    assert f": {refused} requests were refused," in back[0], back[0]
    assert not [r.getMessage() for r in caplog.records if r.exc_info], "a traceback was logged"
    assert not [r for r in caplog.records if r.name == "waybill.app"]  # nothing per request


async def _ended_or_never_begun(gw: Any, request_ids: list[str]) -> None:
    """Each refused request's end is recorded once the ledger is back (or it recorded
    nothing): none is left open for crash recovery."""

    async def ended() -> bool:
        for request_id in request_ids:
            events = await gw.events(request_id)
            if events and events[-1].type != "RequestFailed":
                return False
        return True

    await eventually(ended, within_s=20, interval=0.2)


@pytest.mark.postgres
async def test_database_outage_fails_fast_without_calling_upstream_then_recovers(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    target = make_url(postgres_url)
    proxy = TcpProxy(target.host or "127.0.0.1", target.port or 5432)
    await proxy.start()
    url = target.set(port=proxy.port).render_as_string(hide_password=False)
    async with running_gateway(url, ["east"], [Route("east")]) as gw, gw.http() as http:
        assert (await http.post("/v1/chat/completions", json=BODY)).status_code == 200
        caplog.clear()
        await proxy.cut()
        refused: list[str] = []
        for streamed in (False, True, False, True, False):
            started = time.monotonic()
            down = await http.post("/v1/chat/completions", json={**BODY, "stream": streamed})
            assert time.monotonic() - started < 10
            assert down.status_code == 503, down.text
            error = down.json()["error"]
            assert error["code"] == "ledger_unavailable"
            assert down.headers["x-should-retry"] == "true" and down.headers["retry-after"] == "1"
            refused.append(down.headers["x-request-id"])
        assert gw.upstreams["east"].hits == 1  # nothing was sent without a reservation
        await proxy.start()  # the database is back
        # The first request after it is served.
        back = await http.post("/v1/chat/completions", json=BODY)
        assert back.status_code == 200, back.text
        await _ended_or_never_begun(gw, refused)
        _one_outage_told(caplog, refused=len(refused))
    await proxy.cut()


async def test_a_commit_whose_answer_was_lost_is_found_and_its_attempt_closed(database_url):
    # The append that reserves the attempt and records its start commits, but its caller
    # hears LedgerUnavailable (the connection died before the answer). The gateway made no
    # upstream call; what it records next must continue the stream that really exists:
    # the attempt finished as never started, its reservation released, the request failed.
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw:
        store = gw.served_store
        real_submit = store.submit
        lost: list[str] = []

        def answer_lost(stream_id: str, *args: Any, **kwargs: Any) -> Any:
            committing = real_submit(stream_id, *args, **kwargs)

            async def answer() -> Any:
                recorded = await committing
                if not lost and any(e.type == "AttemptStarted" for e in recorded):
                    lost.append(stream_id)
                    raise LedgerUnavailable("the connection dropped before the commit's answer")
                return recorded

            return asyncio.ensure_future(answer())

        store.submit = answer_lost  # type: ignore[method-assign]
        async with gw.http() as http:
            response = await http.post("/v1/chat/completions", json=BODY)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "ledger_unavailable"
        assert gw.upstreams["east"].hits == 0
        request_id = response.headers["x-request-id"]

        async def ended() -> bool:
            return any(e.type == "RequestFailed" for e in await gw.events(request_id))

        await eventually(ended, within_s=10)
        trail = await gw.events(request_id)
        assert [e.type for e in trail] == [
            "RequestReceived",
            "RouteEvaluated",
            "BudgetReserved",
            "AttemptStarted",
            "AttemptFinished",
            "BudgetReleased",
            "RequestFailed",
        ]
        finished, released, failed = (e.data for e in trail[4:])
        assert (finished["evidence"], finished["error_code"]) == (
            "not_started",
            "ledger_unavailable",
        )
        assert released["reason"] == "not_started"
        assert failed["error_code"] == "ledger_unavailable"
        async with store.engine.connect() as conn:
            states = [row.state for row in await conn.execute(holds())]
        assert states == ["resolved"]


async def test_a_database_refusal_that_is_not_an_outage_is_a_500_not_a_retryable_503(
    database_url: str,
) -> None:
    # A row planted behind the appender's back breaks the ledger's primary key on the next
    # append: retrying cannot help, so the client must not be told to retry.
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw, gw.http() as http:
        assert (await http.post("/v1/chat/completions", json=BODY)).status_code == 200
        async with gw.store.engine.begin() as conn:
            await conn.execute(
                sa.text(
                    "INSERT INTO appends (position, recorded_at, version, stream_id, types, "
                    "hash, payloads) SELECT position + length(types), recorded_at, 1, "
                    "'planted', types, hash, payloads FROM appends "
                    "ORDER BY position DESC LIMIT 1"
                )
            )
        response = await http.post("/v1/chat/completions", json=BODY)
        assert response.status_code == 500, response.text
        assert response.json()["error"]["code"] == "internal_error"
        assert response.headers["x-should-retry"] == "false"
        assert "appends" not in response.text.lower()  # the database's words stay in the log
        assert gw.upstreams["east"].hits == 1  # only the first request was sent upstream


@pytest.mark.postgres
async def test_a_database_refusing_connections_is_503_everywhere_then_recovers(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # ALTER DATABASE ... ALLOW_CONNECTIONS false: the server answers, but refuses the
    # database (SQLSTATE 55000, not a connection error): the ledger is unavailable all the
    # same, on the chat route, the models route and the query API alike.
    from tests.conftest import _admin

    name = make_url(postgres_url).database

    def allow(allowed: bool) -> None:
        with _admin() as admin:
            admin.execute(f"ALTER DATABASE {name} ALLOW_CONNECTIONS {str(allowed).lower()}")
            if not allowed:
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                    (name,),
                )

    caplog.set_level(logging.WARNING)
    async with running_gateway(postgres_url, ["east"], [Route("east")]) as gw, gw.http() as http:
        served = await http.post("/v1/chat/completions", json=BODY)
        assert served.status_code == 200
        caplog.clear()
        await asyncio.to_thread(allow, False)
        try:
            for method, path in (
                ("POST", "/v1/chat/completions"),
                ("GET", "/v1/models"),
                ("GET", f"/v1/requests/{served.headers['x-request-id']}"),
                ("GET", "/v1/requests?limit=5"),
            ):
                answer = await http.request(method, path, json=BODY if method == "POST" else None)
                assert answer.status_code == 503, (path, answer.text)
                assert answer.json()["error"]["code"] == "ledger_unavailable", path
            assert gw.upstreams["east"].hits == 1
        finally:
            await asyncio.to_thread(allow, True)
        # The first read after the database is back is served (the connections it ended
        # while they were idle are not handed out), and so is the next request.
        models = await http.get("/v1/models")
        assert models.status_code == 200, models.text
        assert (await http.post("/v1/chat/completions", json=BODY)).status_code == 200
        _one_outage_told(caplog, refused=4)


@pytest.mark.postgres
async def test_the_first_reads_after_the_database_ended_idle_connections_are_served(
    postgres_url: str,
) -> None:
    # A database restarted while no request came: every connection the gateway kept idle
    # was ended by the server. The requests after it must not each find one of those.
    from tests.conftest import _admin

    name = make_url(postgres_url).database

    def end_connections() -> None:
        with _admin() as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                (name,),
            )

    async with running_gateway(postgres_url, ["east"], [Route("east")]) as gw, gw.http() as http:
        warm = await asyncio.gather(*(http.get("/v1/models") for _ in range(8)))
        assert {answer.status_code for answer in warm} == {200}
        await asyncio.to_thread(end_connections)
        for _ in range(4):
            models = await http.get("/v1/models")
            assert models.status_code == 200, models.text
        assert (await http.post("/v1/chat/completions", json=BODY)).status_code == 200
        assert gw.upstreams["east"].hits == 1
