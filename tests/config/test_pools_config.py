"""Pools in config (contract §2 "Pools"): a model group may list pools — other groups of the
same kind — instead of or beside mappings; validation refuses what cannot be composed, with
paths, and the redacted summary records the pools."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from router.config import MAX_POOL_DEPTH, ConfigError, Pool, parse_config

ENV = {"KEY": "sk-test"}


def _mapping(endpoint: str) -> dict[str, Any]:
    return {
        "endpoint": endpoint,
        "model": "m",
        "context_window": 8000,
        "max_output_tokens": 1000,
        "price": {"input_per_mtok": 1, "output_per_mtok": 2},
    }


def _base() -> dict[str, Any]:
    endpoints = [
        {
            "id": name,
            "driver": "openai",
            "base_url": f"https://{name}.invalid/v1",
            "api_key": "${env:KEY}",
            "region": "us-east",
            "data_classes": ["internal"],
        }
        for name in ("gpu", "cloud")
    ]
    return {
        "endpoints": endpoints,
        "models": [
            {"name": "local", "mappings": [_mapping("gpu")]},
            {"name": "remote", "strategy": "least_latency", "mappings": [_mapping("cloud")]},
            {
                "name": "chat",
                "pools": [{"group": "local"}, {"group": "remote", "tier": 1, "weight": 2}],
            },
        ],
        "workspaces": [
            {
                "id": "acme",
                "models": ["chat", "local", "remote"],
                "regions": ["us-east"],
                "data_class": "internal",
            }
        ],
    }


def _errors(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(yaml.safe_dump(data), environ=ENV)
    return str(caught.value).splitlines()


def test_a_group_of_pools_is_read_with_tiers_and_weights_and_summarized():
    config = parse_config(yaml.safe_dump(_base()), environ=ENV)
    chat = config.model_group("chat")
    assert chat is not None
    assert chat.mappings == ()
    assert chat.pools == (Pool(group="local"), Pool(group="remote", tier=1, weight=2))
    summary = next(g for g in config.redacted_summary()["models"] if g["name"] == "chat")
    assert summary["pools"] == [
        {"group": "local", "tier": 0, "weight": 1},
        {"group": "remote", "tier": 1, "weight": 2},
    ]
    plain = next(g for g in config.redacted_summary()["models"] if g["name"] == "local")
    assert "pools" not in plain  # earlier summaries read as they were


def test_pools_beside_mappings_are_accepted():
    data = _base()
    data["models"][2]["mappings"] = [_mapping("cloud")]
    config = parse_config(yaml.safe_dump(data), environ=ENV)
    chat = config.model_group("chat")
    assert chat is not None and len(chat.mappings) == 1 and len(chat.pools) == 2


def _pools(*groups: str) -> list[dict[str, Any]]:
    return [{"group": g} for g in groups]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        pytest.param(
            lambda d: d["models"][2].update(pools=_pools("nowhere")),
            ["models[2].pools[0].group: unknown model group 'nowhere'"],
            id="unknown_group",
        ),
        pytest.param(
            lambda d: d["models"][2].update(pools=_pools("chat")),
            ["models[2].pools[0].group: a model group cannot be a pool of itself ('chat')"],
            id="itself",
        ),
        pytest.param(
            lambda d: d["models"][2].update(pools=_pools("local", "local")),
            ["models[2].pools[1].group: model group 'local' is already a pool of this group"],
            id="twice",
        ),
        pytest.param(
            lambda d: (
                d["models"][0].update(pools=_pools("chat")),
                d["models"][2].update(pools=_pools("local")),
            ),
            [
                "models[0].pools[0].group: pools form a cycle: local -> chat -> local",
                "models[2].pools[0].group: pools form a cycle: chat -> local -> chat",
            ],
            id="cycle",
        ),
        pytest.param(
            lambda d: d["models"].append({"name": "outer", "pools": _pools("chat")}),
            [
                "models[3].pools[0].group: model group 'chat' lists pools itself: pools nest "
                f"at most {MAX_POOL_DEPTH} level deep"
            ],
            id="too_deep",
        ),
        pytest.param(
            lambda d: d["models"][2].update(pools=[]),
            ["models[2]: a model group lists mappings, pools, or both: it has neither"],
            id="neither",
        ),
        pytest.param(
            lambda d: d["models"][2].update(pools=[{"group": "local", "weight": 0}]),
            ["models[2].pools[0].weight: must be > 0"],
            id="weight",
        ),
    ],
)
def test_pools_that_cannot_be_composed_are_refused_with_their_paths(
    change: Any, expected: list[str]
) -> None:
    data = copy.deepcopy(_base())
    change(data)
    assert _errors(data) == expected
