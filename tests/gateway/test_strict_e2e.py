"""Strict evidence mode end to end (contract §5 "Per on_unknown_execution"): an attempt that may
have run is never followed by another unless the caller says ``X-Waybill-Allow-Failover:
unknown``; a request asking for server-side effects is strict whatever its policy; a model
group's ``policy:`` acts for that group alone. Through HTTP, against fake providers.

Two endpoints serve each model group: ``east`` on tier 0 and ``west`` on tier 1. Same-endpoint
retries of ``upstream_unavailable`` and ``network_error`` are on, so one upstream hit shows
that strictness, not the retry rules, kept the request from running again.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from router.fake_provider import Behavior
from tests.gateway.harness import Gateway, Route, running_gateway

BODY: dict[str, Any] = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
WEB_SEARCH_TOOL = {"type": "web_search"}
ROUTES = (Route("east", tier=0), Route("west", tier=1))
RETRIES_ON = {
    "retry_same_endpoint": "{upstream_unavailable: {max: 1, backoff_ms: [1, 1]}, "
    "network_error: {max: 1, backoff_ms: [1, 1]}}"
}
STRICT = {**RETRIES_ON, "on_unknown_execution": "stop"}

# A ``strict`` policy, in the words the explanation uses for each rule.
CONFIG_RULE = "strict, as on_unknown_execution: stop says"
EFFECTS_RULE = "strict, as every request asking the provider for server-side effects"
HEADER_RULE = "the caller's X-Waybill-Allow-Failover: unknown allowed running it again"


async def _post(
    gw: Gateway, body: dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Response:
    async with gw.http() as http:
        response = await http.post("/v1/chat/completions", json=body, headers=headers or {})
        await response.aread()
        return response


async def _decisions(gw: Gateway, response: httpx.Response) -> list[dict[str, Any]]:
    events = await gw.events(response.headers["x-request-id"])
    return [e.data for e in events if e.type == "FailoverDecided"]


async def _explained(gw: Gateway, response: httpx.Response) -> str:
    async with gw.http() as http:
        explained = await http.get(
            f"/v1/requests/{response.headers['x-request-id']}/explain", params={"format": "text"}
        )
    assert explained.status_code == 200, explained.text
    return " ".join(explained.text.split())  # the text wraps at 100 columns


def _failed_once_with_503(gw: Gateway, response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "upstream_unavailable"
    assert [a["endpoint"] for a in error["attempts"]] == ["east"]
    assert (gw.upstreams["east"].hits, gw.upstreams["west"].hits) == (1, 0)


@pytest.mark.parametrize(
    ("behavior", "stream"),
    [
        (Behavior.server_error(503), False),
        (Behavior.reset_before_bytes(), False),
        (Behavior.disconnect_before_first_event(), True),
    ],
    ids=["503", "reset-after-sending", "stream-broken-before-content"],
)
async def test_strict_mode_makes_an_attempt_of_unknown_execution_the_only_one(
    sqlite_url: str, behavior: Behavior, stream: bool
) -> None:
    async with running_gateway(sqlite_url, ["east", "west"], ROUTES, defaults=STRICT) as gw:
        gw.upstreams["east"].set_plan([behavior, Behavior.ok()])
        response = await _post(gw, {**BODY, "stream": stream})
        _failed_once_with_503(gw, response)
        [decided] = await _decisions(gw, response)
        assert (decided["action"], decided["reason"], decided["policy"]) == (
            "stop",
            "on_unknown_execution_stop",
            "on_unknown_execution=stop",
        )
        assert decided["evidence"] == "unknown"
        assert f"on_unknown_execution_stop, {CONFIG_RULE}" in await _explained(gw, response)


async def test_the_header_unknown_lets_a_strict_request_retry_and_fail_over(
    sqlite_url: str,
) -> None:
    async with running_gateway(sqlite_url, ["east", "west"], ROUTES, defaults=STRICT) as gw:
        gw.upstreams["east"].set_plan([Behavior.server_error(503), Behavior.server_error(503)])
        response = await _post(gw, BODY, {"X-Waybill-Allow-Failover": "unknown"})
        assert response.status_code == 200, response.text
        assert response.headers["x-waybill-endpoint"] == "west"
        assert (gw.upstreams["east"].hits, gw.upstreams["west"].hits) == (2, 1)
        retried, failed_over = await _decisions(gw, response)
        assert (retried["action"], retried["reason"]) == ("retry", "retry_with_backoff")
        assert (failed_over["action"], failed_over["reason"]) == (
            "failover",
            "unknown_execution_allowed_by_header",
        )
        assert retried["policy"] == failed_over["policy"] == "X-Waybill-Allow-Failover=unknown"
        received = (await gw.events(response.headers["x-request-id"]))[0].data
        assert received["requirements"]["allow_unknown_execution"] is True
        assert HEADER_RULE in await _explained(gw, response)


@pytest.mark.parametrize(
    "tools",
    [[WEB_SEARCH_TOOL], [{"type": "function", "function": {"name": "f"}}, WEB_SEARCH_TOOL]],
    ids=["web_search", "function-and-web_search"],
)
async def test_a_server_side_tool_makes_a_request_strict_under_the_default_policy(
    sqlite_url: str, tools: list[dict[str, Any]]
) -> None:
    async with running_gateway(sqlite_url, ["east", "west"], ROUTES, defaults=RETRIES_ON) as gw:
        assert gw.config.defaults.on_unknown_execution == "failover"
        gw.upstreams["east"].set_plan([Behavior.server_error(503), Behavior.ok()])
        response = await _post(gw, {**BODY, "tools": tools})
        _failed_once_with_503(gw, response)
        [decided] = await _decisions(gw, response)
        assert (decided["action"], decided["reason"], decided["policy"]) == (
            "stop",
            "server_side_effects_strict",
            "server_side_effects=strict",
        )
        explained = await _explained(gw, response)
        assert f"server_side_effects_strict, {EFFECTS_RULE}" in explained
        assert "asks the provider for server-side effects, so it is strict" in explained


async def test_a_server_side_tool_moves_on_when_the_caller_allows_it(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url, ["east", "west"], ROUTES) as gw:
        gw.upstreams["east"].set_plan([Behavior.server_error(503)])
        response = await _post(
            gw, {**BODY, "tools": [WEB_SEARCH_TOOL]}, {"X-Waybill-Allow-Failover": "unknown"}
        )
        assert response.status_code == 200, response.text
        assert (gw.upstreams["east"].hits, gw.upstreams["west"].hits) == (1, 1)
        [decided] = await _decisions(gw, response)
        assert decided["reason"] == "unknown_execution_allowed_by_header"


async def test_a_function_tool_alone_fails_over_as_the_policy_says(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url, ["east", "west"], ROUTES) as gw:
        gw.upstreams["east"].set_plan([Behavior.server_error(503)])
        tools = [{"type": "function", "function": {"name": "f"}}]
        response = await _post(gw, {**BODY, "tools": tools})
        assert response.status_code == 200, response.text
        [decided] = await _decisions(gw, response)
        assert decided["reason"] == "unknown_execution_policy_failover"


async def test_a_group_policy_acts_only_for_its_own_group(sqlite_url: str) -> None:
    async with running_gateway(
        sqlite_url,
        ["east", "west"],
        ROUTES,
        policies={"strict": "{on_unknown_execution: stop}"},
    ) as gw:
        assert gw.config.policy_for("chat").on_unknown_execution == "failover"
        gw.upstreams["east"].set_plan([Behavior.server_error(503), Behavior.server_error(503)])
        strict = await _post(gw, {**BODY, "model": "strict"})
        _failed_once_with_503(gw, strict)
        [decided] = await _decisions(gw, strict)
        assert (decided["reason"], decided["policy"]) == (
            "on_unknown_execution_stop",
            "on_unknown_execution=stop",
        )
        relaxed = await _post(gw, BODY)  # the same endpoints, the group without a policy
        assert relaxed.status_code == 200, relaxed.text
        assert relaxed.headers["x-waybill-endpoint"] == "west"
        assert (gw.upstreams["east"].hits, gw.upstreams["west"].hits) == (2, 1)
        [decided] = await _decisions(gw, relaxed)
        assert (decided["reason"], decided["policy"]) == (
            "unknown_execution_policy_failover",
            "on_unknown_execution=failover",
        )


async def test_a_group_policy_sets_the_groups_attempt_limit(sqlite_url: str) -> None:
    async with running_gateway(
        sqlite_url, ["east", "west"], ROUTES, policies={"single": "{max_attempts: 1}"}
    ) as gw:
        gw.upstreams["east"].set_plan([Behavior.rate_limited(), Behavior.rate_limited()])
        single = await _post(gw, {**BODY, "model": "single"})
        assert single.status_code == 429, single.text
        [decided] = await _decisions(gw, single)
        assert (decided["reason"], decided["attempts_left"]) == ("max_attempts_reached", 0)
        assert (await _post(gw, BODY)).status_code == 200  # chat keeps max_attempts 4


@pytest.mark.parametrize("value", ["maybe", "unknown-ish", ""])
async def test_a_bad_allow_failover_value_is_a_400_naming_the_values(
    sqlite_url: str, value: str
) -> None:
    async with running_gateway(sqlite_url, ["east"], [Route("east")]) as gw:
        response = await _post(gw, BODY, {"X-Waybill-Allow-Failover": value})
        assert response.status_code == 400, response.text
        assert response.headers["x-should-retry"] == "false"
        error = response.json()["error"]
        assert (error["code"], error["type"], error["param"]) == (
            "invalid_request",
            "invalid_request_error",
            "X-Waybill-Allow-Failover",
        )
        assert error["request_id"] == response.headers["x-request-id"]
        assert error["attempts"] == []
        assert "true, false or unknown" in error["message"]
        assert gw.upstreams["east"].hits == 0
