"""The books are re-derivable from the ledger: `waybill verify --books` names every balance,
hold and resolution an operator changed behind the ledger's back, and `waybill replay`
puts them back to exactly what the append path keeps."""

from __future__ import annotations

import asyncio
import json
from decimal import Decimal
from typing import Any

import sqlalchemy as sa

from ledger import apikeys
from ledger.store.db import sync_url
from ledger.store.schema import budget_accounts, budget_holds, budget_open_holds, budget_resolutions
from router.fake_provider import Behavior
from tests.gateway.harness import Route, running_gateway
from tests.helpers import eventually
from tests.ledger.test_cli import waybill

D = Decimal
BODY: dict[str, Any] = {
    "model": "chat",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 100,
}
TABLES = (budget_accounts, budget_holds, budget_open_holds, budget_resolutions)


async def _traffic(database_url: str) -> None:
    """Every way a hold ends: settled, released, unknown, unknown settled, overrun."""
    async with running_gateway(
        database_url,
        ["east", "west"],
        [Route("east", tier=0), Route("west", tier=1)],
        workspace_extra="    budget: {limit_usd: 100, window: month}\n"
        "    key_budget: {limit_usd: 50, window: day}",
        defaults={"breaker": "{failure_threshold: 10}"},  # keep east in rotation
    ) as gw:
        admin = await apikeys.create_key(gw.store, "acme", "admin")
        gw.upstreams["east"].set_plan(
            [
                Behavior(overbill_output_tokens=50_000),
                Behavior(),
                Behavior.server_error(),  # unknown, then served by west
                Behavior.server_error(),
                Behavior.rate_limited(),  # released, then served by west
            ]
        )
        async with gw.http() as http:
            for _ in range(5):
                assert (await http.post("/v1/chat/completions", json=BODY)).status_code == 200
        rows = await _rows(gw.store.engine)
        unknown = [h for h in rows["budget_open_holds"] if h["state"] == "unknown"]
        settlement = "unk_" + unknown[0]["reservation_id"].removeprefix("res_")
        async with gw.http() as http:
            http.headers["Authorization"] = f"Bearer {admin.secret}"

            async def listed() -> bool:  # the settlements view follows the ledger
                rows = (await http.get("/v1/settlements/unknown?state=open")).json()["data"]
                return any(r["settlement_id"] == settlement for r in rows)

            await eventually(listed)
            settled = await http.post(
                f"/v1/settlements/unknown/{settlement}",
                json={"settled_usd": "0.001", "reason": "invoice"},
            )
            assert settled.status_code == 200, settled.text


async def _rows(engine: Any) -> dict[str, list[dict[str, Any]]]:
    async with engine.connect() as conn:
        return {
            table.name: [
                dict(row._mapping)
                for row in await conn.execute(sa.select(table).order_by(*table.primary_key))
            ]
            for table in TABLES
        }


def _snapshot(url: str) -> dict[str, list[dict[str, Any]]]:
    engine = sa.create_engine(sync_url(url))
    try:
        with engine.connect() as conn:
            return {
                table.name: [
                    {k: _plain(v) for k, v in row._mapping.items()}
                    for row in conn.execute(sa.select(table).order_by(*table.primary_key))
                ]
                for table in TABLES
            }
    finally:
        engine.dispose()


def _plain(value: Any) -> Any:
    # Money as exact decimals whatever the backend keeps (NUMERIC, or text on SQLite);
    # instants compared as instants.
    if isinstance(value, Decimal):
        return value.normalize()
    if isinstance(value, str) and value.replace(".", "", 1).isdigit():
        return D(value).normalize()
    if hasattr(value, "timestamp"):
        return value.timestamp()
    return value


def _tamper(url: str) -> tuple[str, str, str]:
    """An operator's edits made around the ledger: +5 settled on an account, a resolved
    hold put back to held, a resolution deleted. Returns what was touched."""
    engine = sa.create_engine(sync_url(url))
    try:
        with engine.begin() as conn:
            account = conn.execute(
                sa.select(budget_accounts).where(budget_accounts.c.kind == "workspace")
            ).one()
            conn.execute(
                sa.update(budget_accounts)
                .where(budget_accounts.c.account_id == account.account_id)
                .values(settled_usd=D(str(account.settled_usd)) + 5)
            )
            resolved = conn.execute(
                sa.select(budget_holds.c.reservation_id)
                .where(
                    budget_holds.c.reservation_id.not_in(
                        sa.select(budget_open_holds.c.reservation_id)
                    )
                )
                .order_by(budget_holds.c.reservation_id)
            ).all()
            reopened, vanished = resolved[0][0], resolved[1][0]
            conn.execute(
                sa.insert(budget_open_holds).values(
                    reservation_id=reopened, state="held", owner="gw/inc_reopened"
                )
            )
            conn.execute(
                sa.delete(budget_resolutions).where(budget_resolutions.c.reservation_id == vanished)
            )
    finally:
        engine.dispose()
    return account.account_id, reopened, vanished


def test_verify_books_names_what_was_changed_and_replay_restores_it(database_url: str) -> None:
    asyncio.run(_traffic(database_url))
    kept = _snapshot(database_url)
    assert any(row["overrun_usd"] > 0 for row in kept["budget_accounts"])

    clean = waybill("verify", "--books", "--json", database_url=database_url)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    report = json.loads(clean.stdout)
    assert report["ok"] is True and report["books"]["discrepancies"] == []
    assert report["books"]["holds"] == len(kept["budget_holds"])

    account, reopened, vanished = _tamper(database_url)
    caught = waybill("verify", "--books", database_url=database_url)
    assert caught.returncode == 1, caught.stdout
    assert "ledger OK" in caught.stdout  # the chain itself was not touched
    assert f"account {account}: settled_usd is" in caught.stdout
    assert f"hold {reopened}: state is held, the ledger says resolved" in caught.stdout
    assert f"resolution {vanished}: missing" in caught.stdout
    as_json = json.loads(waybill("verify", "--books", "--json", database_url=database_url).stdout)
    assert as_json["ok"] is False
    assert {(d["kind"], d["id"]) for d in as_json["books"]["discrepancies"]} >= {
        ("account", account),
        ("hold", reopened),
        ("resolution", vanished),
    }

    replayed = waybill("replay", database_url=database_url)
    assert replayed.returncode == 0, replayed.stderr
    assert "books: rebuilt from" in replayed.stdout
    assert "rebuilding the books" in replayed.stderr  # the progress bar
    assert _snapshot(database_url) == kept  # exactly what the append path had written
    assert waybill("verify", "--books", database_url=database_url).returncode == 0

    _tamper(database_url)
    only_books = waybill("replay", "--projection", "books", database_url=database_url)
    assert only_books.returncode == 0, only_books.stderr
    assert _snapshot(database_url) == kept


def test_a_replay_of_untouched_books_changes_nothing(sqlite_url: str) -> None:
    asyncio.run(_traffic(sqlite_url))
    kept = _snapshot(sqlite_url)
    assert waybill("replay", "--projection", "books", database_url=sqlite_url).returncode == 0
    assert _snapshot(sqlite_url) == kept
    unknown = waybill("replay", "--projection", "ledgers", database_url=sqlite_url)
    assert unknown.returncode == 1 and "books" in unknown.stderr
