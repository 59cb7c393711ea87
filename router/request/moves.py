"""What the walk hears and what it asks (contract §4, §5): the happenings the executor tells
:func:`router.request.walk.advance` — a route found or refused, an attempt started, its content,
answer or failure, a hedge's delay run out — and the actions it gets back, in order. Plain
frozen values, no behaviour: the walk decides, the executor carries out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeAlias

from ledger.support.frozen import direct_init
from router.config import ResumeMode
from router.request.classify import Classification
from router.request.decision import Decision
from router.request.selection import RouteContext

__all__ = [
    "Action",
    "Answered",
    "ArmHedge",
    "Begin",
    "BudgetRaced",
    "Cancel",
    "Commit",
    "Content",
    "Decided",
    "Deliver",
    "Fail",
    "Failed",
    "Happening",
    "HedgeDue",
    "Kind",
    "Purpose",
    "Refusal",
    "Route",
    "Routed",
    "Run",
    "Start",
    "Started",
    "Target",
    "Unroutable",
    "Wait",
]


Kind: TypeAlias = Literal["call", "resume", "hedge"]
Refusal: TypeAlias = Literal[
    "breaker_open", "saturated", "credentials_disabled", "over_budget", "unavailable"
]  # decision.REFUSALS
Purpose: TypeAlias = Literal["first", "retry", "failover", "resume", "hedge"]


@dataclass(frozen=True, slots=True)
class Target:
    """A mapping an attempt may run on: what the walk needs to know of it."""

    endpoint: str
    mapping_index: int
    model: str  # the upstream model
    context_window: int
    resume: ResumeMode = "none"
    # The pool of a composed group it lies in (contract §4 "Pools"): a retry, a hedge or a
    # resume of an attempt there stays inside it. None: the requested group's own mapping.
    pool: str | None = None


# --- what happened ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Begin:
    """The request was received."""


@direct_init
@dataclass(frozen=True, slots=True)
class Routed:
    """A route was found (and its breakers admitted it) for the walk's current purpose."""

    target: Target


@direct_init
@dataclass(frozen=True, slots=True)
class Unroutable:
    """No candidate is eligible for the walk's current purpose (for a retry or a resume,
    ``refused`` says why its target refused it)."""

    refused: Refusal = "unavailable"


@dataclass(frozen=True, slots=True)
class BudgetRaced:
    """The start's reservation was refused: another request took the budget first."""


@direct_init
@dataclass(frozen=True, slots=True)
class Started:
    """An attempt's start (and its reservation) is on the ledger."""

    attempt_id: str
    target: Target
    kind: Kind = "call"


@direct_init
@dataclass(frozen=True, slots=True)
class Content:
    """A stream's attempt produced its first content (before anything reached the client)."""

    attempt_id: str


@direct_init
@dataclass(frozen=True, slots=True)
class Answered:
    """An attempt finished with an answer (a buffered answer, or a stream's end)."""

    attempt_id: str


@direct_init
@dataclass(frozen=True, slots=True)
class Failed:
    """An attempt failed (its end and its hold's outcome are being recorded)."""

    attempt_id: str
    classification: Classification
    remaining_ms: int  # of the whole-request deadline
    delivered_chars: int = 0  # text of this request's stream the client already has
    resumable: bool = False  # what was delivered is text a continuation can follow
    # The breaker of its endpoint or mapping that this attempt's own outcome opened (or
    # re-opened): the walk does not plan a retry or a resume the breaker would refuse.
    breaker_opened: Literal["endpoint", "mapping"] | None = None


@dataclass(frozen=True, slots=True)
class HedgeDue:
    """The hedge delay ran out."""


Happening: TypeAlias = (
    Begin | Routed | Unroutable | BudgetRaced | Started | Content | Answered | Failed | HedgeDue
)


# --- what to do ----------------------------------------------------------------------------


@direct_init
@dataclass(frozen=True, slots=True)
class Route:
    """Evaluate the group and choose a mapping (``only``: among these targets alone); the
    executor answers with :class:`Routed` or :class:`Unroutable`."""

    purpose: Purpose
    context: RouteContext
    only: tuple[Target, ...] | None = None


@direct_init
@dataclass(frozen=True, slots=True)
class Start:
    """Reserve the worst case and record the attempt's start; answered with
    :class:`Started` or :class:`BudgetRaced`."""

    target: Target
    cause: Literal["first", "retry", "failover", "hedge"]
    kind: Kind = "call"
    resumed_from: str | None = None
    delivered_chars: int | None = None
    hedge_of: str | None = None


@direct_init
@dataclass(frozen=True, slots=True)
class Run:
    """Send the started attempt upstream (in a task of its own)."""

    attempt_id: str


@direct_init
@dataclass(frozen=True, slots=True)
class ArmHedge:
    """Raise :class:`HedgeDue` after ``after_ms`` unless content arrived first."""

    after_ms: int


@direct_init
@dataclass(frozen=True, slots=True)
class Wait:
    """Back off before the next action."""

    ms: int


@direct_init
@dataclass(frozen=True, slots=True)
class Decided:
    """Record the decision taken after a failed attempt."""

    attempt_id: str
    decision: Decision


@direct_init
@dataclass(frozen=True, slots=True)
class Cancel:
    """Stop a way that lost the race; its usage is settled or held unknown."""

    attempt_id: str


@direct_init
@dataclass(frozen=True, slots=True)
class Commit:
    """Commit the stream of this attempt to the client (its first event goes out)."""

    attempt_id: str


@direct_init
@dataclass(frozen=True, slots=True)
class Deliver:
    """Give this attempt's answer (or the rest of its stream) to the client."""

    attempt_id: str


@direct_init
@dataclass(frozen=True, slots=True)
class Fail:
    """End the request with the error of ``why``."""

    why: Literal["no_route", "budget_raced", "decision"]
    attempt_id: str | None = None  # the failed attempt a decision stopped after
    decision: Decision | None = None  # that decision (recorded by the Decided before this)


Action: TypeAlias = (
    Route | Start | Run | ArmHedge | Wait | Decided | Cancel | Commit | Deliver | Fail
)
