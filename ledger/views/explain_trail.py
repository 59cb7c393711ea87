"""The fold of a request's recorded events into its trail: what the explanation is built from.

:func:`gather_trail` orders a request's events and folds each into a :class:`Trail`: its
route evaluations, its attempts with their outcome and failover decision, each attempt's
money as the budget events tell it, and how the request ended. No wording lives here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Final

from ledger import events as ev
from ledger.store import RecordedEvent

__all__ = ["ZERO", "Attempt", "NotARequestTrail", "Trail", "gather_trail"]

ZERO: Final = Decimal(0)


class NotARequestTrail(ValueError):
    """The events do not begin with a ``RequestReceived``: there is no request to explain."""


@dataclass
class _Money:
    """One attempt's reservation, as the budget events tell it."""

    reservation_id: str | None = None
    reserved: Decimal | None = None
    settled: Decimal = ZERO
    released: Decimal = ZERO
    held_unknown: Decimal = ZERO
    overrun: Decimal = ZERO  # settled beyond the reservation
    outcome: str | None = None  # held | settled | released | held_unknown | unknown_settled


@dataclass
class Attempt:
    started: ev.AttemptStarted
    finished: ev.AttemptFinished | None = None
    decided: ev.FailoverDecided | None = None

    @property
    def name(self) -> str:
        return f"{self.started.endpoint}/{self.started.model}"

    @property
    def status(self) -> str:
        return "in_progress" if self.finished is None else self.finished.status


@dataclass
class Trail:
    received: ev.RequestReceived
    steps: list[tuple[RecordedEvent, ev.Event]] = field(default_factory=list)
    evaluations: list[ev.RouteEvaluated] = field(default_factory=list)
    attempts: dict[str, Attempt] = field(default_factory=dict)
    money: dict[str, _Money] = field(default_factory=dict)
    denials: list[ev.BudgetReservationDenied] = field(default_factory=list)
    end: ev.RequestCompleted | ev.RequestFailed | None = None
    ended_at: datetime | None = None

    @property
    def status(self) -> str:
        match self.end:
            case ev.RequestCompleted():
                return "succeeded"
            case ev.RequestFailed(stream_started=True):
                return "partial_failure"
            case ev.RequestFailed():
                return "failed"
        return "in_progress"

    @property
    def budgeted(self) -> bool:
        return bool(self.money) or bool(self.denials)

    def number(self, attempt_id: str) -> str:
        attempt = self.attempts.get(attempt_id)
        return f"attempt {attempt.started.attempt_number}" if attempt else f"attempt {attempt_id}"


def gather_trail(events: Sequence[RecordedEvent]) -> Trail:
    ordered = sorted(events, key=lambda r: r.position)
    if not ordered or ordered[0].type != ev.RequestReceived.type:
        raise NotARequestTrail("a request's events begin with RequestReceived")
    first = ordered[0].event()
    assert isinstance(first, ev.RequestReceived)
    trail = Trail(received=first)
    for recorded in ordered:
        event = recorded.event()
        if getattr(event, "request_id", first.request_id) != first.request_id:
            continue  # not this request's fact
        trail.steps.append((recorded, event))
        _fold(trail, recorded, event)
    return trail


def _fold(trail: Trail, recorded: RecordedEvent, event: ev.Event) -> None:
    money = trail.money
    match event:
        case ev.RouteEvaluated():
            trail.evaluations.append(event)
        case ev.AttemptStarted():
            trail.attempts[event.attempt_id] = Attempt(event)
        case ev.AttemptFinished():
            if event.attempt_id in trail.attempts:
                trail.attempts[event.attempt_id].finished = event
        case ev.FailoverDecided():
            if event.after_attempt_id in trail.attempts:
                trail.attempts[event.after_attempt_id].decided = event
        case ev.BudgetReserved():
            m = money.setdefault(event.attempt_id, _Money())
            m.reservation_id = event.reservation_id
            m.reserved = (m.reserved or ZERO) + event.amount_usd
            m.outcome = "held"
        case ev.BudgetReservationDenied():
            trail.denials.append(event)
        case ev.BudgetSettled():
            m = money.setdefault(event.attempt_id, _Money())
            m.settled += event.settled_usd
            m.released += event.released_usd
            m.outcome = "settled"
        case ev.BudgetReleased():
            m = money.setdefault(event.attempt_id, _Money())
            m.released += event.released_usd
            m.outcome = "released"
        case ev.UnknownUsageOpened():
            m = money.setdefault(event.attempt_id, _Money())
            m.held_unknown += event.held_usd
            m.outcome = "held_unknown"
        case ev.UnknownUsageSettled():
            m = money.setdefault(event.attempt_id, _Money())
            m.held_unknown -= event.held_usd
            m.settled += event.settled_usd
            m.released += event.released_usd
            m.outcome = "unknown_settled"
        case ev.BudgetOverrun():
            money.setdefault(event.attempt_id, _Money()).overrun += event.excess_usd
        case ev.RequestCompleted() | ev.RequestFailed():
            trail.end = event
            trail.ended_at = recorded.recorded_at
