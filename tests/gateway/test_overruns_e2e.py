"""Overruns end to end: usage above a hold is settled in full and recorded, never capped;
operators and reconciliations settle the amount given; absurd amounts need force."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import httpx

from ledger import apikeys
from router.fake_provider import Behavior
from tests.gateway.harness import Gateway, Route, running_gateway
from tests.helpers import eventually
from tests.ledger.test_cli import waybill

D = Decimal
BODY: dict[str, Any] = {
    "model": "chat",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 100,
}
OVERBILL = Behavior(overbill_output_tokens=100_000)  # 0.2 USD at 2 USD per million output


def _as(gw: Gateway, secret: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=gw.url, headers={"Authorization": f"Bearer {secret}"}, timeout=30
    )


async def test_usage_above_the_reservation_is_settled_in_full_and_blocks_the_account(
    database_url: str,
) -> None:
    async with running_gateway(
        database_url,
        ["east"],
        [Route("east")],
        workspace_extra="    key_budget: {limit_usd: 0.01, window: day}",
    ) as gw:
        gw.upstreams["east"].set_plan([OVERBILL])
        finance = await apikeys.create_key(gw.store, "acme", "finance")
        async with gw.http() as http:
            served = await http.post("/v1/chat/completions", json=BODY)
            assert served.status_code == 200, served.text
            cost = D(served.headers["x-waybill-cost-usd"])
            assert cost > D("0.2")
            request_id = served.headers["x-request-id"]
            events = {e.type: e.data for e in await gw.events(request_id)}
            reserved = D(events["BudgetReserved"]["amount_usd"])
            assert D(events["BudgetSettled"]["settled_usd"]) == cost  # never capped
            overrun = events["BudgetOverrun"]
            assert (D(overrun["held_usd"]), D(overrun["actual_usd"])) == (reserved, cost)
            assert D(overrun["excess_usd"]) == cost - reserved
            assert overrun["cause"] == "usage_above_reservation"
            assert overrun["accounts"] == [
                a["account_id"] for a in events["BudgetReserved"]["accounts"]
            ]

            (key,) = (await http.get("/v1/budgets")).json()["data"]
            assert (D(key["settled_usd"]), D(key["overrun_usd"])) == (cost, cost - reserved)
            assert D(key["available_usd"]) == 0

            # The key's spend is over its limit: nothing more is reserved until it is raised.
            refused = await http.post("/v1/chat/completions", json=BODY)
            assert refused.status_code == 402
            assert refused.json()["error"]["code"] == "budget_exceeded"
            assert gw.upstreams["east"].hits == 1

            explained = (await http.get(f"/v1/requests/{request_id}/explain")).json()
            assert D(explained["overrun_usd"]) == cost - reserved
            assert D(explained["attempts"][0]["overrun_usd"]) == cost - reserved
            assert "overrun" in explained["summary"]
            assert any(c["check"] == "overrun" for c in explained["budget_checks"])

        async with _as(gw, finance.secret) as http:

            async def spend_shows_it() -> bool:
                rows = (await http.get("/v1/spend?group_by=key")).json()["data"]
                return bool(rows) and D(rows[0]["overrun_usd"]) == cost - reserved

            await eventually(spend_shows_it)


async def _open_unknown(gw: Gateway, http: httpx.AsyncClient) -> dict[str, Any]:
    gw.upstreams["east"].set_plan([Behavior.server_error()])
    failed = await http.post("/v1/chat/completions", json=BODY)
    assert failed.status_code == 503
    events = await gw.events(failed.headers["x-request-id"])
    return next(e.data for e in events if e.type == "UnknownUsageOpened")


async def test_an_operator_settles_the_amount_given_and_absurd_amounts_need_force(
    sqlite_url: str,
) -> None:
    async with running_gateway(sqlite_url, ["east"], [Route("east")]) as gw:
        admin = await apikeys.create_key(gw.store, "acme", "admin")
        async with gw.http() as http:
            first, second = [await _open_unknown(gw, http) for _ in range(2)]
        held = D(first["held_usd"])
        async with _as(gw, admin.secret) as http:

            async def listed() -> bool:
                rows = (await http.get("/v1/settlements/unknown?state=open")).json()["data"]
                return len(rows) == 2

            await eventually(listed)
            five_times = held * 5
            settled = await http.post(
                f"/v1/settlements/unknown/{first['settlement_id']}",
                json={"settled_usd": str(five_times), "reason": "invoice line 3"},
            )
            assert settled.status_code == 200, settled.text
            answer = settled.json()
            assert D(answer["settled_usd"]) == five_times
            assert D(answer["overrun_usd"]) == five_times - held
            events = await gw.events(first["request_id"])
            assert [e.type for e in events[-2:]] == ["UnknownUsageSettled", "BudgetOverrun"]
            assert events[-1].data["cause"] == "operator_settlement"

            for absurd in (str(held * 1001), "99999999999999999999999"):
                refused = await http.post(
                    f"/v1/settlements/unknown/{second['settlement_id']}",
                    json={"settled_usd": absurd, "reason": "typo"},
                )
                assert refused.status_code == 400, refused.text
                error = refused.json()["error"]
                assert (error["code"], error["param"]) == ("invalid_request", "settled_usd")
            forced = await http.post(
                f"/v1/settlements/unknown/{second['settlement_id']}",
                json={"settled_usd": str(held * 1001), "reason": "really", "force": True},
            )
            assert forced.status_code == 200, forced.text
            assert D(forced.json()["overrun_usd"]) == held * 1000


def test_the_settle_cli_settles_above_the_hold_and_refuses_absurd_amounts(
    sqlite_url: str,
) -> None:
    import asyncio

    async def unknown_holds() -> list[dict[str, Any]]:
        async with (
            running_gateway(sqlite_url, ["east"], [Route("east")]) as gw,
            gw.http() as http,
        ):
            return [await _open_unknown(gw, http) for _ in range(2)]

    first, second = asyncio.run(unknown_holds())
    held = D(first["held_usd"])
    above = waybill(
        "settle",
        first["settlement_id"],
        "--usd",
        str(held * 2),
        "--reason",
        "invoice",
        database_url=sqlite_url,
    )
    assert above.returncode == 0, above.stderr
    assert "overrun" in above.stdout
    args = ("settle", second["settlement_id"], "--usd", str(held * 2000), "--reason", "x")
    refused = waybill(*args, database_url=sqlite_url)
    assert refused.returncode == 1 and "force" in refused.stderr
    assert "Traceback" not in refused.stderr
    forced = waybill(*args, "--force", database_url=sqlite_url)
    assert forced.returncode == 0, forced.stderr


async def test_a_reconciliation_line_above_the_hold_is_an_overrun_and_a_mismatch(
    database_url: str,
) -> None:
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw:
        finance = await apikeys.create_key(gw.store, "acme", "finance")
        async with gw.http() as http:
            small, huge = [await _open_unknown(gw, http) for _ in range(2)]
        held = D(small["held_usd"])
        header = (
            "attempt_id,provider_request_id,model,input_tokens,output_tokens,"
            "cached_input_tokens,cost_usd,timestamp\n"
        )

        def line(unknown: dict[str, Any], cost: Decimal) -> str:
            return f"{unknown['attempt_id']},,fake-model,10,10,0,{cost},2026-12-01T00:00:00Z\n"

        export = header + line(small, held * 7) + line(huge, held * 5000)
        async with _as(gw, finance.secret) as http:
            refused = await http.post(
                "/v1/reconciliations", content=export, headers={"content-type": "text/csv"}
            )
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["param"] == "cost_usd" and "line 3" in error["message"]
            open_rows = (await http.get("/v1/settlements/unknown?state=open")).json()["data"]
            assert len(open_rows) == 2  # nothing was settled

            forced = await http.post(
                "/v1/reconciliations?force=true",
                content=export,
                headers={"content-type": "text/csv"},
            )
            assert forced.status_code == 200, forced.text
            report = forced.json()
        assert report["settled_unknown"] == []
        overruns = {e["attempt_id"]: e for e in report["overruns"]}
        mismatches = {e["attempt_id"]: e for e in report["amount_mismatches"]}
        assert set(overruns) == set(mismatches) == {small["attempt_id"], huge["attempt_id"]}
        entry = overruns[small["attempt_id"]]
        assert (D(entry["expected_usd"]), D(entry["provider_usd"])) == (held, held * 7)
        events = await gw.events(small["request_id"])
        assert D(events[-2].data["settled_usd"]) == held * 7
        assert (events[-1].type, events[-1].data["cause"]) == ("BudgetOverrun", "reconciliation")
