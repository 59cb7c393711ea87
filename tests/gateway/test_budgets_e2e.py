"""Budgets end to end (contract §6): reserve before every attempt, settle, release, hold unknown
usage — and never overspend, under concurrency and across gateway processes."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import sqlalchemy as sa

from ledger.books.balances import holds
from ledger.store.schema import budget_accounts
from router.doors.chat import parse_body
from router.fake_provider import Behavior, FakeUpstream
from router.request.selection import worst_case_cost
from tests.gateway.harness import (
    Gateway,
    Route,
    closed_port,
    config_text,
    running_gateway,
)
from tests.gateway.processes import new_key, serve_process
from tests.helpers import ledger_events
from tests.ledger.test_cli import waybill

D = Decimal
BODY: dict[str, Any] = {
    "model": "chat",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 100,
}


def worst_case(gw: Gateway, body: dict[str, Any] = BODY, index: int = 0) -> Decimal:
    call = parse_body(orjson.dumps(body))
    workspace = gw.config.workspace("acme")
    assert workspace is not None
    group = gw.config.model_group("chat")
    assert group is not None
    from router.doors.chat import HeaderNarrowing

    return worst_case_cost(group.mappings[index], call.requirements(workspace, HeaderNarrowing()))


async def accounts(gw: Gateway) -> list[Any]:
    async with gw.store.engine.connect() as conn:
        return list((await conn.execute(sa.select(budget_accounts))).all())


@pytest.mark.parametrize("concurrency", [40])
async def test_concurrent_requests_never_spend_over_the_key_budget(
    database_url: str, concurrency: int
) -> None:
    # The worst case of one request is 0.00024 USD (40 input tokens at most, 100 output);
    # the key budget covers 10 of them.
    limit = "0.0024"
    async with (
        running_gateway(
            database_url,
            ["east"],
            [Route("east")],
            workspace_extra=f"    key_budget: {{limit_usd: {limit}, window: day}}",
        ) as gw,
        gw.http() as http,
    ):
        assert worst_case(gw) * 10 == D(limit)
        gw.upstreams["east"].set_default(Behavior.ok(latency_ms=400))
        over: list[Any] = []
        done = asyncio.Event()

        async def sample() -> None:
            while not done.is_set():
                for row in await accounts(gw):
                    if row.held_usd + row.settled_usd > row.limit_usd:
                        over.append(row)
                await asyncio.sleep(0.005)

        sampler = asyncio.create_task(sample())
        responses = await asyncio.gather(
            *(http.post("/v1/chat/completions", json=BODY) for _ in range(concurrency))
        )
        done.set()
        await sampler
        statuses = sorted(r.status_code for r in responses)
        served = statuses.count(200)
        # At least the 10 worst cases the budget covers; a few more when an early success
        # settles (at its tiny actual cost) before the last requests reserve.
        assert 10 <= served < concurrency, statuses
        assert statuses.count(402) == concurrency - served
        assert not over, "settled + held went over the limit at a sampled moment"
        refused = next(r for r in responses if r.status_code == 402).json()["error"]
        assert refused["code"] == "budget_exceeded"
        assert "key:" in refused["message"]  # names the account
        assert gw.upstreams["east"].hits == served
        (account,) = await accounts(gw)
        assert account.held_usd == 0
        assert D(0) < account.settled_usd <= D(limit)


async def test_failover_after_an_unknown_attempt_must_fit_in_what_is_left(sqlite_url: str) -> None:
    # The request may spend 1.5 worst cases. East fails with a 500: the upstream may have
    # done the work, so its whole hold stays. West's worst case no longer fits: it is not
    # called (the outage is not billed twice).
    async with (
        running_gateway(
            sqlite_url, ["east", "west"], [Route("east", tier=0), Route("west", tier=1)]
        ) as gw,
        gw.http() as http,
    ):
        gw.upstreams["east"].set_plan([Behavior.server_error()])
        budget = worst_case(gw) * D("1.5")
        response = await http.post(
            "/v1/chat/completions", json=BODY, headers={"X-Waybill-Max-Cost-Usd": str(budget)}
        )
        assert response.status_code == 402, response.text
        assert response.json()["error"]["code"] == "budget_exceeded"
        assert (gw.upstreams["east"].hits, gw.upstreams["west"].hits) == (1, 0)
        events = await gw.events(response.headers["x-request-id"])
        types = [e.type for e in events]
        assert "UnknownUsageOpened" in types and "BudgetReservationDenied" in types
        second = [e.data for e in events if e.type == "RouteEvaluated"][1]
        west = next(c for c in second["candidates"] if c["endpoint"] == "west")
        assert west["reason_code"] == "over_budget"
        assert west["detail"].startswith("request:")


async def test_without_the_unknown_hold_the_fallback_fits(sqlite_url: str) -> None:
    # Control for the test above: a 429 did not start, its hold is released, west fits.
    async with (
        running_gateway(
            sqlite_url, ["east", "west"], [Route("east", tier=0), Route("west", tier=1)]
        ) as gw,
        gw.http() as http,
    ):
        gw.upstreams["east"].set_plan([Behavior.rate_limited()])
        budget = worst_case(gw) * D("1.5")
        response = await http.post(
            "/v1/chat/completions", json=BODY, headers={"X-Waybill-Max-Cost-Usd": str(budget)}
        )
        assert response.status_code == 200
        types = await gw.types(response.headers["x-request-id"])
        assert "BudgetReleased" in types and "BudgetSettled" in types


async def test_a_broken_stream_leaves_an_unknown_usage_settlement(sqlite_url: str) -> None:
    async with (
        running_gateway(
            sqlite_url,
            ["east"],
            [Route("east")],
            workspace_extra="    budget: {limit_usd: 5, window: month}",
        ) as gw,
        gw.http() as http,
    ):
        gw.upstreams["east"].set_plan([Behavior.mid_stream_disconnect(after_events=3)])
        async with http.stream(
            "POST", "/v1/chat/completions", json={**BODY, "stream": True}
        ) as response:
            body = b"".join([chunk async for chunk in response.aiter_bytes()])
        assert b'"error"' in body
        events = await gw.events(response.headers["x-request-id"])
        opened = next(e.data for e in events if e.type == "UnknownUsageOpened")
        assert opened["cause"] == "broken_stream"
        assert D(opened["held_usd"]) == worst_case(gw)
        (account,) = await accounts(gw)
        assert (account.held_usd, account.settled_usd) == (worst_case(gw), D(0))


async def test_no_eligible_candidate_under_the_workspace_budget_is_402(sqlite_url: str) -> None:
    async with (
        running_gateway(
            sqlite_url,
            ["east"],
            [Route("east")],
            workspace_extra="    budget: {limit_usd: 0.0001, window: total}",
        ) as gw,
        gw.http() as http,
    ):
        response = await http.post("/v1/chat/completions", json=BODY)
        assert response.status_code == 402
        assert "workspace:acme:total" in response.json()["error"]["message"]
        assert gw.upstreams["east"].hits == 0
        events = await gw.events(response.headers["x-request-id"])
        denied = next(e.data for e in events if e.type == "BudgetReservationDenied")
        assert denied["account_id"] == "workspace:acme:total"
        assert "BudgetReserved" not in [e.type for e in events]  # nothing was reserved


@pytest.mark.slow
@pytest.mark.postgres
def test_two_gateway_processes_on_one_postgres_never_overspend(
    postgres_url: str, tmp_path: Path
) -> None:
    with FakeUpstream("east", default=Behavior.ok(latency_ms=400)) as east:
        config = tmp_path / "waybill.yaml"
        config.write_text(
            config_text(
                {"east": east},
                [Route("east")],
                workspace_extra="    key_budget: {limit_usd: 0.0024, window: day}",
            )
        )
        secret = new_key(postgres_url)
        ports = [closed_port(), closed_port()]
        processes = [serve_process(config, postgres_url, port) for port in ports]
        try:

            async def load() -> list[int]:
                async with httpx.AsyncClient(
                    headers={"Authorization": f"Bearer {secret}"}, timeout=30
                ) as http:
                    responses = await asyncio.gather(
                        *(
                            http.post(
                                f"http://127.0.0.1:{ports[n % 2]}/v1/chat/completions", json=BODY
                            )
                            for n in range(40)
                        )
                    )
                return [r.status_code for r in responses]

            statuses = asyncio.run(load())
            served = statuses.count(200)
            assert 10 <= served < 40 and statuses.count(402) == 40 - served, statuses
            assert east.hits == served
        finally:
            for process in processes:
                process.terminate()
                process.wait(timeout=20)
        engine = sa.create_engine(postgres_url)
        with engine.connect() as conn:
            row = conn.execute(sa.select(budget_accounts)).one()
        engine.dispose()
        assert row.held_usd == 0 and row.settled_usd <= D("0.0024")


@pytest.mark.slow
def test_kill_9_mid_request_then_restart_leaves_an_open_unknown_settlement(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'crash.db'}"
    assert waybill("migrate", database_url=url).returncode == 0
    with FakeUpstream("east", default=Behavior.ok(latency_ms=30_000)) as east:
        config = tmp_path / "waybill.yaml"
        config.write_text(config_text({"east": east}, [Route("east")]))
        secret = new_key(url)
        port = closed_port()
        first = serve_process(config, url, port, env={"WAYBILL_HEARTBEAT_S": "0.2"})
        with (
            httpx.Client(headers={"Authorization": f"Bearer {secret}"}) as http,
            contextlib.suppress(httpx.ReadTimeout),  # the upstream is slow: in flight
        ):
            http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=BODY, timeout=1)
        assert east.hits == 1
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        second = serve_process(config, url, port, env={"WAYBILL_HEARTBEAT_S": "0.2"})
        try:
            engine = sa.create_engine(url)
            deadline = time.monotonic() + 20
            while True:
                with engine.connect() as conn:
                    states = [r.state for r in conn.execute(holds())]
                if states == ["unknown"]:
                    break
                assert time.monotonic() < deadline, states
                time.sleep(0.1)
            with engine.connect() as conn:
                types = [e.type for e in ledger_events(conn)]
            engine.dispose()
            assert "UnknownUsageOpened" in types
            assert types[-1] == "RequestFailed"
        finally:
            second.terminate()
            second.wait(timeout=20)


async def test_a_keys_own_budget_overrides_the_workspace_default(sqlite_url: str) -> None:
    from decimal import Decimal as Dec

    from ledger import apikeys

    async with running_gateway(
        sqlite_url,
        ["east"],
        [Route("east")],
        workspace_extra="    key_budget: {limit_usd: 100, window: day}",
        defaults={"breaker": "{failure_threshold: 10}"},  # keep east in rotation
    ) as gw:
        tight = await apikeys.create_key(
            gw.store, "acme", "client", budget=(worst_case(gw) * 2, "month")
        )
        async with httpx.AsyncClient(
            base_url=gw.url, headers={"Authorization": f"Bearer {tight.secret}"}
        ) as http:
            # 500s leave their whole holds counted (unknown usage): two fill this key's budget.
            gw.upstreams["east"].set_default(Behavior.server_error())
            responses = [await http.post("/v1/chat/completions", json=BODY) for _ in range(3)]
        assert [r.status_code for r in responses] == [503, 503, 402]
        assert gw.upstreams["east"].hits == 2
        refused = responses[-1].json()["error"]
        assert f"key:{tight.key_id}:" in refused["message"]
        rows = await accounts(gw)
        assert [r.limit_usd for r in rows] == [worst_case(gw) * Dec(2)]


async def test_budget_balances_show_limit_held_settled_and_available(sqlite_url: str) -> None:
    async with (
        running_gateway(
            sqlite_url,
            ["east"],
            [Route("east")],
            workspace_extra="    budget: {limit_usd: 5, window: month}\n"
            "    key_budget: {limit_usd: 1, window: day}",
        ) as gw,
        gw.http() as http,
    ):
        assert (await http.post("/v1/chat/completions", json=BODY)).status_code == 200
        rows = (await http.get("/v1/budgets")).json()["data"]
        kinds = {r["kind"]: r for r in rows}
        assert set(kinds) == {"key"}  # a client key sees its own key's account only
        key = kinds["key"]
        assert D(key["held_usd"]) == 0 and D(key["settled_usd"]) > 0
        assert D(key["available_usd"]) == D(key["limit_usd"]) - D(key["settled_usd"])
        from ledger import apikeys

        finance = await apikeys.create_key(gw.store, "acme", "finance")
        async with httpx.AsyncClient(
            base_url=gw.url, headers={"Authorization": f"Bearer {finance.secret}"}
        ) as finance_http:
            rows = (await finance_http.get("/v1/budgets")).json()["data"]
        assert {r["kind"] for r in rows} == {"key", "workspace"}
