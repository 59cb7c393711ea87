"""Spend read models (contract §3, §6): one row per attempt's hold, one per unknown-usage
settlement, folded from the budget events.

``spend_attempts`` is the fact table the spend report groups: every hold with its
dimensions (workspace, key, model group, endpoint, upstream model, door, day) and what became of
it — settled, released, or held as unknown usage. ``unknown_settlements`` lists the holds
whose usage is unknown, open until a reconciliation or an operator settles them. Both are
rebuilt from events alone, to identical rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from ledger import events as ev
from ledger.books.accounting import BOOK_EVENTS, reservation_id
from ledger.store.schema import open_spend_attempts, spend_attempts, unknown_settlements
from ledger.values import Usage
from ledger.views.page import PageEvent, fields_of, with_defaults
from ledger.views.projection import ModelWriter, Projection, fold_into

__all__ = ["SpendProjection", "fold_attempt", "fold_settlement"]

_ZERO = Decimal(0)
Row = dict[str, Any]


def fold_attempt(row: Row | None, recorded: PageEvent) -> Row | None:
    """The spend row of one hold after ``recorded``."""
    kind = recorded.type
    if kind == ev.BudgetReserved.type:
        if row is not None:
            return row
        data = fields_of(recorded)
        return {
            "reservation_id": data["reservation_id"],
            "request_id": data["request_id"],
            "attempt_id": data["attempt_id"],
            "workspace": data["workspace"] or "",
            "key_id": data["key_id"] or "",
            "model_group": data["model_group"] or "",
            "endpoint": data["endpoint"],
            "model": data["model"],
            "api": data["api"],
            "day": recorded.recorded_at.date().isoformat(),
            "state": "held",
            "reserved_usd": Decimal(data["amount_usd"]),
            "settled_usd": _ZERO,
            "held_unknown_usd": _ZERO,
            "overrun_usd": _ZERO,
            "adjustment_settled_usd": None,
            "adjustment_held_unknown_usd": None,
            "adjustment_overrun_usd": None,
            "reserved_at": recorded.recorded_at,
            "upstream_request_id": None,
            "response_id": None,
            "input_tokens": None,
            "output_tokens": None,
            "cached_input_tokens": None,
            "last_position": recorded.position,
        }
    if row is None or recorded.position <= row["last_position"]:
        return row
    row = dict(row, last_position=recorded.position)
    data = fields_of(recorded)
    match kind:
        case ev.AttemptFinished.type:
            usage = data["usage"]
            if usage is not None:
                usage = with_defaults(Usage, usage)
            row.update(
                upstream_request_id=data["upstream_request_id"],
                response_id=data["response_id"],
                input_tokens=None if usage is None else usage["input_tokens"],
                output_tokens=None if usage is None else usage["output_tokens"],
                cached_input_tokens=None if usage is None else usage["cached_input_tokens"],
            )
        case ev.BudgetSettled.type:
            row.update(state="settled", settled_usd=Decimal(data["settled_usd"]))
        case ev.BudgetReleased.type:
            row.update(state="released")
        case ev.UnknownUsageOpened.type:
            row.update(state="unknown", held_unknown_usd=Decimal(data["held_usd"]))
        case ev.UnknownUsageSettled.type:
            row.update(
                state="unknown_settled",
                held_unknown_usd=_ZERO,
                settled_usd=Decimal(data["settled_usd"]),
            )
        case ev.BudgetOverrun.type:
            row.update(overrun_usd=Decimal(data["excess_usd"]))
        case ev.PeriodAdjusted.type:
            row.update(
                adjustment_settled_usd=_plus(row["adjustment_settled_usd"], data["settled_usd"]),
                adjustment_held_unknown_usd=_plus(
                    row["adjustment_held_unknown_usd"], data["held_unknown_usd"]
                ),
                adjustment_overrun_usd=_plus(row["adjustment_overrun_usd"], data["overrun_usd"]),
            )
    return row


def _plus(adjustment: Decimal | None, delta: str) -> Decimal:
    """An adjustment column after one more delta, as recorded (None: none yet)."""
    return (adjustment or _ZERO) + Decimal(delta)


def fold_settlement(row: Row | None, recorded: PageEvent) -> Row | None:
    """The unknown-usage settlement row after ``recorded``."""
    event = recorded.event()
    if isinstance(event, ev.UnknownUsageOpened):
        if row is not None:
            return row
        return {
            "settlement_id": event.settlement_id,
            "request_id": event.request_id,
            "attempt_id": event.attempt_id,
            "reservation_id": event.reservation_id,
            "workspace": event.workspace,
            "key_id": event.key_id,
            "endpoint": event.endpoint,
            "model": event.model,
            "cause": event.cause,
            "held_usd": event.held_usd,
            "state": "open",
            "settled_usd": None,
            "opened_at": recorded.recorded_at,
            "settled_at": None,
            "last_position": recorded.position,
        }
    if row is None or recorded.position <= row["last_position"]:
        return row
    if isinstance(event, ev.UnknownUsageSettled):
        return dict(
            row,
            state="settled",
            settled_usd=event.settled_usd,
            settled_at=recorded.recorded_at,
            last_position=recorded.position,
        )
    return row


def _reservation_of(recorded: PageEvent) -> str:
    # AttemptFinished names its attempt, not its hold; the hold's id follows from it
    # (router.request.budget: one attempt, one reservation, "res_<attempt>").
    if "reservation_id" in recorded.data:
        return str(recorded.data["reservation_id"])
    return reservation_id(str(recorded.data["attempt_id"]))


def _held(row: Row) -> bool:
    # Held: the attempt is in flight (its hold not yet settled, released or unknown).
    return bool(row["state"] == "held")


class SpendProjection(Projection):
    name = "spend"
    tables = (spend_attempts, open_spend_attempts, unknown_settlements)
    event_types = BOOK_EVENTS | {ev.AttemptFinished.type, ev.PeriodAdjusted.type}

    async def apply(self, writer: ModelWriter, batch: Sequence[PageEvent]) -> None:
        await fold_into(
            writer,
            spend_attempts,
            "reservation_id",
            batch,
            fold_attempt,
            key_of=_reservation_of,
            open_table=open_spend_attempts,
            is_open=_held,
        )
        settlement_events = [
            e for e in batch if e.type in (ev.UnknownUsageOpened.type, ev.UnknownUsageSettled.type)
        ]
        if settlement_events:
            await fold_into(
                writer, unknown_settlements, "settlement_id", settlement_events, fold_settlement
            )
