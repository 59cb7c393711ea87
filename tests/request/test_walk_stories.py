"""The walk never tells a story the ledger's story rules refuse (ledger/audit/stories.py).

A simulated gateway carries out the walk's actions the way the executor does, with every
outside answer drawn by hypothesis — routes found or refused (and why), reservations lost,
attempts that answer, stream or fail (their breakers opened or not), streams that break —
and writes the events the executor records. Whatever happens, `waybill verify`'s rules hold:
each decision is followed by what it says, every attempt of an ended request is finished,
and a request completes only after an attempt that succeeded.
"""

from __future__ import annotations

import random
from typing import Any, get_args

from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.audit.stories import Stories
from ledger.events import Evidence, FailureClass
from router.config import Defaults
from router.request.classify import Classification
from router.request.moves import (
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
from router.request.walk import (
    Walk,
    WalkPolicy,
    advance,
)

TARGETS = (
    Target("east", 0, "big", 8000, "assistant_prefill"),
    Target("west", 1, "small", 16000),
    Target("north", 2, "big", 8000, "prefix_flag"),
)
# A composed group's flat targets (contract §4 "Pools"): two pools, one model in both.
POOLED = (
    Target("east", 0, "big", 8000, "assistant_prefill", "local"),
    Target("west", 1, "small", 16000, pool="cloud"),
    Target("north", 2, "big", 8000, "prefix_flag", "local"),
    Target("south", 3, "big", 8000, "assistant_prefill", "cloud"),
)
_CLASSES = (
    Classification(FailureClass.UPSTREAM_UNAVAILABLE, Evidence.UNKNOWN, "endpoint", False, "yes"),
    Classification(FailureClass.NETWORK_ERROR, Evidence.NOT_STARTED, "endpoint", False, "yes"),
    Classification(FailureClass.TIMEOUT, Evidence.UNKNOWN, "endpoint", False, "yes"),
    Classification(FailureClass.RATE_LIMITED, Evidence.NOT_STARTED, "endpoint", False, "yes", 50),
    Classification(FailureClass.POLICY_DENIED, Evidence.STARTED, None, False, "never"),
    Classification(FailureClass.NON_RETRYABLE, Evidence.NOT_STARTED, None, False, "no"),
)
_REFUSALS: tuple[Refusal, ...] = get_args(Refusal)


class _Gateway:
    """Carries out the walk's actions, drawing every outside answer, writing the story."""

    def __init__(self, draw: Any, stream: bool, policy: WalkPolicy) -> None:
        self.draw = draw
        self.stream = stream
        self.walk = Walk(policy=policy)
        self.targets = policy.siblings
        self.stories = Stories()
        self.position = 0
        self.endpoints: dict[str, str] = {}
        self.pools: dict[str, str | None] = {}
        self.running: list[str] = []
        self.committed: str | None = None
        self.hedge_armed = False
        self.ended = False
        self.attempt_ids = 0

    def record(self, event_type: str, **data: Any) -> None:
        self.position += 1
        body = {"type": event_type, "data": data}
        broken = self.stories.feed(self.position, "request-r", body)
        assert broken == [], "\n".join(map(str, broken))

    def run(self) -> None:
        self.record("RequestReceived")
        queue: list[Happening] = [Begin()]
        for _ in range(60):
            if self.ended:
                return
            if not queue:
                queue.append(self.next_happening())
            step = advance(self.walk, queue.pop(0), random.Random(1))
            self.walk = step.walk
            for action in step.actions:
                queue += self.act(action)
        # A walk that never ended in 60 steps is fine for the rules; nothing more to check.

    def act(self, action: Any) -> list[Happening]:
        draw = self.draw
        match action:
            case Route(purpose=purpose, context=context, only=only):
                if only is not None:
                    if draw(st.booleans()):
                        return [Routed(draw(st.sampled_from(only)))]
                    return [Unroutable(draw(st.sampled_from(_REFUSALS)))]
                left = [
                    t
                    for t in self.targets
                    if t.endpoint not in context.tried_endpoints
                    and t.model not in context.excluded_models
                ]
                if purpose == "hedge":
                    left = [t for t in left if t.endpoint not in self.running_endpoints()]
                    # A hedge is delegated to the running attempt's pool (routing.py).
                    pools = {self.pools[a] for a in self.running}
                    left = [t for t in left if t.pool in pools]
                if not left or draw(st.integers(0, 4)) == 0:  # none left, or none fits
                    return [Unroutable()]
                return [Routed(draw(st.sampled_from(left)))]
            case Start(target=target, cause=cause, kind=kind, hedge_of=hedge_of):
                if draw(st.integers(0, 5)) == 0:
                    return [BudgetRaced()]
                self.attempt_ids += 1
                attempt_id = f"a{self.attempt_ids}"
                self.endpoints[attempt_id] = target.endpoint
                self.pools[attempt_id] = target.pool
                self.record(
                    "AttemptStarted",
                    attempt_id=attempt_id,
                    endpoint=target.endpoint,
                    cause=cause,
                    kind=kind,
                    pool=target.pool,
                    hedge_of=hedge_of,
                    resumed_from=action.resumed_from,
                )
                return [Started(attempt_id, target, kind)]
            case Run(attempt_id=attempt_id):
                self.running.append(attempt_id)
            case ArmHedge():
                self.hedge_armed = True
            case Wait():
                pass
            case Decided(attempt_id=attempt_id, decision=decision):
                self.record(
                    "FailoverDecided",
                    after_attempt_id=attempt_id,
                    action=decision.action,
                    reason=decision.reason,
                )
            case Cancel(attempt_id=attempt_id):
                self.finish(attempt_id, "failed")
            case Commit(attempt_id=attempt_id):
                self.committed = attempt_id
            case Deliver(attempt_id=attempt_id):
                if not self.stream:
                    self.finish(attempt_id, "succeeded")
                    self.record("RequestCompleted")
                    self.ended = True
                else:
                    self.committed = attempt_id
            case Fail():
                for attempt_id in list(self.running):
                    self.finish(attempt_id, "failed")
                self.record("RequestFailed", error_code="upstream_error")
                self.ended = True
        return []

    def running_endpoints(self) -> set[str]:
        return {self.endpoints[a] for a in self.running}

    def finish(self, attempt_id: str, status: str) -> None:
        if attempt_id in self.running:
            self.running.remove(attempt_id)
        self.record("AttemptFinished", attempt_id=attempt_id, status=status)

    def next_happening(self) -> Happening:
        draw = self.draw
        if self.committed is not None and self.committed in self.running:
            attempt_id = self.committed
            if draw(st.booleans()):  # the stream ends well: recorded, and the walk is done
                self.finish(attempt_id, "succeeded")
                self.record("RequestCompleted")
                self.ended = True
                return HedgeDue()
            return self.failed(attempt_id, delivered=draw(st.integers(0, 50)))
        if self.hedge_armed and draw(st.booleans()):
            self.hedge_armed = False
            return HedgeDue()
        if not self.running:
            return HedgeDue()
        attempt_id = draw(st.sampled_from(self.running))
        if draw(st.booleans()):
            return Content(attempt_id) if self.stream else Answered(attempt_id)
        return self.failed(attempt_id)

    def failed(self, attempt_id: str, delivered: int = 0) -> Failed:
        draw = self.draw
        self.finish(attempt_id, "failed")
        return Failed(
            attempt_id,
            draw(st.sampled_from(_CLASSES)),
            remaining_ms=draw(st.sampled_from([0, 30_000])),
            delivered_chars=delivered,
            resumable=draw(st.booleans()),
            breaker_opened=draw(st.sampled_from([None, None, "endpoint", "mapping"])),
        )


@settings(max_examples=300, deadline=None)
@given(
    st.data(),
    st.booleans(),
    st.booleans(),
    st.sampled_from([None, 200]),
    st.sampled_from(["failover", "stop"]),
    st.sampled_from([TARGETS, POOLED]),
)
def test_every_walk_tells_a_story_the_ledgers_rules_accept(
    data: st.DataObject,
    stream: bool,
    allow_failover: bool,
    hedge: int | None,
    unknown: str,
    targets: tuple[Target, ...],
) -> None:
    """Pooled too: a composed group's retries, hedges and resumes stay in their pool."""
    policy = WalkPolicy(
        defaults=Defaults(max_attempts=4, on_unknown_execution=unknown),
        allow_failover=allow_failover,
        hedge_after_ms=hedge,
        max_ways=2 if hedge else 1,
        siblings=targets,
    )
    _Gateway(data.draw, stream, policy).run()
