"""The request's walk (router/request/walk.py), step by step, without I/O: every row of the failure
table, retries, failovers, budget races, stream resume and hedging."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from ledger.events import Evidence, FailureClass
from router.config import Defaults
from router.request.classify import RULES, Classification
from router.request.decision import Decision
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
from router.request.walk import (
    MAX_BUDGET_RACES,
    Step,
    Walk,
    WalkPolicy,
    advance,
)

PRIMARY = Target("east", 0, "big", 8000, "assistant_prefill")
FALLBACK = Target("west", 1, "small", 16000)
TWIN = Target("north", 2, "big", 8000, "prefix_flag")  # the same upstream model elsewhere
RNG = random.Random(7)


def _policy(**overrides: Any) -> WalkPolicy:
    defaults = overrides.pop("defaults", Defaults())
    return WalkPolicy(defaults=defaults, siblings=(PRIMARY, FALLBACK, TWIN), **overrides)


def _cls(
    failure_class: FailureClass,
    evidence: Evidence = Evidence.UNKNOWN,
    may_fail_over: Any = "per_on_unknown_execution",
    retry_after_ms: int | None = None,
) -> Classification:
    return Classification(
        failure_class=failure_class,
        evidence=evidence,
        breaker_scope="endpoint",
        breaker_opens_at_once=False,
        may_fail_over=may_fail_over,
        retry_after_ms=retry_after_ms,
    )


BROKEN = _cls(FailureClass.NETWORK_ERROR)


class Driver:
    """Feeds the walk and keeps its state, as the gateway does."""

    def __init__(self, policy: WalkPolicy | None = None) -> None:
        self.walk = Walk(policy=policy or _policy())

    def __call__(self, happening: Happening) -> tuple[Any, ...]:
        step: Step = advance(self.walk, happening, RNG)
        self.walk = step.walk
        return step.actions

    def started(self, attempt_id: str, target: Target = PRIMARY) -> tuple[Any, ...]:
        """Route, start and run one attempt the walk asks for; the run's actions."""
        actions = self(Routed(target))
        assert isinstance(actions[0], Start)
        return self(Started(attempt_id, target, actions[0].kind))


def _first_attempt(policy: WalkPolicy | None = None) -> Driver:
    walk = Driver(policy)
    assert walk(Begin()) == (Route("first", RouteContext()),)
    assert walk(Routed(PRIMARY)) == (Start(PRIMARY, "first"),)
    assert walk(Started("a1", PRIMARY)) == (Run("a1"),)
    return walk


# --- the happy paths ---------------------------------------------------------------------


def test_a_buffered_answer_is_delivered_and_ends_the_walk():
    walk = _first_attempt()
    assert walk(Answered("a1")) == (Deliver("a1"),)
    assert walk.walk.ended
    with pytest.raises(ValueError, match="ended"):
        walk(Answered("a1"))


def test_a_streams_first_content_commits_it():
    walk = _first_attempt()
    assert walk(Content("a1")) == (Commit("a1"),)
    assert walk.walk.committed


# --- every row of the failure table, under the default policy and the strict one -------------

# What follows each row's failure on a first attempt, under the defaults (on_unknown_execution
# failover) and under strict mode (stop): (decision action, reason).
EXPECTED: tuple[tuple[tuple[str, str], tuple[str, str]], ...] = (
    (("failover", "not_started_failover"),) * 2,  # connect error
    (  # reset after send
        ("failover", "unknown_execution_policy_failover"),
        ("stop", "on_unknown_execution_stop"),
    ),
    (  # no headers within the attempt timeout
        ("failover", "unknown_execution_policy_failover"),
        ("stop", "on_unknown_execution_stop"),
    ),
    (  # no first event
        ("failover", "unknown_execution_policy_failover"),
        ("stop", "on_unknown_execution_stop"),
    ),
    (  # a stream stalled before it was committed
        ("failover", "unknown_execution_policy_failover"),
        ("stop", "on_unknown_execution_stop"),
    ),
    (  # a stream broken before it was committed
        ("failover", "unknown_execution_policy_failover"),
        ("stop", "on_unknown_execution_stop"),
    ),
    (("failover", "class_allows_failover"),) * 2,  # response too large
    (("retry", "retry_with_backoff"), ("stop", "on_unknown_execution_stop")),  # not a completion
    (("stop", "quota_exhausted_stops"),) * 2,
    (("retry", "retry_after_honoured"),) * 2,  # 429 with Retry-After
    (("stop", "policy_denied_never_routed_around"),) * 2,
    (("stop", "on_credentials_error_stop"),) * 2,
    (("failover", "not_started_failover"),) * 2,  # model not found
    (("failover", "larger_context_failover"),) * 2,
    (("retry", "retry_with_backoff"), ("stop", "on_unknown_execution_stop")),  # 5xx
    (("stop", "non_retryable_stops"),) * 2,  # the client's own 400
    (("stop", "non_retryable_stops"),) * 2,
    (("retry", "retry_with_backoff"), ("stop", "on_unknown_execution_stop")),  # anything else
)


def _row_class(rule: Any) -> Classification:
    evidence = rule.evidence if isinstance(rule.evidence, Evidence) else Evidence.UNKNOWN
    return Classification(
        failure_class=rule.failure_class,
        evidence=evidence,
        breaker_scope=rule.breaker_scope,
        breaker_opens_at_once=rule.breaker_opens_at_once,
        may_fail_over=rule.may_fail_over,
        retry_after_ms=1000 if rule.failure_class is FailureClass.RATE_LIMITED else None,
    )


def test_the_expected_table_has_a_line_for_every_row():
    assert len(EXPECTED) == len(RULES)


@pytest.mark.parametrize("strict", [False, True], ids=["failover", "stop"])
@pytest.mark.parametrize(
    ("row", "rule"),
    list(enumerate(RULES)),
    ids=[f"{i}-{r.failure_class}" for i, r in enumerate(RULES)],
)
def test_every_row_of_the_failure_table(row, rule, strict):
    defaults = Defaults(on_unknown_execution="stop" if strict else "failover")
    walk = _first_attempt(_policy(defaults=defaults))
    classification = _row_class(rule)
    actions = walk(Failed("a1", classification, remaining_ms=30_000))
    action, reason = EXPECTED[row][strict]
    decided = actions[0]
    assert isinstance(decided, Decided)
    assert (decided.decision.action, decided.decision.reason) == (action, reason)
    match action:
        case "stop":
            assert actions[1:] == (Fail("decision", "a1", decided.decision),)
            assert walk.walk.ended
        case "retry":
            backoff = decided.decision.backoff_ms
            assert backoff is not None
            assert actions[1:] == (Wait(backoff), Route("retry", walk.walk.context, (PRIMARY,)))
            assert walk(Routed(PRIMARY)) == (Start(PRIMARY, "retry"),)
        case "failover":
            route = actions[1]
            assert isinstance(route, Route) and route.purpose == "failover"
            assert route.context.tried_endpoints == {"east"}
            if rule.failure_class is FailureClass.CONTEXT_TOO_SMALL:
                assert route.context.larger_context_than == PRIMARY.context_window
            assert walk(Routed(FALLBACK)) == (Start(FALLBACK, "failover"),)


def test_a_retry_the_breaker_refuses_is_a_failover_the_record_names():
    # Another request took the half-open breaker's probe between the decision and the start.
    walk = _first_attempt()
    walk(Failed("a1", _cls(FailureClass.UPSTREAM_UNAVAILABLE), remaining_ms=30_000))
    assert walk(Unroutable("breaker_open")) == (
        Decided("a1", Decision("failover", "retry_refused_breaker_open")),
        Route("failover", RouteContext(tried_endpoints=frozenset({"east"}))),
    )
    assert walk(Routed(FALLBACK)) == (Start(FALLBACK, "failover"),)


def test_a_refused_retry_stops_where_the_caller_forbade_moving():
    walk = _first_attempt(_policy(allow_failover=False))
    walk(Failed("a1", _cls(FailureClass.UPSTREAM_UNAVAILABLE), remaining_ms=30_000))
    stop = Decision("stop", "retry_refused_saturated")
    assert walk(Unroutable("saturated")) == (Decided("a1", stop), Fail("decision", "a1", stop))


def test_a_retry_whose_reservation_is_lost_to_a_budget_race_is_a_named_failover():
    walk = _first_attempt()
    walk(Failed("a1", _cls(FailureClass.UPSTREAM_UNAVAILABLE), remaining_ms=30_000))
    assert isinstance(walk(Routed(PRIMARY))[0], Start)
    assert walk(BudgetRaced()) == (
        Decided("a1", Decision("failover", "retry_refused_over_budget")),
        Route("failover", RouteContext(tried_endpoints=frozenset({"east"}))),
    )


@pytest.mark.parametrize("scope", ["endpoint", "mapping"])
def test_a_failure_that_opens_its_own_breaker_fails_over_at_once_naming_it(scope):
    walk = _first_attempt()
    failed = Failed(
        "a1", _cls(FailureClass.UPSTREAM_UNAVAILABLE), remaining_ms=30_000, breaker_opened=scope
    )
    actions = walk(failed)
    assert actions[0] == Decided("a1", Decision("failover", f"{scope}_breaker_opened"))
    assert not any(isinstance(a, Wait) for a in actions)  # no back-off before a failover
    assert isinstance(actions[1], Route) and actions[1].purpose == "failover"


def test_a_retry_after_waited_out_is_the_breakers_probe_and_stands():
    # A 429's Retry-After opens the breaker with that very cool-down: the retry that waits
    # it out is admitted as the probe, so it is not turned into a failover.
    walk = _first_attempt()
    limited = _cls(FailureClass.RATE_LIMITED, Evidence.NOT_STARTED, "yes", retry_after_ms=300)
    actions = walk(Failed("a1", limited, remaining_ms=30_000, breaker_opened="endpoint"))
    assert actions[0] == Decided("a1", Decision("retry", "retry_after_honoured", 300))
    assert actions[1] == Wait(300)


def test_a_failure_that_opens_its_own_breaker_stops_where_moving_is_forbidden():
    walk = _first_attempt(_policy(allow_failover=False))
    failed = Failed(
        "a1",
        _cls(FailureClass.UPSTREAM_UNAVAILABLE),
        remaining_ms=30_000,
        breaker_opened="endpoint",
    )
    stop = Decision("stop", "endpoint_breaker_opened")
    assert walk(failed) == (Decided("a1", stop), Fail("decision", "a1", stop))


def test_attempts_are_bounded_by_max_attempts():
    walk = _first_attempt(_policy(defaults=Defaults(max_attempts=2)))
    walk(Failed("a1", _cls(FailureClass.TIMEOUT), remaining_ms=30_000))
    walk.started("a2", FALLBACK)
    actions = walk(Failed("a2", _cls(FailureClass.TIMEOUT), remaining_ms=30_000))
    assert actions == (
        Decided("a2", Decision("stop", "max_attempts_reached")),
        Fail("decision", "a2", Decision("stop", "max_attempts_reached")),
    )


def test_nothing_left_to_fail_over_to_ends_the_request():
    walk = _first_attempt()
    walk(Failed("a1", _cls(FailureClass.TIMEOUT), remaining_ms=30_000))
    assert walk(Unroutable()) == (Fail("no_route"),)


def test_a_header_that_forbids_failover_stops_where_a_failover_would_go():
    walk = _first_attempt(_policy(allow_failover=False))
    actions = walk(Failed("a1", _cls(FailureClass.TIMEOUT), remaining_ms=30_000))
    assert actions[0] == Decided("a1", Decision("stop", "failover_forbidden_by_header"))


def test_a_group_failing_over_on_grant_stops_without_one_where_a_failover_would_go():
    walk = _first_attempt(_policy(allow_failover=False, failover_not_granted=True))
    actions = walk(Failed("a1", _cls(FailureClass.TIMEOUT), remaining_ms=30_000))
    stop = Decision("stop", "failover_not_granted", policy="failover=on_grant")
    assert actions == (Decided("a1", stop), Fail("decision", "a1", stop))


@pytest.mark.parametrize("races", [1, MAX_BUDGET_RACES])
def test_a_start_lost_to_a_budget_race_is_routed_again(races):
    walk = Driver()
    walk(Begin())
    for _ in range(races):
        walk(Routed(PRIMARY))
        assert walk(BudgetRaced()) == (Route("first", RouteContext()),)
    assert walk(Routed(PRIMARY)) == (Start(PRIMARY, "first"),)


def test_too_many_budget_races_end_the_request():
    walk = Driver()
    walk(Begin())
    for _ in range(MAX_BUDGET_RACES):
        walk(Routed(PRIMARY))
        walk(BudgetRaced())
    walk(Routed(PRIMARY))
    assert walk(BudgetRaced()) == (Fail("budget_raced"),)


# --- stream resume -------------------------------------------------------------------------


def _committed(policy: WalkPolicy | None = None) -> Driver:
    walk = _first_attempt(policy)
    assert walk(Content("a1")) == (Commit("a1"),)
    return walk


def _broken(attempt_id: str, delivered: int = 120, **kw: Any) -> Failed:
    kw.setdefault("resumable", True)
    return Failed(attempt_id, BROKEN, remaining_ms=30_000, delivered_chars=delivered, **kw)


def test_a_broken_stream_resumes_on_its_own_mapping():
    walk = _committed()
    actions = walk(_broken("a1"))
    assert actions == (
        Decided("a1", Decision("resume", "resume_same_model")),
        Route("resume", RouteContext(), (PRIMARY, TWIN)),
    )
    start = Start(PRIMARY, "retry", "resume", resumed_from="a1", delivered_chars=120)
    assert walk(Routed(PRIMARY)) == (start,)
    assert walk(Started("a2", PRIMARY, "resume")) == (Run("a2"),)  # never hedged
    assert walk(Content("a2")) == (Deliver("a2"),)
    assert walk(Answered("a2")) == (Deliver("a2"),)


def test_a_resume_may_go_to_a_mapping_of_the_same_model_elsewhere():
    walk = _committed()
    walk(_broken("a1"))
    start = Start(TWIN, "failover", "resume", resumed_from="a1", delivered_chars=120)
    assert walk(Routed(TWIN)) == (start,)


def test_a_stream_stalled_twice_is_resumed_twice():
    walk = _committed()
    walk(_broken("a1", 100))
    walk.started("a2")
    walk(Content("a2"))
    actions = walk(_broken("a2", 220))
    assert actions[0] == Decided("a2", Decision("resume", "resume_same_model"))
    assert walk(Routed(PRIMARY))[0].delivered_chars == 220


def test_a_mapping_without_the_capability_is_never_resumed_onto():
    # The stream broke on the fallback, whose upstream cannot continue a partial answer.
    walk = Driver()
    walk(Begin())
    walk.started("a1", FALLBACK)
    walk(Content("a1"))
    actions = walk(_broken("a1"))
    assert actions == (
        Decided("a1", Decision("stop", "stream_committed")),
        Fail("decision", "a1", Decision("stop", "stream_committed")),
    )


@pytest.mark.parametrize(
    ("failed", "reason"),
    [
        (_broken("a1", resumable=False), "stream_committed"),  # a tool call went out
        (_broken("a1", delivered=0), "stream_committed"),  # nothing to continue
        (
            Failed("a1", BROKEN, remaining_ms=0, delivered_chars=9, resumable=True),
            "deadline_exceeded",
        ),
    ],
    ids=["not-text", "nothing-delivered", "deadline"],
)
def test_a_broken_stream_that_cannot_be_resumed_ends(failed, reason):
    walk = _committed()
    actions = walk(failed)
    stop = Decision("stop", reason)
    assert actions == (Decided("a1", stop), Fail("decision", "a1", stop))


def test_resumes_count_against_max_attempts():
    walk = _committed(_policy(defaults=Defaults(max_attempts=2)))
    walk(_broken("a1"))
    walk.started("a2")
    walk(Content("a2"))
    actions = walk(_broken("a2"))
    assert actions[0] == Decided("a2", Decision("stop", "max_attempts_reached"))


def test_strict_mode_never_resumes_without_the_requests_authority():
    strict = Defaults(on_unknown_execution="stop")
    walk = _committed(_policy(defaults=strict))
    assert walk(_broken("a1"))[0] == Decided("a1", Decision("stop", "on_unknown_execution_stop"))


def test_a_caller_that_forbids_failover_is_resumed_on_its_own_mapping_only():
    walk = _committed(_policy(allow_failover=False))
    assert walk(_broken("a1"))[1] == Route("resume", RouteContext(), (PRIMARY,))


def test_a_resume_nobody_can_take_ends_the_stream_saying_why():
    walk = _committed()
    walk(_broken("a1"))
    stop = Decision("stop", "resume_refused_breaker_open")
    assert walk(Unroutable("breaker_open")) == (Decided("a1", stop), Fail("decision", "a1", stop))


def test_a_stream_whose_break_opened_its_breaker_resumes_only_elsewhere():
    walk = _committed()
    actions = walk(_broken("a1", breaker_opened="endpoint"))
    assert actions == (
        Decided("a1", Decision("resume", "resume_same_model")),
        Route("resume", RouteContext(), (TWIN,)),
    )


def test_a_stream_whose_break_opened_its_breaker_with_no_sibling_ends_naming_it():
    walk = _committed(_policy(allow_failover=False))  # the twin elsewhere is out of bounds
    stop = Decision("stop", "mapping_breaker_opened")
    assert walk(_broken("a1", breaker_opened="mapping")) == (
        Decided("a1", stop),
        Fail("decision", "a1", stop),
    )


# --- hedging -------------------------------------------------------------------------------


def _hedged() -> Driver:
    walk = Driver(_policy(hedge_after_ms=300, max_ways=2))
    walk(Begin())
    assert walk.started("a1") == (Run("a1"), ArmHedge(300))
    actions = walk(HedgeDue())
    assert actions == (Route("hedge", RouteContext(tried_endpoints=frozenset({"east"}))),)
    assert walk(Routed(FALLBACK)) == (Start(FALLBACK, "hedge", "hedge", hedge_of="a1"),)
    assert walk(Started("a2", FALLBACK, "hedge")) == (Run("a2"),)  # max_ways reached
    return walk


def test_the_first_content_of_a_hedged_stream_wins_and_the_other_way_is_cancelled():
    walk = _hedged()
    assert walk(Content("a2")) == (Cancel("a1"), Commit("a2"))
    assert walk(HedgeDue()) == ()


def test_the_first_answer_of_a_hedged_request_wins():
    walk = _hedged()
    assert walk(Answered("a1")) == (Cancel("a2"), Deliver("a1"))
    assert walk.walk.ended


def test_a_hedged_way_that_fails_leaves_the_request_to_the_other():
    walk = _hedged()
    actions = walk(Failed("a1", _cls(FailureClass.TIMEOUT), remaining_ms=30_000))
    assert actions == (Decided("a1", Decision("failover", "other_way_running")),)
    assert walk(Answered("a2")) == (Deliver("a2"),)


def test_the_last_way_failing_decides_as_any_attempt_does():
    walk = _hedged()
    walk(Failed("a1", _cls(FailureClass.TIMEOUT), remaining_ms=30_000))
    actions = walk(Failed("a2", _cls(FailureClass.TIMEOUT), remaining_ms=30_000))
    assert actions[0] == Decided("a2", Decision("failover", "unknown_execution_policy_failover"))
    assert actions[1] == Route(
        "failover", RouteContext(tried_endpoints=frozenset({"east", "west"}))
    )


def test_no_hedge_after_the_first_content():
    walk = Driver(_policy(hedge_after_ms=300, max_ways=2))
    walk(Begin())
    walk.started("a1")
    walk(Content("a1"))
    assert walk(HedgeDue()) == ()


def test_no_second_way_to_hedge_to_leaves_the_first_alone():
    walk = Driver(_policy(hedge_after_ms=300, max_ways=2))
    walk(Begin())
    walk.started("a1")
    walk(HedgeDue())
    assert walk(Unroutable()) == ()
    assert walk(Answered("a1")) == (Deliver("a1"),)


def test_a_hedge_without_the_grant_on_grant_needs_looks_for_no_other_endpoint():
    # failover: on_grant, no X-Waybill-Allow-Failover: true (contract §4 step 4).
    walk = Driver(_policy(hedge_after_ms=300, max_ways=2, allow_failover=False,
                          failover_not_granted=True))  # fmt: skip
    walk(Begin())
    assert walk.started("a1") == (Run("a1"), ArmHedge(300))
    # The evaluation is made (and recorded), every other endpoint excluded for the grant.
    context = RouteContext(tried_endpoints=frozenset({"east"}), failover_not_granted=True)
    assert walk(HedgeDue()) == (Route("hedge", context),)
    assert walk(Unroutable()) == ()  # the first way carries the request on alone
    assert walk(Answered("a1")) == (Deliver("a1"),)


def test_a_request_that_forbids_moving_is_never_hedged():
    # X-Waybill-Allow-Failover: false, or a pinned endpoint: a second way would move.
    walk = Driver(_policy(hedge_after_ms=300, max_ways=2, allow_failover=False))
    walk(Begin())
    assert walk.started("a1") == (Run("a1"),)
    assert walk(HedgeDue()) == ()
    assert walk(Answered("a1")) == (Deliver("a1"),)


def test_a_hedge_where_moving_is_granted_is_not_marked():
    walk = Driver(_policy(hedge_after_ms=300, max_ways=2))
    walk(Begin())
    walk.started("a1")
    (route,) = walk(HedgeDue())
    assert isinstance(route, Route) and not route.context.failover_not_granted


def test_a_hedge_lost_to_a_budget_race_is_not_retried():
    walk = Driver(_policy(hedge_after_ms=300, max_ways=2))
    walk(Begin())
    walk.started("a1")
    walk(HedgeDue())
    walk(Routed(FALLBACK))
    assert walk(BudgetRaced()) == ()
    assert walk(Answered("a1")) == (Deliver("a1"),)


def test_three_ways_arm_the_timer_again():
    walk = Driver(_policy(hedge_after_ms=300, max_ways=3))
    walk(Begin())
    walk.started("a1")
    walk(HedgeDue())
    assert walk.started("a2", FALLBACK) == (Run("a2"), ArmHedge(300))


def test_hedges_count_against_max_attempts():
    walk = Driver(_policy(hedge_after_ms=300, max_ways=2, defaults=Defaults(max_attempts=1)))
    walk(Begin())
    walk.started("a1")
    assert walk(HedgeDue()) == ()


def test_a_pooled_stream_resumes_only_inside_its_pool():
    # contract §4 "Pools": a child's resumes stay inside the pool's scope.
    pooled = dataclasses.replace(PRIMARY, pool="local")
    elsewhere = dataclasses.replace(TWIN, pool="cloud")  # the same model, another pool
    inside = dataclasses.replace(TWIN, pool="local", mapping_index=3, endpoint="south")
    siblings = (pooled, elsewhere, inside)
    walk = Driver(WalkPolicy(defaults=Defaults(), siblings=siblings))
    walk(Begin())
    walk.started("a1", pooled)
    assert walk(Content("a1")) == (Commit("a1"),)
    actions = walk(_broken("a1"))
    assert actions[1] == Route("resume", RouteContext(), (pooled, inside))


def test_a_pooled_attempt_hedges_by_its_pools_policy():
    # contract §4 "Pools": a pool keeps its own hedging; the group's holds for its own.
    local = dataclasses.replace(PRIMARY, pool="local")
    cloud = dataclasses.replace(FALLBACK, pool="cloud")
    policy = WalkPolicy(
        defaults=Defaults(),
        hedge_after_ms=500,
        max_ways=2,
        siblings=(local, cloud),
        pool_hedging=(("local", 100, 2), ("cloud", None, 1)),
    )
    hedged = Driver(policy)
    hedged(Begin())
    assert hedged.started("a1", local) == (Run("a1"), ArmHedge(100))
    never = Driver(policy)
    never(Begin())
    assert never.started("a1", cloud) == (Run("a1"),)
    own = Driver(dataclasses.replace(policy, siblings=(PRIMARY,)))
    own(Begin())
    assert own.started("a1", PRIMARY) == (Run("a1"), ArmHedge(500))
