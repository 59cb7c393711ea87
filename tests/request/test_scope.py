"""The caller's endpoint scope (contract §4 "Endpoint scope"), the preferred endpoint, and the
answer to a request whose every candidate refused admission (contract §3), as pure functions."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from ledger.events import Candidate, ReasonCode, Requirements
from router.config import Config, ModelGroup, Workspace, parse_config
from router.errors import ErrorCode
from router.request.final_error import (
    MAX_ADMISSION_RETRY_AFTER_S,
    Tally,
    admission_retry_after_s,
    no_route_error,
)
from router.request.scope import bad_scope_name, endpoint_scope, expand
from router.request.selection import RouteContext, WeightedRoundRobin, evaluate, select

CONFIG = """
endpoints:
  - {id: oa-east, driver: openai, base_url: "https://a.invalid/v1", region: us-east,
     data_classes: [internal]}
  - {id: oa-west, driver: openai, base_url: "https://b.invalid/v1", region: us-east,
     data_classes: [internal]}
  - {id: claude, driver: anthropic, base_url: "https://c.invalid", region: us-east,
     data_classes: [internal]}
  - {id: elsewhere, driver: anthropic, base_url: "https://d.invalid", region: us-east,
     data_classes: [internal]}
models:
  - name: chat
    mappings:
      - {endpoint: oa-east, model: m, tier: 0, weight: 1, capabilities: [text],
         context_window: 8000, max_output_tokens: 100,
         price: {input_per_mtok: 1, output_per_mtok: 1}}
      - {endpoint: oa-west, model: m, tier: 0, weight: 1, capabilities: [text],
         context_window: 8000, max_output_tokens: 100,
         price: {input_per_mtok: 1, output_per_mtok: 1}}
      - {endpoint: claude, model: c, tier: 1, weight: 1, capabilities: [text],
         context_window: 8000, max_output_tokens: 100,
         price: {input_per_mtok: 1, output_per_mtok: 1}}
  - name: other
    mappings:
      - {endpoint: elsewhere, model: c, capabilities: [text], context_window: 8000,
         max_output_tokens: 100, price: {input_per_mtok: 1, output_per_mtok: 1}}
workspaces:
  - {id: acme, models: [chat, other], regions: [us-east], data_class: internal}
"""


@functools.cache
def _config() -> Config:
    return parse_config(CONFIG, environ={})


def _chat() -> ModelGroup:
    group = _config().model_group("chat")
    assert group is not None
    return group


def _workspace() -> Workspace:
    workspace = _config().workspace("acme")
    assert workspace is not None
    return workspace


def _scope(**requirements: Any) -> frozenset[str] | None:
    scope = endpoint_scope(_config(), _chat(), Requirements(**requirements))
    return None if scope is None else scope.endpoints


def _evaluate(**requirements: Any) -> tuple[Candidate, ...]:
    return evaluate(
        _config(),
        _workspace(),
        _chat(),
        Requirements(capabilities=("text",), **requirements),
        RouteContext(),
        breaker_open=lambda endpoint, mapping: None,
    )


def _reasons(candidates: tuple[Candidate, ...]) -> dict[str, tuple[str | None, str | None]]:
    return {
        c.endpoint: (c.reason_code.value if c.reason_code else None, c.detail) for c in candidates
    }


# --- expansion and intersection --------------------------------------------------------------


def test_a_provider_label_expands_to_that_drivers_endpoints_within_the_requested_group():
    # `elsewhere` is an anthropic endpoint too, but not of model group `chat`.
    assert expand(_config(), _chat(), ["provider:anthropic"]) == {"claude"}
    assert expand(_config(), _chat(), ["provider:openai"]) == {"oa-east", "oa-west"}
    assert expand(_config(), _chat(), ["oa-east", "provider:anthropic"]) == {"oa-east", "claude"}


def test_a_name_outside_the_group_adds_nothing():
    assert expand(_config(), _chat(), ["elsewhere", "no-such-endpoint"]) == frozenset()


def test_no_narrowing_is_no_scope_at_all():
    assert endpoint_scope(_config(), _chat(), Requirements()) is None


def test_the_header_narrows_the_keys_scope_and_never_widens_it():
    key = ("provider:openai",)
    assert _scope(key_endpoints=key) == frozenset({"oa-east", "oa-west"})
    assert _scope(key_endpoints=key, endpoints=("oa-west", "claude")) == frozenset({"oa-west"})
    assert _scope(key_endpoints=key, endpoints=("claude",)) == frozenset()


def test_a_pin_is_the_scope_of_one_endpoint_inside_the_others():
    assert _scope(require_endpoint="claude") == frozenset({"claude"})
    assert _scope(prefer_endpoint="claude") is None, "a preference does not narrow"
    pinned_outside = _scope(key_endpoints=("provider:openai",), require_endpoint="claude")
    assert pinned_outside == frozenset()


@pytest.mark.parametrize(
    ("name", "bad"),
    [("oa-east", False), ("provider:openai", False), ("provider:gemini", True), ("", True)],
)
def test_a_scope_names_endpoint_ids_and_known_providers(name: str, bad: bool) -> None:
    assert (bad_scope_name(name) is not None) is bad


# --- eligibility -------------------------------------------------------------------------------


def test_candidates_outside_the_scope_are_excluded_out_of_scope_naming_the_narrowing():
    reasons = _reasons(_evaluate(key_endpoints=("provider:openai",), endpoints=("oa-east",)))
    assert reasons == {
        "oa-east": (None, None),
        "oa-west": ("out_of_scope", "not in X-Waybill-Endpoints"),
        "claude": ("out_of_scope", "not in the key's endpoint scope"),
    }


def test_an_empty_intersection_excludes_everything_scope_empty_never_unrestricted():
    for requirements in (
        {"endpoints": ("elsewhere",)},
        {"key_endpoints": ("oa-east",), "endpoints": ("claude",)},
        {"key_endpoints": ("oa-east",), "require_endpoint": "claude"},
    ):
        reasons = _reasons(_evaluate(**requirements))
        assert {r for r, _ in reasons.values()} == {"scope_empty"}, requirements
        assert {d for _, d in reasons.values()} == {"endpoints"}


def test_a_pinned_request_has_only_its_endpoint_eligible():
    reasons = _reasons(_evaluate(require_endpoint="claude"))
    assert reasons["claude"] == (None, None)
    assert reasons["oa-east"] == ("out_of_scope", "not in X-Waybill-Require-Endpoint")


# --- the preferred endpoint --------------------------------------------------------------------


def test_a_preferred_eligible_endpoint_is_chosen_ahead_of_tier_and_round_robin():
    rr = WeightedRoundRobin()
    for _ in range(3):
        choice = select(_evaluate(), rr, "acme", _chat(), prefer="claude")
        assert choice is not None
        assert (choice.endpoint, choice.tier, choice.preferred) == ("claude", 1, True)


def test_a_preference_for_an_ineligible_endpoint_is_overruled():
    candidates = _evaluate(endpoints=("provider:openai",))
    choice = select(candidates, WeightedRoundRobin(), "acme", _chat(), prefer="claude")
    assert choice is not None
    assert choice.endpoint in {"oa-east", "oa-west"}
    assert not choice.preferred


# --- nothing eligible: refused at admission, or for good -------------------------------------


def _candidate(endpoint: str, reason: ReasonCode, index: int) -> Candidate:
    return Candidate(
        endpoint=endpoint,
        model="m",
        mapping_index=index,
        tier=0,
        weight=1,
        eligible=False,
        reason_code=reason,
        detail="why",
    )


@pytest.mark.parametrize(
    "reasons",
    [
        (ReasonCode.ENDPOINT_SATURATED,),
        (ReasonCode.BREAKER_OPEN,),
        (ReasonCode.ENDPOINT_SATURATED, ReasonCode.BREAKER_OPEN),
        (ReasonCode.ENDPOINT_SATURATED, ReasonCode.OUT_OF_SCOPE, ReasonCode.MISSING_CAPABILITY),
    ],
)
def test_every_candidate_left_refused_at_admission_is_503_with_retry_after(
    reasons: tuple[ReasonCode, ...],
) -> None:
    candidates = tuple(_candidate(f"e{i}", r, i) for i, r in enumerate(reasons))
    error = no_route_error(candidates, Tally(), "chat")
    assert (error.status, error.code) == (503, ErrorCode.UPSTREAM_UNAVAILABLE)
    assert error.headers() == {"x-should-retry": "true", "retry-after": "1"}
    assert "refused admission" in error.message


@pytest.mark.parametrize(
    "reasons",
    [
        (ReasonCode.SCOPE_EMPTY, ReasonCode.SCOPE_EMPTY),
        (ReasonCode.OUT_OF_SCOPE, ReasonCode.MISSING_CAPABILITY),
        (ReasonCode.REGION_NOT_ALLOWED,),
    ],
)
def test_nothing_eligible_for_good_stays_422(reasons: tuple[ReasonCode, ...]) -> None:
    candidates = tuple(_candidate(f"e{i}", r, i) for i, r in enumerate(reasons))
    error = no_route_error(candidates, Tally(), "chat")
    assert (error.status, error.code) == (422, ErrorCode.NO_ELIGIBLE_ROUTE)
    assert error.headers() == {"x-should-retry": "false"}


def test_retry_after_is_the_soonest_a_refused_candidate_may_admit_bounded():
    saturated = _candidate("e0", ReasonCode.ENDPOINT_SATURATED, 0)
    opened = _candidate("e1", ReasonCode.BREAKER_OPEN, 1)
    later = _candidate("e2", ReasonCode.BREAKER_OPEN, 2)
    assert admission_retry_after_s((opened, later), {1: 4200, 2: 9000}) == 5
    assert admission_retry_after_s((saturated, opened), {1: 4200}) == 1, "a slot: at once"
    assert admission_retry_after_s((opened,), {1: 0}) == 1, "never below a second"
    assert admission_retry_after_s((opened,), {}) == 1, "unknown: at once"
    assert admission_retry_after_s((opened,), {1: 600_000}) == MAX_ADMISSION_RETRY_AFTER_S
    error = no_route_error((opened, later), Tally(), "chat", {1: 4200, 2: 9000})
    assert error.headers()["retry-after"] == "5"


def test_a_budget_that_covers_no_candidate_stays_402_beside_admission_refusals():
    candidates = (
        _candidate("e0", ReasonCode.ENDPOINT_SATURATED, 0),
        _candidate("e1", ReasonCode.OVER_BUDGET, 1),
    )
    assert no_route_error(candidates, Tally(), "chat").status == 402


def test_select_is_unchanged_without_a_preference():
    rr_a, rr_b = WeightedRoundRobin(), WeightedRoundRobin()
    candidates = _evaluate()
    for _ in range(4):
        assert select(candidates, rr_a, "acme", _chat()) == select(
            candidates, rr_b, "acme", _chat(), prefer=None
        )
