"""Period close (contract §6): a month's books, closed once, adjusted after.

A period is a calendar month, UTC. An attempt belongs to the period of its reservation day
(``spend_attempts.day``, the UTC date its ``BudgetReserved`` was recorded), wherever its
settlement falls: a reservation on 30 November settled on 2 December is November's spend.

Closing records ``PeriodClosed`` on stream ``period-YYYY-MM`` at ``NO_STREAM`` (so a period
closes once): the per-workspace totals of the spend read model, caught up to the head first,
and the position they include. A change to a closed period's attempt afterwards (an
unknown-usage settlement by a reconciliation or an operator, and its overrun) is recorded
with it as ``PeriodAdjusted`` in the period open then (``adjustment_for``); the spend report
shows a closed period's totals as closed and the adjustments beside them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any, Literal

from sqlalchemy import case, func, select

from ledger import events as ev
from ledger.store import NO_STREAM, EventStore, WrongExpectedVersion
from ledger.store.schema import (
    all_spend_attempts,
    appends,
    projection_checkpoints,
    unknown_settlements,
)
from ledger.views.projection import ProjectionRunner
from ledger.views.spend_queries import spend_report

__all__ = [
    "PeriodError",
    "adjustment_for",
    "close_period",
    "closed_period",
    "parse_period",
    "period_bounds",
    "period_of",
    "period_stream",
]


class PeriodError(ValueError):
    """A period that cannot be closed (not ended, already closed, open unknown usage)."""


def parse_period(value: str) -> str:
    """``YYYY-MM``, checked."""
    try:
        first = date.fromisoformat(f"{value}-01")
    except ValueError:
        raise PeriodError(f"a period is a month like 2026-11, not {value!r}") from None
    if len(value) != 7:
        raise PeriodError(f"a period is a month like 2026-11, not {value!r}")
    return first.strftime("%Y-%m")


def period_of(day: date | datetime | str) -> str:
    """The period of a UTC day (or instant, or ISO day)."""
    if isinstance(day, datetime):
        # SQLite hands back the books' UTC instants naive.
        day = (day if day.tzinfo is None else day.astimezone(UTC)).date()
    return str(day)[:7] if isinstance(day, str) else day.strftime("%Y-%m")


def period_bounds(period: str) -> tuple[date, date]:
    """First and last day of ``period``, inclusive."""
    first = date.fromisoformat(f"{period}-01")
    following = date(first.year + first.month // 12, first.month % 12 + 1, 1)
    return first, date.fromordinal(following.toordinal() - 1)


def period_stream(period: str) -> str:
    return f"period-{period}"


@dataclass(frozen=True, slots=True)
class _OpenUnknown:
    count: int
    oldest: str | None  # settlement id
    oldest_at: datetime | None
    streams: list[str]  # their requests' streams


async def close_period(
    store: EventStore,
    period: str,
    *,
    actor: str,
    allow_open: bool = False,
    today: date | None = None,
) -> ev.PeriodClosed:
    """Close ``period``: refuse a month not yet ended, one already closed, and (unless
    ``allow_open``) one whose attempts still hold open unknown-usage settlements."""
    period = parse_period(period)
    first, last = period_bounds(period)
    if last >= (today or datetime.now(UTC).date()):
        raise PeriodError(f"{period} has not ended yet (UTC): it cannot be closed")
    closed = await closed_period(store, period)
    if closed is not None:
        raise PeriodError(
            f"{period} is already closed (at ledger position {closed.position}); "
            "later changes are recorded as adjustments"
        )
    for _ in range(_CLOSE_TRIES):
        event, unchanged = await _closing(store, period, first, last, actor, allow_open)
        try:
            await store.append(period_stream(period), NO_STREAM, [event], requires=unchanged)
        except WrongExpectedVersion as moved:
            if moved.stream_id == period_stream(period):
                raise PeriodError(f"{period} is already closed") from None
            continue  # an open settlement moved after the totals were read: read them again
        return event
    raise PeriodError(f"{period} kept changing while it was being closed; try again")


_CLOSE_TRIES = 3


async def _closing(
    store: EventStore, period: str, first: date, last: date, actor: str, allow_open: bool
) -> tuple[ev.PeriodClosed, dict[str, int]]:
    """The ``PeriodClosed`` of the month as the spend read model has it now, and the
    versions its append must find unchanged: the request streams of the month's open
    unknown-usage settlements, the only changes a month whose attempts have ended can still
    get (a settlement appends to its request's stream). A settlement committed after the
    totals were read moves its stream, and the close is refused and read again."""
    from ledger.views import SpendProjection

    runner = ProjectionRunner(store, [SpendProjection()])
    await runner.catch_up()
    in_flight = await _in_flight(store, first, last)
    if in_flight:
        # A hold still held ends in the gateway's own settlement, which no adjustment would
        # follow: the month closes once its attempts have ended (a dead gateway's holds are
        # recovered within six heartbeats).
        raise PeriodError(
            f"{period} has {in_flight} attempt(s) still in flight: close it once they end"
        )
    open_unknown = await _open_unknown(store, first, last)
    if open_unknown.count and not allow_open:
        raise PeriodError(
            f"{period} has {open_unknown.count} open unknown-usage settlement(s), the oldest "
            f"{open_unknown.oldest} opened {open_unknown.oldest_at:%Y-%m-%dT%H:%MZ}: settle "
            "them (waybill settle, waybill reconcile) or close with --allow-open"
        )
    async with store.engine.connect() as conn:
        position = int(
            (
                await conn.execute(
                    select(projection_checkpoints.c.position).where(
                        projection_checkpoints.c.name == "spend"
                    )
                )
            ).scalar_one()
        )
        unchanged = await _stream_versions(conn, open_unknown.streams, position)
    rows = await spend_report(store.engine, group_by=["workspace"], since=first, until=last)
    event = ev.PeriodClosed(
        period=period,
        position=position,
        totals=tuple(
            ev.PeriodTotal(
                workspace=r["workspace"],
                settled_usd=Decimal(r["settled_usd"]),
                held_unknown_usd=Decimal(r["held_unknown_usd"]),
                overrun_usd=Decimal(r["overrun_usd"]),
                requests=r["requests"],
                attempts=r["attempts"],
            )
            for r in rows
        ),
        open_unknown=open_unknown.count,
        closed_by=actor,
    )
    return event, unchanged


async def _stream_versions(conn: Any, streams: list[str], position: int) -> dict[str, int]:
    """Each stream's version as of ledger ``position``."""
    if not streams:
        return {}
    a = appends.c
    # A row's last event at or before ``position``: all of them, or those up to it.
    last = case(
        (a.position + func.length(a.types) - 1 <= position, a.version + func.length(a.types) - 1),
        else_=a.version + (position - a.position),
    )
    rows = await conn.execute(
        select(a.stream_id, func.max(last))
        .where(a.stream_id.in_(streams), a.position <= position)
        .group_by(a.stream_id)
    )
    return {str(stream): int(version) for stream, version in rows}


async def closed_period(store: EventStore, period: str) -> ev.PeriodClosed | None:
    """The ``PeriodClosed`` of ``period``, if it was closed."""
    for recorded in await store.read_stream(period_stream(period)):
        event = recorded.event()
        if isinstance(event, ev.PeriodClosed):
            return event
    return None


async def _in_flight(store: EventStore, first: date, last: date) -> int:
    a = all_spend_attempts
    query = select(func.count()).where(
        a.c.state == "held", a.c.day >= first.isoformat(), a.c.day <= last.isoformat()
    )
    async with store.engine.connect() as conn:
        return int((await conn.execute(query)).scalar_one())


async def _open_unknown(store: EventStore, first: date, last: date) -> _OpenUnknown:
    s, a = unknown_settlements, all_spend_attempts
    query = (
        select(s.c.settlement_id, s.c.opened_at, s.c.request_id)
        .join(a, a.c.reservation_id == s.c.reservation_id)
        .where(s.c.state == "open", a.c.day >= first.isoformat(), a.c.day <= last.isoformat())
        .order_by(s.c.opened_at, s.c.settlement_id)
    )
    async with store.engine.connect() as conn:
        rows = (await conn.execute(query)).all()
    if not rows:
        return _OpenUnknown(0, None, None, [])
    streams = sorted({f"request-{row.request_id}" for row in rows})
    return _OpenUnknown(len(rows), str(rows[0].settlement_id), rows[0].opened_at, streams)


async def adjustment_for(
    store: EventStore,
    *,
    reserved_at: datetime,
    request_id: str,
    attempt_id: str,
    reservation_id: str,
    workspace: str,
    cause: Literal["operator_settlement", "reconciliation"],
    settled_usd: Decimal,
    held_unknown_usd: Decimal,
    overrun_usd: Decimal,
) -> ev.PeriodAdjusted | None:
    """The ``PeriodAdjusted`` to append with a change to an attempt reserved at
    ``reserved_at``, if its period is closed; None while it is open."""
    period = period_of(reserved_at)
    if await closed_period(store, period) is None:
        return None
    return ev.PeriodAdjusted(
        period=period,
        in_period=period_of(datetime.now(UTC)),
        request_id=request_id,
        attempt_id=attempt_id,
        reservation_id=reservation_id,
        workspace=workspace,
        cause=cause,
        settled_usd=settled_usd,
        held_unknown_usd=held_unknown_usd,
        overrun_usd=overrun_usd,
    )
