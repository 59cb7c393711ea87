"""The routing core against contract §4 and §5: eligibility, selection, retry and failover."""

from __future__ import annotations

import functools
import itertools
import random
from collections import Counter
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.events import Candidate, Evidence, FailureClass, ReasonCode, Requirements
from router.config import Config, Defaults, Mapping, ModelGroup, Workspace, parse_config
from router.request.classify import Classification, MayFailOver, UpstreamOutcome, classify
from router.request.composer import POOL_REASONS
from router.request.decision import (
    DECISION_REASONS,
    AttemptOutcome,
    Decision,
    decide,
    next_context,
)
from router.request.selection import (
    CHECK_ORDER,
    RouteContext,
    Scope,
    WeightedRoundRobin,
    effective_scope,
    effective_weight,
    evaluate,
    select,
    worst_case_cost,
)

ENV = {"EAST_KEY": "sk-test-east"}

CONFIG = """
endpoints:
  - id: east
    driver: openai
    base_url: https://east.invalid/v1
    api_key: ${env:EAST_KEY}
    region: us-east
    data_classes: [public, internal]
  - id: west
    driver: anthropic
    base_url: https://west.invalid
    region: eu-west
    data_classes: [public, internal, restricted]
  - id: south
    driver: openai
    base_url: https://south.invalid/v1
    region: ap-south
    data_classes: [public, internal, restricted]
  - id: dormant
    driver: openai
    base_url: https://off.invalid/v1
    region: us-east
    data_classes: [public, internal, restricted]
    enabled: false
models:
  - name: chat
    mappings:
      - endpoint: east            # 0
        model: small
        tier: 0
        weight: 3
        capabilities: [text, stream, tools]
        context_window: 8192
        max_output_tokens: 1024
        price: {input_per_mtok: 0.15, output_per_mtok: 0.60}
      - endpoint: east            # 1: a second route to the same endpoint
        model: large
        tier: 0
        weight: 1
        capabilities: [text, stream, tools, vision]
        context_window: 128000
        max_output_tokens: 4096
        price: {input_per_mtok: 2.5, output_per_mtok: 10}
      - endpoint: west            # 2
        model: claude
        tier: 1
        weight: 2
        capabilities: [text, stream, tools, vision, json_schema]
        context_window: 200000
        max_output_tokens: 8192
        price: {input_per_mtok: 3, output_per_mtok: 15}
      - endpoint: south           # 3: outside acme's regions
        model: far
        tier: 1
        capabilities: [text, stream]
        context_window: 32000
        max_output_tokens: 2048
        price: {input_per_mtok: 1, output_per_mtok: 2}
      - endpoint: dormant           # 4: disabled
        model: spare
        tier: 0
        weight: 5
        capabilities: [text, stream, tools, vision]
        context_window: 128000
        max_output_tokens: 4096
        price: {input_per_mtok: 1, output_per_mtok: 2}
workspaces:
  - id: acme
    models: [chat]
    regions: [us-east, eu-west]
    data_class: internal
"""


@functools.cache
def _config() -> Config:
    return parse_config(CONFIG, environ=ENV)


def _workspace() -> Workspace:
    workspace = _config().workspace("acme")
    assert workspace is not None
    return workspace


def _group() -> ModelGroup:
    group = _config().model_group("chat")
    assert group is not None
    return group


def _admit(endpoint_id: str, mapping: Mapping) -> str | None:
    return None


def _evaluate(
    requirements: Requirements | None = None,
    context: RouteContext | None = None,
    **callbacks: Any,
) -> tuple[Candidate, ...]:
    callbacks.setdefault("breaker_open", _admit)
    return evaluate(
        _config(),
        _workspace(),
        _group(),
        requirements or Requirements(capabilities=("text",), estimated_input_tokens=100),
        context or RouteContext(),
        **callbacks,
    )


def _reasons(candidates: tuple[Candidate, ...]) -> list[str | None]:
    return [c.reason_code.value if c.reason_code else None for c in candidates]


# --- scope -------------------------------------------------------------------------------


def test_scope_without_narrowing_is_the_workspaces_regions():
    scope = effective_scope(_workspace(), Requirements())
    assert scope == Scope(regions=frozenset({"us-east", "eu-west"}), data_class="internal")


def test_scope_narrows_regions_to_the_intersection():
    scope = effective_scope(_workspace(), Requirements(regions=("eu-west", "ap-south")))
    assert scope.regions == frozenset({"eu-west"})
    assert scope.empty is None


@pytest.mark.parametrize("regions", [("ap-south",), ()])
def test_scope_narrowed_to_nothing_is_marked_empty_not_unrestricted(regions):
    scope = effective_scope(_workspace(), Requirements(regions=regions))
    assert scope.regions == frozenset()
    assert scope.empty == "regions"


def test_scope_data_class_is_the_requests_and_never_below_the_workspaces():
    assert effective_scope(_workspace(), Requirements(data_class="restricted")).data_class == (
        "restricted"
    )
    assert effective_scope(_workspace(), Requirements(data_class="public")).data_class == (
        "internal"
    )


# --- worst-case cost ---------------------------------------------------------------------


def test_worst_case_cost_is_exact_decimal_with_the_mappings_max_output():
    small = _group().mappings[0]  # 0.15 in, 0.60 out, max_output_tokens 1024
    cost = worst_case_cost(small, Requirements(estimated_input_tokens=1234))
    # 1234 × 0.15 / 1e6 + 1024 × 0.60 / 1e6 = 0.0001851 + 0.0006144
    assert cost == Decimal("0.0007995")
    assert isinstance(cost, Decimal)


def test_worst_case_cost_uses_the_requests_max_tokens_even_above_the_mappings():
    small = _group().mappings[0]
    below = worst_case_cost(small, Requirements(estimated_input_tokens=0, max_output_tokens=10))
    above = worst_case_cost(small, Requirements(estimated_input_tokens=0, max_output_tokens=5000))
    assert below == Decimal("0.000006")
    assert above == Decimal("0.003")


def test_worst_case_cost_has_no_float_rounding():
    # In floats 3 × 0.1 is 0.30000000000000004.
    mapping = _mapping_with_prices(Decimal("0.1"), Decimal("0.1"), max_output=3)
    cost = worst_case_cost(mapping, Requirements(estimated_input_tokens=0))
    assert cost == Decimal("0.0000003")
    assert Fraction(cost) == Fraction(3, 10**7)


def _mapping_with_prices(input_price: Decimal, output_price: Decimal, max_output: int) -> Mapping:
    return Mapping.model_validate(
        {
            "endpoint": "east",
            "model": "m",
            "context_window": 10**9,
            "max_output_tokens": max_output,
            "price": {"input_per_mtok": input_price, "output_per_mtok": output_price},
        }
    )


_prices = st.decimals(min_value=0, max_value=1000, places=6, allow_nan=False, allow_infinity=False)


@given(
    _prices,
    _prices,
    st.integers(0, 10**8),
    st.integers(1, 10**6),
    st.none() | st.integers(0, 10**7),
)
def test_worst_case_cost_equals_the_exact_rational_formula(
    input_price, output_price, input_tokens, mapping_max, request_max
):
    mapping = _mapping_with_prices(input_price, output_price, mapping_max)
    requirements = Requirements(estimated_input_tokens=input_tokens, max_output_tokens=request_max)
    out = mapping_max if request_max is None else request_max
    expected = (
        Fraction(input_tokens) * Fraction(input_price) + Fraction(out) * Fraction(output_price)
    ) / 10**6
    assert Fraction(worst_case_cost(mapping, requirements)) == expected


def test_every_candidate_carries_its_worst_case_cost_eligible_or_not():
    requirements = Requirements(estimated_input_tokens=1000)
    candidates = _evaluate(requirements)
    assert not all(c.eligible for c in candidates)
    for candidate, mapping in zip(candidates, _group().mappings, strict=True):
        assert candidate.worst_case_usd == worst_case_cost(mapping, requirements)


# --- evaluation: one candidate per mapping --------------------------------------------------


def test_evaluate_returns_one_candidate_per_mapping_in_mapping_order():
    candidates = _evaluate()
    assert [(c.mapping_index, c.endpoint, c.model, c.tier, c.weight) for c in candidates] == [
        (0, "east", "small", 0, 3),
        (1, "east", "large", 0, 1),
        (2, "west", "claude", 1, 2),
        (3, "south", "far", 1, 1),
        (4, "dormant", "spare", 0, 5),
    ]
    assert _reasons(candidates) == [None, None, None, "region_not_allowed", "endpoint_disabled"]
    assert [c.eligible for c in candidates] == [True, True, True, False, False]
    assert all(c.detail is None for c in candidates if c.eligible)


def test_endpoint_disabled():
    off = _evaluate()[4]
    assert (off.reason_code, off.detail) == (
        ReasonCode.ENDPOINT_DISABLED,
        "endpoint dormant disabled",
    )


def test_model_kind_mismatch():
    candidates = _evaluate(Requirements(kind="embedding"))
    assert _reasons(candidates)[:4] == ["model_kind_mismatch"] * 4
    assert candidates[0].detail == "group kind chat != requested embedding"


def test_already_tried_excludes_every_mapping_leading_to_that_endpoint():
    candidates = _evaluate(context=RouteContext(tried_endpoints=frozenset({"east"})))
    assert _reasons(candidates)[:3] == ["already_tried", "already_tried", None]
    assert candidates[0].detail == candidates[1].detail == "failed over from east"


def test_scope_empty_is_given_to_every_candidate_and_nothing_is_eligible():
    candidates = _evaluate(Requirements(regions=("mars",)))
    assert _reasons(candidates) == ["scope_empty"] * 4 + ["endpoint_disabled"]
    assert {c.detail for c in candidates[:4]} == {"regions"}
    assert select(candidates, WeightedRoundRobin(), "acme", _group()) is None


def test_region_not_allowed_names_the_endpoints_region():
    candidates = _evaluate(Requirements(regions=("eu-west",)))
    assert _reasons(candidates)[:4] == [
        "region_not_allowed",
        "region_not_allowed",
        None,
        "region_not_allowed",
    ]
    assert [c.detail for c in candidates[:4]] == ["us-east", "us-east", None, "ap-south"]


def test_data_class_not_allowed_names_the_data_class():
    candidates = _evaluate(Requirements(data_class="restricted"))
    assert _reasons(candidates)[:3] == ["data_class_not_allowed", "data_class_not_allowed", None]
    assert candidates[0].detail == "restricted"


def _retention_config(retentions: list[str | None]) -> Config:
    data = {
        "endpoints": [
            {
                "id": f"ep{i}",
                "driver": "openai",
                "base_url": f"https://ep{i}.invalid/v1",
                "region": "us-east",
                "data_classes": ["internal"],
                **({"retention": r} if r is not None else {}),
            }
            for i, r in enumerate(retentions)
        ],
        "models": [
            {
                "name": "g",
                "mappings": [
                    {
                        "endpoint": f"ep{i}",
                        "model": "m",
                        "context_window": 1000,
                        "max_output_tokens": 100,
                        "price": {"input_per_mtok": 1, "output_per_mtok": 2},
                    }
                    for i in range(len(retentions))
                ],
            }
        ],
        "workspaces": [
            {"id": "w", "models": ["g"], "regions": ["us-east"], "data_class": "internal"}
        ],
    }
    return parse_config(yaml.safe_dump(data), environ={})


def _retention_reasons(bound: str | None) -> list[tuple[str | None, str | None]]:
    config = _retention_config(["none", "zero", "1d", "30d", "31d", None])
    candidates = evaluate(
        config,
        config.workspaces[0],
        config.models[0],
        Requirements(retention=bound),
        RouteContext(),
        breaker_open=_admit,
    )
    return [(c.reason_code.value if c.reason_code else None, c.detail) for c in candidates]


def test_without_a_retention_bound_every_endpoint_is_eligible_declared_or_not():
    assert [reason for reason, _ in _retention_reasons(None)] == [None] * 6


def test_retention_over_the_bound_or_undeclared_is_excluded_naming_both():
    assert _retention_reasons("30d") == [
        (None, None),
        (None, None),
        (None, None),
        (None, None),
        ("retention_exceeded", "endpoint ep4 keeps 31d; required 30d"),
        ("retention_exceeded", "endpoint ep5 does not declare its retention; required 30d"),
    ]


def test_a_zero_bound_admits_only_endpoints_keeping_nothing_after_the_answer():
    reasons = [reason for reason, _ in _retention_reasons("zero")]
    assert reasons == [None, None] + ["retention_exceeded"] * 4
    reasons = [reason for reason, _ in _retention_reasons("none")]
    assert reasons == [None] + ["retention_exceeded"] * 5


def _deadline_reasons(
    remaining_ms: int | None, p95s: dict[tuple[str, str], int] | None
) -> list[tuple[str | None, str | None]]:
    config = _retention_config([None, None, None])
    candidates = evaluate(
        config,
        config.workspaces[0],
        config.models[0],
        Requirements(),
        RouteContext(remaining_ms=remaining_ms),
        breaker_open=_admit,
        first_content_p95=p95s,
    )
    return [(c.reason_code.value if c.reason_code else None, c.detail) for c in candidates]


def test_a_mapping_slower_than_the_deadline_left_is_excluded_naming_both_figures():
    # ep0 is slower than what is left, ep1 just as fast as it, ep2 unmeasured: it may try.
    assert _deadline_reasons(800, {("ep0", "m"): 801, ("ep1", "m"): 800}) == [
        (
            "deadline_insufficient",
            "p95 time to first content 801 ms > 800 ms left of the deadline",
        ),
        (None, None),
        (None, None),
    ]


def test_without_a_deadline_or_figures_no_mapping_is_excluded_for_time():
    assert _deadline_reasons(None, {("ep0", "m"): 10_000}) == [(None, None)] * 3
    assert _deadline_reasons(0, None) == [(None, None)] * 3
    assert _deadline_reasons(0, {}) == [(None, None)] * 3


def test_missing_capability_lists_the_missing_names_comma_joined():
    candidates = _evaluate(Requirements(capabilities=("text", "vision", "json_schema")))
    assert _reasons(candidates)[:3] == ["missing_capability", "missing_capability", None]
    assert candidates[0].detail == "json_schema,vision"
    assert candidates[1].detail == "json_schema"


def test_dialect_unsupported_excludes_only_the_dialect_named_with_its_feature():
    candidates = _evaluate(Requirements(unsupported=(("openai", "thinking"),)))
    # east (openai) twice, west (anthropic), south (openai, outside the regions first).
    assert _reasons(candidates)[:4] == [
        "dialect_unsupported",
        "dialect_unsupported",
        None,
        "region_not_allowed",
    ]
    assert candidates[0].detail == "thinking"


def test_dialect_unsupported_comes_after_missing_capability():
    needs = Requirements(capabilities=("text", "vision"), unsupported=(("openai", "document"),))
    assert _reasons(_evaluate(needs))[:2] == ["missing_capability", "dialect_unsupported"]


def test_context_too_small_when_input_plus_max_output_exceeds_the_window():
    # small: window 8192, max_output_tokens 1024: 7168 input fits exactly, 7169 does not.
    fits = _evaluate(Requirements(estimated_input_tokens=7168))[0]
    too_big = _evaluate(Requirements(estimated_input_tokens=7169))[0]
    assert fits.eligible
    assert too_big.reason_code is ReasonCode.CONTEXT_TOO_SMALL
    assert too_big.detail == "context_window 8192 < needed 8193"


def test_context_too_small_counts_the_requests_max_tokens():
    candidate = _evaluate(Requirements(estimated_input_tokens=1000, max_output_tokens=8000))[0]
    assert candidate.detail == "context_window 8192 < needed 9000"


def test_unpriced_input_names_the_dimension_and_leaves_no_worst_case():
    # east/large can see images but has no image price; west is an Anthropic endpoint,
    # whose driver sends no image, so its worst case is the text's.
    requirements = Requirements(
        capabilities=("text", "vision"), estimated_input_tokens=100, image_inputs=2
    )
    small, large, claude = _evaluate(requirements)[:3]
    assert (small.reason_code, large.reason_code) == (R.MISSING_CAPABILITY, R.UNPRICED_INPUT)
    assert (large.detail, large.worst_case_usd) == ("image_input", None)
    assert claude.eligible
    assert claude.worst_case_usd == worst_case_cost(
        _group().mappings[2], requirements.model_copy(update={"image_inputs": 0})
    )


def test_the_context_check_counts_each_priced_part_at_its_bound():
    data = yaml.safe_load(CONFIG)
    data["models"][0]["mappings"][1]["price"]["image_input"] = {"tokens": 62000}
    config = parse_config(yaml.safe_dump(data), environ=ENV)
    group = config.model_group("chat")
    assert group is not None
    one, two = (
        Requirements(capabilities=("vision",), estimated_input_tokens=1000, image_inputs=n)
        for n in (1, 2)
    )
    fits, too_big = (
        evaluate(config, _workspace(), group, r, RouteContext(), breaker_open=_admit)[1]
        for r in (one, two)
    )
    assert fits.eligible  # 1000 + 62000 + 4096 <= 128000
    assert (too_big.reason_code, too_big.detail) == (
        R.CONTEXT_TOO_SMALL,
        "context_window 128000 < needed 129096",
    )


def test_after_context_too_small_only_larger_windows_and_never_the_same_model():
    context = RouteContext(larger_context_than=128000, excluded_models=frozenset({"small"}))
    candidates = _evaluate(context=context)
    assert _reasons(candidates)[:3] == ["context_too_small", "context_too_small", None]
    assert candidates[0].detail == "model small already failed as context_too_small"
    assert candidates[1].detail == "context_window 128000 <= failed 128000"


def test_breaker_open_records_the_breakers_scope_and_is_asked_with_endpoint_and_mapping():
    asked: list[tuple[str, str]] = []

    def breaker(endpoint_id: str, mapping: Mapping) -> str | None:
        asked.append((endpoint_id, mapping.model))
        return "mapping" if mapping.model == "large" else None

    candidates = _evaluate(breaker_open=breaker)
    assert _reasons(candidates)[:3] == [None, "breaker_open", None]
    assert candidates[1].detail == "mapping"
    # Not asked about the out-of-region or disabled mappings.
    assert asked == [("east", "small"), ("east", "large"), ("west", "claude")]


def test_a_disabled_endpoint_is_excluded_with_what_was_refused_before_its_breaker_is_asked():
    asked: list[str] = []

    def disabled(endpoint_id: str) -> str | None:
        asked.append(endpoint_id)
        return "the upstream answered 401 invalid_api_key" if endpoint_id == "east" else None

    def breaker(endpoint_id: str, mapping: Mapping) -> str | None:
        assert endpoint_id != "east", "a disabled endpoint's breaker is not asked"
        return None

    candidates = _evaluate(credentials_disabled=disabled, breaker_open=breaker)
    assert _reasons(candidates)[:3] == ["credentials_disabled", "credentials_disabled", None]
    assert candidates[0].detail == "the upstream answered 401 invalid_api_key"
    assert asked == ["east", "east", "west"]


def test_over_budget_records_the_account_and_is_asked_with_the_worst_case_cost():
    asked: list[Decimal] = []

    def budget(worst: Decimal) -> str | None:
        asked.append(worst)
        return "workspace:acme" if worst > Decimal("0.1") else None

    candidates = _evaluate(over_budget=budget)
    assert _reasons(candidates)[:3] == [None, None, "over_budget"]
    assert candidates[2].detail == "workspace:acme"
    assert asked == [c.worst_case_usd for c in candidates[:3]]


def test_without_an_over_budget_callback_no_budget_check_is_made():
    assert _reasons(_evaluate(over_budget=None))[:3] == [None, None, None]


def test_a_group_naming_an_endpoint_unknown_to_the_config_is_refused():
    other = parse_config(
        CONFIG.replace("id: west", "id: elsewhere").replace(
            "endpoint: west", "endpoint: elsewhere"
        ),
        environ=ENV,
    )
    foreign_group = other.model_group("chat")
    assert foreign_group is not None
    with pytest.raises(ValueError, match="elsewhere"):
        evaluate(
            _config(),
            _workspace(),
            foreign_group,
            Requirements(),
            RouteContext(),
            breaker_open=_admit,
        )


# --- the check order ---------------------------------------------------------------------

R = ReasonCode
SPEC_ORDER = (
    R.ENDPOINT_DISABLED,
    R.MODEL_KIND_MISMATCH,
    R.QUOTA_EXHAUSTED,
    R.RESPONSE_AFFINITY,
    R.ALREADY_TRIED,
    R.FAILOVER_NOT_GRANTED,
    R.SCOPE_EMPTY,
    R.OUT_OF_SCOPE,
    R.REGION_NOT_ALLOWED,
    R.DATA_CLASS_NOT_ALLOWED,
    R.RETENTION_EXCEEDED,
    R.MISSING_CAPABILITY,
    R.DIALECT_UNSUPPORTED,
    R.UNPRICED_INPUT,
    R.CONTEXT_TOO_SMALL,
    R.DEADLINE_INSUFFICIENT,
    R.CREDENTIALS_DISABLED,
    R.BREAKER_OPEN,
    R.ENDPOINT_SATURATED,
    R.OVER_BUDGET,
)


def test_check_order_is_the_contracts_and_covers_every_reason_code():
    assert CHECK_ORDER == SPEC_ORDER
    assert set(CHECK_ORDER) == set(ReasonCode) - POOL_REASONS  # the others: a pool's


@functools.cache
def _single_mapping_config(disabled: bool, far_region: bool) -> Config:
    data = {
        "endpoints": [
            {
                "id": "ep",
                "driver": "openai",
                "base_url": "https://ep.invalid/v1",
                "region": "ap-south" if far_region else "us-east",
                "data_classes": ["public", "internal"],
                "enabled": not disabled,
                "retention": "30d",
            },
            {  # a disabled spare: never eligible, never asked about live state
                "id": "spare",
                "driver": "openai",
                "base_url": "https://spare.invalid/v1",
                "region": "us-east",
                "data_classes": ["public", "internal"],
                "enabled": False,
            },
        ],
        "models": [
            {
                "name": "g",
                "mappings": [
                    {
                        "endpoint": "ep",
                        "model": "m",
                        "capabilities": ["text"],
                        "context_window": 1000,
                        "max_output_tokens": 100,
                        "price": {"input_per_mtok": 1, "output_per_mtok": 2},
                    },
                    {
                        "endpoint": "spare",
                        "model": "m",
                        "capabilities": ["text"],
                        "context_window": 1000,
                        "max_output_tokens": 100,
                        "price": {"input_per_mtok": 1, "output_per_mtok": 2},
                    },
                ],
            }
        ],
        "workspaces": [
            {"id": "w", "models": ["g"], "regions": ["us-east"], "data_class": "internal"}
        ],
    }
    return parse_config(yaml.safe_dump(data), environ={})


def _evaluate_failing(failing: frozenset[ReasonCode]) -> tuple[Candidate, list[str]]:
    """Evaluate a group's first mapping set up to fail exactly the checks in ``failing`` (the
    other, a disabled spare, is what an endpoint scope leaves the request)."""
    config = _single_mapping_config(R.ENDPOINT_DISABLED in failing, R.REGION_NOT_ALLOWED in failing)
    called: list[str] = []

    def disabled(endpoint_id: str) -> str | None:
        called.append("disabled")
        return "the upstream answered 401" if R.CREDENTIALS_DISABLED in failing else None

    def breaker(endpoint_id: str, mapping: Mapping) -> str | None:
        called.append("breaker")
        return "endpoint" if R.BREAKER_OPEN in failing else None

    def saturated(endpoint_id: str) -> str | None:
        called.append("saturated")
        return "2 of 2 in flight" if R.ENDPOINT_SATURATED in failing else None

    def budget(worst: Decimal) -> str | None:
        called.append("budget")
        return "request" if R.OVER_BUDGET in failing else None

    requirements = Requirements(
        kind="embedding" if R.MODEL_KIND_MISMATCH in failing else "chat",
        regions=("nowhere",) if R.SCOPE_EMPTY in failing else None,
        data_class="restricted" if R.DATA_CLASS_NOT_ALLOWED in failing else "internal",
        retention="7d" if R.RETENTION_EXCEEDED in failing else "30d",
        capabilities=("text", "vision") if R.MISSING_CAPABILITY in failing else ("text",),
        image_inputs=1 if R.UNPRICED_INPUT in failing else 0,  # the mapping prices no image
        unsupported=(("openai", "thinking"),) if R.DIALECT_UNSUPPORTED in failing else (),
        affinity_endpoint="elsewhere" if R.RESPONSE_AFFINITY in failing else None,
        estimated_input_tokens=901 if R.CONTEXT_TOO_SMALL in failing else 900,
        endpoints=("spare",) if R.OUT_OF_SCOPE in failing else None,
    )
    tried = frozenset({"ep"}) if R.ALREADY_TRIED in failing else frozenset()
    remaining = 499 if R.DEADLINE_INSUFFICIENT in failing else 500
    exhausted = frozenset({"ep"}) if R.QUOTA_EXHAUSTED in failing else frozenset()
    workspace, group = config.workspaces[0], config.models[0]
    candidate, _spare = evaluate(
        config,
        workspace,
        group,
        requirements,
        RouteContext(
            tried_endpoints=tried,
            remaining_ms=remaining,
            quota_exhausted=exhausted,
            failover_not_granted=R.FAILOVER_NOT_GRANTED in failing,
        ),
        breaker_open=breaker,
        saturated=saturated,
        over_budget=budget,
        credentials_disabled=disabled,
        first_content_p95={("ep", "m"): 500},
    )
    return candidate, called


def test_each_check_alone_excludes_with_its_own_reason():
    assert _evaluate_failing(frozenset())[0].eligible
    for code in CHECK_ORDER:
        candidate, _ = _evaluate_failing(frozenset({code}))
        assert (candidate.eligible, candidate.reason_code) == (False, code)
        assert candidate.detail


def test_the_first_failing_check_is_the_reason_for_every_combination():
    for size in range(1, len(SPEC_ORDER) + 1):
        for combination in itertools.combinations(SPEC_ORDER, size):
            candidate, called = _evaluate_failing(frozenset(combination))
            assert candidate.reason_code is combination[0], combination
            # Live state is asked only about a mapping that passed every earlier check.
            passed = SPEC_ORDER.index(combination[0]) - SPEC_ORDER.index(R.CREDENTIALS_DISABLED)
            expected_calls = ["disabled", "breaker", "saturated", "budget"][: max(0, passed + 1)]
            assert called == expected_calls, combination


# --- selection: tiers ----------------------------------------------------------------------


def _candidate(index: int, weight: int = 1, tier: int = 0, eligible: bool = True) -> Candidate:
    return Candidate(
        endpoint=f"e{index}",
        model=f"m{index}",
        mapping_index=index,
        tier=tier,
        weight=weight,
        eligible=eligible,
        reason_code=None if eligible else ReasonCode.BREAKER_OPEN,
        detail=None if eligible else "endpoint",
    )


def test_select_prefers_tier_0_whatever_the_weights_and_falls_back_when_it_is_excluded():
    rr = WeightedRoundRobin()
    primary_only = [_candidate(0, weight=1, tier=0), _candidate(1, weight=100, tier=1)]
    chosen = [select(primary_only, rr, "acme", _group()) for _ in range(50)]
    assert {(c.tier, c.mapping_index) for c in chosen if c} == {(0, 0)}
    fallback = [_candidate(0, tier=0, eligible=False), _candidate(1, weight=100, tier=1)]
    choice = select(fallback, rr, "acme", _group())
    assert choice is not None
    assert (choice.tier, choice.mapping_index, choice.selection_position) == (1, 1, 0)


def test_select_from_a_real_evaluation_stays_in_tier_0_until_it_is_tried():
    rr = WeightedRoundRobin()
    first = select(_evaluate(), rr, "acme", _group())
    assert first is not None
    assert (first.endpoint, first.tier) == ("east", 0)
    after = select(
        _evaluate(context=RouteContext(tried_endpoints=frozenset({"east"}))), rr, "acme", _group()
    )
    assert after is not None
    assert (after.endpoint, after.model, after.tier, after.weight) == ("west", "claude", 1, 2)


# --- selection: strategies ------------------------------------------------------------------


def _priced(index: int, cost: str, latency: int | None = None, tier: int = 0) -> Candidate:
    return _candidate(index, tier=tier).model_copy(
        update={"worst_case_usd": Decimal(cost), "latency_ms": latency}
    )


def _choose(candidates: list[Candidate], strategy: str, rounds: int = 1) -> list[int]:
    rr, group = WeightedRoundRobin(), _group().model_copy(update={"strategy": strategy})
    picks = [select(candidates, rr, "acme", group) for _ in range(rounds)]
    return [p.mapping_index for p in picks if p is not None]


def test_least_cost_chooses_the_cheapest_worst_case_and_spreads_over_equals():
    candidates = [_priced(0, "0.004"), _priced(1, "0.001"), _priced(2, "0.001")]
    assert _choose(candidates, "least_cost", rounds=4) == [1, 2, 1, 2]


def test_least_latency_measures_every_mapping_before_ranking_them():
    candidates = [_priced(0, "1", latency=90), _priced(1, "1"), _priced(2, "1", latency=40)]
    assert _choose(candidates, "least_latency", rounds=3) == [1, 1, 1]
    measured = [_priced(0, "1", latency=90), _priced(1, "1", latency=120), _priced(2, "1", 40)]
    assert _choose(measured, "least_latency", rounds=3) == [2, 2, 2]


@pytest.mark.parametrize("strategy", ["least_cost", "least_latency"])
def test_a_strategy_chooses_inside_the_best_tier_only(strategy):
    candidates = [_priced(0, "9", latency=900), _priced(1, "0.1", latency=1, tier=1)]
    assert _choose(candidates, strategy, rounds=3) == [0, 0, 0]


@pytest.mark.parametrize("strategy", ["weighted", "least_cost", "least_latency"])
def test_a_strategys_choice_is_the_same_for_the_same_state(strategy):
    candidates = [_priced(i, str(i % 2 + 1), latency=(i % 3) * 10) for i in range(5)]
    assert _choose(candidates, strategy, rounds=7) == _choose(candidates, strategy, rounds=7)


def test_evaluation_records_each_mappings_latency_figure():
    candidates = _evaluate(latencies={("east", "small"): 87.6})
    figures = {(c.endpoint, c.model): c.latency_ms for c in candidates}
    assert figures[("east", "small")] == 88
    assert all(v is None for k, v in figures.items() if k != ("east", "small"))


def test_select_returns_none_when_nothing_is_eligible():
    candidates = [_candidate(0, eligible=False), _candidate(1, tier=1, eligible=False)]
    assert select(candidates, WeightedRoundRobin(), "acme", _group()) is None
    assert select([], WeightedRoundRobin(), "acme", _group()) is None


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 10), st.booleans()), min_size=1, max_size=8
    ),
    st.integers(1, 20),
)
def test_select_never_picks_a_lower_tier_while_a_higher_priority_one_has_a_candidate(specs, rounds):
    candidates = [_candidate(i, weight=w, tier=t, eligible=e) for i, (t, w, e) in enumerate(specs)]
    eligible_tiers = [c.tier for c in candidates if c.eligible]
    rr = WeightedRoundRobin()
    for _ in range(rounds):
        choice = select(candidates, rr, "acme", _group())
        if not eligible_tiers:
            assert choice is None
            continue
        assert choice is not None
        assert choice.tier == min(eligible_tiers)
        assert candidates[choice.mapping_index].eligible


# --- selection: smooth weighted round-robin --------------------------------------------------

KEY = ("acme", "chat", "chat", 0)


def _run(rr: WeightedRoundRobin, key: Any, candidates: list[Candidate], n: int) -> list[int]:
    return [rr.choose(key, candidates)[0].mapping_index for _ in range(n)]


def test_swrr_matches_nginx_sequence_for_weights_5_1_1():
    rr = WeightedRoundRobin()
    candidates = [_candidate(0, 5), _candidate(1, 1), _candidate(2, 1)]
    picks = [rr.choose(KEY, candidates) for _ in range(7)]
    assert [c.mapping_index for c, _ in picks] == [0, 0, 1, 0, 2, 0, 0]
    assert [position for _, position in picks] == list(range(7))


def test_swrr_ties_break_on_the_lowest_mapping_index_whatever_the_list_order():
    rr = WeightedRoundRobin()
    candidates = [_candidate(2), _candidate(0), _candidate(1)]
    assert _run(rr, KEY, candidates, 6) == [0, 1, 2, 0, 1, 2]


def test_swrr_state_follows_the_mapping_index_not_the_position_in_the_list():
    forward, shuffled = WeightedRoundRobin(), WeightedRoundRobin()
    candidates = [_candidate(0, 4), _candidate(1, 2), _candidate(2, 3)]
    rng = random.Random(7)
    for _ in range(40):
        permuted = rng.sample(candidates, len(candidates))
        assert forward.choose(KEY, candidates)[0] == shuffled.choose(KEY, permuted)[0]


def test_swrr_ineligible_candidates_take_no_part():
    rr = WeightedRoundRobin()
    candidates = [_candidate(0, 10, eligible=False), _candidate(1, 1), _candidate(2, 1)]
    assert _run(rr, KEY, candidates, 4) == [1, 2, 1, 2]


def test_swrr_refuses_an_empty_round():
    with pytest.raises(ValueError):
        WeightedRoundRobin().choose(KEY, [_candidate(0, eligible=False)])


@given(st.lists(st.integers(1, 10), min_size=1, max_size=6), st.integers(1, 60))
def test_swrr_is_deterministic_across_fresh_instances(weights, n):
    candidates = [_candidate(i, w) for i, w in enumerate(weights)]
    a, b = WeightedRoundRobin(), WeightedRoundRobin()
    assert [a.choose(KEY, candidates) for _ in range(n)] == [
        b.choose(KEY, candidates) for _ in range(n)
    ]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 10), min_size=1, max_size=6), st.integers(1, 3))
def test_swrr_shares_equal_the_weights_and_every_prefix_stays_close(weights, k):
    """Over k·W selections each candidate is chosen exactly k·weight times. In any prefix of
    n selections, with W = Σw and m candidates, SWRR keeps current_i = n·w_i − W·count_i with
    −W < current_i < (m−1)·W (the sum of currents is 0 and a winner's is ≥ W/m before it
    gives back W), i.e. count_i − n·w_i/W < 1 and n·w_i/W − count_i < max(1, m−1)."""
    candidates = [_candidate(i, w) for i, w in enumerate(weights)]
    total, m = sum(weights), len(weights)
    rr = WeightedRoundRobin()
    counts: Counter[int] = Counter()
    for n in range(1, k * total + 1):
        chosen, position = rr.choose(KEY, candidates)
        assert position == n - 1
        counts[chosen.mapping_index] += 1
        for i, w in enumerate(weights):
            excess = counts[i] * total - n * w  # (count_i − n·w_i/W)·W, exact in integers
            assert excess < total
            assert -excess < max(1, m - 1) * total
    assert [counts[i] for i in range(m)] == [k * w for w in weights]


def test_swrr_keeps_separate_state_and_positions_per_tier_key():
    candidates = [_candidate(0, 5), _candidate(1, 1), _candidate(2, 1)]
    keys = [
        ("acme", "chat", "chat", 0),
        ("acme", "chat", "chat", 1),
        ("beta", "chat", "chat", 0),
        ("acme", "other", "chat", 0),
    ]
    alone = _run(WeightedRoundRobin(), KEY, candidates, 7)
    shared = WeightedRoundRobin()
    interleaved: dict[Any, list[tuple[int, int]]] = {key: [] for key in keys}
    for _ in range(7):
        for key in keys:
            chosen, position = shared.choose(key, candidates)
            interleaved[key].append((chosen.mapping_index, position))
    for key in keys:
        assert [index for index, _ in interleaved[key]] == alone
        assert [position for _, position in interleaved[key]] == list(range(7))


def test_select_keys_the_round_robin_by_workspace_group_kind_and_tier():
    candidates = [_candidate(0, 1), _candidate(1, 1)]
    rr = WeightedRoundRobin()
    a1 = select(candidates, rr, "acme", _group())
    b1 = select(candidates, rr, "beta", _group())
    a2 = select(candidates, rr, "acme", _group())
    assert a1 is not None and b1 is not None and a2 is not None
    assert (a1.mapping_index, a1.selection_position) == (0, 0)
    assert (b1.mapping_index, b1.selection_position) == (0, 0)
    assert (a2.mapping_index, a2.selection_position) == (1, 1)


# --- decide: retry, failover or stop -----------------------------------------------------------


def _cls(
    failure_class: FailureClass,
    may_fail_over: MayFailOver = "yes",
    evidence: Evidence = Evidence.NOT_STARTED,
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


def _from(trust: bool = False, **facts: Any) -> Classification:
    return classify(UpstreamOutcome(**facts), trust_not_started=trust)


def _decide(
    classification: Classification,
    defaults: Defaults | None = None,
    seed: int = 0,
    **outcome: Any,
) -> Decision:
    fields: dict[str, Any] = {"attempts_made": 1, "retries_on_endpoint": 0, "remaining_ms": 60000}
    fields.update(outcome)
    return decide(
        AttemptOutcome(classification=classification, **fields),
        defaults or Defaults(),
        random.Random(seed),
    )


def _defaults(**data: Any) -> Defaults:
    return Defaults.model_validate(data)


RATE_LIMITED_2S = _from(http_status=429, retry_after_ms=2000)
FIVE_XX = _from(http_status=503)


def test_decision_allowed_is_false_only_for_stop():
    assert Decision("retry", "retry_with_backoff", 100).allowed
    assert Decision("failover", "not_started_failover").allowed
    assert not Decision("stop", "stream_committed").allowed


def test_decision_refuses_a_reason_not_in_the_list():
    with pytest.raises(ValueError):
        Decision("stop", "because")


def test_a_committed_stream_stops_even_when_a_retry_would_fit():
    decision = _decide(RATE_LIMITED_2S, stream_committed=True)
    assert (decision.action, decision.reason) == ("stop", "stream_committed")


def test_client_canceled_stops():
    decision = _decide(_cls(FailureClass.CLIENT_CANCELED))
    assert (decision.action, decision.reason) == ("stop", "client_canceled")


@pytest.mark.parametrize(
    ("classification", "remaining_ms"),
    [(_cls(FailureClass.DEADLINE_EXCEEDED), 5000), (RATE_LIMITED_2S, 0), (FIVE_XX, -1)],
)
def test_deadline_exceeded_stops(classification, remaining_ms):
    decision = _decide(classification, remaining_ms=remaining_ms)
    assert (decision.action, decision.reason) == ("stop", "deadline_exceeded")


def test_max_attempts_reached_stops_at_the_limit_not_before():
    defaults = _defaults(max_attempts=3)
    assert _decide(RATE_LIMITED_2S, defaults, attempts_made=2).action == "retry"
    decision = _decide(RATE_LIMITED_2S, defaults, attempts_made=3)
    assert (decision.action, decision.reason) == ("stop", "max_attempts_reached")


@pytest.mark.parametrize(
    ("facts", "reason"),
    [
        ({"http_status": 429, "error_code": "insufficient_quota"}, "quota_exhausted_stops"),
        ({"http_status": 422, "error_message": "bad request"}, "non_retryable_stops"),
    ],
)
def test_classes_that_may_not_fail_over_stop_and_surface_the_cause(facts, reason):
    decision = _decide(_from(**facts), _defaults(on_credentials_error="failover"))
    assert (decision.action, decision.reason) == ("stop", reason)


def test_policy_denied_is_never_routed_around_whatever_the_config():
    policy = _from(http_status=400, error_code="content_policy_violation")
    defaults = _defaults(
        on_credentials_error="failover",
        on_unknown_execution="failover",
        retry_same_endpoint={"policy_denied": {"max": 3}},
    )
    decision = _decide(policy, defaults)
    assert (decision.action, decision.reason) == ("stop", "policy_denied_never_routed_around")


def test_credentials_stop_by_default_and_fail_over_when_configured():
    credentials = _from(http_status=401)
    assert _decide(credentials).reason == "on_credentials_error_stop"
    decision = _decide(credentials, _defaults(on_credentials_error="failover"))
    assert (decision.action, decision.reason) == ("failover", "credentials_policy_failover")


def test_unknown_execution_stops_when_configured_so():
    decision = _decide(FIVE_XX, _defaults(on_unknown_execution="stop"))
    assert (decision.action, decision.reason) == ("stop", "on_unknown_execution_stop")


def test_unknown_execution_not_started_goes_on_even_with_the_stop_policy():
    trusted = _from(trust=True, http_status=503, execution_state_header="not-started")
    assert trusted.evidence is Evidence.NOT_STARTED
    hand_built = _cls(FailureClass.NETWORK_ERROR, "per_on_unknown_execution", Evidence.NOT_STARTED)
    for classification in (trusted, hand_built):
        decision = _decide(
            classification, _defaults(on_unknown_execution="stop"), retries_on_endpoint=1
        )
        assert (decision.action, decision.reason) == ("failover", "not_started_failover")


# --- strict evidence mode: on_unknown_execution: stop, server-side effects, the header -------

# X-Waybill-Allow-Failover as the request carries it: (allow_failover, allow_unknown_execution).
HEADER = {"true": (True, False), "unknown": (True, True), "false": (False, False)}
UNKNOWN_503 = FIVE_XX
NOT_STARTED_503 = _from(trust=True, http_status=503, execution_state_header="not-started")

# (policy, server-side effects, header) → (action, reason, FailoverDecided.policy), for a 503 of
# unknown execution whose same-endpoint retries are used up. Every combination is listed.
_BY_POLICY = ("unknown_execution_policy_failover", "on_unknown_execution=failover")
_BY_HEADER = ("unknown_execution_allowed_by_header", "X-Waybill-Allow-Failover=unknown")
_FORBIDDEN = ("failover_forbidden_by_header", "on_unknown_execution=failover")
_EFFECTS = ("server_side_effects_strict", "server_side_effects=strict")
_STOP = ("on_unknown_execution_stop", "on_unknown_execution=stop")
STRICT_TABLE = [
    ("failover", False, "true",    "failover", *_BY_POLICY),
    ("failover", False, "unknown", "failover", *_BY_POLICY),
    ("failover", False, "false",   "stop",     *_FORBIDDEN),
    ("failover", True,  "true",    "stop",     *_EFFECTS),
    ("failover", True,  "unknown", "failover", *_BY_HEADER),
    ("failover", True,  "false",   "stop",     *_EFFECTS),
    ("stop",     False, "true",    "stop",     *_STOP),
    ("stop",     False, "unknown", "failover", *_BY_HEADER),
    ("stop",     False, "false",   "stop",     *_STOP),
    ("stop",     True,  "true",    "stop",     *_STOP),
    ("stop",     True,  "unknown", "failover", *_BY_HEADER),
    ("stop",     True,  "false",   "stop",     *_STOP),
]  # fmt: skip


def _strict_outcome(effects: bool, header: str, **outcome: Any) -> dict[str, Any]:
    allow_failover, allow_unknown = HEADER[header]
    return {
        "allow_failover": allow_failover,
        "allow_unknown_execution": allow_unknown,
        "server_side_effects": effects,
        **outcome,
    }


def test_the_strict_table_lists_every_combination_once():
    combos = [(p, e, h) for p, e, h, *_ in STRICT_TABLE]
    assert sorted(combos) == sorted(
        itertools.product(("failover", "stop"), (False, True), tuple(HEADER))
    )


@pytest.mark.parametrize(
    ("policy", "effects", "header", "action", "reason", "rule"),
    STRICT_TABLE,
    ids=[f"{p}-{'effects' if e else 'plain'}-header_{h}" for p, e, h, *_ in STRICT_TABLE],
)
def test_an_attempt_of_unknown_execution_after_its_retries(
    policy, effects, header, action, reason, rule
):
    decision = _decide(
        UNKNOWN_503,
        _defaults(on_unknown_execution=policy),
        **_strict_outcome(effects, header, retries_on_endpoint=1),
    )
    assert (decision.action, decision.reason, decision.policy) == (action, reason, rule)


@pytest.mark.parametrize(
    ("policy", "effects", "header"),
    [(p, e, h) for p, e, h, *_ in STRICT_TABLE],
    ids=[f"{p}-{'effects' if e else 'plain'}-header_{h}" for p, e, h, *_ in STRICT_TABLE],
)
def test_a_strict_request_is_not_retried_in_place_unless_the_header_allows_it(
    policy, effects, header
):
    # upstream_unavailable retries once by default: only strictness stands in the way.
    decision = _decide(
        UNKNOWN_503, _defaults(on_unknown_execution=policy), **_strict_outcome(effects, header)
    )
    strict = policy == "stop" or effects
    if strict and header != "unknown":
        assert decision.action == "stop"
        assert decision.reason in ("on_unknown_execution_stop", "server_side_effects_strict")
    else:
        assert (decision.action, decision.reason) == ("retry", "retry_with_backoff")


@pytest.mark.parametrize(
    ("policy", "effects", "header"),
    [(p, e, h) for p, e, h, *_ in STRICT_TABLE],
    ids=[f"{p}-{'effects' if e else 'plain'}-header_{h}" for p, e, h, *_ in STRICT_TABLE],
)
def test_not_started_evidence_always_moves_on_whatever_the_strictness(policy, effects, header):
    hand_built = _cls(FailureClass.NETWORK_ERROR, "per_on_unknown_execution", Evidence.NOT_STARTED)
    for classification in (NOT_STARTED_503, hand_built):
        decision = _decide(
            classification,
            _defaults(on_unknown_execution=policy),
            **_strict_outcome(effects, header, retries_on_endpoint=1),
        )
        if header == "false":
            assert (decision.action, decision.reason) == ("stop", "failover_forbidden_by_header")
        else:
            assert (decision.action, decision.reason) == ("failover", "not_started_failover")


@pytest.mark.parametrize(
    "facts",
    [
        {"transport": "sent_then_reset"},
        {"transport": "timeout_before_headers"},
        {"transport": "first_token_timeout"},
        {"transport": "broken_stream"},
        {"transport": "invalid_response"},
        {"http_status": 502},
        {"http_status": 408},
        {"http_status": 302},
    ],
)
def test_every_row_of_unknown_execution_is_strict_for_server_side_effects(facts):
    classification = _from(**facts)
    assert classification.may_fail_over == "per_on_unknown_execution"
    decision = _decide(classification, server_side_effects=True)
    assert (decision.action, decision.reason) == ("stop", "server_side_effects_strict")
    allowed = _decide(
        classification,
        server_side_effects=True,
        allow_unknown_execution=True,
        retries_on_endpoint=1,
    )
    assert (allowed.action, allowed.reason) == ("failover", "unknown_execution_allowed_by_header")


@pytest.mark.parametrize(
    ("facts", "outcome"),
    [
        ({"http_status": 429}, {}),  # rate_limited: not started
        ({"http_status": 404, "error_code": "model_not_found"}, {}),
        ({"transport": "connect_error"}, {}),
        ({"transport": "response_too_large"}, {}),  # the table allows it outright
        ({"http_status": 400, "error_code": "context_length_exceeded"}, {}),
    ],
)
def test_strictness_leaves_the_other_rows_as_they_were(facts, outcome):
    classification = _from(**facts)
    plain = _decide(classification, **outcome)
    strict = _decide(
        classification,
        _defaults(on_unknown_execution="stop"),
        server_side_effects=True,
        **outcome,
    )
    assert (strict.action, strict.reason, strict.policy) == (
        plain.action,
        plain.reason,
        plain.policy,
    )


def test_the_header_authorises_nothing_the_failure_class_forbids():
    for facts in (
        {"http_status": 429, "error_code": "insufficient_quota"},
        {"http_status": 400, "error_code": "content_policy_violation"},
        {"http_status": 401},
    ):
        plain = _decide(_from(**facts))
        allowed = _decide(_from(**facts), allow_unknown_execution=True)
        assert (
            (allowed.action, allowed.reason)
            == (plain.action, plain.reason)
            == (
                "stop",
                plain.reason,
            )
        )


def test_credentials_decisions_name_their_policy():
    assert _decide(_from(http_status=401)).policy == "on_credentials_error=stop"
    failover = _decide(_from(http_status=401), _defaults(on_credentials_error="failover"))
    assert failover.policy == "on_credentials_error=failover"


def test_unknown_execution_fails_over_by_policy_after_its_retries():
    decision = _decide(FIVE_XX, retries_on_endpoint=1)
    assert (decision.action, decision.reason) == ("failover", "unknown_execution_policy_failover")
    assert decision.backoff_ms is None


def test_rate_limited_honours_a_retry_after_that_fits():
    decision = _decide(RATE_LIMITED_2S)
    assert (decision.action, decision.reason, decision.backoff_ms) == (
        "retry",
        "retry_after_honoured",
        2000,
    )


@pytest.mark.parametrize(
    ("classification", "outcome"),
    [
        (_from(http_status=429), {}),  # no Retry-After: nothing to honour
        (_from(http_status=429, retry_after_ms=5001), {}),  # above max_retry_after_ms 5000
        (RATE_LIMITED_2S, {"remaining_ms": 2000}),  # does not fit the deadline
        (RATE_LIMITED_2S, {"retries_on_endpoint": 1}),  # rule max 1 already used
    ],
)
def test_rate_limited_fails_over_when_the_retry_after_does_not_fit(classification, outcome):
    decision = _decide(classification, **outcome)
    assert (decision.action, decision.reason) == ("failover", "not_started_failover")


def test_rate_limited_retry_after_at_the_max_is_honoured():
    decision = _decide(_from(http_status=429, retry_after_ms=5000))
    assert (decision.action, decision.backoff_ms) == ("retry", 5000)


def test_a_retry_does_not_need_failover_permission():
    decision = _decide(RATE_LIMITED_2S, allow_failover=False)
    assert decision.action == "retry"


@settings(max_examples=200)
@given(st.integers(0, 2**32 - 1))
def test_backoff_is_drawn_from_the_seeded_rng_within_the_rules_bounds(seed):
    decision = _decide(FIVE_XX, seed=seed)
    assert (decision.action, decision.reason) == ("retry", "retry_with_backoff")
    assert decision.backoff_ms is not None
    assert 100 <= decision.backoff_ms <= 500
    assert decision.backoff_ms == random.Random(seed).randint(100, 500)


def test_backoff_uses_the_configured_range_and_varies_with_the_rng():
    defaults = _defaults(retry_same_endpoint={"network_error": {"max": 2, "backoff_ms": [7, 9]}})
    reset = _from(transport="sent_then_reset")
    backoffs = {
        _decide(reset, defaults, seed=s, retries_on_endpoint=1).backoff_ms for s in range(50)
    }
    assert backoffs == {7, 8, 9}


def test_a_backoff_that_does_not_fit_the_deadline_fails_over_instead():
    assert all(_decide(FIVE_XX, seed=s, remaining_ms=100).action == "failover" for s in range(20))
    assert all(_decide(FIVE_XX, seed=s, remaining_ms=501).action == "retry" for s in range(20))


def test_a_silent_route_is_never_retried_whatever_the_config():
    defaults = _defaults(retry_same_endpoint={"timeout": {"max": 5, "backoff_ms": [1, 1]}})
    for transport in ("timeout_before_headers", "first_token_timeout"):
        decision = _decide(_from(transport=transport), defaults)
        assert (decision.action, decision.reason) == (
            "failover",
            "unknown_execution_policy_failover",
        )


def test_context_too_small_is_never_retried_and_fails_over_to_a_larger_context_only():
    defaults = _defaults(
        retry_same_endpoint={"context_too_small": {"max": 5, "backoff_ms": [1, 1]}}
    )
    context = _from(http_status=400, error_code="context_length_exceeded")
    decision = _decide(context, defaults)
    assert (decision.action, decision.reason) == ("failover", "larger_context_failover")


def test_response_too_large_fails_over_although_the_work_started():
    decision = _decide(_from(transport="response_too_large"))
    assert (decision.action, decision.reason) == ("failover", "class_allows_failover")


def test_a_failure_not_started_and_not_retried_fails_over():
    decision = _decide(_from(transport="connect_error"))
    assert (decision.action, decision.reason) == ("failover", "not_started_failover")
    model_gone = _from(http_status=404, error_code="model_not_found")
    assert _decide(model_gone).reason == "not_started_failover"


def test_failover_forbidden_by_header_stops_after_the_retries():
    decision = _decide(FIVE_XX, allow_failover=False, retries_on_endpoint=1)
    assert (decision.action, decision.reason) == ("stop", "failover_forbidden_by_header")


def test_failover_not_granted_stops_where_a_failover_would_go_and_names_the_policy():
    decision = _decide(
        FIVE_XX, allow_failover=False, failover_not_granted=True, retries_on_endpoint=1
    )
    assert (decision.action, decision.reason) == ("stop", "failover_not_granted")
    assert decision.policy == "failover=on_grant"
    # Retries on the same endpoint follow the existing rules.
    retry = _decide(FIVE_XX, allow_failover=False, failover_not_granted=True)
    assert (retry.action, retry.reason) == ("retry", "retry_with_backoff")


def test_a_class_stop_is_reported_before_the_header():
    quota = _from(http_status=429, error_code="insufficient_quota")
    assert _decide(quota, allow_failover=False).reason == "quota_exhausted_stops"


def test_every_decision_reason_is_listed_once_and_reachable():
    assert len(DECISION_REASONS) == len(set(DECISION_REASONS))
    seen: set[str] = set()
    policies = [
        _defaults(on_credentials_error=c, on_unknown_execution=u, on_quota_exhausted=c)
        for c in ("stop", "failover")
        for u in ("stop", "failover")
    ]
    may_fail_over: tuple[MayFailOver, ...] = (
        "yes",
        "no",
        "never",
        "per_on_credentials_error",
        "per_on_unknown_execution",
        "per_on_invalid_output",
        "per_on_quota_exhausted",
        "larger_context_only",
    )
    for fc, mfo, evidence, defaults in itertools.product(
        FailureClass, may_fail_over, Evidence, policies
    ):
        for retry_after in (None, 1000):
            classification = _cls(fc, mfo, evidence, retry_after)
            for outcome in (
                {},
                {"retries_on_endpoint": 1},
                {"retries_on_endpoint": 1, "allow_failover": False},
                {"retries_on_endpoint": 1, "allow_failover": False, "failover_not_granted": True},
                {"retries_on_endpoint": 1, "server_side_effects": True},
                {
                    "retries_on_endpoint": 1,
                    "server_side_effects": True,
                    "allow_unknown_execution": True,
                },
                {"stream_committed": True},
                {"remaining_ms": 0},
                {"attempts_made": 4},
            ):
                decision = _decide(classification, defaults, **outcome)
                assert decision.reason in DECISION_REASONS
                assert (decision.backoff_ms is not None) == (decision.action == "retry")
                seen.add(decision.reason)
    assert seen == set(DECISION_REASONS)


# --- the next evaluation's context ---------------------------------------------------------------


def test_failover_adds_the_endpoint_to_the_tried_ones():
    small = _group().mappings[0]
    context = next_context(RouteContext(), "failover", small, FailureClass.RATE_LIMITED)
    assert context == RouteContext(tried_endpoints=frozenset({"east"}))


@pytest.mark.parametrize("action", ["retry", "stop"])
def test_retry_and_stop_leave_the_context_unchanged(action):
    start = RouteContext(tried_endpoints=frozenset({"west"}))
    small = _group().mappings[0]
    assert next_context(start, action, small, FailureClass.CONTEXT_TOO_SMALL) is start


def test_context_too_small_failover_asks_for_a_larger_window_and_excludes_the_model():
    small, large = _group().mappings[0], _group().mappings[1]
    first = next_context(RouteContext(), "failover", large, FailureClass.CONTEXT_TOO_SMALL)
    assert first == RouteContext(
        tried_endpoints=frozenset({"east"}),
        larger_context_than=128000,
        excluded_models=frozenset({"large"}),
    )
    # A later, smaller window never lowers the bar.
    on_west = small.model_copy(update={"endpoint": "west"})
    second = next_context(first, "failover", on_west, FailureClass.CONTEXT_TOO_SMALL)
    assert second.larger_context_than == 128000
    assert second.tried_endpoints == frozenset({"east", "west"})
    assert second.excluded_models == frozenset({"large", "small"})


def test_a_whole_request_walks_from_tier_0_to_the_fallback_and_then_runs_out():
    rr = WeightedRoundRobin()
    context = RouteContext()
    requirements = Requirements(capabilities=("text",), estimated_input_tokens=100)
    visited = []
    for _ in range(3):
        choice = select(_evaluate(requirements, context), rr, "acme", _group())
        if choice is None:
            break
        visited.append(choice.endpoint)
        decision = _decide(FIVE_XX, retries_on_endpoint=1)
        mapping = _group().mappings[choice.mapping_index]
        context = next_context(context, decision.action, mapping, FIVE_XX.failure_class)
    assert visited == ["east", "west"]


def test_a_backoff_must_end_strictly_before_the_deadline():
    defaults = _defaults(
        retry_same_endpoint={"upstream_unavailable": {"max": 1, "backoff_ms": [200, 200]}}
    )
    assert _decide(FIVE_XX, defaults, remaining_ms=200).action == "failover"
    assert _decide(FIVE_XX, defaults, remaining_ms=201).backoff_ms == 200


def _evaluate_embeddings(requirements: Requirements) -> tuple[Candidate, ...]:
    embeddings = _group().model_copy(update={"kind": "embeddings"})
    return evaluate(
        _config(), _workspace(), embeddings, requirements, RouteContext(), breaker_open=_admit
    )


def test_an_embeddings_batch_fits_when_its_longest_input_fits_the_window():
    # small: window 8192. Each input is embedded on its own: the batch's total (20000)
    # and the output bound (none) do not count, the longest input does.
    batch = Requirements(
        kind="embeddings",
        estimated_input_tokens=20000,
        largest_input_tokens=8192,
        max_output_tokens=0,
    )
    assert _evaluate_embeddings(batch)[0].eligible
    longer = batch.model_copy(update={"largest_input_tokens": 8193})
    too_big = _evaluate_embeddings(longer)[0]
    assert too_big.reason_code is ReasonCode.CONTEXT_TOO_SMALL
    assert too_big.detail == "context_window 8192 < needed 8193"


# --- quota failover: the provider account ---------------------------------------------------


def _accounts_config() -> Config:
    """``a`` and ``b`` share a host and a key (one account); ``c`` has another key; ``d`` the
    same key on another host."""

    def endpoint(name: str, base_url: str, key: str) -> dict[str, Any]:
        return {
            "id": name,
            "driver": "openai",
            "base_url": base_url,
            "api_key": "${env:" + key + "}",
            "region": "us-east",
            "data_classes": ["internal"],
        }

    mapping = {
        "model": "m",
        "capabilities": ["text"],
        "context_window": 8000,
        "max_output_tokens": 100,
        "price": {"input_per_mtok": 1, "output_per_mtok": 1},
    }
    data = {
        "endpoints": [
            endpoint("a", "https://api.one.invalid/v1", "KEY_1"),
            endpoint("b", "https://api.one.invalid/v2", "KEY_1"),
            endpoint("c", "https://api.one.invalid/v1", "KEY_2"),
            endpoint("d", "https://api.two.invalid/v1", "KEY_1"),
        ],
        "models": [
            {"name": "g", "mappings": [{"endpoint": e, **mapping} for e in "abcd"]},
        ],
        "workspaces": [
            {"id": "w", "models": ["g"], "regions": ["us-east"], "data_class": "internal"}
        ],
    }
    return parse_config(yaml.safe_dump(data), environ={"KEY_1": "sk-one", "KEY_2": "sk-two"})


def test_a_quota_failover_excludes_every_endpoint_of_the_exhausted_account():
    config = _accounts_config()
    assert "sk-one" not in config.endpoints[0].account  # a digest, never the key
    candidates = evaluate(
        config,
        config.workspaces[0],
        config.models[0],
        Requirements(capabilities=("text",), data_class="internal"),
        RouteContext(tried_endpoints=frozenset({"a"}), quota_exhausted=frozenset({"a"})),
        breaker_open=lambda endpoint_id, mapping: None,
    )
    assert [(c.endpoint, c.reason_code) for c in candidates] == [
        ("a", R.QUOTA_EXHAUSTED),
        ("b", R.QUOTA_EXHAUSTED),
        ("c", None),
        ("d", None),
    ]
    assert candidates[0].detail == "a answered insufficient_quota"
    assert candidates[1].detail == "same provider account as a, which answered insufficient_quota"


def test_quota_failover_is_an_approved_policy_never_a_retry():
    quota = _from(http_status=429, error_code="insufficient_quota")
    assert _decide(quota).reason == "quota_exhausted_stops"
    approved = _defaults(
        on_quota_exhausted="failover",
        retry_same_endpoint={"quota_exhausted": {"max": 3, "backoff_ms": [1, 1]}},
    )
    decision = _decide(quota, approved)
    assert (decision.action, decision.reason) == ("failover", "quota_failover_policy")
    assert decision.policy == "on_quota_exhausted=failover"
    # The caller's header still forbids moving.
    assert _decide(quota, approved, allow_failover=False).reason == "failover_forbidden_by_header"


def test_an_earlier_requests_quota_exhaustion_excludes_the_endpoint_alone():
    config = _accounts_config()
    candidates = evaluate(
        config,
        config.workspaces[0],
        config.models[0],
        Requirements(capabilities=("text",), data_class="internal"),
        RouteContext(),
        breaker_open=lambda endpoint_id, mapping: None,
        quota_exhausted=lambda endpoint_id: "cooling" if endpoint_id == "a" else None,
    )
    assert [(c.endpoint, c.reason_code, c.detail) for c in candidates] == [
        ("a", R.QUOTA_EXHAUSTED, "cooling"),
        ("b", None, None),
        ("c", None, None),
        ("d", None, None),
    ]


# --- ramp-up after a breaker closes (contract §5 "Circuit breakers") ----------------------


def test_a_ramping_mapping_records_its_effective_weight_and_a_full_one_records_none():
    shares = {("east", "small"): Decimal("0.1"), ("west", "claude"): Decimal("0.55")}

    def ramp_share(endpoint_id: str, mapping: Mapping) -> Decimal:
        return shares.get((endpoint_id, mapping.model), Decimal(1))

    candidates = _evaluate(ramp_share=ramp_share)
    assert [c.effective_weight for c in candidates] == [
        Decimal("0.3"),  # weight 3 at the floor
        None,
        Decimal("1.1"),  # weight 2 at 0.55
        None,
        None,
    ]
    assert candidates[0].model_dump(mode="json")["effective_weight"] == "0.300"
    assert "effective_weight" not in candidates[1].model_dump(mode="json")


def test_an_effective_weight_is_never_0_however_small_the_share():
    assert effective_weight(1, Decimal("0.0001")) == Decimal("0.001")
    assert effective_weight(7, Decimal(1)) is None


def _ramped(index: int, weight: int, effective: str | None) -> Candidate:
    candidate = _candidate(index, weight)
    if effective is None:
        return candidate
    return candidate.model_copy(update={"effective_weight": Decimal(effective)})


def test_swrr_shares_follow_the_effective_weights_while_ramping():
    rr = WeightedRoundRobin()
    # A recovered mapping of weight 1 at its floor, beside a steady one of weight 1.
    candidates = [_ramped(0, 1, "0.1"), _ramped(1, 1, None)]
    picks = Counter(_run(rr, KEY, candidates, 110))
    assert picks == {0: 10, 1: 100}


@given(st.lists(st.integers(1, 9), min_size=1, max_size=4), st.integers(1, 60))
def test_swrr_picks_the_same_sequence_with_no_ramp_as_before(weights: list[int], n: int):
    # Ranked in thousandths, unramped weights keep nginx's exact sequence.
    candidates = [_candidate(i, w) for i, w in enumerate(weights)]
    picks = _run(WeightedRoundRobin(), KEY, candidates, n)
    current = [0] * len(weights)
    expected = []
    for _ in range(n):
        current = [c + w for c, w in zip(current, weights, strict=True)]
        best = max(range(len(weights)), key=lambda i: (current[i], -i))
        current[best] -= sum(weights)
        expected.append(best)
    assert picks == expected


# --- a hedge without the grant (failover: on_grant) ---------------------------------------


def test_a_hedge_without_the_grant_excludes_every_endpoint_it_is_not_on():
    context = RouteContext(tried_endpoints=frozenset({"east"}), failover_not_granted=True)
    candidates = _evaluate(context=context)
    assert _reasons(candidates) == [
        "already_tried",  # the running way's endpoint
        "already_tried",
        "failover_not_granted",
        "failover_not_granted",
        "endpoint_disabled",  # a static fact comes first
    ]
    assert candidates[2].detail == (
        "another endpoint than the request's; model group chat fails over on grant only "
        "(X-Waybill-Allow-Failover: true)"
    )
    assert select(candidates, WeightedRoundRobin(), "acme", _group()) is None
