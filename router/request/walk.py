"""The request's walk as a pure state machine (contract §4, §5).

A request goes route → reserve and start → run → (wait / retry / fail over / resume /
hedge) → finish. This module decides every one of those moves and does none of them: the
executor (:mod:`router.request.executor`) tells :func:`advance` what happened — a route was
found or not, an attempt started, produced content, answered or failed, a hedge's delay
ran out — and executes the actions it gets back, in order, recording each fact on the
ledger as it goes. The walk reads no clock (the executor passes the deadline left with each
failure), does no I/O, and draws randomness only from the ``random.Random`` it is given, so
every path is unit-tested without a server (tests/request/test_walk.py).

State is a frozen :class:`Walk`; a step returns the next ``Walk`` and its actions (the
happenings and actions themselves are :mod:`router.request.moves`, re-exported here). What is
decided after a failure is :func:`router.request.decision.decide` (retry, fail over or stop), plus
what only the walk can know: that a committed stream may be resumed on the same upstream
model, and that a failed way of a hedged request leaves the request to the other way.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Final, Literal

from ledger.support.frozen import direct_init, evolve
from router.config import Defaults
from router.request.decision import AttemptOutcome, Decision, decide, next_context
from router.request.moves import (
    Action,
    Answered,
    ArmHedge,
    Begin,
    BudgetRaced,
    Cancel,
    Commit,
    Content,
    Decided,
    Deliver,
    Fail,
    Failed,
    Happening,
    HedgeDue,
    Kind,
    Purpose,
    Refusal,
    Route,
    Routed,
    Run,
    Start,
    Started,
    Target,
    Unroutable,
    Wait,
)
from router.request.selection import RouteContext

__all__ = [
    "MAX_BUDGET_RACES",
    "Step",
    "Walk",
    "WalkPolicy",
    "advance",
]

MAX_BUDGET_RACES: Final = 5  # reservations lost to concurrent requests before giving up
# Stops that forbid moving to another endpoint, not going on: a broken stream may still be
# resumed on its own mapping.
_MOVE_FORBIDDEN: Final = ("failover_forbidden_by_header", "failover_not_granted")
_FIRST_CONTEXT: Final = RouteContext()  # frozen: every walk begins with the same one


@direct_init
@dataclass(frozen=True, slots=True)
class WalkPolicy:
    """What is fixed for the whole request: the group's effective policy and the caller's
    narrowing of it."""

    defaults: Defaults
    allow_failover: bool = True
    # allow_failover is False only because the group's `failover: on_grant` got no grant.
    failover_not_granted: bool = False
    allow_unknown_execution: bool = False
    server_side_effects: bool = False
    hedge_after_ms: int | None = None  # None: this request is never hedged
    max_ways: int = 1
    siblings: tuple[Target, ...] = ()  # every mapping of the group (for resume targets)
    # A composed group's pools keep their own hedging (contract §4 "Pools"): each pool's
    # (name, hedge_after_ms, max_ways), for the attempts that run in it.
    pool_hedging: tuple[tuple[str, int | None, int], ...] = ()

    def hedging(self, pool: str | None) -> tuple[int | None, int]:
        """The hedge delay and ways of an attempt in ``pool`` (None: the group's own)."""
        for name, after_ms, ways in self.pool_hedging:
            if name == pool:
                return after_ms, ways
        return self.hedge_after_ms, self.max_ways


@direct_init
@dataclass(frozen=True, slots=True)
class _Way:
    attempt_id: str
    target: Target
    kind: Kind


@direct_init
@dataclass(frozen=True, slots=True)
class _Resume:
    attempt_id: str
    target: Target  # the broken attempt's mapping
    delivered_chars: int
    own_blocked: bool = False  # its own outcome opened a breaker of that mapping


@direct_init
@dataclass(frozen=True, slots=True)
class Walk:
    """Everything the walk has learnt so far."""

    policy: WalkPolicy
    attempts: int = 0
    retries: tuple[tuple[str, int], ...] = ()  # endpoint → same-endpoint retries made
    context: RouteContext = _FIRST_CONTEXT
    budget_races: int = 0
    running: tuple[_Way, ...] = ()  # started and not yet finished (two while hedged)
    winner: str | None = None  # the attempt whose content reached the client first
    committed: bool = False  # a stream's first event went to the client: the model is fixed
    hedges: int = 0
    hedge_armed: bool = False
    routing: Purpose | None = None  # what the route being looked for is for
    starting: Purpose | None = None  # what the attempt being started is for
    resume_of: _Resume | None = None  # the broken attempt a resume continues
    retry_of: _Way | None = None  # the failed attempt a retry being routed or started follows
    ended: bool = False

    def retries_on(self, endpoint: str) -> int:
        return dict(self.retries).get(endpoint, 0)

    def way(self, attempt_id: str) -> _Way | None:
        return next((w for w in self.running if w.attempt_id == attempt_id), None)


@direct_init
@dataclass(frozen=True, slots=True)
class Step:
    walk: Walk
    actions: tuple[Action, ...]


# --- the walk ------------------------------------------------------------------------------


def advance(walk: Walk, happening: Happening, rng: random.Random) -> Step:
    """The next state of ``walk`` after ``happening``, and what to do about it."""
    if walk.ended:
        raise ValueError(f"the walk has ended; {happening!r} came after")
    match happening:
        case Begin():
            return _route(walk, "first")
        case Routed(target=target):
            return _start(walk, target)
        case Unroutable(refused=refused):
            return _unroutable(walk, refused)
        case BudgetRaced():
            return _budget_raced(walk)
        case Started():
            return _started(walk, happening)
        case Content(attempt_id=attempt_id):
            return _content(walk, attempt_id)
        case Answered(attempt_id=attempt_id):
            return _answered(walk, attempt_id)
        case Failed():
            return _failed(walk, happening, rng)
        case HedgeDue():
            return _hedge_due(walk)
    raise TypeError(f"not a happening: {happening!r}")


def _route(walk: Walk, purpose: Purpose, only: tuple[Target, ...] | None = None) -> Step:
    walk = evolve(walk, routing=purpose)
    return Step(walk, (Route(purpose, walk.context, only),))


def _start(walk: Walk, target: Target) -> Step:
    purpose = walk.routing
    if purpose is None:
        raise ValueError("a route came that nobody asked for")
    walk = evolve(walk, routing=None, starting=purpose)
    match purpose:
        case "first":
            # A start lost to a budget race is routed again: a failover if one was made.
            return Step(walk, (Start(target, "failover" if walk.attempts else "first"),))
        case "hedge":
            first = walk.running[0].attempt_id if walk.running else None
            return Step(walk, (Start(target, "hedge", "hedge", hedge_of=first),))
        case "resume":
            resume = walk.resume_of
            assert resume is not None, "a resume is routed only after a broken stream"
            cause: Literal["retry", "failover"] = (
                "retry" if target.endpoint == resume.target.endpoint else "failover"
            )
            start = Start(
                target,
                cause,
                "resume",
                resumed_from=resume.attempt_id,
                delivered_chars=resume.delivered_chars,
            )
            return Step(walk, (start,))
        case "retry" | "failover":
            return Step(walk, (Start(target, purpose),))


def _unroutable(walk: Walk, refused: Refusal) -> Step:
    purpose = walk.routing
    walk = evolve(walk, routing=None)
    if purpose == "hedge" or (purpose != "resume" and walk.running):
        return Step(walk, ())  # the ways already running carry the request
    if purpose == "retry":
        # The retry's target refused it (say, another request took its breaker's probe): the
        # plan changes, and the record says so before the next step.
        return _retry_refused(walk, refused)
    if purpose == "resume" and walk.resume_of is not None:
        stop = Decision("stop", f"resume_refused_{refused}")
        after = walk.resume_of.attempt_id
        return _end(walk, Decided(after, stop), Fail("decision", after, stop))
    return _end(walk, Fail("no_route"))


def _retry_refused(walk: Walk, refused: Refusal) -> Step:
    """A planned retry cannot start: fail over, evaluating the whole group again with that
    target counted as refused, or stop where the caller forbade moving."""
    way = walk.retry_of
    assert way is not None, "a retry follows a failed attempt"
    after = way.attempt_id
    reason = f"retry_refused_{refused}"
    if not walk.policy.allow_failover:
        walk = evolve(walk, retry_of=None)
        stop = Decision("stop", reason)
        return _end(walk, Decided(after, stop), Fail("decision", after, stop))
    # A failover from that endpoint, as any other: it is never entered again.
    tried = walk.context.tried_endpoints | {way.target.endpoint}
    context = evolve(walk.context, tried_endpoints=tried)
    step = _route(evolve(walk, retry_of=None, context=context), "failover")
    return Step(step.walk, (Decided(after, Decision("failover", reason)), *step.actions))


def _budget_raced(walk: Walk) -> Step:
    purpose = walk.starting
    walk = evolve(walk, starting=None, budget_races=walk.budget_races + 1)
    if purpose == "hedge":
        return Step(walk, ())  # no hedge: the first way goes on alone
    if walk.budget_races > MAX_BUDGET_RACES:
        return _end(walk, Fail("budget_raced")) if not walk.running else Step(walk, ())
    if purpose == "resume":
        return _route(walk, "resume", _resume_targets(walk))
    if purpose == "retry":
        return _retry_refused(walk, "over_budget")
    return _route(walk, "failover" if walk.attempts else "first")


def _started(walk: Walk, started: Started) -> Step:
    way = _Way(started.attempt_id, started.target, started.kind)
    walk = evolve(
        walk,
        attempts=walk.attempts + 1,
        starting=None,
        retry_of=None,
        running=(*walk.running, way),
    )
    actions: list[Action] = [Run(started.attempt_id)]
    after, ways = walk.policy.hedging(started.target.pool)
    if (
        after is not None
        and started.kind != "resume"
        and not walk.committed
        and len(walk.running) < ways
        and _may_hedge(walk.policy)
    ):
        actions.append(ArmHedge(after))
    return Step(walk, tuple(actions))


def _may_hedge(policy: WalkPolicy) -> bool:
    # A second way is always on another endpoint, so a caller who forbade moving
    # (X-Waybill-Allow-Failover: false, a pinned endpoint) gets none. Without a grant that
    # `failover: on_grant` asks for, the hedge's evaluation is still made and recorded.
    return policy.allow_failover or policy.failover_not_granted


def _hedge_due(walk: Walk) -> Step:
    policy = walk.policy
    if (
        walk.committed
        or walk.winner is not None
        or not walk.running
        or walk.routing is not None
        or walk.starting is not None
        or len(walk.running) >= policy.hedging(walk.running[0].target.pool)[1]
        or walk.attempts >= policy.defaults.max_attempts
        or not _may_hedge(policy)
    ):
        return Step(walk, ())
    # The way the router would fail over to next: every running endpoint counted as left.
    # Where moving needs a grant the request lacks (`failover: on_grant`), no other endpoint
    # may carry it: the evaluation is still made, and records each one excluded for that.
    running = frozenset(w.target.endpoint for w in walk.running)
    context = evolve(
        walk.context,
        tried_endpoints=walk.context.tried_endpoints | running,
        failover_not_granted=policy.failover_not_granted,
    )
    walk = evolve(walk, routing="hedge", hedges=walk.hedges + 1)
    return Step(walk, (Route("hedge", context),))


def _content(walk: Walk, attempt_id: str) -> Step:
    if walk.way(attempt_id) is None or (walk.winner is not None and not walk.committed):
        return Step(walk, ())  # a way already cancelled
    if walk.committed:
        # A resume's continuation: the client already has the stream's beginning.
        return Step(evolve(walk, winner=attempt_id), (Deliver(attempt_id),))
    losers = tuple(Cancel(w.attempt_id) for w in walk.running if w.attempt_id != attempt_id)
    walk = evolve(
        walk,
        winner=attempt_id,
        committed=True,
        running=tuple(w for w in walk.running if w.attempt_id == attempt_id),
    )
    return Step(walk, (*losers, Commit(attempt_id)))


def _answered(walk: Walk, attempt_id: str) -> Step:
    if walk.way(attempt_id) is None:
        return Step(walk, ())
    losers = tuple(Cancel(w.attempt_id) for w in walk.running if w.attempt_id != attempt_id)
    # The request's end: one copy of the walk, not two (every buffered answer comes here).
    walk = evolve(walk, winner=attempt_id, running=(), ended=True)
    return Step(walk, (*losers, Deliver(attempt_id)))


def _failed(walk: Walk, failed: Failed, rng: random.Random) -> Step:
    way = walk.way(failed.attempt_id)
    if way is None:
        return Step(walk, ())  # a cancelled loser's end
    walk = evolve(
        walk,
        running=tuple(w for w in walk.running if w is not way),
        winner=None if walk.winner == way.attempt_id else walk.winner,
    )
    c = failed.classification
    if walk.running and not walk.committed:
        # A hedged request: the other way carries it on (as a failover would have).
        context = next_context(walk.context, "failover", way.target, c.failure_class)
        walk = evolve(walk, context=context)
        return Step(walk, (Decided(way.attempt_id, Decision("failover", "other_way_running")),))
    decision = decide(_outcome(walk, way, failed), walk.policy.defaults, rng)
    if walk.committed:
        return _after_broken_stream(walk, way, failed, decision)
    if decision.action == "stop":
        decided = Decided(way.attempt_id, decision)
        return _end(walk, decided, Fail("decision", way.attempt_id, decision))
    endpoint = way.target.endpoint
    walk = evolve(
        walk,
        context=next_context(walk.context, decision.action, way.target, c.failure_class),
    )
    if decision.action == "failover":
        step = _route(walk, "failover")
        return Step(step.walk, (Decided(way.attempt_id, decision), *step.actions))
    retries = dict(walk.retries)
    retries[endpoint] = retries.get(endpoint, 0) + 1
    walk = evolve(walk, retries=tuple(sorted(retries.items())), retry_of=way)
    step = _route(walk, "retry", (way.target,))
    wait = (Wait(decision.backoff_ms),) if decision.backoff_ms else ()
    return Step(step.walk, (Decided(way.attempt_id, decision), *wait, *step.actions))


def _outcome(walk: Walk, way: _Way, failed: Failed) -> AttemptOutcome:
    policy = walk.policy
    return AttemptOutcome(
        classification=failed.classification,
        attempts_made=walk.attempts,
        retries_on_endpoint=walk.retries_on(way.target.endpoint),
        remaining_ms=failed.remaining_ms,
        allow_failover=policy.allow_failover,
        failover_not_granted=policy.failover_not_granted,
        allow_unknown_execution=policy.allow_unknown_execution,
        server_side_effects=policy.server_side_effects,
        breaker_opened=failed.breaker_opened,
    )


def _after_broken_stream(walk: Walk, way: _Way, failed: Failed, decision: Decision) -> Step:
    """A committed stream broke: resume it on the same upstream model, or end it."""
    stop = Decision("stop", "stream_committed")
    if decision.action == "stop" and decision.reason not in _MOVE_FORBIDDEN:
        stop = decision  # the request's limits (deadline, attempts, strictness) hold
    elif failed.resumable and failed.delivered_chars > 0:
        walk = evolve(
            walk,
            resume_of=_Resume(
                way.attempt_id,
                way.target,
                failed.delivered_chars,
                own_blocked=failed.breaker_opened is not None,
            ),
        )
        targets = _resume_targets(walk)
        if targets:
            step = _route(walk, "resume", targets)
            resume = Decision("resume", "resume_same_model")
            return Step(step.walk, (Decided(way.attempt_id, resume), *step.actions))
        if failed.breaker_opened is not None:
            # The broken attempt's own breaker refuses its resume, and no sibling can: say so.
            stop = Decision("stop", f"{failed.breaker_opened}_breaker_opened")
    return _end(walk, Decided(way.attempt_id, stop), Fail("decision", way.attempt_id, stop))


def _resume_targets(walk: Walk) -> tuple[Target, ...]:
    """The mappings that can continue the broken stream: its own, if it can resume, then
    every other mapping of the same upstream model that can (unless the caller forbade
    moving to another endpoint). Never one without the capability."""
    resume = walk.resume_of
    assert resume is not None
    policy = walk.policy
    broken = resume.target
    own = (broken,) if broken.resume != "none" and not resume.own_blocked else ()
    others = tuple(
        t
        for t in policy.siblings
        if t.model == broken.model
        and t.pool == broken.pool  # a pool's resumes stay in its scope (contract §4 "Pools")
        and t.resume != "none"
        and t.endpoint != broken.endpoint
        and policy.allow_failover
    )
    return own + others


def _end(walk: Walk, *actions: Action) -> Step:
    return Step(evolve(walk, ended=True), actions)
