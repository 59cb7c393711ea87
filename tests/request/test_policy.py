"""The walk's policy for one request (router/request/policy.py): the group's policy, the
caller's narrowing, the hedge delay, and every mapping a broken stream may resume on."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from ledger.events import Requirements
from router.config import Defaults, Hedge, ModelGroup
from router.request.moves import (
    Target,
)
from router.request.policy import FirstAnswerTimes, group_targets, hedge_p95, walk_policy


def _group() -> ModelGroup:
    price = {"input_per_mtok": "1", "output_per_mtok": "2"}
    mapping = {"context_window": 8000, "max_output_tokens": 1000, "price": price}
    return ModelGroup.model_validate(
        {
            "name": "chat",
            "mappings": [
                {"endpoint": "east", "model": "m", **mapping},
                {"endpoint": "west", "model": "m", "tier": 1, "resume": "assistant_prefill"}
                | mapping,
                {"endpoint": "south", "model": "other", "tier": 2, **mapping},
            ],
        }
    )


def test_the_siblings_are_every_mapping_of_the_group_in_order() -> None:
    group = _group()
    siblings = group_targets(group)
    assert siblings == (
        Target("east", 0, "m", 8000, "none"),
        Target("west", 1, "m", 8000, "assistant_prefill"),
        Target("south", 2, "other", 8000, "none"),
    )
    policy = walk_policy(Defaults(), Requirements(), siblings)
    assert policy.siblings == siblings


def test_the_callers_narrowing_reaches_the_walk() -> None:
    requirements = Requirements(allow_failover=False, allow_unknown_execution=True)
    policy = walk_policy(Defaults(), requirements, group_targets(_group()))
    assert (policy.allow_failover, policy.allow_unknown_execution) == (False, True)
    assert policy.hedge_after_ms is None and policy.max_ways == 1


def test_a_group_that_fails_over_on_grant_waits_for_the_callers_explicit_grant() -> None:
    on_grant = Defaults(failover="on_grant")
    siblings = group_targets(_group())
    ungranted = walk_policy(on_grant, Requirements(), siblings)
    assert (ungranted.allow_failover, ungranted.failover_not_granted) == (False, True)
    granted = walk_policy(on_grant, Requirements(failover_granted=True), siblings)
    assert (granted.allow_failover, granted.failover_not_granted) == (True, False)
    # A caller who forbids failover is told so by its own header's reason, not the policy's.
    forbidden = walk_policy(on_grant, Requirements(allow_failover=False), siblings)
    assert (forbidden.allow_failover, forbidden.failover_not_granted) == (False, False)
    # The default policy needs no grant.
    allowed = walk_policy(Defaults(), Requirements(), siblings)
    assert (allowed.allow_failover, allowed.failover_not_granted) == (True, False)


def test_a_hedged_group_waits_its_delay_unless_the_request_has_server_side_effects() -> None:
    defaults = Defaults(hedge=Hedge(enabled=True, after_ms=300, max_ways=3))
    policy = walk_policy(defaults, Requirements(), ())
    assert (policy.hedge_after_ms, policy.max_ways) == (300, 3)
    strict = walk_policy(defaults, Requirements(server_side_effects=True), ())
    assert (strict.hedge_after_ms, strict.max_ways, strict.server_side_effects) == (None, 1, True)


def test_after_p95_takes_the_observed_p95_once_there_is_one() -> None:
    defaults = Defaults(hedge=Hedge(enabled=True, after_ms=300, after_p95=True))
    assert hedge_p95(defaults) and not hedge_p95(Defaults())
    times = FirstAnswerTimes()
    for ms in range(1, 20):
        times.add("chat", False, ms)
    assert times.p95("chat", False) is None, "fewer than 20 answers: after_ms stands"
    assert walk_policy(defaults, Requirements(), (), times.p95("chat", False)).hedge_after_ms == 300
    times.add("chat", False, 20)
    assert times.p95("chat", False) == 19
    assert times.p95("chat", True) is None, "streams and buffered answers apart"
    assert walk_policy(defaults, Requirements(), (), times.p95("chat", False)).hedge_after_ms == 19


def test_a_mappings_p95_counts_its_own_answers_once_there_are_twenty() -> None:
    times = FirstAnswerTimes()
    fast, slow = ("a", "m"), ("b", "m")
    for ms in range(1, 21):
        times.add("chat", False, ms, fast)
        times.add("chat", False, ms * 100, slow if ms < 20 else None)
    assert times.place_p95s((fast, slow), False) == {fast: 19}, "b: 19 answers, unmeasured"
    assert times.place_p95s((fast, slow), True) == {}, "streams and buffered answers apart"
    times.add("other", False, 5000, slow)  # a mapping's answers count whatever group asked
    assert times.place_p95s((slow,), False) == {slow: 1900}
    assert times.p95("chat", False) == 1800, "the group's p95 counts all its 40 answers"


@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=450))
def test_a_p95_is_taken_over_the_last_two_hundred_answers_as_they_came(figures: list[int]) -> None:
    times = FirstAnswerTimes()
    for ms in figures:
        times.add("chat", False, ms, ("a", "m"))
    last = sorted(figures[-200:])
    expected = None
    if len(last) >= 20:
        expected = max(1, last[min(len(last) - 1, math.ceil(0.95 * len(last)) - 1)])
    assert times.p95("chat", False) == expected
    assert times.place_p95s((("a", "m"),), False).get(("a", "m")) == expected


def test_each_pool_keeps_its_own_hedging_unless_the_request_has_server_side_effects() -> None:
    hedged = Defaults(hedge=Hedge(enabled=True, after_ms=250, max_ways=2, after_p95=True))
    pools = (("local", hedged), ("cloud", Defaults()))
    policy = walk_policy(Defaults(), Requirements(), (), None, pools)
    # after_p95 falls back to after_ms in a pool: first answers are counted per group asked.
    assert policy.pool_hedging == (("local", 250, 2), ("cloud", None, 1))
    assert policy.hedging("local") == (250, 2) and policy.hedging(None) == (None, 1)
    strict = walk_policy(Defaults(), Requirements(server_side_effects=True), (), None, pools)
    assert strict.pool_hedging == (("local", None, 1), ("cloud", None, 1))
