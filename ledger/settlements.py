"""Settling unknown usage (SPEC §6): an operator's or a reconciliation's word on what an
attempt of unknown usage really cost. The hold is resolved exactly once."""

from __future__ import annotations

from decimal import Decimal

from sqlalchemy import select

from ledger import events as ev
from ledger.accounting import HoldStateError, SettleUnknown, reservation_of_settlement
from ledger.schema import budget_holds
from ledger.store import ANY_VERSION, EventStore

__all__ = ["SettlementError", "settle_unknown"]


class SettlementError(LookupError):
    """No open unknown-usage settlement by that id."""


def _reservation_id(settlement_id: str) -> str:
    reservation = reservation_of_settlement(settlement_id)
    if reservation is None:
        raise SettlementError(f"{settlement_id!r} is not a settlement id (unk_...)")
    return reservation


async def settle_unknown(
    store: EventStore,
    settlement_id: str,
    cost_usd: Decimal,
    *,
    actor: str,
    source: str = "operator",
    reason: str | None = None,
    reconciliation_id: str | None = None,
    usage: ev.Usage | None = None,
) -> ev.UnknownUsageSettled:
    """Settle an open unknown-usage settlement at ``cost_usd`` (at most what was held)."""
    if not cost_usd.is_finite() or cost_usd < 0:
        raise SettlementError("the settled amount must be a non-negative decimal")
    reservation_id = _reservation_id(settlement_id)
    async with store.engine.connect() as conn:
        hold = (
            await conn.execute(
                select(budget_holds).where(budget_holds.c.reservation_id == reservation_id)
            )
        ).first()
    if hold is None or hold.state != "unknown":
        raise SettlementError(f"no open unknown-usage settlement {settlement_id}")
    settled = min(cost_usd, hold.amount_usd)
    event = ev.UnknownUsageSettled(
        settlement_id=settlement_id,
        request_id=hold.request_id,
        attempt_id=hold.attempt_id,
        reservation_id=reservation_id,
        held_usd=hold.amount_usd,
        settled_usd=settled,
        released_usd=hold.amount_usd - settled,
        source="reconciliation" if source == "reconciliation" else "operator",
        actor=actor,
        reason=reason,
        reconciliation_id=reconciliation_id,
        usage=usage,
    )
    try:
        await store.append(
            f"request-{hold.request_id}",
            ANY_VERSION,
            [event],
            effects=[SettleUnknown(reservation_id, cost_usd)],
        )
    except HoldStateError:  # settled by someone else since we looked
        raise SettlementError(f"no open unknown-usage settlement {settlement_id}") from None
    return event
