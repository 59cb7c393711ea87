"""Spend, unknown-usage settlements and their settlement, through the API and the CLI."""

from __future__ import annotations

import csv
import io
from decimal import Decimal
from typing import Any

import httpx
import sqlalchemy as sa

from ledger import apikeys
from ledger.store.schema import spend_attempts, unknown_settlements
from ledger.views import all_projections
from ledger.views.projection import ProjectionRunner
from router.fake_provider import Behavior
from tests.gateway.harness import Gateway, Route, running_gateway
from tests.helpers import eventually
from tests.ledger.test_cli import waybill, waybill_in_terminal

D = Decimal
BODY: dict[str, Any] = {
    "model": "chat",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 100,
}


async def _traffic(gw: Gateway, http: httpx.AsyncClient) -> str:
    """Two successes and one 500 (unknown usage, then served by the fallback)."""
    for _ in range(2):
        assert (await http.post("/v1/chat/completions", json=BODY)).status_code == 200
    gw.upstreams["east"].set_plan([Behavior.server_error()])
    response = await http.post("/v1/chat/completions", json=BODY)
    assert response.status_code == 200
    return response.headers["x-request-id"]


async def _spend(http: httpx.AsyncClient, query: str, within: int = 4) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    async def caught_up() -> bool:
        nonlocal rows
        rows = (await http.get(f"/v1/spend?{query}")).json()["data"]
        return bool(sum(r["attempts"] for r in rows) >= within)

    await eventually(caught_up)
    return rows


async def test_spend_adds_up_to_the_settled_events(database_url: str) -> None:
    async with running_gateway(
        database_url, ["east", "west"], [Route("east", tier=0), Route("west", tier=1)]
    ) as gw:
        finance = await apikeys.create_key(gw.store, "acme", "finance")
        async with gw.http() as http:
            await _traffic(gw, http)
        async with httpx.AsyncClient(
            base_url=gw.url, headers={"Authorization": f"Bearer {finance.secret}"}
        ) as http:
            settled = sum(
                (
                    D(e.data["settled_usd"])
                    for e in await gw.store.read_all(limit=10_000)
                    if e.type == "BudgetSettled"
                ),
                D(0),
            )
            rows: list[dict[str, Any]] = []

            async def caught_up() -> bool:
                # The spend view follows the ledger: wait until it has every settlement.
                nonlocal rows
                rows = (await http.get("/v1/spend?group_by=workspace,endpoint")).json()["data"]
                return sum((D(r["settled_usd"]) for r in rows), D(0)) == settled

            await eventually(caught_up)
            by_endpoint = {r["endpoint"]: r for r in rows}
            assert set(by_endpoint) == {"east", "west"}
            assert by_endpoint["east"]["attempts"] == 3 and by_endpoint["east"]["requests"] == 3
            assert D(by_endpoint["east"]["held_unknown_usd"]) > 0  # the 500's hold
            assert by_endpoint["west"]["requests"] == 1
            as_csv = await http.get("/v1/spend?group_by=endpoint&format=csv")
            table = list(csv.DictReader(io.StringIO(as_csv.text)))
            assert [r["endpoint"] for r in table] == ["east", "west"]
            bad = await http.get("/v1/spend?group_by=colour")
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "group_by"


async def test_an_unknown_settlement_is_listed_then_settled_by_an_operator(
    sqlite_url: str,
) -> None:
    async with running_gateway(
        sqlite_url, ["east", "west"], [Route("east", tier=0), Route("west", tier=1)]
    ) as gw:
        admin = await apikeys.create_key(gw.store, "acme", "admin")
        async with gw.http() as http:
            request_id = await _traffic(gw, http)
        async with httpx.AsyncClient(
            base_url=gw.url, headers={"Authorization": f"Bearer {admin.secret}"}
        ) as http:
            listed: list[dict[str, Any]] = []

            async def opened() -> bool:
                nonlocal listed
                listed = (await http.get("/v1/settlements/unknown?state=open")).json()["data"]
                return len(listed) == 1

            await eventually(opened)
            (open_one,) = listed
            assert open_one["request_id"] == request_id and open_one["state"] == "open"
            assert open_one["cause"] == "upstream_unavailable"
            settled = await http.post(
                f"/v1/settlements/unknown/{open_one['settlement_id']}",
                json={"settled_usd": "0.00001", "reason": "provider invoice line 17"},
            )
            assert settled.status_code == 200, settled.text
            assert settled.json()["actor"] == admin.key_id
            again = await http.post(
                f"/v1/settlements/unknown/{open_one['settlement_id']}",
                json={"settled_usd": "0.00001", "reason": "twice"},
            )
            assert again.status_code == 409  # resolved exactly once

            async def closed() -> bool:
                rows = (await http.get("/v1/settlements/unknown?state=settled")).json()["data"]
                return len(rows) == 1 and rows[0]["settled_usd"] == "0.000010"

            await eventually(closed)
        events = await gw.events(request_id)
        assert events[-1].type == "UnknownUsageSettled"
        assert events[-1].data["reason"] == "provider invoice line 17"


async def test_spend_and_settlements_are_scoped_by_role(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url, ["east"], [Route("east")]) as gw:
        async with gw.http() as http:
            await http.post("/v1/chat/completions", json=BODY)
        other_client = await apikeys.create_key(gw.store, "acme", "client")
        outsider = await apikeys.create_key(gw.store, "other", "finance")
        for secret, expected in [
            (gw.secret, 1),  # the client that spent it
            (other_client.secret, 0),  # another key of the same workspace
            (outsider.secret, 0),  # another workspace
        ]:
            async with httpx.AsyncClient(
                base_url=gw.url, headers={"Authorization": f"Bearer {secret}"}
            ) as http:
                if expected:
                    rows = await _spend(http, "group_by=key", within=1)
                else:
                    rows = (await http.get("/v1/spend?group_by=key")).json()["data"]
                assert sum(r["attempts"] for r in rows) == expected
        async with httpx.AsyncClient(
            base_url=gw.url, headers={"Authorization": f"Bearer {other_client.secret}"}
        ) as http:
            refused = await http.post("/v1/settlements/unknown/unk_x", json={})
            assert refused.status_code == 403


async def test_spend_views_are_identical_after_replay(sqlite_url: str) -> None:
    async with running_gateway(
        sqlite_url, ["east", "west"], [Route("east", tier=0), Route("west", tier=1)]
    ) as gw:
        async with gw.http() as http:
            await _traffic(gw, http)
        runner = ProjectionRunner(gw.store, all_projections())
        spend = runner.get("spend")
        await runner.catch_up(spend)

        async def snapshot() -> list[Any]:
            async with gw.store.engine.connect() as conn:
                return [
                    list((await conn.execute(sa.select(t).order_by(*t.primary_key))).all())
                    for t in (spend_attempts, unknown_settlements)
                ]

        before = await snapshot()
        await runner.replay(spend)
        assert await snapshot() == before
        assert before[0] and before[1]


def test_spend_and_settle_cli(tmp_path: Any, sqlite_url: str) -> None:
    import asyncio

    async def traffic() -> str:
        async with (
            running_gateway(
                sqlite_url, ["east", "west"], [Route("east", tier=0), Route("west", tier=1)]
            ) as gw,
            gw.http() as http,
        ):
            return await _traffic(gw, http)

    asyncio.run(traffic())
    report = waybill("spend", "--group-by", "endpoint", "--format", "json", database_url=sqlite_url)
    assert report.returncode == 0, report.stderr
    import json

    rows = {r["endpoint"]: r for r in json.loads(report.stdout)["data"]}
    assert rows["east"]["attempts"] == 3

    # In an 80-column terminal every amount is whole, however many keys the rows carry, and
    # a column of nothing but zeros (no overrun here) is left out.
    grouped = ("--group-by", "day,key,model,endpoint,upstream_model")
    shown = waybill_in_terminal("spend", *grouped, database_url=sqlite_url)
    detailed = waybill("spend", *grouped, "--format", "json", database_url=sqlite_url)
    assert all(len(line) <= 80 for line in shown.splitlines()), shown
    assert "…" not in shown and "overrun" not in shown and "amounts in USD" in shown
    for row in json.loads(detailed.stdout)["data"]:
        for column in ("settled_usd", "held_unknown_usd"):
            assert format(Decimal(row[column]).normalize(), "f") in shown, (column, shown)
    as_csv = waybill(
        "spend", "--group-by", "day,endpoint", "--format", "csv", database_url=sqlite_url
    )
    assert as_csv.stdout.splitlines()[0] == (
        "day,endpoint,settled_usd,held_unknown_usd,overrun_usd,requests,attempts,"
        "adjustment_settled_usd,adjustment_held_unknown_usd,adjustment_overrun_usd"
    )
    engine = sa.create_engine(sqlite_url)
    with engine.connect() as conn:
        (settlement_id,) = conn.execute(
            sa.text("SELECT settlement_id FROM unknown_settlements")
        ).scalars()
    engine.dispose()
    settled = waybill(
        "settle", settlement_id, "--usd", "0.00002", "--reason", "invoice", database_url=sqlite_url
    )
    assert settled.returncode == 0, settled.stderr
    assert "released" in settled.stdout
    twice = waybill("settle", settlement_id, "--usd", "0", "--reason", "x", database_url=sqlite_url)
    assert twice.returncode == 1 and "no open unknown-usage settlement" in twice.stderr
