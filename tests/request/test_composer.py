"""The composer (router/request/composer.py), pure: a composed group's flat mappings, the
pre-planned fallback order, the composer's candidate for a pool, and the directive checks;
then, through the executor and its fakes, a composition error ends a request before any
upstream I/O, with no fallback and no breaker count."""

from __future__ import annotations

import asyncio
import dataclasses
from decimal import Decimal

import pytest

from ledger import events as ev
from router.config import Config, ModelGroup, parse_config
from router.errors import GatewayError
from router.request.composed import ComposedRouting
from router.request.composer import (
    RULES,
    Composition,
    CompositionError,
    Dispatch,
    check_dispatch,
    compose,
    fallback_order,
    pool_candidate,
    preferred,
)
from router.request.moves import (
    Target,
)
from router.request.routing import plan_for
from tests.request.fakes import ENV, FakeDriver, World, answer


def _config(own: bool = False, local_policy: str = "") -> Config:
    def mapping(endpoint: str, model: str = "m", tier: int = 0) -> str:
        return f"""      - endpoint: {endpoint}
        model: {model}
        tier: {tier}
        capabilities: [text, stream]
        context_window: 32000
        max_output_tokens: 1000
        price: {{input_per_mtok: 1, output_per_mtok: 2}}
"""

    endpoints = "".join(
        f"""  - id: {name}
    driver: openai
    base_url: https://{name}.invalid/v1
    api_key: ${{env:KEY}}
    region: us-east
    data_classes: [public, internal]
"""
        for name in ("east", "west", "north")
    )
    own_mappings = f"    mappings:\n{mapping('north')}" if own else ""
    text = f"""generation: unit-1
defaults:
  deadline_ms: 20000
endpoints:
{endpoints}
models:
  - name: local
{local_policy}    mappings:
{mapping("east", tier=1)}{mapping("north")}
  - name: cloud
    mappings:
{mapping("west")}
  - name: chat
{own_mappings}    pools:
      - {{group: cloud, tier: 1}}
      - {{group: local, tier: 0}}
workspaces:
  - id: acme
    models: [chat, local, cloud]
    regions: [us-east]
    data_class: internal
"""
    return parse_config(text, environ=ENV)


def _composed(own: bool = False) -> tuple[Composition, ModelGroup]:
    config = _config(own)
    chat = config.model_group("chat")
    assert chat is not None
    return compose(config, chat)


def test_a_composed_group_serves_its_own_mappings_then_each_pools_in_order():
    composition, flat = _composed(own=True)
    assert [m.endpoint for m in flat.mappings] == ["north", "west", "east", "north"]
    assert (composition.own, [(p.name, p.offset) for p in composition.pools]) == (
        1,
        [("cloud", 1), ("local", 2)],
    )
    assert [getattr(composition.pool_of(i), "name", None) for i in range(4)] == [
        None,
        "cloud",
        "local",
        "local",
    ]
    assert composition.path("local") == ("chat", "local")
    assert composition.path(None) == ("chat",)


def test_the_plan_starts_at_the_first_binding_then_members_by_tier_and_pools_by_their_own():
    composition, flat = _composed(own=True)
    # Tier 0: its own north (0), the local pool (north 3 at its tier 0, then east 2); tier 1:
    # the cloud pool (west 1).
    assert fallback_order(composition, flat, 3) == (3, 0, 2, 1)
    assert fallback_order(composition, flat, 1) == (1, 0, 3, 2)


def test_the_flat_targets_name_their_pool_for_the_walk():
    config = _config()
    chat = config.model_group("chat")
    assert chat is not None
    plan = plan_for(config, chat)
    assert [(t.endpoint, t.pool) for t in plan.targets] == [
        ("west", "cloud"),
        ("east", "local"),
        ("north", "local"),
    ]
    assert plan.targets[1] == Target("east", 1, "m", 32000, "none", "local")


def _candidate(endpoint: str, index: int, tier: int, eligible: bool = True) -> ev.Candidate:
    return ev.Candidate(
        endpoint=endpoint,
        model="m",
        mapping_index=index,
        tier=tier,
        weight=1,
        eligible=eligible,
        reason_code=None if eligible else ev.ReasonCode.ENDPOINT_SATURATED,
        detail=None if eligible else "1 of 1 in flight",
        worst_case_usd=Decimal("0.01"),
    )


def test_a_pool_is_a_candidate_with_its_preferred_binding_or_the_reason_it_cannot_take_it():
    composition, _ = _composed()
    local = composition.pools[1]
    evaluated = (_candidate("east", 0, 1), _candidate("north", 1, 0))
    assert preferred(evaluated) == evaluated[1]  # the best tier's first
    taken = pool_candidate(2, local, evaluated, permitted=True)
    assert (taken.pool, taken.endpoint, taken.eligible, taken.tier) == ("local", "north", True, 0)
    full = (_candidate("east", 0, 1, False), _candidate("north", 1, 0, False))
    refused = pool_candidate(2, local, full, permitted=True)
    assert (refused.eligible, refused.reason_code) == (False, ev.ReasonCode.POOL_UNAVAILABLE)
    assert refused.detail == "east: endpoint_saturated, north: endpoint_saturated"
    barred = pool_candidate(2, local, evaluated, permitted=False)
    assert barred.reason_code is ev.ReasonCode.POOL_NOT_PERMITTED


@pytest.mark.parametrize(
    ("dispatch", "rule"),
    [
        (Dispatch("delegate_pool", "elsewhere", 1, "west", "m"), "unknown_pool"),
        (Dispatch("delegate_pool", None, 0, "north", "m"), "leaf_cannot_delegate"),
        (Dispatch("execute_endpoint", "cloud", 2, "east", "m"), "binding_outside_scope"),
        (Dispatch("execute_endpoint", "local", 2, "west", "m"), "binding_outside_scope"),
        (Dispatch("delegate_pool", "local", 2, "east", "m", "west"), "preference_outside_scope"),
        (Dispatch("execute_endpoint", "cloud", 1, "west", "gone"), "binding_outside_scope"),
    ],
)
def test_a_directive_the_pool_cannot_carry_out_is_a_composition_error(
    dispatch: Dispatch, rule: str
) -> None:
    composition, flat = _composed(own=True)
    with pytest.raises(CompositionError) as caught:
        check_dispatch(composition, flat, dispatch)
    assert caught.value.rule == rule
    assert rule in RULES


def test_an_excluded_model_is_a_composition_error_and_a_sound_directive_passes():
    composition, flat = _composed(own=True)
    exact = Dispatch("execute_endpoint", "local", 3, "north", "m")
    with pytest.raises(CompositionError) as caught:
        check_dispatch(composition, flat, exact, frozenset({"m"}))
    assert caught.value.rule == "model_excluded"
    check_dispatch(composition, flat, exact)
    check_dispatch(composition, flat, Dispatch("delegate_pool", "local", 2, "east", "m", "north"))
    check_dispatch(composition, flat, Dispatch("execute_endpoint", None, 0, "north", "m"))


async def test_a_composition_error_ends_the_request_before_any_upstream_io():
    config = _config()
    chat = config.model_group("chat")
    assert chat is not None
    plan = plan_for(config, chat)
    assert plan.composition is not None
    # A composer out of step with its pool: it reads the local pool's mappings from the
    # wrong place, so the binding it hands the pool is not one of the pool's own.
    cloud, local = plan.composition.pools
    broken = dataclasses.replace(
        plan.composition, pools=(cloud, dataclasses.replace(local, offset=0))
    )
    world = World(config)
    world.drivers["north"] = FakeDriver("north")
    world.drivers["west"].then(answer())
    executor = world.executor(plan=dataclasses.replace(plan, composition=broken))
    with pytest.raises(GatewayError) as caught:
        await executor.complete()
    error = caught.value
    assert (error.status, error.code) == (500, "composition_error")
    assert "binding_outside_scope" in error.message
    assert all(driver.sent == [] for driver in world.drivers.values())
    assert world.breakers.failures == [] and world.breakers.admitted == []
    types = world.journal.types()
    assert "AttemptStarted" not in types and "BudgetReserved" not in types
    (failed,) = world.journal.of(ev.RequestFailed)
    assert (failed.error_code, failed.attempts) == ("composition_error", 0)


async def test_a_composition_error_on_a_hedges_route_ends_the_way_running_with_the_request():
    config = _config(local_policy="    policy: {hedge: {enabled: true, after_ms: 200}}\n")
    world = World(config)
    world.drivers["north"] = FakeDriver("north")
    world.drivers["north"].then(answer(gate=asyncio.Event()))  # never answers
    executor = world.executor()
    task = asyncio.create_task(executor.complete())
    await world.clock.armed.wait()  # the first way runs in the local pool; a hedge is armed
    routing = executor.routing
    assert isinstance(routing, ComposedRouting)
    cloud, local = routing._composition.pools
    routing._composition = dataclasses.replace(
        routing._composition, pools=(cloud, dataclasses.replace(local, offset=0))
    )
    world.clock.fire()
    with pytest.raises(GatewayError) as caught:
        await task
    await world.kept.drain()
    assert caught.value.code == "composition_error"
    (started,) = world.journal.of(ev.AttemptStarted)
    (finished,) = world.journal.of(ev.AttemptFinished)
    assert (finished.attempt_id, finished.status) == (started.attempt_id, "failed")
    (failed,) = world.journal.of(ev.RequestFailed)
    assert failed.error_code == "composition_error"
    assert world.breakers.failures == []
