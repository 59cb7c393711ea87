"""A workspace's rate limits (``limits``, ``key_limits``; contract §2 "Rate limits")."""

from __future__ import annotations

import pytest

from router.config import ConfigError, parse_config
from tests.config.test_checkpoint_config import BASE

WORKSPACE = "  - {id: acme, models: [chat], regions: [us], data_class: public}\n"


def _with(extra: str) -> str:
    return BASE.replace(WORKSPACE, WORKSPACE.replace("}\n", ", " + extra + "}\n"))


def test_limits_are_read_and_summarised() -> None:
    config = parse_config(
        _with("limits: {requests_per_minute: 60}, key_limits: {tokens_per_minute: 1000}")
    )
    (workspace,) = config.workspaces
    assert workspace.limits is not None and workspace.limits.requests_per_minute == 60
    assert workspace.key_limits is not None and workspace.key_limits.tokens_per_minute == 1000
    (summary,) = config.redacted_summary()["workspaces"]
    assert summary["limits"] == {"requests_per_minute": 60}
    assert summary["key_limits"] == {"tokens_per_minute": 1000}
    assert "limits" not in parse_config(BASE).redacted_summary()["workspaces"][0]


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        ("limits: {}", "workspaces[0].limits: set requests_per_minute, tokens_per_minute"),
        ("limits: {requests_per_minute: 0}", "workspaces[0].limits.requests_per_minute"),
        ("key_limits: {tokens_per_minute: 1.5}", "workspaces[0].key_limits.tokens_per_minute"),
        ("limits: {per_hour: 5}", "workspaces[0].limits.per_hour: unknown key"),
    ],
)
def test_a_bad_limit_is_refused_with_its_path(extra: str, error: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config(_with(extra))
    assert error in str(refused.value), str(refused.value)
