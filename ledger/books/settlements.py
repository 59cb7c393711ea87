"""Settling unknown usage (contract §6): an operator's or a reconciliation's word on what an
attempt of unknown usage really cost. The hold is resolved exactly once."""

from __future__ import annotations

from decimal import Decimal

import orjson

from ledger import events as ev
from ledger.books.accounting import (
    HoldStateError,
    SettleUnknown,
    overrun_event,
    reservation_of_settlement,
    settlement_refusal,
)
from ledger.books.balances import holds
from ledger.finance.periods import adjustment_for, period_of, period_stream
from ledger.store import ANY_VERSION, NO_STREAM, EventStore, WrongExpectedVersion
from ledger.store.schema import budget_holds

__all__ = ["SettlementError", "SettlementRefused", "settle_unknown"]


class SettlementError(LookupError):
    """No open unknown-usage settlement by that id."""


class SettlementRefused(ValueError):
    """An amount the books refuse to settle (absurd without ``force``, or no amount)."""


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
    force: bool = False,
    bucket: str | None = None,
) -> tuple[ev.UnknownUsageSettled, ev.BudgetOverrun | None]:
    """Settle an open unknown-usage settlement at ``cost_usd``, the amount given: above
    the hold it is an overrun, recorded with it; far above it (``settlement_refusal``) it
    is refused unless ``force``. ``bucket``: the provider report's bucket it was settled
    from. Returns the settlement and its overrun, if any."""
    reservation_id = _reservation_id(settlement_id)
    async with store.engine.connect() as conn:
        hold = (
            await conn.execute(holds().where(budget_holds.c.reservation_id == reservation_id))
        ).first()
    if hold is None or hold.state != "unknown":
        raise SettlementError(f"no open unknown-usage settlement {settlement_id}")
    refusal = settlement_refusal(hold.amount_usd, cost_usd, force=force)
    if refusal is not None:
        raise SettlementRefused(refusal)
    from_reconciliation = source == "reconciliation"
    settled = ev.UnknownUsageSettled(
        settlement_id=settlement_id,
        request_id=hold.request_id,
        attempt_id=hold.attempt_id,
        reservation_id=reservation_id,
        held_usd=hold.amount_usd,
        settled_usd=cost_usd,
        released_usd=max(Decimal(0), hold.amount_usd - cost_usd),
        source="reconciliation" if from_reconciliation else "operator",
        actor=actor,
        reason=reason,
        reconciliation_id=reconciliation_id,
        usage=usage,
        bucket=bucket,
    )
    overrun = overrun_event(
        request_id=hold.request_id,
        attempt_id=hold.attempt_id,
        reservation_id=reservation_id,
        accounts=orjson.loads(hold.accounts),
        held=hold.amount_usd,
        actual=cost_usd,
        cause="reconciliation" if from_reconciliation else "operator_settlement",
    )
    # Its period closed, the settlement changes a closed month: it is recorded with an
    # adjustment in the period open now (contract §6), the closed totals left as they were.
    # While the period is open, the append requires its stream still absent: a close that
    # commits first refuses it, and it is decided again, as an adjustment.
    period = period_stream(period_of(hold.created_at))
    for _ in range(2):
        adjusted = await adjustment_for(
            store,
            reserved_at=hold.created_at,
            request_id=hold.request_id,
            attempt_id=hold.attempt_id,
            reservation_id=reservation_id,
            workspace=hold.workspace,
            cause="reconciliation" if from_reconciliation else "operator_settlement",
            settled_usd=cost_usd,
            held_unknown_usd=-hold.amount_usd,
            overrun_usd=overrun.excess_usd if overrun is not None else Decimal(0),
        )
        appended: list[ev.Event] = [settled] if overrun is None else [settled, overrun]
        if adjusted is not None:
            appended.append(adjusted)
        requires = None if adjusted is not None else {period: NO_STREAM}
        try:
            await store.append(
                f"request-{hold.request_id}",
                ANY_VERSION,
                appended,
                effects=[SettleUnknown(reservation_id, cost_usd)],
                requires=requires,
            )
        except HoldStateError:  # settled by someone else since we looked
            raise SettlementError(f"no open unknown-usage settlement {settlement_id}") from None
        except WrongExpectedVersion as moved:
            if requires is None or moved.stream_id != period:
                raise
            continue  # the period closed meanwhile: settle again, with its adjustment
        return settled, overrun
    raise SettlementError(f"{settlement_id}: its period kept changing; try again")
