"""Reconciliation end to end: real gateway traffic against the fake providers, the export a
provider would send back for it, imported over HTTP and with the CLI."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from ledger import apikeys
from ledger.books.balances import holds
from ledger.events import Usage
from ledger.store.schema import budget_holds, spend_attempts
from ledger.views import all_projections
from ledger.views.projection import ProjectionRunner
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
COLUMNS = (
    "attempt_id",
    "provider_request_id",
    "model",
    "input_tokens",
    "output_tokens",
    "cached_input_tokens",
    "cost_usd",
    "timestamp",
)
# What the provider says the call it could not answer really used.
UNKNOWN_INPUT, UNKNOWN_OUTPUT, UNKNOWN_COST = 9, 4, D("0.000017")


@dataclass
class Traffic:
    """The attempts of the test's traffic, by role, as the ledger and the provider saw them."""

    rows: dict[str, Any]  # role -> spend_attempts row
    provider_ids: dict[str, str]  # role -> the provider's x-request-id for that attempt
    unknown_request: str  # the request whose first attempt's usage is unknown


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _cost(input_tokens: int, output_tokens: int) -> Decimal:
    # The provider's own price list (the harness config: $1 / $2 per million tokens).
    return D(input_tokens) * D("0.000001") + D(output_tokens) * D("0.000002")


async def _traffic(gw: Gateway, http: httpx.AsyncClient) -> Traffic:
    """Four successes on east, then a 500 on east (unknown usage) served by west."""
    request_ids = []
    for _ in range(4):
        response = await http.post("/v1/chat/completions", json=BODY)
        assert response.status_code == 200, response.text
        request_ids.append(response.headers["x-request-id"])
    gw.upstreams["east"].set_plan([Behavior.server_error()])
    response = await http.post("/v1/chat/completions", json=BODY)
    assert response.status_code == 200 and response.headers["x-waybill-endpoint"] == "west"
    request_ids.append(response.headers["x-request-id"])
    for request_id in request_ids:
        await gw.wait_for_types(request_id, "RequestCompleted")
    runner = ProjectionRunner(gw.store, all_projections())
    await runner.catch_up(runner.get("spend"))
    async with gw.store.engine.connect() as conn:
        rows = (
            await conn.execute(sa.select(spend_attempts).order_by(spend_attempts.c.reserved_at))
        ).all()
    assert [r.endpoint for r in rows] == ["east"] * 5 + ["west"]
    roles = ["by_attempt", "by_request_id", "left_out", "wrong_amount", "unknown", "fallback"]
    by_role = dict(zip(roles, rows, strict=True))
    assert by_role["unknown"].state == "unknown"
    # The provider's side: every call it received carried the gateway's attempt id.
    provider_ids = {}
    for role, row in by_role.items():
        (received,) = [
            r
            for r in gw.upstreams[row.endpoint].requests
            if r.headers.get("x-waybill-attempt-id") == row.attempt_id
        ]
        provider_ids[role] = received.request_id
        assert row.upstream_request_id in (None, received.request_id)
    return Traffic(by_role, provider_ids, request_ids[4])


def _lines(traffic: Traffic) -> list[dict[str, Any]]:
    """The provider's export: one line per billed call, and one for a call nobody made."""
    rows, ids = traffic.rows, traffic.provider_ids

    def billed(role: str, *, attempt: bool, request: bool, factor: int = 1) -> dict[str, Any]:
        row = rows[role]
        tokens = (
            (UNKNOWN_INPUT, UNKNOWN_OUTPUT)
            if role == "unknown"
            else (row.input_tokens, row.output_tokens)
        )
        return {
            "attempt_id": row.attempt_id if attempt else "",
            "provider_request_id": ids[role] if request else "",
            "model": row.model,
            "input_tokens": tokens[0],
            "output_tokens": tokens[1],
            "cached_input_tokens": 0,
            "cost_usd": _cost(*tokens) * factor,
            "timestamp": _utc(row.reserved_at),
        }

    stranger = billed("wrong_amount", attempt=True, request=True)
    stranger.update(attempt_id="att_never_made", provider_request_id="req_east_999999")
    return [
        billed("by_attempt", attempt=True, request=False),
        billed("by_request_id", attempt=False, request=True),
        billed("wrong_amount", attempt=True, request=True, factor=3),
        billed("unknown", attempt=True, request=True),
        billed("fallback", attempt=False, request=True),
        stranger,
    ]


def _csv(lines: list[dict[str, Any]]) -> bytes:
    def cell(value: Any) -> str:
        return value.isoformat() if isinstance(value, datetime) else str(value)

    body = [",".join(COLUMNS)] + [",".join(cell(line[c]) for c in COLUMNS) for line in lines]
    return ("\n".join(body) + "\n").encode()


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    out = []
    for line in lines:
        fields = [f'"{c}": {json.dumps(str(line[c]))}' for c in ("attempt_id", "model")]
        fields += [f'"{c}": {line[c]}' for c in ("input_tokens", "output_tokens")]
        if line["provider_request_id"]:
            fields.append(f'"provider_request_id": "{line["provider_request_id"]}"')
        # A bare JSON number, as exports write it: 0.000017 must stay exactly that.
        fields.append(f'"cost_usd": {line["cost_usd"]:f}')
        fields.append(f'"timestamp": "{line["timestamp"].isoformat()}"')
        out.append("{" + ", ".join(fields) + "}")
    return ("\n".join(out) + "\n").encode()


def _client(gw: Gateway, secret: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=gw.url, headers={"Authorization": f"Bearer {secret}"}, timeout=30
    )


def _by_attempt(report: dict[str, Any], name: str) -> dict[str | None, dict[str, Any]]:
    return {e["attempt_id"]: e for e in report[name]}


async def _round_trip(database_url: str, export_format: str) -> None:
    async with running_gateway(
        database_url, ["east", "west"], [Route("east", tier=0), Route("west", tier=1)]
    ) as gw:
        finance = await apikeys.create_key(gw.store, "acme", "finance")
        async with gw.http() as http:
            traffic = await _traffic(gw, http)
        rows = traffic.rows
        lines = _lines(traffic)
        export, media = (
            (_csv(lines), "text/csv")
            if export_format == "csv"
            else (_jsonl(lines), "application/x-ndjson")
        )
        first = 1 if export_format == "csv" else 0  # a CSV's line 1 is its header
        async with _client(gw, finance.secret) as http:
            posted = await http.post(
                "/v1/reconciliations", content=export, headers={"content-type": media}
            )
            assert posted.status_code == 200, posted.text
            report = posted.json()
            assert report["id"].startswith("rec_") and report["lines"] == 6

            matched = _by_attempt(report, "matched")
            assert set(matched) == {
                rows["by_attempt"].attempt_id,
                rows["by_request_id"].attempt_id,
                rows["fallback"].attempt_id,
            }
            for role in ("by_attempt", "by_request_id"):
                entry = matched[rows[role].attempt_id]
                assert D(entry["expected_usd"]) == rows[role].settled_usd
                assert entry["provider_usd"] == entry["expected_usd"]
            assert matched[rows["by_request_id"].attempt_id]["detail"] == "by provider_request_id"
            assert [e["line"] for e in report["matched"]] == [1 + first, 2 + first, 5 + first]

            (mismatch,) = report["amount_mismatches"]
            wrong = rows["wrong_amount"]
            assert mismatch["attempt_id"] == wrong.attempt_id and mismatch["line"] == 3 + first
            assert D(mismatch["expected_usd"]) == wrong.settled_usd
            assert D(mismatch["provider_usd"]) == wrong.settled_usd * 3

            (settled,) = report["settled_unknown"]
            unknown = rows["unknown"]
            assert settled["attempt_id"] == unknown.attempt_id and settled["line"] == 4 + first
            assert settled["provider_usd"] == settled["expected_usd"] == "0.000017"

            (stranger,) = report["unmatched_provider_lines"]
            assert stranger["line"] == 6 + first and stranger["attempt_id"] == "att_never_made"
            (missing,) = report["unmatched_attempts"]
            assert missing["attempt_id"] == rows["left_out"].attempt_id
            assert missing["line"] is None
            assert missing["provider_request_id"] == traffic.provider_ids["left_out"]

            # The unknown-usage settlement was settled from the provider's line.
            (event,) = [
                e
                for e in await gw.events(traffic.unknown_request)
                if e.type == "UnknownUsageSettled"
            ]
            assert event.data["source"] == "reconciliation"
            assert event.data["reconciliation_id"] == report["id"]
            assert event.data["actor"] == finance.key_id
            assert D(event.data["settled_usd"]) == UNKNOWN_COST
            assert Usage.model_validate(event.data["usage"]) == Usage(
                input_tokens=UNKNOWN_INPUT, output_tokens=UNKNOWN_OUTPUT
            )
            async with gw.store.engine.connect() as conn:
                hold = (
                    await conn.execute(
                        holds().where(budget_holds.c.reservation_id == unknown.reservation_id)
                    )
                ).one()
            assert hold.state == "resolved"

            async def released() -> bool:
                spend = (await http.get("/v1/spend?group_by=endpoint")).json()["data"]
                east = next(r for r in spend if r["endpoint"] == "east")
                return D(east["held_unknown_usd"]) == 0 and D(east["settled_usd"]) == sum(
                    (rows[r].settled_usd for r in ("by_attempt", "by_request_id", "left_out")),
                    rows["wrong_amount"].settled_usd + UNKNOWN_COST,
                )

            await eventually(released)

            # Recorded, readable, and idempotent.
            read = await http.get(f"/v1/reconciliations/{report['id']}")
            assert read.status_code == 200 and read.json() == report
            head = await gw.store.head()
            again = await http.post(
                "/v1/reconciliations", content=export, headers={"content-type": media}
            )
            assert again.status_code == 200 and again.json() == report
            assert await gw.store.head() == head
        recorded = [
            e for e in await gw.store.read_all(limit=10_000) if e.type == "ReconciliationImported"
        ]
        assert [e.stream_id for e in recorded] == [f"reconciliation-{report['id']}"]
        assert recorded[0].data["imported_by"] == finance.key_id


async def test_a_realistic_csv_export_reconciles_round_trip(database_url: str) -> None:
    await _round_trip(database_url, "csv")


async def test_the_same_export_as_jsonl_reconciles_the_same(sqlite_url: str) -> None:
    await _round_trip(sqlite_url, "jsonl")


async def test_reconciliation_is_for_admin_and_finance_in_their_workspace(
    sqlite_url: str,
) -> None:
    async with running_gateway(
        sqlite_url, ["east", "west"], [Route("east", tier=0), Route("west", tier=1)]
    ) as gw:
        async with gw.http() as http:
            traffic = await _traffic(gw, http)
        export = _csv(_lines(traffic))
        roles: tuple[apikeys.Role, ...] = ("auditor", "finance", "admin")
        keys = {role: await apikeys.create_key(gw.store, "acme", role) for role in roles}
        outsider = await apikeys.create_key(gw.store, "other", "finance")
        reports = {}
        for secret in (gw.secret, keys["auditor"].secret):
            async with _client(gw, secret) as http:
                refused = await http.post("/v1/reconciliations", content=export)
                assert refused.status_code == 403
                assert refused.json()["error"]["code"] == "permission_denied"
                assert (await http.get("/v1/reconciliations/rec_0")).status_code == 403

        async with _client(gw, outsider.secret) as http:
            blind = (await http.post("/v1/reconciliations", content=export)).json()
        # Another workspace's finance sees nothing of acme's attempts, and settles nothing.
        assert [e["line"] for e in blind["unmatched_provider_lines"]] == [2, 3, 4, 5, 6, 7]
        assert {e["detail"] for e in blind["unmatched_provider_lines"]} == {
            "no attempt with this attempt_id or provider_request_id"
        }
        assert not any(blind[k] for k in ("matched", "settled_unknown", "unmatched_attempts"))
        assert blind["workspace"] == "other"
        types = [e.type for e in await gw.events(traffic.unknown_request)]
        assert "UnknownUsageSettled" not in types

        for role in ("finance", "admin"):
            async with _client(gw, keys[role].secret) as http:
                posted = await http.post("/v1/reconciliations", content=export)
                assert posted.status_code == 200, posted.text
                reports[role] = posted.json()
        assert len(reports["finance"]["settled_unknown"]) == 1
        assert reports["finance"]["id"] != reports["admin"]["id"] != blind["id"]
        # The admin's came second: the unknown usage was settled already, not twice.
        assert not reports["admin"]["settled_unknown"]

        async def read(secret: str, rec_id: str) -> int:
            async with _client(gw, secret) as http:
                response = await http.get(f"/v1/reconciliations/{rec_id}")
                if response.status_code == 404:
                    assert response.json()["error"]["code"] == "reconciliation_not_found"
                return response.status_code

        finance, admin = reports["finance"]["id"], reports["admin"]["id"]
        assert await read(keys["finance"].secret, finance) == 200
        assert await read(keys["admin"].secret, finance) == 200
        assert await read(outsider.secret, finance) == 404
        assert await read(keys["finance"].secret, admin) == 404  # spans every workspace
        assert await read(outsider.secret, blind["id"]) == 200
        assert await read(keys["finance"].secret, blind["id"]) == 404
        assert await read(keys["admin"].secret, "rec_0123456789abcdef") == 404
        assert await read(keys["admin"].secret, "not-an-id") == 404


async def test_a_bad_export_is_refused_naming_its_line_and_field(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with running_gateway(sqlite_url, ["east"], [Route("east")]) as gw:
        admin = await apikeys.create_key(gw.store, "acme", "admin")
        head = await gw.store.head()
        bad = (
            b"attempt_id,model,input_tokens,output_tokens,cost_usd,timestamp\n"
            b"att_1,m,1,2,0.1,2026-11-30T12:00:00Z\n"
            b"att_2,m,1,2,twelve cents,2026-11-30T12:00:00Z\n"
        )
        async with _client(gw, admin.secret) as http:
            refused = await http.post("/v1/reconciliations", content=bad)
            assert refused.status_code == 400
            error = refused.json()["error"]
            assert error["code"] == "invalid_request" and error["param"] == "cost_usd"
            assert error["message"].startswith("line 3, cost_usd: not a decimal amount")
            # Told it is JSONL, the same bytes are refused at line 1.
            as_jsonl = await http.post(
                "/v1/reconciliations", content=bad, headers={"content-type": "application/jsonl"}
            )
            assert as_jsonl.status_code == 400
            assert as_jsonl.json()["error"]["message"].startswith("line 1: not valid JSON")
            monkeypatch.setattr("router.http.reconcile.MAX_EXPORT_BYTES", 64)
            too_large = await http.post("/v1/reconciliations", content=bad)
            assert too_large.status_code == 413
        assert await gw.store.head() == head  # nothing recorded


def test_the_reconcile_cli_prints_the_report(tmp_path: Path, sqlite_url: str) -> None:
    async def traffic() -> bytes:
        async with (
            running_gateway(
                sqlite_url, ["east", "west"], [Route("east", tier=0), Route("west", tier=1)]
            ) as gw,
            gw.http() as http,
        ):
            return _csv(_lines(await _traffic(gw, http)))

    export = tmp_path / "usage.csv"
    export.write_bytes(asyncio.run(traffic()))
    as_json = waybill("reconcile", str(export), "--json", database_url=sqlite_url)
    assert as_json.returncode == 0, as_json.stderr
    report = json.loads(as_json.stdout)
    assert len(report["settled_unknown"]) == 1 and report["imported_by"] == "cli"
    assert [len(report[k]) for k in ("matched", "amount_mismatches")] == [3, 1]
    assert "reconciling" in as_json.stderr  # the progress bar

    table = waybill("reconcile", str(export), database_url=sqlite_url)
    assert table.returncode == 0, table.stderr
    assert f"reconciliation {report['id']}: 6 lines" in table.stdout
    assert "settled_unknown" in table.stdout and "att_never_made" in table.stdout

    as_csv = waybill("reconcile", str(export), "--output", "csv", database_url=sqlite_url)
    rows = as_csv.stdout.strip().splitlines()
    assert rows[0] == "list,line,attempt_id,provider_request_id,expected_usd,provider_usd,detail"
    assert len(rows) == 1 + sum(len(report[k]) for k in report if isinstance(report[k], list))
    assert sum(r.startswith("settled_unknown,") for r in rows) == 1
    # Saved to a file, the CSV leaves the terminal the id `reconcile show` needs.
    assert f"reconciliation {report['id']}" in as_csv.stderr
    both = waybill("reconcile", str(export), "--json", "-o", "csv", database_url=sqlite_url)
    assert both.returncode == 1 and "choose one" in both.stderr
    named = waybill(
        "reconcile", "import", str(export), "--format", "lines", "--json", database_url=sqlite_url
    )
    assert json.loads(named.stdout)["id"] == report["id"]

    scoped = waybill(
        "reconcile", str(export), "--provider", "west", "--json", database_url=sqlite_url
    )
    west = json.loads(scoped.stdout)
    assert west["provider"] == "west" and west["id"] != report["id"]
    assert len(west["matched"]) == 1 and len(west["unmatched_provider_lines"]) == 5

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"attempt_id": "a", "model": "m", "input_tokens": -1}\n')
    refused = waybill("reconcile", str(bad), database_url=sqlite_url)
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines()[-1] == (
        f"error: {bad}: line 1, input_tokens: must be a whole number >= 0, not -1"
    )
    missing = waybill("reconcile", str(tmp_path / "nope.csv"), database_url=sqlite_url)
    assert missing.returncode == 1 and "cannot read" in missing.stderr
