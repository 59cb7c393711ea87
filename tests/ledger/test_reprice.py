"""Repricing: the ledger's recorded costs against a provider's cost report, by model and day;
the days where they part are named."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal as D
from pathlib import Path

import pytest

from ledger.finance.provider_reports import ExportError
from ledger.finance.reprice import compare, provider_costs
from ledger.store import EventStore
from ledger.store.db import create_engine
from tests.ledger.test_cli import waybill
from tests.ledger.test_periods import _attempt

REPORTS = Path(__file__).parent / "reports"
NOV = (date(2026, 11, 1), date(2026, 11, 30))


def test_an_openai_cost_report_is_summed_by_day_and_model_from_its_line_items() -> None:
    pages = [("openai-costs.json", (REPORTS / "openai-costs.json").read_bytes())]
    assert provider_costs(pages, *NOV) == {
        ("2026-11-30", "gpt-4o-mini"): D("0.0084") + D("0.00186"),
        ("2026-11-30", "gpt-4o"): D("0.0035"),
    }
    assert provider_costs(pages, date(2026, 12, 1), date(2026, 12, 31)) == {}


def test_an_anthropic_cost_report_names_its_model() -> None:
    pages = [("anthropic-costs.json", (REPORTS / "anthropic-costs.json").read_bytes())]
    assert set(provider_costs(pages, *NOV)) == {("2026-11-30", "claude-sonnet-4-5")}


def test_an_anthropic_analytics_cost_report_is_summed_by_model_and_a_usage_one_refused() -> None:
    pages = [("c.json", (REPORTS / "anthropic-analytics-cost.json").read_bytes())]
    assert provider_costs(pages, *NOV) == {("2026-11-30", "claude-sonnet-4-5"): D("0.0591")}
    usage = [("u.json", (REPORTS / "anthropic-analytics-usage.json").read_bytes())]
    with pytest.raises(ExportError, match="count usage, not costs"):
        provider_costs(usage, *NOV)


def test_a_csv_of_day_model_cost_is_read_exactly_and_a_bad_line_named() -> None:
    data = (
        b"day,model,cost_usd\n2026-11-02,gpt-4o-mini-2024-07-18,0.1\n2026-11-02,gpt-4o-mini,0.2\n"
    )
    assert provider_costs([("c.csv", data)], *NOV) == {("2026-11-02", "gpt-4o-mini"): D("0.3")}
    with pytest.raises(ExportError, match="line 2: cost_usd"):
        provider_costs([("c.csv", b"day,model,cost_usd\n2026-11-02,m,lots\n")], *NOV)
    with pytest.raises(ExportError, match="lacks cost_usd"):
        provider_costs([("c.csv", b"day,model\n2026-11-02,m\n")], *NOV)


def test_days_part_beyond_the_tolerance_and_either_side_may_be_missing() -> None:
    rows = compare(
        {("2026-11-01", "m"): D("1.00"), ("2026-11-02", "m"): D("1.00")},
        {
            ("2026-11-01", "m"): D("1.005"),
            ("2026-11-02", "m"): D("1.25"),
            ("2026-11-03", "m"): D(1),
        },
    )
    assert [(r.day, r.parted) for r in rows] == [
        ("2026-11-01", False),  # within 1%
        ("2026-11-02", True),  # a price the config missed
        ("2026-11-03", True),  # nothing recorded
    ]
    assert rows[1].as_json()["difference_usd"] == "0.250000"


def test_the_cli_names_the_days_where_costs_part(database_url: str, tmp_path: Path) -> None:
    async def build() -> None:
        engine = create_engine(database_url)
        store = EventStore(engine)
        try:
            await _attempt(store, 1, "acme", "0.0012")
            await _attempt(store, 3, "beta", "0.0020")
        finally:
            await store.close()
            await engine.dispose()

    asyncio.run(build())
    today = datetime.now(UTC).date()
    yesterday = today - timedelta(days=1)
    report = tmp_path / "costs.csv"
    report.write_text(f"day,model,cost_usd\n{today},m,0.0032\n{yesterday},m,0.5\n")
    since, until = yesterday.isoformat(), today.isoformat()
    answer = waybill(
        "reprice",
        str(report),
        "--since",
        since,
        "--until",
        until,
        "--json",
        database_url=database_url,
    )
    assert answer.returncode == 0, answer.stderr
    body = json.loads(answer.stdout)
    assert body["parted_days"] == [yesterday.isoformat()]
    assert [(r["day"], r["status"]) for r in body["rows"]] == [
        (yesterday.isoformat(), "parted"),
        (today.isoformat(), "match"),
    ]
    table = waybill(
        "reprice", str(report), "--since", since, "--until", until, database_url=database_url
    )
    assert f"costs part on 1 day(s): {yesterday}" in table.stdout
    bad = waybill(
        "reprice", str(report), "--since", "soon", "--until", until, database_url=database_url
    )
    assert bad.returncode == 1 and "--since and --until must be dates" in bad.stderr


def test_a_csv_of_one_endpoints_costs_is_held_against_that_endpoint_alone(
    database_url: str, tmp_path: Path
) -> None:
    async def build() -> None:
        engine = create_engine(database_url)
        store = EventStore(engine)
        try:
            await _attempt(store, 1, "acme", "0.0012", endpoint="east")
            await _attempt(store, 2, "acme", "0.0020", endpoint="west")
        finally:
            await store.close()
            await engine.dispose()

    asyncio.run(build())
    today = datetime.now(UTC).date().isoformat()
    bill = tmp_path / "east-costs.csv"  # east's own bill: west's traffic is not on it
    bill.write_text(f"day,model,cost_usd\n{today},m,0.0012\n")
    days = ("--since", today, "--until", today, "--json")

    def parted(*scope: str) -> list[str]:
        answer = waybill("reprice", str(bill), *days, *scope, database_url=database_url)
        assert answer.returncode == 0, answer.stderr
        return list(json.loads(answer.stdout)["parted_days"])

    assert parted() == [today]  # every endpoint's costs against one endpoint's bill
    assert parted("--endpoint", "east") == []
    assert parted("--endpoint", "west") == [today]
