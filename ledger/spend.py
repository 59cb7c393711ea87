"""Spend and unknown-usage queries over the spend read models (``ledger.views.spend``).

Totals are summed in exact decimals in Python, the same way on both backends (SQLite keeps
money as text, so its SQL ``SUM`` would be a float): they add up to the settled events.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date, datetime
from decimal import Decimal
from typing import Any, Final

from sqlalchemy import and_, or_, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ledger import events as ev
from ledger.schema import appends, budget_accounts, spend_attempts, unknown_settlements
from ledger.store import decode_row
from ledger.stored import holding, previous_hash
from ledger.types import money_str

__all__ = [
    "ADJUSTMENT_COLUMNS",
    "GROUP_KEYS",
    "SettlementPage",
    "SpendScope",
    "budget_balances",
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
    query = select(spend_attempts)
    if scope.workspace is not None:
        query = query.where(spend_attempts.c.workspace == scope.workspace)
    if scope.key_id is not None:
        query = query.where(spend_attempts.c.key_id == scope.key_id)
    if since is not None:
        query = query.where(spend_attempts.c.day >= since.isoformat())
    if until is not None:
        query = query.where(spend_attempts.c.day <= until.isoformat())
    totals: dict[tuple[str, ...], dict[str, Any]] = {}
    async with engine.connect() as conn:
        adjusted = await _adjustments(conn)
        result = await conn.stream(query)
        async for row in result:
            group = tuple(str(getattr(row, GROUP_KEYS[k])) for k in group_by)
            entry = totals.get(group)
            if entry is None:
                entry = totals[group] = {
                    "settled": Decimal(0),
                    "held": Decimal(0),
                    "overrun": Decimal(0),
                    "requests": set(),
                    "attempts": 0,
                    "adjustment": [Decimal(0)] * 3,
                }
            adjustment = adjusted.get(row.reservation_id, _NO_ADJUSTMENT)
            entry["settled"] += row.settled_usd - adjustment[0]
            entry["held"] += row.held_unknown_usd - adjustment[1]
            entry["overrun"] += row.overrun_usd - adjustment[2]
            entry["adjustment"] = [
                a + b for a, b in zip(entry["adjustment"], adjustment, strict=True)
            ]
            entry["requests"].add(row.request_id)
            entry["attempts"] += 1
    return [
        {
            **dict(zip(group_by, group, strict=True)),
            "settled_usd": money_str(entry["settled"]),
            "held_unknown_usd": money_str(entry["held"]),
            "overrun_usd": money_str(entry["overrun"]),
            "requests": len(entry["requests"]),
            "attempts": entry["attempts"],
            **{
                column: money_str(amount)
                for column, amount in zip(ADJUSTMENT_COLUMNS, entry["adjustment"], strict=True)
            },
        }
        for group, entry in sorted(totals.items())
    ]


ADJUSTMENT_COLUMNS: Final = (
    "adjustment_settled_usd",
    "adjustment_held_unknown_usd",
    "adjustment_overrun_usd",
)
_NO_ADJUSTMENT: Final = (Decimal(0), Decimal(0), Decimal(0))


async def _adjustments(conn: AsyncConnection) -> dict[str, tuple[Decimal, Decimal, Decimal]]:
    """What ``PeriodAdjusted`` events moved each closed-period attempt by, by reservation."""
    a = appends.c
    query = select(a.position, previous_hash(), a.payloads).where(holding(ev.PeriodAdjusted.type))
    adjustments = [
        recorded.event()
        for row in (await conn.execute(query)).all()
        for recorded in decode_row(row.position, row.previous, row.payloads)
        if recorded.type == ev.PeriodAdjusted.type
    ]
    found: dict[str, tuple[Decimal, Decimal, Decimal]] = {}
    for event in adjustments:
        assert isinstance(event, ev.PeriodAdjusted)
        settled, held, overrun = found.get(event.reservation_id, _NO_ADJUSTMENT)
        found[event.reservation_id] = (
            settled + event.settled_usd,
            held + event.held_unknown_usd,
            overrun + event.overrun_usd,
        )
    return found


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


async def budget_balances(
    engine: AsyncEngine, *, scope: SpendScope, kinds: Sequence[str] = ("key", "workspace")
) -> list[dict[str, Any]]:
    """Live account balances (the books themselves, not a projection), newest window first."""
    table = budget_accounts
    query = select(table).where(table.c.kind.in_(list(kinds)))
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
