"""Period close (contract §6) on both backends: a month closes once, with its totals; a
settlement that lands later is an adjustment beside the closed totals, never a change to them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal as D
from typing import Any, Self

import pytest

from ledger import events as ev
from ledger.books.accounting import AccountSpec, Hold, HoldUnknown, Reserve, Settle
from ledger.books.settlements import settle_unknown
from ledger.finance.periods import PeriodError, close_period, period_of
from ledger.store import ANY_VERSION, EventStore
from ledger.store import event_store as store_module
from ledger.store.db import create_engine
from ledger.views import SpendProjection
from ledger.views.projection import ProjectionRunner
from ledger.views.spend_queries import spend_report
from tests.ledger.test_cli import waybill

# Noon, ten days before this month began: a day of the last month, which has ended.
LAST_MONTH = datetime.combine(
    datetime.now(UTC).date().replace(day=1) - timedelta(days=10),
    datetime.min.time(),
    tzinfo=UTC,
) + timedelta(hours=12)
PERIOD = period_of(LAST_MONTH)


class _LastMonthClock(datetime):
    @classmethod
    def now(cls, tz: Any = None) -> Self:
        return cls.fromtimestamp(LAST_MONTH.timestamp(), UTC)


@pytest.fixture
def last_month() -> Iterator[None]:
    """Appends recorded within it are stamped in the last month (the store's clock)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(store_module, "datetime", _LastMonthClock)
        yield


async def _attempt(
    store: EventStore, n: int, workspace: str, cost: str | None, endpoint: str = "east"
) -> None:
    """One attempt's hold of 0.0050 on ``endpoint``, settled at ``cost`` or (None) held as
    unknown usage."""
    request_id, attempt_id, reservation_id = f"req_{n}", f"att_{n}", f"res_{n}"
    spec = AccountSpec(f"key:{workspace}:total", "key", workspace, "k1", None, D(10))
    hold = Hold(
        reservation_id, request_id, attempt_id, workspace, "k1", endpoint, "m", D("0.0050"), (), "i"
    )
    reserved = ev.BudgetReserved(
        request_id=request_id,
        attempt_id=attempt_id,
        reservation_id=reservation_id,
        amount_usd=D("0.0050"),
        accounts=(ev.AccountRef(account_id=spec.account_id, kind="key", limit_usd=D(10)),),
        endpoint=endpoint,
        model="m",
        workspace=workspace,
        key_id="k1",
        model_group="chat",
    )
    stream = f"request-{request_id}"
    await store.append(stream, ANY_VERSION, [reserved], effects=[Reserve(hold, (spec,))])
    outcome: ev.Event
    if cost is not None:
        outcome = ev.BudgetSettled(
            request_id=request_id,
            attempt_id=attempt_id,
            reservation_id=reservation_id,
            reserved_usd=D("0.0050"),
            settled_usd=D(cost),
            released_usd=D("0.0050") - D(cost),
            usage=ev.Usage(input_tokens=10, output_tokens=5),
        )
        effect: Settle | HoldUnknown = Settle(reservation_id, D(cost))
    else:
        outcome = ev.UnknownUsageOpened(
            settlement_id=f"unk_{n}",
            request_id=request_id,
            attempt_id=attempt_id,
            reservation_id=reservation_id,
            workspace=workspace,
            key_id="k1",
            endpoint=endpoint,
            model="m",
            held_usd=D("0.0050"),
            cause="upstream_unavailable",
        )
        effect = HoldUnknown(reservation_id)
    await store.append(stream, ANY_VERSION, [outcome], effects=[effect])


async def _last_months_ledger(store: EventStore) -> None:
    """acme: one settled attempt and one of unknown usage; beta: one settled attempt."""
    await _attempt(store, 1, "acme", "0.0012")
    await _attempt(store, 2, "acme", None)
    await _attempt(store, 3, "beta", "0.0020")


async def _spend(store: EventStore) -> dict[str, dict[str, Any]]:
    await ProjectionRunner(store, [SpendProjection()]).catch_up()
    rows = await spend_report(store.engine, group_by=["workspace"])
    return {row["workspace"]: row for row in rows}


async def test_a_period_closes_with_its_totals_per_workspace_and_position(
    store: EventStore, last_month: None
) -> None:
    await _attempt(store, 1, "acme", "0.0012")
    await _attempt(store, 3, "beta", "0.0020")
    closed = await close_period(store, PERIOD, actor="test", today=date.max)
    assert closed.period == PERIOD and closed.open_unknown == 0
    assert closed.position == (await store.head())[0] - 1  # all but the close itself
    assert [(t.workspace, t.settled_usd, t.attempts) for t in closed.totals] == [
        ("acme", D("0.0012"), 1),
        ("beta", D("0.0020"), 1),
    ]
    (recorded,) = await store.read_stream(f"period-{PERIOD}")
    assert recorded.event() == closed


async def test_closing_a_period_twice_is_refused(store: EventStore, last_month: None) -> None:
    await _attempt(store, 1, "acme", "0.0012")
    await close_period(store, PERIOD, actor="test", today=date.max)
    with pytest.raises(PeriodError, match=f"{PERIOD} is already closed"):
        await close_period(store, PERIOD, actor="test", today=date.max)


async def test_a_month_not_yet_ended_is_refused(store: EventStore) -> None:
    this_month = period_of(datetime.now(UTC))
    with pytest.raises(PeriodError, match="has not ended"):
        await close_period(store, this_month, actor="test")


async def test_open_unknown_usage_refuses_the_close_unless_allowed(
    store: EventStore, last_month: None
) -> None:
    await _last_months_ledger(store)
    with pytest.raises(PeriodError, match=r"1 open unknown-usage settlement.*the oldest unk_2"):
        await close_period(store, PERIOD, actor="test", today=date.max)
    assert await store.read_stream(f"period-{PERIOD}") == []
    closed = await close_period(store, PERIOD, actor="test", allow_open=True, today=date.max)
    assert closed.open_unknown == 1
    assert closed.totals[0].held_unknown_usd == D("0.0050")


async def test_a_late_settlement_is_an_adjustment_beside_unchanged_closed_totals(
    store: EventStore,
) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(store_module, "datetime", _LastMonthClock)
        await _last_months_ledger(store)
        closed = await close_period(store, PERIOD, actor="test", allow_open=True, today=date.max)
    _, overrun = await settle_unknown(store, "unk_2", D("0.0080"), actor="k_fin", reason="x")
    assert overrun is not None and overrun.excess_usd == D("0.0030")
    trail = [r.event() for r in await store.read_stream("request-req_2")]
    adjusted = trail[-1]
    assert isinstance(adjusted, ev.PeriodAdjusted)
    assert adjusted.period == PERIOD and adjusted.in_period == period_of(datetime.now(UTC))
    assert (adjusted.settled_usd, adjusted.held_unknown_usd, adjusted.overrun_usd) == (
        D("0.0080"),
        D("-0.0050"),
        D("0.0030"),
    )

    acme, beta = (await _spend(store))["acme"], (await _spend(store))["beta"]
    total = closed.totals[0]
    assert _usd(acme, "settled_usd", "held_unknown_usd", "overrun_usd") == (
        total.settled_usd,
        total.held_unknown_usd,
        total.overrun_usd,
    )
    assert _usd(acme, "adjustment_settled_usd", "adjustment_held_unknown_usd") == (
        D("0.0080"),
        D("-0.0050"),
    )
    assert _usd(acme, "adjustment_overrun_usd") == (D("0.0030"),)
    assert _usd(beta, "adjustment_settled_usd") == (D(0),)


def _usd(row: dict[str, Any], *columns: str) -> tuple[D, ...]:
    return tuple(D(row[c]) for c in columns)


async def test_a_settlement_in_an_open_period_is_no_adjustment(
    store: EventStore, last_month: None
) -> None:
    await _last_months_ledger(store)
    await settle_unknown(store, "unk_2", D("0.0040"), actor="k_fin", reason="x")
    trail = [r.event() for r in await store.read_stream("request-req_2")]
    assert not any(isinstance(e, ev.PeriodAdjusted) for e in trail)
    assert _usd((await _spend(store))["acme"], "settled_usd") == (D("0.0052"),)


def test_the_cli_closes_refuses_and_spend_shows_the_adjustment(database_url: str) -> None:
    async def build() -> None:
        engine = create_engine(database_url)
        store = EventStore(engine)
        try:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(store_module, "datetime", _LastMonthClock)
                await _last_months_ledger(store)
        finally:
            await store.close()
            await engine.dispose()

    asyncio.run(build())
    refused = waybill("period", "close", PERIOD, database_url=database_url)
    assert refused.returncode == 1
    assert "1 open unknown-usage settlement(s), the oldest unk_2" in refused.stderr
    assert "--allow-open" in refused.stderr

    closed = waybill("period", "close", PERIOD, "--allow-open", database_url=database_url)
    assert closed.returncode == 0, closed.stderr
    assert f"closed {PERIOD} at ledger position" in closed.stdout
    assert "1 unknown-usage settlement(s) open" in closed.stdout

    again = waybill("period", "close", PERIOD, "--allow-open", database_url=database_url)
    assert again.returncode == 1 and f"{PERIOD} is already closed" in again.stderr

    late = waybill(
        "settle", "unk_2", "--usd", "0.0030", "--reason", "invoice", database_url=database_url
    )
    assert late.returncode == 0, late.stderr
    spend = waybill("spend", "--format", "json", database_url=database_url)
    rows = {r["workspace"]: r for r in json.loads(spend.stdout)["data"]}
    assert _usd(rows["acme"], "settled_usd", "held_unknown_usd") == (D("0.0012"), D("0.005"))
    assert _usd(rows["acme"], "adjustment_settled_usd", "adjustment_held_unknown_usd") == (
        D("0.003"),
        D("-0.005"),
    )
    table = waybill("spend", database_url=database_url)
    assert "adj_settled" in table.stdout and "adj_held_unknown" in table.stdout


async def test_a_month_with_attempts_in_flight_does_not_close(
    store: EventStore, last_month: None
) -> None:
    # A held hold ends in the gateway's own settlement, which no adjustment would follow.
    await _last_months_ledger(store)
    spec = AccountSpec("key:acme:total", "key", "acme", "k1", None, D(10))
    hold = Hold("res_9", "req_9", "att_9", "acme", "k1", "east", "m", D("0.0050"), (), "i")
    reserved = ev.BudgetReserved(
        request_id="req_9",
        attempt_id="att_9",
        reservation_id="res_9",
        amount_usd=D("0.0050"),
        accounts=(ev.AccountRef(account_id=spec.account_id, kind="key", limit_usd=D(10)),),
        endpoint="east",
        model="m",
        workspace="acme",
        key_id="k1",
    )
    await store.append("request-req_9", ANY_VERSION, [reserved], effects=[Reserve(hold, (spec,))])
    with pytest.raises(PeriodError, match=r"1 attempt\(s\) still in flight"):
        await close_period(store, PERIOD, actor="test", allow_open=True, today=date.max)
    assert await store.read_stream(f"period-{PERIOD}") == []


async def test_a_settlement_racing_the_close_is_recorded_as_its_adjustment(
    store: EventStore,
) -> None:
    # The settlement looked while the period was open; the close commits before its append.
    # The append, which required the period's stream absent, is refused and decided again.
    from ledger.finance.periods import adjustment_for as looked

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(store_module, "datetime", _LastMonthClock)
        await _last_months_ledger(store)
    calls = 0

    async def close_meanwhile(*args: Any, **kwargs: Any) -> ev.PeriodAdjusted | None:
        nonlocal calls
        calls += 1
        answer = await looked(*args, **kwargs)
        if calls == 1:
            assert answer is None  # open when it looked
            await close_period(store, PERIOD, actor="test", allow_open=True, today=date.max)
        return answer

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("ledger.books.settlements.adjustment_for", close_meanwhile)
        await settle_unknown(store, "unk_2", D("0.0040"), actor="k_fin", reason="x")
    assert calls == 2
    trail = [r.event() for r in await store.read_stream("request-req_2")]
    assert isinstance(trail[-1], ev.PeriodAdjusted) and trail[-1].period == PERIOD
    assert sum(isinstance(e, ev.UnknownUsageSettled) for e in trail) == 1


async def test_a_settlement_between_the_totals_and_the_close_is_in_the_totals(
    store: EventStore,
) -> None:
    # The close read its totals; a settlement of one of the month's open unknowns commits
    # before the close's append. The append, which required that request's stream unchanged,
    # is refused; the close reads again and its totals hold the settlement.
    from ledger.views.spend_queries import spend_report as read_totals

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(store_module, "datetime", _LastMonthClock)
        await _last_months_ledger(store)
    calls = 0

    async def settle_meanwhile(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        nonlocal calls
        calls += 1
        totals = await read_totals(*args, **kwargs)
        if calls == 1:
            await settle_unknown(store, "unk_2", D("0.0040"), actor="k_fin", reason="x")
        return totals

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("ledger.finance.periods.spend_report", settle_meanwhile)
        closed = await close_period(store, PERIOD, actor="test", allow_open=True, today=date.max)
    assert calls == 2
    acme = next(t for t in closed.totals if t.workspace == "acme")
    assert (acme.settled_usd, acme.held_unknown_usd) == (D("0.0052"), D(0))
    assert closed.open_unknown == 0
    trail = [r.event() for r in await store.read_stream("request-req_2")]
    assert not any(isinstance(e, ev.PeriodAdjusted) for e in trail)
