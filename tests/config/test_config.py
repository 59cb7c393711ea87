"""The config contract (contract §2): what validates, what is rejected and with which path."""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from ledger.events import DATA_CLASSES, FailureClass, data_class_rank
from router.adapters.breaker_policy import BreakerSettings
from router.config import (
    FAILURE_CLASSES,
    Breaker,
    Config,
    ConfigError,
    Defaults,
    RetrySameEndpoint,
    load_config,
    parse_config,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "config.example.yaml"
SECRET = "sk-live-DO-NOT-LEAK-0123456789"
ENV = {"OPENAI_API_KEY": SECRET, "ANTHROPIC_API_KEY": SECRET + "-ant"}


def _base() -> dict[str, Any]:
    """A small valid config; tests mutate a deep copy."""
    return {
        "endpoints": [
            {
                "id": "openai-east",
                "driver": "openai",
                "base_url": "https://example.invalid/v1",
                "api_key": "${env:OPENAI_API_KEY}",
                "region": "us-east",
                "data_classes": ["public", "internal"],
            },
            {
                "id": "anthropic-eu",
                "driver": "anthropic",
                "base_url": "https://anthropic.invalid",
                "region": "eu-west",
                "data_classes": ["public"],
            },
        ],
        "models": [
            {
                "name": "chat-default",
                "mappings": [
                    {
                        "endpoint": "openai-east",
                        "model": "gpt-4o-mini",
                        "tier": 0,
                        "weight": 3,
                        "capabilities": ["text", "stream"],
                        "context_window": 128000,
                        "max_output_tokens": 16384,
                        "price": {"input_per_mtok": 0.15, "output_per_mtok": 0.60},
                    },
                    {
                        "endpoint": "anthropic-eu",
                        "model": "claude",
                        "tier": 1,
                        "context_window": 200000,
                        "max_output_tokens": 8192,
                        "price": {"input_per_mtok": 3, "output_per_mtok": 15},
                    },
                ],
            }
        ],
        "workspaces": [
            {
                "id": "acme",
                "models": ["chat-default"],
                "regions": ["us-east"],
                "data_class": "internal",
            }
        ],
    }


def _parse(data: dict[str, Any], environ: dict[str, str] | None = None) -> Config:
    return parse_config(yaml.safe_dump(data), environ=ENV if environ is None else environ)


def _errors(data: dict[str, Any], environ: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        _parse(data, environ)
    return str(caught.value).splitlines()


def _mutated(mutate: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    data = copy.deepcopy(_base())
    mutate(data)
    return data


def _endpoint(data: dict[str, Any], index: int = 0) -> dict[str, Any]:
    endpoint: dict[str, Any] = data["endpoints"][index]
    return endpoint


def _mapping(data: dict[str, Any], index: int = 0) -> dict[str, Any]:
    mapping: dict[str, Any] = data["models"][0]["mappings"][index]
    return mapping


# --- what validates --------------------------------------------------------------------------


def test_example_config_validates() -> None:
    config = load_config(EXAMPLE, environ=ENV)
    assert config.generation == "7"
    assert [e.id for e in config.endpoints] == ["openai-east", "anthropic-eu", "local-vllm"]
    assert config.endpoints[2].api_key is None
    assert config.endpoints[2].enabled is False
    assert config.models[0].mappings[0].price.output_per_mtok == Decimal("0.60")
    assert config.workspaces[1].budget is not None
    assert config.workspaces[1].budget.window == "total"


def test_failover_bench_example_gives_each_scenario_a_primary_endpoint_of_its_own() -> None:
    config = load_config(EXAMPLE.parent / "examples" / "failoverbench.yaml", environ={})
    scenarios = [g for g in config.models if g.name != "fb-ok"]
    assert len(scenarios) == 16
    primaries = [g.mappings[0] for g in scenarios]
    assert all(m.tier == 0 and m.model == g.name for m, g in zip(primaries, scenarios, strict=True))
    assert len({m.endpoint for m in primaries}) == 16  # no breaker is shared by two scenarios
    fallbacks = {g.name: g.mappings[1] for g in scenarios}
    assert {m.endpoint for m in fallbacks.values()} == {"wall-fallbacks"}
    assert {name for name, m in fallbacks.items() if m.model == "fb-ok-noprefill"} == {
        "fb-s14-stream-cut"
    }
    # S12 fails over only to a larger context window.
    assert all(m.tier == 1 and m.context_window > 8192 for m in fallbacks.values())
    assert config.defaults.breaker.max_cooldown_ms <= 15000  # S15's probe lands in time
    assert [w.models for w in config.workspaces] == [tuple(g.name for g in config.models)]


def test_base_config_validates_and_lookups_find_each_object() -> None:
    config = _parse(_base())
    assert config.endpoint("openai-east") is config.endpoints[0]
    assert config.model_group("chat-default") is config.models[0]
    assert config.workspace("acme") is config.workspaces[0]
    assert config.endpoint("nope") is None
    assert config.model_group("nope") is None
    assert config.workspace("nope") is None


# --- errors: exact path and message ---------------------------------------------------------


def _rolling_defaults_and_an_endpoint_threshold(data: dict[str, Any]) -> None:
    data["defaults"] = {"breaker": {"policy": "rolling"}}
    _endpoint(data)["breaker"] = {"failure_threshold": 1}


RETENTION_MESSAGE = "must be none, zero or a number of days such as 30d (1d to 99999d)"
ERROR_CASES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    (
        "unknown_key",
        lambda d: _endpoint(d).update(regoin="us-east"),
        "endpoints[0].regoin: unknown key",
    ),
    (
        "unknown_top_level_key",
        lambda d: d.update(endpionts=[]),
        "endpionts: unknown key",
    ),
    (
        "unknown_endpoint_reference",
        lambda d: _mapping(d, 1).update(endpoint="nowhere"),
        "models[0].mappings[1].endpoint: unknown endpoint 'nowhere'",
    ),
    (
        "zero_weight",
        lambda d: _mapping(d, 1).update(weight=0),
        "models[0].mappings[1].weight: must be > 0",
    ),
    (
        "negative_weight",
        lambda d: _mapping(d).update(weight=-2),
        "models[0].mappings[0].weight: must be > 0",
    ),
    (
        "fractional_weight",
        lambda d: _mapping(d).update(weight=1.5),
        "models[0].mappings[0].weight: must be an integer",
    ),
    (
        "negative_tier",
        lambda d: _mapping(d).update(tier=-1),
        "models[0].mappings[0].tier: must be >= 0",
    ),
    ("missing_price", lambda d: _mapping(d).pop("price"), "models[0].mappings[0].price: required"),
    (
        "missing_input_price",
        lambda d: _mapping(d)["price"].pop("input_per_mtok"),
        "models[0].mappings[0].price.input_per_mtok: required",
    ),
    (
        "negative_price",
        lambda d: _mapping(d)["price"].update(output_per_mtok=-1),
        "models[0].mappings[0].price.output_per_mtok: must be >= 0",
    ),
    (
        "price_not_a_number",
        lambda d: _mapping(d)["price"].update(output_per_mtok="cheap"),
        "models[0].mappings[0].price.output_per_mtok: must be a number",
    ),
    (
        "literal_api_key",
        lambda d: _endpoint(d).update(api_key=SECRET),
        "endpoints[0].api_key: must be a ${env:NAME} reference, never a literal secret",
    ),
    (
        "duplicate_endpoint_id",
        lambda d: d["endpoints"].append({**_endpoint(d, 1), "id": "openai-east"}),
        "endpoints[2].id: duplicate id 'openai-east'",
    ),
    (
        "duplicate_model_group_name",
        lambda d: d["models"].append(copy.deepcopy(d["models"][0])),
        "models[1].name: duplicate name 'chat-default'",
    ),
    (
        "duplicate_workspace_id",
        lambda d: d["workspaces"].append(copy.deepcopy(d["workspaces"][0])),
        "workspaces[1].id: duplicate id 'acme'",
    ),
    (
        "workspace_unknown_model_group",
        lambda d: d["workspaces"][0]["models"].append("chat-nope"),
        "workspaces[0].models[1]: unknown model group 'chat-nope'",
    ),
    (
        "bad_driver",
        lambda d: _endpoint(d).update(driver="gemini"),
        "endpoints[0].driver: must be 'openai' or 'anthropic'",
    ),
    (
        "bad_data_class",
        lambda d: d["workspaces"][0].update(data_class="secret"),
        "workspaces[0].data_class: must be 'public', 'internal' or 'restricted'",
    ),
    (
        "endpoint_timeouts_unknown_key",
        lambda d: _endpoint(d).update(timeouts={"connect_timeout_ms": 500}),
        "endpoints[0].timeouts.connect_timeout_ms: unknown key",
    ),
    (
        "endpoint_timeouts_not_positive",
        lambda d: _endpoint(d).update(timeouts={"first_token_timeout_ms": 0}),
        "endpoints[0].timeouts.first_token_timeout_ms: must be > 0",
    ),
    (
        "endpoint_timeouts_not_an_integer",
        lambda d: _endpoint(d).update(timeouts={"attempt_timeout_ms": "2s"}),
        "endpoints[0].timeouts.attempt_timeout_ms: must be an integer",
    ),
    (
        "endpoint_timeouts_not_a_mapping",
        lambda d: _endpoint(d).update(timeouts=5000),
        "endpoints[0].timeouts: must be a mapping",
    ),
    (
        "bad_endpoint_retention",
        lambda d: _endpoint(d).update(retention="30 days"),
        "endpoints[0].retention: " + RETENTION_MESSAGE,
    ),
    (
        "zero_days_endpoint_retention",
        lambda d: _endpoint(d).update(retention="0d"),
        "endpoints[0].retention: " + RETENTION_MESSAGE,
    ),
    (
        "bad_workspace_retention",
        lambda d: d["workspaces"][0].update(retention="forever"),
        "workspaces[0].retention: " + RETENTION_MESSAGE,
    ),
    (
        "numeric_workspace_retention",
        lambda d: d["workspaces"][0].update(retention=30),
        "workspaces[0].retention: must be a string",
    ),
    (
        "bad_endpoint_data_class",
        lambda d: _endpoint(d)["data_classes"].append("top-secret"),
        "endpoints[0].data_classes[2]: must be 'public', 'internal' or 'restricted'",
    ),
    (
        "bad_on_credentials_error",
        lambda d: d.update(defaults={"on_credentials_error": "retry"}),
        "defaults.on_credentials_error: must be 'stop' or 'failover'",
    ),
    (
        "bad_budget_window",
        lambda d: d["workspaces"][0].update(budget={"limit_usd": 5, "window": "week"}),
        "workspaces[0].budget.window: must be 'day', 'month' or 'total'",
    ),
    (
        "string_for_integer",
        lambda d: d.update(defaults={"max_attempts": "four"}),
        "defaults.max_attempts: must be an integer",
    ),
    (
        "boolean_for_integer",
        lambda d: d.update(defaults={"max_attempts": True}),
        "defaults.max_attempts: must be an integer",
    ),
    (
        "zero_max_attempts",
        lambda d: d.update(defaults={"max_attempts": 0}),
        "defaults.max_attempts: must be > 0",
    ),
    (
        "string_for_boolean",
        lambda d: _endpoint(d).update(enabled="maybe"),
        "endpoints[0].enabled: must be a boolean (true or false)",
    ),
    (
        "integer_for_name",
        lambda d: _endpoint(d).update(region=5),
        "endpoints[0].region: must be a string",
    ),
    (
        "mapping_for_list",
        lambda d: d.update(endpoints={"id": "x"}),
        "endpoints: must be a list",
    ),
    (
        "scalar_for_mapping",
        lambda d: d.update(defaults="fast"),
        "defaults: must be a mapping",
    ),
    ("missing_section", lambda d: d.pop("workspaces"), "workspaces: required"),
    (
        "empty_mappings",
        lambda d: d["models"][0].update(mappings=[]),
        "models[0]: a model group lists mappings, pools, or both: it has neither",
    ),
    (
        "unknown_failure_class",
        lambda d: d.update(defaults={"retry_same_endpoint": {"overloaded": {"max": 1}}}),
        "defaults.retry_same_endpoint.overloaded: unknown failure class; expected one of "
        + ", ".join(FAILURE_CLASSES),
    ),
    (
        "backoff_out_of_order",
        lambda d: d.update(
            defaults={"retry_same_endpoint": {"upstream_unavailable": {"backoff_ms": [500, 100]}}}
        ),
        "defaults.retry_same_endpoint.upstream_unavailable.backoff_ms: "
        "must be [lo, hi] with lo <= hi",
    ),
    (
        "backoff_wrong_length",
        lambda d: d.update(
            defaults={"retry_same_endpoint": {"upstream_unavailable": {"backoff_ms": [1, 2, 3]}}}
        ),
        "defaults.retry_same_endpoint.upstream_unavailable.backoff_ms: must have at most 2 items",
    ),
    (
        "breaker_cooldowns_out_of_order",
        lambda d: d.update(defaults={"breaker": {"base_cooldown_ms": 60000}}),
        "defaults.breaker: base_cooldown_ms must be <= max_cooldown_ms",
    ),
    (
        "base_url_not_http",
        lambda d: _endpoint(d).update(base_url="ftp://example.invalid"),
        "endpoints[0].base_url: must be an http:// or https:// URL",
    ),
    (
        "base_url_with_credentials",
        lambda d: _endpoint(d).update(base_url="https://user:pw@example.invalid/v1"),
        "endpoints[0].base_url: must not embed credentials; use api_key",
    ),
    (
        "output_larger_than_context",
        lambda d: _mapping(d).update(max_output_tokens=200000),
        "models[0].mappings[0]: max_output_tokens must be <= context_window",
    ),
    (
        "uppercase_capability",
        lambda d: _mapping(d).update(capabilities=["Vision"]),
        "models[0].mappings[0].capabilities[0]: must be a lowercase capability token such as "
        "'vision'",
    ),
    (
        "name_with_space",
        lambda d: _endpoint(d).update(region="us east"),
        "endpoints[0].region: must be a non-empty name without spaces",
    ),
    (
        "bad_kind",
        lambda d: d["models"][0].update(kind="embedding"),
        "models[0].kind: must be 'chat' or 'embeddings'",
    ),
    (
        "bad_generation",
        lambda d: d.update(generation=[1]),
        "generation: must be an integer or a non-empty string",
    ),
    (
        "zero_max_n",
        lambda d: d.update(limits={"max_n": 0}),
        "limits.max_n: must be > 0",
    ),
    (
        "unknown_limit",
        lambda d: d.update(limits={"max_choices": 4}),
        "limits.max_choices: unknown key",
    ),
    (
        "image_input_without_tokens",
        lambda d: _mapping(d)["price"].update(image_input={"per_mtok": 1}),
        "models[0].mappings[0].price.image_input.tokens: required",
    ),
    (
        "negative_audio_input_tokens",
        lambda d: _mapping(d)["price"].update(audio_input={"tokens": -5}),
        "models[0].mappings[0].price.audio_input.tokens: must be >= 0",
    ),
    (
        "file_input_price_not_a_number",
        lambda d: _mapping(d)["price"].update(file_input={"tokens": 10, "per_mtok": "dear"}),
        "models[0].mappings[0].price.file_input.per_mtok: must be a number",
    ),
    (
        "audio_output_without_price",
        lambda d: _mapping(d)["price"].update(audio_output={}),
        "models[0].mappings[0].price.audio_output.per_mtok: required",
    ),
    (
        "web_search_negative",
        lambda d: _mapping(d)["price"].update(web_search={"per_choice_usd": -1}),
        "models[0].mappings[0].price.web_search.per_choice_usd: must be >= 0",
    ),
    (
        "unknown_group_policy_key",
        lambda d: d["models"][0].update(policy={"max_attempt": 2}),
        "models[0].policy.max_attempt: unknown key; a model group's policy takes the keys of "
        "defaults: max_attempts, deadline_ms, attempt_timeout_ms, first_token_timeout_ms, "
        "stream_idle_timeout_ms, retry_same_endpoint, on_credentials_error, "
        "on_unknown_execution, on_invalid_output, hedge, failover, on_quota_exhausted",
    ),
    (
        "group_policy_breaker",
        lambda d: d["models"][0].update(policy={"breaker": {"failure_threshold": 1}}),
        "models[0].policy.breaker: breakers belong to endpoints and mappings, which model groups "
        "share: set breaker under defaults or on an endpoint",
    ),
    (
        "group_policy_bad_value",
        lambda d: d["models"][0].update(policy={"on_unknown_execution": "halt"}),
        "models[0].policy.on_unknown_execution: must be 'failover' or 'stop'",
    ),
    (
        "group_policy_bad_failover",
        lambda d: d["models"][0].update(policy={"failover": "granted"}),
        "models[0].policy.failover: must be 'allowed' or 'on_grant'",
    ),
    (
        "group_policy_bad_on_quota_exhausted",
        lambda d: d["models"][0].update(policy={"on_quota_exhausted": "retry"}),
        "models[0].policy.on_quota_exhausted: must be 'stop' or 'failover'",
    ),
    (
        "defaults_bad_failover",
        lambda d: d.update(defaults={"failover": True}),
        "defaults.failover: must be 'allowed' or 'on_grant'",
    ),
    (
        "group_policy_zero_deadline",
        lambda d: d["models"][0].update(policy={"deadline_ms": 0}),
        "models[0].policy.deadline_ms: must be > 0",
    ),
    (
        "group_policy_unknown_failure_class",
        lambda d: d["models"][0].update(policy={"retry_same_endpoint": {"busy": {"max": 1}}}),
        "models[0].policy.retry_same_endpoint.busy: unknown failure class; expected one of "
        + ", ".join(FAILURE_CLASSES),
    ),
    (
        "group_policy_merged_backoff_out_of_order",
        # The group's lo above the defaults' hi: checked on the merged rule.
        lambda d: d["models"][0].update(
            policy={"retry_same_endpoint": {"upstream_unavailable": {"backoff_ms": [900, 100]}}}
        ),
        "models[0].policy.retry_same_endpoint.upstream_unavailable.backoff_ms: "
        "must be [lo, hi] with lo <= hi",
    ),
    (
        "group_policy_not_a_mapping",
        lambda d: d["models"][0].update(policy=["stop"]),
        "models[0].policy: must be a mapping",
    ),
    (
        "group_policy_hedge_max_ways",
        lambda d: d["models"][0].update(policy={"hedge": {"enabled": True, "max_ways": 1}}),
        "models[0].policy.hedge.max_ways: must be >= 2",
    ),
    (
        "after_p95_not_a_boolean",
        lambda d: d.update(defaults={"hedge": {"after_p95": "yes"}}),
        "defaults.hedge.after_p95: must be a boolean (true or false)",
    ),
    (
        "cache_write_price_on_openai",
        lambda d: _mapping(d)["price"].update(cache_write_per_mtok=3.75),
        "models[0].mappings[0].price.cache_write_per_mtok: only an anthropic endpoint bills "
        "prompt-cache writes; endpoint 'openai-east' reports none",
    ),
    (
        "cache_write_negative",
        lambda d: _mapping(d, 1)["price"].update(cache_write_1h_per_mtok=-1),
        "models[0].mappings[1].price.cache_write_1h_per_mtok: must be >= 0",
    ),
    (
        "unknown_resume",
        lambda d: _mapping(d).update(resume="prefill"),
        "models[0].mappings[0].resume: must be 'none', 'assistant_prefill', 'prefix_flag' or "
        "'continue_final_message'",
    ),
    (
        "prefix_flag_on_anthropic",
        lambda d: _mapping(d, 1).update(resume="prefix_flag"),
        "models[0].mappings[1].resume: prefix_flag is an OpenAI-compatible server's convention; "
        "endpoint 'anthropic-eu' (driver anthropic) continues a trailing assistant message "
        "itself: use assistant_prefill",
    ),
    (
        "continue_final_message_on_anthropic",
        lambda d: _mapping(d, 1).update(resume="continue_final_message"),
        "models[0].mappings[1].resume: continue_final_message is an OpenAI-compatible server's "
        "convention; endpoint 'anthropic-eu' (driver anthropic) continues a trailing assistant "
        "message itself: use assistant_prefill",
    ),
    (
        "rolling_key_under_consecutive",
        lambda d: d.update(defaults={"breaker": {"failure_rate": 0.5, "window_calls": 10}}),
        "defaults.breaker: window_calls, failure_rate: only with policy: rolling",
    ),
    (
        "failure_threshold_under_rolling",
        lambda d: d.update(defaults={"breaker": {"policy": "rolling", "failure_threshold": 3}}),
        "defaults.breaker: failure_threshold counts failures in a row (policy: consecutive); "
        "policy rolling opens at failure_rate",
    ),
    (
        "unknown_breaker_policy",
        lambda d: d.update(defaults={"breaker": {"policy": "adaptive"}}),
        "defaults.breaker.policy: must be 'consecutive' or 'rolling'",
    ),
    (
        "both_windows",
        lambda d: d.update(
            defaults={"breaker": {"policy": "rolling", "window_calls": 10, "window_ms": 10000}}
        ),
        "defaults.breaker: give window_calls or window_ms, not both",
    ),
    (
        "window_ms_not_in_tenths",
        lambda d: d.update(defaults={"breaker": {"policy": "rolling", "window_ms": 10005}}),
        "defaults.breaker: window_ms must be a multiple of 10",
    ),
    (
        "window_ms_below_a_second",
        lambda d: d.update(defaults={"breaker": {"policy": "rolling", "window_ms": 500}}),
        "defaults.breaker.window_ms: must be >= 1000",
    ),
    (
        "window_calls_too_large",
        lambda d: d.update(defaults={"breaker": {"policy": "rolling", "window_calls": 1001}}),
        "defaults.breaker.window_calls: must be <= 1000",
    ),
    (
        "minimum_calls_beyond_the_window",
        lambda d: d.update(
            defaults={"breaker": {"policy": "rolling", "window_calls": 5, "minimum_calls": 6}}
        ),
        "defaults.breaker: minimum_calls must be <= window_calls: the window holds no more",
    ),
    (
        "failure_rate_above_one",
        lambda d: d.update(defaults={"breaker": {"policy": "rolling", "failure_rate": 1.5}}),
        "defaults.breaker.failure_rate: must be > 0 and <= 1",
    ),
    (
        "failure_rate_zero",
        lambda d: d.update(defaults={"breaker": {"policy": "rolling", "failure_rate": 0}}),
        "defaults.breaker.failure_rate: must be > 0 and <= 1",
    ),
    (
        "failure_rate_too_precise",
        lambda d: d.update(defaults={"breaker": {"policy": "rolling", "failure_rate": 0.33333}}),
        "defaults.breaker.failure_rate: must have at most 4 decimal places",
    ),
    (
        "slow_call_rate_without_slow_call_ms",
        lambda d: d.update(defaults={"breaker": {"policy": "rolling", "slow_call_rate": 0.5}}),
        "defaults.breaker: slow_call_rate needs slow_call_ms: which calls are slow",
    ),
    (
        "ramp_up_ms_negative",
        lambda d: d.update(defaults={"breaker": {"ramp_up_ms": -1}}),
        "defaults.breaker.ramp_up_ms: must be >= 0",
    ),
    (
        "ramp_up_ms_beyond_a_day",
        lambda d: d.update(defaults={"breaker": {"ramp_up_ms": 86_400_001}}),
        "defaults.breaker.ramp_up_ms: must be <= 86400000",
    ),
    (
        "ramp_up_ms_not_a_number",
        lambda d: d.update(defaults={"breaker": {"ramp_up_ms": "soon"}}),
        "defaults.breaker.ramp_up_ms: must be an integer",
    ),
    (
        "ramp_up_floor_zero",
        lambda d: d.update(defaults={"breaker": {"ramp_up_ms": 1000, "ramp_up_floor": 0}}),
        "defaults.breaker.ramp_up_floor: must be > 0 and <= 1",
    ),
    (
        "ramp_up_floor_above_one",
        lambda d: d.update(defaults={"breaker": {"ramp_up_ms": 1000, "ramp_up_floor": 1.5}}),
        "defaults.breaker.ramp_up_floor: must be > 0 and <= 1",
    ),
    (
        "ramp_up_floor_too_precise",
        lambda d: d.update(defaults={"breaker": {"ramp_up_ms": 1000, "ramp_up_floor": 0.1234}}),
        "defaults.breaker.ramp_up_floor: must have at most 3 decimal places",
    ),
    (
        "ramp_up_floor_without_ramp_up_ms",
        lambda d: d.update(defaults={"breaker": {"ramp_up_floor": 0.5}}),
        "defaults.breaker: ramp_up_floor needs ramp_up_ms: how long the ramp-up lasts",
    ),
    (
        "endpoint_ramp_up_floor_bad",
        lambda d: _endpoint(d, 1).update(breaker={"ramp_up_ms": 500, "ramp_up_floor": "x"}),
        "endpoints[1].breaker.ramp_up_floor: must be a number",
    ),
    (
        "unknown_priced_dimension",
        lambda d: _mapping(d)["price"].update(video_input={"tokens": 1}),
        "models[0].mappings[0].price.video_input: unknown key",
    ),
    (
        "endpoint_breaker_bad_rate",
        lambda d: _endpoint(d, 1).update(breaker={"policy": "rolling", "failure_rate": 1.5}),
        "endpoints[1].breaker.failure_rate: must be > 0 and <= 1",
    ),
    (
        "endpoint_breaker_unknown_key",
        lambda d: _endpoint(d).update(breaker={"threshold": 1}),
        "endpoints[0].breaker.threshold: unknown key",
    ),
    (
        "endpoint_breaker_not_a_mapping",
        lambda d: _endpoint(d).update(breaker=3),
        "endpoints[0].breaker: must be a mapping",
    ),
    (
        "endpoint_breaker_rolling_key_under_consecutive_defaults",
        lambda d: _endpoint(d).update(breaker={"window_calls": 10}),
        "endpoints[0].breaker: window_calls: only with policy: rolling",
    ),
    (
        "endpoint_breaker_failure_threshold_under_rolling_defaults",
        _rolling_defaults_and_an_endpoint_threshold,
        "endpoints[0].breaker: failure_threshold counts failures in a row (policy: consecutive); "
        "policy rolling opens at failure_rate",
    ),
    (
        # Judged merged: the endpoint's base above the max cool-down defaults give it.
        "endpoint_breaker_base_cooldown_above_the_defaults_max",
        lambda d: _endpoint(d).update(breaker={"base_cooldown_ms": 60000}),
        "endpoints[0].breaker: base_cooldown_ms must be <= max_cooldown_ms",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [pytest.param(m, e, id=name) for name, m, e in ERROR_CASES],
)
def test_each_invalid_config_reports_exactly_its_path_and_message(
    mutate: Callable[[dict[str, Any]], None], expected: str
) -> None:
    assert _errors(_mutated(mutate)) == [expected]


def test_unresolvable_env_reference_is_an_error_at_its_path() -> None:
    assert _errors(_base(), environ={}) == [
        "endpoints[0].api_key: unresolvable ${env:OPENAI_API_KEY}: "
        "environment variable 'OPENAI_API_KEY' is not set"
    ]


def test_empty_env_value_is_an_error() -> None:
    assert _errors(_base(), environ={"OPENAI_API_KEY": ""}) == [
        "endpoints[0].api_key: unresolvable ${env:OPENAI_API_KEY}: "
        "environment variable 'OPENAI_API_KEY' is empty"
    ]


def test_config_error_carries_a_list_of_path_message_pairs() -> None:
    data = _mutated(lambda d: _mapping(d, 1).update(weight=0))
    with pytest.raises(ConfigError) as caught:
        _parse(data)
    assert caught.value.errors == (("models[0].mappings[1].weight", "must be > 0"),)


def test_several_errors_are_all_reported_together() -> None:
    def mutate(d: dict[str, Any]) -> None:
        _endpoint(d).update(regoin="x")
        _mapping(d).update(weight=0, tier=-1)
        _mapping(d, 1).update(endpoint="nowhere")
        d["workspaces"][0]["models"] = ["chat-nope"]
        d["endpoints"].append({**_endpoint(d, 1), "id": "openai-east"})

    assert sorted(_errors(_mutated(mutate), environ={})) == sorted(
        [
            "endpoints[0].regoin: unknown key",
            "endpoints[0].api_key: unresolvable ${env:OPENAI_API_KEY}: "
            "environment variable 'OPENAI_API_KEY' is not set",
            "models[0].mappings[0].tier: must be >= 0",
            "models[0].mappings[0].weight: must be > 0",
            "models[0].mappings[1].endpoint: unknown endpoint 'nowhere'",
            "endpoints[2].id: duplicate id 'openai-east'",
            "workspaces[0].models[0]: unknown model group 'chat-nope'",
        ]
    )


def test_a_broken_endpoints_section_does_not_also_flag_every_reference() -> None:
    assert _errors(_mutated(lambda d: d.update(endpoints="none"))) == ["endpoints: must be a list"]


# --- errors: the file itself ------------------------------------------------------------------


def test_yaml_syntax_error_names_the_line() -> None:
    text = "endpoints:\n  - id: a\n    driver: [openai\n"
    with pytest.raises(ConfigError) as caught:
        parse_config(text, source="gw.yaml")
    (line,) = str(caught.value).splitlines()
    assert line.startswith("gw.yaml: invalid YAML: line 4, column 1: ")


def test_duplicate_yaml_key_is_an_error_with_its_line() -> None:
    text = "generation: 1\ndefaults:\n  max_attempts: 2\n  max_attempts: 3\n"
    with pytest.raises(ConfigError) as caught:
        parse_config(text, source="gw.yaml")
    assert str(caught.value) == (
        "gw.yaml: invalid YAML: line 4, column 3: duplicate key 'max_attempts'"
    )


def test_non_string_yaml_key_is_an_error() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config("on: 1\n", source="gw.yaml")
    assert str(caught.value) == (
        "gw.yaml: invalid YAML: line 1, column 1: keys must be strings (quote this one)"
    )


def test_yaml_anchors_and_merge_keys_still_work() -> None:
    data = _base()
    text = yaml.safe_dump({k: v for k, v in data.items() if k != "endpoints"}) + (
        "endpoints:\n"
        "  - &east {id: openai-east, driver: openai, base_url: 'https://a.invalid',"
        " region: us-east, data_classes: [public]}\n"
        "  - <<: *east\n"
        "    id: anthropic-eu\n"  # overrides the merged id: not a duplicate key
        "    driver: anthropic\n"
    )
    config = parse_config(text, environ=ENV)
    assert [(e.id, e.driver, e.region) for e in config.endpoints] == [
        ("openai-east", "openai", "us-east"),
        ("anthropic-eu", "anthropic", "us-east"),
    ]


def test_top_level_that_is_not_a_mapping_is_an_error() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config("- a\n- b\n", source="gw.yaml")
    assert str(caught.value) == "gw.yaml: must be a mapping of config keys, not a list"


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "---\n"])
def test_empty_file_is_an_error(text: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, source="gw.yaml")
    assert str(caught.value) == "gw.yaml: empty config file"


def test_missing_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == f"{path}: file not found"


def test_directory_instead_of_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path)
    assert str(caught.value).startswith(f"{tmp_path}: cannot read file: ")


def test_non_utf8_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"generation: caf\xe9\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == f"{path}: not UTF-8 text"


# --- secrets ------------------------------------------------------------------------------------


def test_env_references_resolve_from_the_given_environ() -> None:
    data = _mutated(lambda d: _endpoint(d).update(base_url="https://${env:GW_HOST}/v1"))
    config = _parse(data, environ={"OPENAI_API_KEY": "k-1", "GW_HOST": "api.example.invalid"})
    api_key = config.endpoints[0].api_key
    assert api_key is not None
    assert api_key.get_secret_value() == "k-1"
    assert config.endpoints[0].base_url == "https://api.example.invalid/v1"
    assert config.endpoints[1].api_key is None


def test_env_references_default_to_the_process_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "from-process")
    config = parse_config(yaml.safe_dump(_base()))
    api_key = config.endpoints[0].api_key
    assert api_key is not None
    assert api_key.get_secret_value() == "from-process"


def test_secret_never_appears_in_repr_str_dumps_or_summary() -> None:
    config = load_config(EXAMPLE, environ=ENV)
    renderings = [
        repr(config),
        str(config),
        repr(config.endpoints[0]),
        config.model_dump_json(),
        str(config.model_dump()),
        json.dumps(config.redacted_summary()),
    ]
    for text in renderings:
        assert SECRET not in text
    api_key = config.endpoints[0].api_key
    assert api_key is not None
    assert api_key.get_secret_value() == SECRET


def test_literal_secret_is_not_echoed_by_the_error_or_its_context() -> None:
    data = _mutated(lambda d: _endpoint(d).update(api_key=SECRET))
    with pytest.raises(ConfigError) as caught:
        _parse(data)
    assert SECRET not in str(caught.value)
    assert SECRET not in repr(caught.value.errors)
    # No chained pydantic error (whose text would quote the input value).
    assert caught.value.__cause__ is None
    assert caught.value.__context__ is None


def test_yaml_error_does_not_quote_the_offending_line() -> None:
    text = f"endpoints:\n  - api_key: {SECRET}\n   bad: [\n"
    with pytest.raises(ConfigError) as caught:
        parse_config(text)
    assert SECRET not in str(caught.value)


def test_redacted_summary_is_json_and_records_only_the_host() -> None:
    data = _mutated(
        lambda d: _endpoint(d).update(base_url="https://api.example.invalid:8443/v1?tenant=t")
    )
    summary = _parse(data).redacted_summary()
    assert json.loads(json.dumps(summary)) == summary
    endpoint = summary["endpoints"][0]
    assert endpoint["base_url_host"] == "api.example.invalid:8443"
    assert endpoint["has_api_key"] is True
    assert "tenant" not in json.dumps(summary)
    assert summary["models"][0]["mappings"][0]["price"] == {
        "input_per_mtok": "0.15",
        "output_per_mtok": "0.6",
        "cached_input_per_mtok": "0.15",
    }
    assert summary["workspaces"][0]["budget"] is None


# --- money, generation, immutability -------------------------------------------------------


def test_prices_are_exact_decimals() -> None:
    config = parse_config(
        yaml.safe_dump(_base()).replace("input_per_mtok: 0.15", "input_per_mtok: 0.1"),
        environ=ENV,
    )
    price = config.models[0].mappings[0].price
    assert price.input_per_mtok == Decimal("0.1")
    assert price.input_per_mtok * 3 == Decimal("0.3")  # 0.1 * 3 != 0.3 in float
    assert _parse(_base()).models[0].mappings[0].price.input_per_mtok == Decimal("0.15")
    assert isinstance(price.output_per_mtok, Decimal)


def test_money_accepts_quoted_decimal_strings() -> None:
    data = _mutated(
        lambda d: d["workspaces"][0].update(budget={"limit_usd": "12.345", "window": "day"})
    )
    budget = _parse(data).workspaces[0].budget
    assert budget is not None
    assert budget.limit_usd == Decimal("12.345")


def test_limits_default_to_eight_choices_and_take_the_configs() -> None:
    assert _parse(_base()).limits.max_n == 8
    assert _parse(_mutated(lambda d: d.update(limits={"max_n": 128}))).limits.max_n == 128


def test_priced_dimensions_are_exact_and_absent_unless_given() -> None:
    def priced(d: dict[str, Any]) -> None:
        _mapping(d)["price"].update(
            image_input={"tokens": 1105},
            audio_input={"tokens": 20000, "per_mtok": "40"},
            audio_output={"per_mtok": 80},
            web_search={"per_choice_usd": "0.025"},
        )

    config = _parse(_mutated(priced))
    price = config.models[0].mappings[0].price
    assert price.image_input is not None and price.image_input.tokens == 1105
    assert price.image_input.per_mtok is None  # the input price applies
    assert price.audio_input is not None and price.audio_input.per_mtok == Decimal("40")
    assert price.web_search is not None and price.web_search.per_choice_usd == Decimal("0.025")
    assert price.file_input is None
    summary = config.redacted_summary()["models"][0]["mappings"][0]["price"]
    assert summary["image_input"] == {"tokens": 1105}
    assert summary["audio_input"] == {"tokens": 20000, "per_mtok": "40"}
    assert summary["web_search"] == {"per_choice_usd": "0.025"}
    assert "file_input" not in summary
    assert _parse(_base()).models[0].mappings[1].price.image_input is None


def test_cached_input_price_defaults_to_the_input_price() -> None:
    mappings = _parse(_base()).models[0].mappings
    assert mappings[0].price.cached_input_per_mtok == Decimal("0.15")
    assert mappings[1].price.cached_input_per_mtok == Decimal("3")


def test_generation_defaults_to_a_hash_of_the_bytes() -> None:
    text = yaml.safe_dump(_base())
    config = parse_config(text, environ=ENV)
    assert config.generation == hashlib.sha256(text.encode()).hexdigest()[:12]
    assert parse_config(text, environ=ENV).generation == config.generation
    assert parse_config(text + "# edited\n", environ=ENV).generation != config.generation


def test_generation_of_a_file_hashes_its_raw_bytes(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_bytes(yaml.safe_dump(_base()).encode())
    expected = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    assert load_config(path, environ=ENV).generation == expected


@pytest.mark.parametrize(("value", "expected"), [(7, "7"), ("2024-06-blue", "2024-06-blue")])
def test_explicit_generation_is_kept_as_a_string(value: object, expected: str) -> None:
    assert _parse(_mutated(lambda d: d.update(generation=value))).generation == expected


def test_config_objects_are_frozen() -> None:
    config = _parse(_base())
    with pytest.raises(ValidationError):
        config.generation = "other"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        config.models[0].mappings[0].weight = 9  # type: ignore[misc]
    with pytest.raises(ValidationError):
        config.defaults.breaker.failure_threshold = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        config.endpoints.append(config.endpoints[0])  # type: ignore[attr-defined]


# --- defaults ----------------------------------------------------------------------------------

# contract §2's values, written out independently of the code that applies them.
SPEC_DEFAULTS: dict[str, Any] = {
    "max_attempts": 4,
    "deadline_ms": 60000,
    "attempt_timeout_ms": 30000,
    "first_token_timeout_ms": 10000,
    "stream_idle_timeout_ms": 15000,
    "retry_same_endpoint": {
        "rate_limited": {"max": 1, "max_retry_after_ms": 5000},
        "upstream_unavailable": {"max": 1, "backoff_ms": [100, 500]},
        "timeout": {"max": 0},
    },
    "breaker": {"failure_threshold": 2, "base_cooldown_ms": 5000, "max_cooldown_ms": 30000},
    "on_credentials_error": "stop",
    "on_unknown_execution": "failover",
    "hedge": {"enabled": False, "after_ms": 2000, "max_ways": 2},
}


@given(st.sets(st.sampled_from(sorted(SPEC_DEFAULTS))))
def test_every_spec_default_applies_when_omitted(written: set[str]) -> None:
    data = _base()
    data["defaults"] = {key: SPEC_DEFAULTS[key] for key in written}
    assert (
        _parse(data).defaults
        == _parse(_mutated(lambda d: d.update(defaults=SPEC_DEFAULTS))).defaults
    )


def test_omitted_defaults_equal_the_spec_values() -> None:
    defaults = _parse(_base()).defaults
    assert defaults == Defaults()
    retry = defaults.retry_same_endpoint
    rate_limited = retry.rule(FailureClass.RATE_LIMITED)
    assert (rate_limited.max, rate_limited.max_retry_after_ms) == (1, 5000)
    unavailable = retry.rule(FailureClass.UPSTREAM_UNAVAILABLE)
    assert (unavailable.max, unavailable.backoff_ms) == (1, (100, 500))
    assert retry.rule(FailureClass.TIMEOUT).max == 0
    assert all(
        retry.rule(c).max == 0
        for c in FailureClass
        if c not in SPEC_DEFAULTS["retry_same_endpoint"]
    )
    endpoint, mapping = _parse(_base()).endpoints[1], _parse(_base()).models[0].mappings[1]
    assert (endpoint.trust_not_started, endpoint.enabled) == (False, True)
    assert endpoint.max_response_bytes == 8 * 1024 * 1024
    assert (mapping.weight, mapping.capabilities) == (1, frozenset({"text"}))
    assert _parse(_base()).models[0].kind == "chat"


def test_overriding_one_retry_rule_keeps_the_others() -> None:
    data = _mutated(
        lambda d: d.update(defaults={"retry_same_endpoint": {"rate_limited": {"max": 3}}})
    )
    retry = _parse(data).defaults.retry_same_endpoint
    rate_limited = retry.rule(FailureClass.RATE_LIMITED)
    assert (rate_limited.max, rate_limited.max_retry_after_ms) == (3, 5000)
    assert retry.rule(FailureClass.UPSTREAM_UNAVAILABLE).max == 1


def test_retry_rules_cover_exactly_the_failure_classes() -> None:
    assert tuple(RetrySameEndpoint.model_fields) == FAILURE_CLASSES
    assert tuple(c.value for c in FailureClass) == FAILURE_CLASSES
    assert all(RetrySameEndpoint().rule(c) is not None for c in FailureClass)


def test_an_endpoints_timeouts_are_laid_over_the_groups_policy_key_by_key() -> None:
    data = _mutated(lambda d: _endpoint(d).update(timeouts={"first_token_timeout_ms": 700}))
    config = parse_config(yaml.safe_dump(data), environ=ENV)
    own = config.endpoints[0].timeouts
    assert own is not None and config.endpoints[1].timeouts is None
    policy = Defaults(attempt_timeout_ms=9000, first_token_timeout_ms=4000)
    laid = own.over(policy)
    assert (laid.attempt_timeout_ms, laid.first_token_timeout_ms) == (9000, 700)
    assert laid.stream_idle_timeout_ms == policy.stream_idle_timeout_ms
    assert laid.max_attempts == policy.max_attempts
    summary = config.redacted_summary()["endpoints"]
    assert summary[0]["timeouts"] == {"first_token_timeout_ms": 700}
    assert "timeouts" not in summary[1]


def test_retention_is_read_from_endpoints_and_workspaces_and_summarized() -> None:
    data = _mutated(lambda d: _endpoint(d).update(retention="30d"))
    data["workspaces"][0]["retention"] = "zero"
    config = parse_config(yaml.safe_dump(data), environ=ENV)
    assert (config.endpoints[0].retention, config.endpoints[1].retention) == ("30d", None)
    assert config.workspaces[0].retention == "zero"
    summary = config.redacted_summary()
    assert summary["endpoints"][0]["retention"] == "30d"
    assert "retention" not in summary["endpoints"][1]
    assert summary["workspaces"][0]["retention"] == "zero"


def test_data_classes_rank_public_below_internal_below_restricted() -> None:
    assert [data_class_rank(c) for c in DATA_CLASSES] == [0, 1, 2]
    assert DATA_CLASSES == ("public", "internal", "restricted")


def test_hedging_is_configured_in_defaults() -> None:
    config = _parse(
        _mutated(
            lambda d: d.setdefault("defaults", {}).update(
                hedge={"enabled": True, "after_ms": 250, "max_ways": 3}
            )
        )
    )
    assert config.defaults.hedge.enabled and config.defaults.hedge.after_ms == 250
    errors = _errors(_mutated(lambda d: d.setdefault("defaults", {}).update(hedge={"max_ways": 1})))
    assert len(errors) == 1 and errors[0].startswith("defaults.hedge.max_ways: ")


# --- provider identity and admin key (reconciliation against provider reports) -------------


def test_an_endpoint_names_its_provider_identity_and_admin_key_by_reference() -> None:
    admin = "sk-admin-" + SECRET

    def identify(d: dict[str, Any]) -> None:
        _endpoint(d).update(
            provider_project_id="proj_east",
            provider_api_key_id="key_east",
            admin_api_key="${env:OPENAI_ADMIN_KEY}",
        )
        _endpoint(d, 1).update(
            provider_workspace_id="wrkspc_1", admin_base_url="https://admin.invalid"
        )

    config = _parse(_mutated(identify), {**ENV, "OPENAI_ADMIN_KEY": admin})
    east, claude = config.endpoints
    assert (east.provider_project_id, east.provider_api_key_id) == ("proj_east", "key_east")
    assert east.admin_api_key is not None and east.admin_api_key.get_secret_value() == admin
    assert east.admin_url == "https://example.invalid/v1"  # base_url, by default
    assert claude.admin_url == "https://admin.invalid"
    summary = config.redacted_summary()["endpoints"]
    assert summary[0]["provider_identity"] == {"project_id": "proj_east", "api_key_id": "key_east"}
    assert summary[0]["has_admin_api_key"] and not summary[1]["has_admin_api_key"]
    for text in (json.dumps(config.redacted_summary()), repr(config), config.model_dump_json()):
        assert admin not in text


def test_a_literal_admin_key_or_an_id_the_provider_does_not_report_is_refused() -> None:
    literal = _mutated(lambda d: _endpoint(d).update(admin_api_key="sk-admin-" + SECRET))
    assert _errors(literal) == [
        "endpoints[0].admin_api_key: must be a ${env:NAME} reference, never a literal secret"
    ]
    assert _errors(_mutated(lambda d: _endpoint(d).update(provider_workspace_id="w"))) == [
        "endpoints[0]: provider_workspace_id is not an id openai reports name"
    ]
    assert _errors(_mutated(lambda d: _endpoint(d, 1).update(provider_project_id="p"))) == [
        "endpoints[1]: provider_project_id is not an id anthropic reports name"
    ]
    assert _errors(_mutated(lambda d: _endpoint(d).update(admin_base_url="ftp://x"))) == [
        "endpoints[0].admin_base_url: must be an http:// or https:// URL"
    ]


# --- a model group's policy ------------------------------------------------------------------


def _with_policy(policy: Any, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    data = _base()
    second = copy.deepcopy(data["models"][0])
    second["name"] = "chat-plain"
    data["models"].append(second)
    data["models"][0]["policy"] = policy
    data["workspaces"][0]["models"].append("chat-plain")
    if defaults is not None:
        data["defaults"] = defaults
    return data


def test_a_group_policy_overrides_defaults_for_that_group_only() -> None:
    config = _parse(
        _with_policy(
            {"on_unknown_execution": "stop", "max_attempts": 2},
            defaults={"deadline_ms": 9000, "on_credentials_error": "failover"},
        )
    )
    policy = config.policy_for("chat-default")
    assert (policy.on_unknown_execution, policy.max_attempts) == ("stop", 2)
    # Keys the block leaves out keep the defaults' values, not the built-in ones.
    assert (policy.deadline_ms, policy.on_credentials_error) == (9000, "failover")
    assert policy.breaker == config.defaults.breaker
    assert config.policy_for("chat-plain") is config.defaults
    assert config.defaults.on_unknown_execution == "failover"
    with pytest.raises(KeyError):
        config.policy_for("nope")


def test_nested_blocks_of_a_group_policy_merge_key_by_key() -> None:
    config = _parse(
        _with_policy(
            {
                "retry_same_endpoint": {"upstream_unavailable": {"max": 3}},
                "hedge": {"after_p95": True},
            },
            defaults={
                "retry_same_endpoint": {
                    "upstream_unavailable": {"max": 1, "backoff_ms": [10, 20]},
                    "network_error": {"max": 2},
                },
                "hedge": {"after_ms": 700, "max_ways": 3},
            },
        )
    )
    retry = config.policy_for("chat-default").retry_same_endpoint
    unavailable = retry.rule(FailureClass.UPSTREAM_UNAVAILABLE)
    assert (unavailable.max, unavailable.backoff_ms) == (3, (10, 20))
    assert retry.rule(FailureClass.NETWORK_ERROR).max == 2  # the defaults' rule, kept whole
    assert retry.rule(FailureClass.RATE_LIMITED).max == 1  # the built-in default
    hedge = config.policy_for("chat-default").hedge
    assert (hedge.enabled, hedge.after_ms, hedge.after_p95, hedge.max_ways) == (
        False,
        700,
        True,
        3,
    )
    assert config.defaults.hedge.after_p95 is False


def test_an_empty_group_policy_is_the_defaults() -> None:
    config = _parse(_with_policy({}, defaults={"max_attempts": 7}))
    assert config.policy_for("chat-default") == config.defaults
    assert _parse(_with_policy(None)).models[0].policy is None


def test_invalid_defaults_are_reported_once_not_again_under_each_group_policy() -> None:
    data = _with_policy({"on_unknown_execution": "stop"}, defaults={"max_attempts": 0})
    assert _errors(data) == ["defaults.max_attempts: must be > 0"]


def test_the_summary_records_a_group_policy_only_when_there_is_one() -> None:
    summary = _parse(_with_policy({"on_unknown_execution": "stop"})).redacted_summary()
    groups = {g["name"]: g for g in summary["models"]}
    assert groups["chat-default"]["policy"]["on_unknown_execution"] == "stop"
    assert "breaker" not in groups["chat-default"]["policy"]
    assert "policy" not in groups["chat-plain"]
    # Defaults' after_p95 appears only when set, so an unchanged config keeps its summary.
    assert "after_p95" not in summary["defaults"]["hedge"]
    with_p95 = _parse(_mutated(lambda d: d.update(defaults={"hedge": {"after_p95": True}})))
    assert with_p95.redacted_summary()["defaults"]["hedge"]["after_p95"] is True


# --- an endpoint's breaker ---------------------------------------------------------------------


def _with_breakers(
    defaults: dict[str, Any] | None, **endpoints: dict[str, Any] | None
) -> dict[str, Any]:
    """The base config with ``defaults.breaker`` and a ``breaker:`` block on the endpoints
    named (``east``: openai-east, ``eu``: anthropic-eu)."""
    data = _base()
    if defaults is not None:
        data["defaults"] = {"breaker": defaults}
    for name, breaker in endpoints.items():
        _endpoint(data, ["east", "eu"].index(name))["breaker"] = breaker
    return data


def test_an_endpoint_breaker_merges_over_defaults_key_by_key() -> None:
    config = _parse(
        _with_breakers(
            {"failure_threshold": 3, "base_cooldown_ms": 1000, "max_cooldown_ms": 9000},
            east={"failure_threshold": 1},
        )
    )
    east, eu = config.endpoints
    assert east.breaker is not None
    assert east.breaker.settings() == BreakerSettings(
        failure_threshold=1, base_cooldown_ms=1000, max_cooldown_ms=9000
    )
    assert eu.breaker is None
    assert config.endpoint_breakers() == {"openai-east": east.breaker}
    assert config.defaults.breaker.failure_threshold == 3


def test_an_endpoint_breaker_of_another_policy_drops_the_defaults_keys_of_theirs() -> None:
    config = _parse(
        _with_breakers(
            {"failure_threshold": 3, "max_cooldown_ms": 9000},
            east={
                "policy": "rolling",
                "window_calls": 20,
                "minimum_calls": 10,
                "failure_rate": 0.5,
            },
        )
    )
    settings = config.endpoint_breakers()["openai-east"].settings()
    assert (settings.policy, settings.window_calls, settings.minimum_calls) == ("rolling", 20, 10)
    assert (settings.failure_rate, settings.max_cooldown_ms) == (5000, 9000)
    # And back: a consecutive endpoint under rolling defaults keeps none of their window.
    back = _parse(
        _with_breakers(
            {"policy": "rolling", "window_ms": 60000, "failure_rate": 0.25},
            eu={"policy": "consecutive", "failure_threshold": 4},
        )
    ).endpoint_breakers()["anthropic-eu"]
    assert back.settings() == BreakerSettings(failure_threshold=4)


def test_an_endpoint_window_replaces_the_defaults_window_of_the_other_kind() -> None:
    config = _parse(
        _with_breakers(
            {"policy": "rolling", "window_ms": 60000, "failure_rate": 0.25},
            east={"window_calls": 10},
        )
    )
    settings = config.endpoint_breakers()["openai-east"].settings()
    assert (settings.window_calls, settings.window_ms) == (10, None)
    assert (settings.policy, settings.failure_rate) == ("rolling", 2500)


def test_invalid_breaker_defaults_are_reported_once_not_again_under_each_endpoint() -> None:
    data = _with_breakers({"failure_threshold": 0}, east={"base_cooldown_ms": 100})
    assert _errors(data) == ["defaults.breaker.failure_threshold: must be > 0"]


def test_the_summary_records_an_endpoint_breaker_in_effect_only_when_it_has_one() -> None:
    summary = _parse(
        _with_breakers({"max_cooldown_ms": 9000}, east={"failure_threshold": 1})
    ).redacted_summary()
    east, eu = summary["endpoints"]
    assert east["breaker"] == {
        "failure_threshold": 1,
        "base_cooldown_ms": 5000,
        "max_cooldown_ms": 9000,
    }
    assert "breaker" not in eu
    assert "breaker" not in _parse(_base()).redacted_summary()["endpoints"][0]


# --- a mapping's resume ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "resume", ["none", "assistant_prefill", "prefix_flag", "continue_final_message"]
)
def test_an_openai_endpoint_takes_every_resume(resume: str) -> None:
    config = _parse(_mutated(lambda d: _mapping(d).update(resume=resume)))
    assert config.models[0].mappings[0].resume == resume


def test_resume_defaults_to_none_and_an_anthropic_endpoint_prefills() -> None:
    config = _parse(_mutated(lambda d: _mapping(d, 1).update(resume="assistant_prefill")))
    assert config.models[0].mappings[0].resume == "none"
    assert config.models[0].mappings[1].resume == "assistant_prefill"
    summary = config.redacted_summary()["models"][0]["mappings"]
    assert "resume" not in summary[0] and summary[1]["resume"] == "assistant_prefill"


# --- breaker policies ----------------------------------------------------------------------


def test_a_rolling_breaker_takes_its_keys_and_gives_defaults_for_the_rest() -> None:
    rolling = _parse(
        _mutated(
            lambda d: d.update(
                defaults={
                    "breaker": {
                        "policy": "rolling",
                        "window_ms": 60000,
                        "failure_rate": 0.25,
                        "slow_call_ms": 8000,
                    }
                }
            )
        )
    ).defaults.breaker.settings()
    assert rolling == BreakerSettings(
        policy="rolling",
        failure_threshold=2,
        base_cooldown_ms=5000,
        max_cooldown_ms=30000,
        window_calls=None,
        window_ms=60000,
        minimum_calls=10,
        failure_rate=2500,
        slow_call_ms=8000,
        slow_call_rate=10000,
    )
    counted = _parse(
        _mutated(lambda d: d.update(defaults={"breaker": {"policy": "rolling", "window_calls": 4}}))
    ).defaults.breaker.settings()
    # minimum_calls defaults to 10, or to the window when it holds fewer calls.
    assert (counted.window_calls, counted.window_ms, counted.minimum_calls) == (4, None, 4)
    assert Breaker(policy="rolling").settings().window_calls == 20


def test_the_summary_records_a_consecutive_breaker_as_before_and_a_rolling_one_in_full() -> None:
    summary = _parse(_base()).redacted_summary()["defaults"]["breaker"]
    assert summary == {"failure_threshold": 2, "base_cooldown_ms": 5000, "max_cooldown_ms": 30000}
    rolling = _parse(
        _mutated(
            lambda d: d.update(
                defaults={"breaker": {"policy": "rolling", "window_calls": 50, "slow_call_ms": 9}}
            )
        )
    ).redacted_summary()["defaults"]["breaker"]
    assert rolling == {
        "policy": "rolling",
        "base_cooldown_ms": 5000,
        "max_cooldown_ms": 30000,
        "window_calls": 50,
        "minimum_calls": 10,
        "failure_rate": "0.5",
        "slow_call_ms": 9,
        "slow_call_rate": "1",
    }


def test_a_group_policy_walks_by_the_rolling_breaker_of_defaults() -> None:
    config = _parse(
        _with_policy(
            {"max_attempts": 2},
            defaults={"breaker": {"policy": "rolling", "window_ms": 10000}},
        )
    )
    assert config.policy_for("chat-default").breaker == config.defaults.breaker


# --- embeddings groups -----------------------------------------------------------------------


def _embeddings_group(data: dict[str, Any], endpoint: str, capabilities: list[str]) -> None:
    data["models"].append(
        {
            "name": "embed",
            "kind": "embeddings",
            "mappings": [
                {
                    "endpoint": endpoint,
                    "model": "text-embedding-3-small",
                    "capabilities": capabilities,
                    "context_window": 8191,
                    "max_output_tokens": 1,
                    "price": {"input_per_mtok": 0.02, "output_per_mtok": 0},
                }
            ],
        }
    )


def test_an_embeddings_group_of_openai_mappings_that_embed_validates():
    config = _parse(_mutated(lambda d: _embeddings_group(d, "openai-east", ["embeddings"])))
    group = config.model_group("embed")
    assert group is not None and group.kind == "embeddings"
    chat = config.model_group("chat-default")
    assert chat is not None and chat.kind == "chat"


def test_an_embeddings_mapping_must_declare_it_embeds():
    errors = _errors(_mutated(lambda d: _embeddings_group(d, "openai-east", ["text"])))
    assert any(
        "models[1].mappings[0].capabilities" in e and "must declare embeddings" in e for e in errors
    )


def test_an_anthropic_endpoint_is_never_in_an_embeddings_group():
    errors = _errors(_mutated(lambda d: _embeddings_group(d, "anthropic-eu", ["embeddings"])))
    assert any("models[1].mappings[0].endpoint" in e and "cannot embed" in e for e in errors), (
        errors
    )


def test_an_endpoint_may_turn_off_the_ramp_up_its_defaults_give():
    data = _base()
    data["defaults"] = {"breaker": {"ramp_up_ms": 30000, "ramp_up_floor": 0.25}}
    _endpoint(data, 1)["breaker"] = {"ramp_up_ms": 0}
    config = _parse(data)
    settings = config.defaults.breaker.settings()
    assert (settings.ramp_up_ms, settings.ramp_up_floor) == (30000, Decimal("0.25"))
    own = config.endpoint_breakers()[_endpoint(data, 1)["id"]].settings()
    assert own.ramp_up_ms == 0


def test_a_breaker_summary_names_its_ramp_up_only_when_it_ramps():
    data = _base()
    assert "ramp_up_ms" not in _parse(data).defaults.breaker.summary()
    data["defaults"] = {"breaker": {"ramp_up_ms": 30000}}
    summary = _parse(data).defaults.breaker.summary()
    assert (summary["ramp_up_ms"], summary["ramp_up_floor"]) == (30000, "0.1")
