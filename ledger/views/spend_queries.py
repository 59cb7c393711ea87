"""Spend and unknown-usage queries over the spend read models (``ledger.views.spend``).

Totals are exact decimals on both backends: PostgreSQL sums its NUMERIC columns in the
database; SQLite keeps money as text, which its SQL ``SUM`` would add as floats, so its rows
are summed in Python. Either way they add up to the settled events.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date, datetime
from decimal import Decimal
from typing import Any, Final

from sqlalchemy import ColumnElement, and_, case, distinct, func, or_, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ledger.store.schema import all_spend_attempts, budget_accounts, unknown_settlements
from ledger.types import money_str

__all__ = [
    "ADJUSTMENT_COLUMNS",
    "GROUP_KEYS",
    "DayRouting",
    "SettlementPage",
    "SpendScope",
    "attempt_owner",
    "budget_balances",
    "response_endpoint",
    "routing_by_day",
    "spend_csv",
    "spend_report",
    "unknown_settlements_page",
]

# Report key -> column. "model" is the model group a client asked for (contract §3);
# "upstream_model" the provider's model the attempt was bound to.
GROUP_KEYS: Final = {
    "workspace": "workspace",
    "key": "key_id",
    "model": "model_group",
    "endpoint": "endpoint",
    "upstream_model": "model",
    "api": "api",  # the door: openai.chat_completions, anthropic.messages, ...
    "day": "day",
}


@dataclass(frozen=True, slots=True)
class SpendScope:
    """What the caller may see: None leaves a field unnarrowed."""

    workspace: str | None = None
    key_id: str | None = None


async def spend_report(
    engine: AsyncEngine,
    *,
    group_by: Sequence[str],
    since: date | None = None,
    until: date | None = None,
    scope: SpendScope = SpendScope(),
) -> list[dict[str, Any]]:
    """Spend rows: the ``group_by`` keys, ``settled_usd`` (overruns included),
    ``held_unknown_usd``, ``overrun_usd`` (settled beyond the reservations), ``requests``
    and ``attempts``; ``since``/``until`` are inclusive UTC days of reservation.

    An attempt of a closed period counts as it stood at the close; what changed it since
    (``PeriodAdjusted``) is in ``adjustment_settled_usd``, ``adjustment_held_unknown_usd``
    and ``adjustment_overrun_usd`` beside: the closed figure plus the adjustment is today's."""
    unknown = [k for k in group_by if k not in GROUP_KEYS]
    if unknown:
        raise ValueError(f"cannot group by {', '.join(unknown)}")
    conditions = _conditions(since, until, scope)
    async with engine.connect() as conn:
        adjusted = await _adjustments(conn)
        if conn.dialect.name == "postgresql":
            totals = await _summed_in_sql(conn, group_by, conditions, adjusted)
        else:
            totals = await _summed_in_python(conn, group_by, conditions, adjusted)
    return [
        {
            **dict(zip(group_by, group, strict=True)),
            "settled_usd": money_str(entry.settled),
            "held_unknown_usd": money_str(entry.held),
            "overrun_usd": money_str(entry.overrun),
            "requests": entry.requests,
            "attempts": entry.attempts,
            **{
                column: money_str(amount)
                for column, amount in zip(ADJUSTMENT_COLUMNS, entry.adjustment, strict=True)
            },
        }
        for group, entry in sorted(totals.items())
    ]


@dataclass
class _Total:
    settled: Decimal = Decimal(0)
    held: Decimal = Decimal(0)
    overrun: Decimal = Decimal(0)
    requests: int = 0
    attempts: int = 0
    adjustment: tuple[Decimal, Decimal, Decimal] = (Decimal(0), Decimal(0), Decimal(0))

    def adjust(self, by: tuple[Decimal, Decimal, Decimal]) -> None:
        """An attempt of a closed period counts as it stood at the close: what moved it since
        leaves the live figures for the adjustment columns."""
        self.settled -= by[0]
        self.held -= by[1]
        self.overrun -= by[2]
        self.adjustment = (
            self.adjustment[0] + by[0],
            self.adjustment[1] + by[1],
            self.adjustment[2] + by[2],
        )


def _conditions(
    since: date | None, until: date | None, scope: SpendScope
) -> list[ColumnElement[bool]]:
    t = all_spend_attempts.c
    conditions = []
    if scope.workspace is not None:
        conditions.append(t.workspace == scope.workspace)
    if scope.key_id is not None:
        conditions.append(t.key_id == scope.key_id)
    if since is not None:
        conditions.append(t.day >= since.isoformat())
    if until is not None:
        conditions.append(t.day <= until.isoformat())
    return conditions


async def _summed_in_python(
    conn: AsyncConnection,
    group_by: Sequence[str],
    conditions: list[ColumnElement[bool]],
    adjusted: dict[str, tuple[Decimal, Decimal, Decimal]],
) -> dict[tuple[str, ...], _Total]:
    """SQLite keeps money as text, which its SUM would add as floats: rows summed here."""
    totals: dict[tuple[str, ...], _Total] = {}
    requests: dict[tuple[str, ...], set[str]] = {}
    result = await conn.stream(select(all_spend_attempts).where(*conditions))
    async for row in result:
        group = tuple(str(getattr(row, GROUP_KEYS[k])) for k in group_by)
        entry = totals.get(group)
        if entry is None:
            entry = totals[group] = _Total()
            requests[group] = set()
        entry.settled += row.settled_usd
        entry.held += row.held_unknown_usd
        entry.overrun += row.overrun_usd
        entry.attempts += 1
        requests[group].add(row.request_id)
        adjustment = adjusted.get(row.reservation_id)
        if adjustment is not None:
            entry.adjust(adjustment)
    for group, entry in totals.items():
        entry.requests = len(requests[group])
    return totals


async def _summed_in_sql(
    conn: AsyncConnection,
    group_by: Sequence[str],
    conditions: list[ColumnElement[bool]],
    adjusted: dict[str, tuple[Decimal, Decimal, Decimal]],
) -> dict[tuple[str, ...], _Total]:
    """PostgreSQL sums NUMERIC exactly: grouped in the database, one row per group out of
    however many attempts (a month of a busy ledger), then the few adjusted attempts moved
    to their adjustment columns."""
    t = all_spend_attempts.c
    keys = [t[GROUP_KEYS[k]] for k in group_by]
    query = (
        select(
            *keys,
            func.sum(t.settled_usd),
            func.sum(t.held_unknown_usd),
            func.sum(t.overrun_usd),
            func.count(distinct(t.request_id)),
            func.count(),
        )
        .where(*conditions)
        .group_by(*keys)
    )
    totals: dict[tuple[str, ...], _Total] = {}
    width = len(keys)
    for row in await conn.execute(query):
        group = tuple(str(value) for value in row[:width])
        settled, held, overrun, requests, attempts = row[width:]
        totals[group] = _Total(settled, held, overrun, int(requests), int(attempts))
    if adjusted:
        located = select(t.reservation_id, *keys).where(
            *conditions, t.reservation_id.in_(list(adjusted))
        )
        for row in await conn.execute(located):
            group = tuple(str(value) for value in row[1:])
            totals[group].adjust(adjusted[row[0]])
    return totals


ADJUSTMENT_COLUMNS: Final = (
    "adjustment_settled_usd",
    "adjustment_held_unknown_usd",
    "adjustment_overrun_usd",
)


async def _adjustments(conn: AsyncConnection) -> dict[str, tuple[Decimal, Decimal, Decimal]]:
    """What ``PeriodAdjusted`` events moved each closed-period attempt by, by reservation
    (folded into its spend row, where the columns are NULL for an attempt none moved: the
    events may have left for the archive)."""
    t = all_spend_attempts.c
    query = select(
        t.reservation_id,
        t.adjustment_settled_usd,
        t.adjustment_held_unknown_usd,
        t.adjustment_overrun_usd,
    ).where(t.adjustment_settled_usd.is_not(None))  # a partial index's predicate
    return {
        str(reservation): (settled, held, overrun)
        for reservation, settled, held, overrun in await conn.execute(query)
    }


@dataclass(frozen=True, slots=True)
class DayRouting:
    """One day's requests (by the day of their first reservation) and how many of them
    were served or tried on more than one endpoint: failed over, or hedged."""

    day: str
    requests: int
    failed_over: int


async def routing_by_day(
    engine: AsyncEngine,
    *,
    since: date | None = None,
    until: date | None = None,
    scope: SpendScope = SpendScope(),
) -> list[DayRouting]:
    """Per UTC day, the requests that reserved an attempt and those whose attempts went to
    more than one endpoint; oldest day first. Counts only: the same SQL on both backends."""
    t = all_spend_attempts.c
    per_request = (
        select(
            func.min(t.day).label("day"),
            func.count(distinct(t.endpoint)).label("endpoints"),
        )
        .where(*_conditions(since, until, scope))
        .group_by(t.request_id)
        .subquery()
    )
    query = (
        select(
            per_request.c.day,
            func.count(),
            func.sum(case((per_request.c.endpoints > 1, 1), else_=0)),
        )
        .group_by(per_request.c.day)
        .order_by(per_request.c.day)
    )
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).all()
    return [DayRouting(str(day), int(requests), int(moved or 0)) for day, requests, moved in rows]


def spend_csv(rows: Sequence[dict[str, Any]], group_by: Sequence[str]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    columns = [
        *group_by,
        "settled_usd",
        "held_unknown_usd",
        "overrun_usd",
        "requests",
        "attempts",
        *ADJUSTMENT_COLUMNS,
    ]
    writer.writerow(columns)
    for row in rows:
        writer.writerow([row[c] for c in columns])
    return out.getvalue()


async def response_endpoint(engine: AsyncEngine, workspace: str, response_id: str) -> str | None:
    """The endpoint whose attempt answered with ``response_id`` (the provider's id recorded on
    its ``AttemptFinished``), among ``workspace``'s attempts; None if none did."""
    t = all_spend_attempts.c
    query = select(t.endpoint).where(t.response_id == response_id, t.workspace == workspace)
    async with engine.connect() as conn:
        row = (await conn.execute(query.limit(1))).first()
    return None if row is None else str(row[0])


async def attempt_owner(engine: AsyncEngine, attempt_id: str) -> tuple[str, str, str] | None:
    """The request, workspace and key of an attempt (by its hold), or None if unknown."""
    t = all_spend_attempts.c
    query = select(t.request_id, t.workspace, t.key_id).where(t.attempt_id == attempt_id)
    async with engine.connect() as conn:
        row = (await conn.execute(query.limit(1))).first()
    return None if row is None else (str(row[0]), str(row[1]), str(row[2]))


async def budget_balances(
    engine: AsyncEngine,
    *,
    scope: SpendScope,
    kinds: Sequence[str] = ("key", "workspace"),
    limit: int | None = None,
) -> list[dict[str, Any]]:
    """Live account balances (the books themselves, not a projection), newest window first;
    the first ``limit`` of them if given."""
    table = budget_accounts
    query = select(table).where(table.c.kind.in_(list(kinds)))
    if limit is not None:
        query = query.limit(limit)
    if scope.workspace is not None:
        query = query.where(table.c.workspace == scope.workspace)
    if scope.key_id is not None:
        query = query.where(table.c.key_id == scope.key_id)
    query = query.order_by(table.c.window_start.desc(), table.c.account_id)
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).all()
    return [
        {
            "account_id": r.account_id,
            "kind": r.kind,
            "workspace": r.workspace,
            "key_id": r.key_id,
            "window_start": r.window_start,
            "limit_usd": money_str(r.limit_usd),
            "held_usd": money_str(r.held_usd),
            "settled_usd": money_str(r.settled_usd),
            "overrun_usd": money_str(r.overrun_usd),
            # Spend over the limit (an overrun) leaves nothing for a new reservation.
            "available_usd": money_str(max(Decimal(0), r.limit_usd - r.held_usd - r.settled_usd)),
        }
        for r in rows
    ]


@dataclass(frozen=True, slots=True)
class SettlementPage:
    data: list[dict[str, Any]]
    next_after: tuple[datetime, str] | None


async def unknown_settlements_page(
    engine: AsyncEngine,
    *,
    state: str | None,
    scope: SpendScope,
    limit: int,
    after: tuple[datetime, str] | None = None,
    settlement_id: str | None = None,
) -> SettlementPage:
    """Unknown-usage settlements, oldest first, in contract §3's shape."""
    table = unknown_settlements
    query = select(table).order_by(table.c.opened_at, table.c.settlement_id).limit(limit + 1)
    if state is not None:
        query = query.where(table.c.state == state)
    if settlement_id is not None:
        query = query.where(table.c.settlement_id == settlement_id)
    if scope.workspace is not None:
        query = query.where(table.c.workspace == scope.workspace)
    if scope.key_id is not None:
        query = query.where(table.c.key_id == scope.key_id)
    if after is not None:
        opened_at, settlement_id = after
        query = query.where(
            or_(
                table.c.opened_at > opened_at,
                and_(table.c.opened_at == opened_at, table.c.settlement_id > settlement_id),
            )
        )
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).all()
    page = rows[:limit]
    data = [
        {
            "settlement_id": r.settlement_id,
            "request_id": r.request_id,
            "attempt_id": r.attempt_id,
            "workspace": r.workspace,
            "key_id": r.key_id,
            "endpoint": r.endpoint,
            "model": r.model,
            "cause": r.cause,
            "held_usd": money_str(r.held_usd),
            "state": r.state,
            "settled_usd": None if r.settled_usd is None else money_str(r.settled_usd),
            "opened_at": r.opened_at.isoformat(),
            "settled_at": r.settled_at.isoformat() if r.settled_at else None,
        }
        for r in page
    ]
    next_after = (page[-1].opened_at, page[-1].settlement_id) if len(rows) > limit else None
    return SettlementPage(data, next_after)
