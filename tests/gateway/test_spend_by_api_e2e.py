"""Spend grouped by the door a request came through (`group_by=api`), through the API and
the CLI: a chat completions request and one handed to the core as the Anthropic Messages
door hands it over each count under their own door, and rows folded before the door was
recorded read as chat completions."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from alembic import command

from ledger.events import BudgetReserved
from ledger.store.db import _alembic_config, migrate, sync_url
from tests.gateway.door_traffic import served_through
from tests.gateway.harness import Gateway, Route, running_gateway
from tests.helpers import eventually
from tests.ledger.test_cli import waybill

D = Decimal
BODY: dict[str, Any] = {
    "model": "chat",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 100,
}


async def _traffic(gw: Gateway) -> dict[str, str]:
    """One request per door: their request ids by door."""
    async with gw.http() as http:
        response = await http.post("/v1/chat/completions", json=BODY)
        assert response.status_code == 200, response.text
    messages = await served_through(gw, "anthropic.messages", BODY)
    return {
        "openai.chat_completions": response.headers["x-request-id"],
        "anthropic.messages": messages,
    }


async def test_spend_groups_by_the_door_a_request_came_through(database_url: str) -> None:
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw:
        by_door = await _traffic(gw)
        settled = {}
        for api, request_id in by_door.items():
            events = await gw.events(request_id)
            received = next(e for e in events if e.type == "RequestReceived")
            reserved = next(e for e in events if e.type == "BudgetReserved")
            assert received.data["api"] == reserved.data["api"] == api
            settled[api] = D(
                next(e for e in events if e.type == "BudgetSettled").data["settled_usd"]
            )
        rows: list[dict[str, Any]] = []
        async with gw.http() as http:

            async def caught_up() -> bool:
                nonlocal rows
                response = await http.get("/v1/spend?group_by=api,model")
                assert response.status_code == 200, response.text
                rows = response.json()["data"]
                return bool(sum(r["attempts"] for r in rows) >= 2)

            await eventually(caught_up)
            as_csv = await http.get("/v1/spend?group_by=api&format=csv")
            refused = await http.get("/v1/spend?group_by=door")
        assert {r["api"]: (r["model"], r["requests"], D(r["settled_usd"])) for r in rows} == {
            api: ("chat", 1, amount) for api, amount in settled.items()
        }
        assert as_csv.text.splitlines()[0].startswith("api,settled_usd,")
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "group_by"
        assert "api" in refused.json()["error"]["message"]


def test_waybill_spend_groups_by_api(sqlite_url: str) -> None:
    async def traffic() -> None:
        async with running_gateway(sqlite_url, ["east"], [Route("east")]) as gw:
            await _traffic(gw)

    asyncio.run(traffic())
    report = waybill("spend", "--group-by", "api", "--format", "json", database_url=sqlite_url)
    assert report.returncode == 0, report.stderr
    rows = {r["api"]: r for r in json.loads(report.stdout)["data"]}
    assert set(rows) == {"openai.chat_completions", "anthropic.messages"}
    assert rows["anthropic.messages"]["requests"] == 1
    table = waybill("spend", "--group-by", "api", database_url=sqlite_url)
    assert table.returncode == 0 and "anthropic.messages" in table.stdout


def test_spend_rows_folded_before_the_door_was_recorded_are_of_chat_completions(
    empty_database_url: str,
) -> None:
    # Migration 0015 on a spend read model that holds a row: it reads as chat completions, the
    # only door there was, as an older BudgetReserved does; and back.
    url = empty_database_url
    migrate(url)
    command.downgrade(_alembic_config(url), "0014")
    engine = sa.create_engine(sync_url(url))
    try:
        row = {c: "x" for c in ("request_id", "attempt_id", "workspace", "key_id")}
        row |= {"model_group": "chat", "endpoint": "east", "model": "m", "day": "2026-12-01"}
        zero = "0"
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO spend_attempts (reservation_id, request_id, attempt_id, "
                    "workspace, key_id, model_group, endpoint, model, day, state, reserved_usd, "
                    "settled_usd, held_unknown_usd, overrun_usd, reserved_at, last_position) "
                    "VALUES ('res_1', :request_id, :attempt_id, :workspace, :key_id, "
                    ":model_group, :endpoint, :model, :day, 'settled', :zero, :zero, :zero, "
                    ":zero, :at, 1)"
                ),
                {**row, "zero": zero, "at": datetime(2026, 12, 1, tzinfo=UTC)},
            )
        migrate(url)
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT api FROM spend_attempts")).scalar_one() == (
                "openai.chat_completions"
            )
        command.downgrade(_alembic_config(url), "0014")
        with engine.connect() as conn:
            columns = {c["name"] for c in sa.inspect(conn).get_columns("spend_attempts")}
        assert "api" not in columns and "model" in columns
    finally:
        engine.dispose()
    older = BudgetReserved.model_validate(
        {
            "request_id": "r1",
            "attempt_id": "att_1",
            "reservation_id": "res_1",
            "amount_usd": "0.01",
            "accounts": [],
            "endpoint": "east",
            "model": "m",
        }
    )
    assert older.api == "openai.chat_completions"
