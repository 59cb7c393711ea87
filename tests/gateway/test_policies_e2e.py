"""Approved failover policies end to end (contract §4 "Retry and failover are different acts"):
a model group whose ``policy`` says ``failover: on_grant`` moves to another endpoint only when
the request grants it with ``X-Waybill-Allow-Failover: true``. Through the OpenAI SDK over
HTTP, against fake providers, on both ledger backends.

Two endpoints serve each model group: ``east`` on tier 0 and ``west`` on tier 1.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from router.fake_provider import Behavior
from tests.gateway.harness import Gateway, Route, running_gateway

MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]
ROUTES = (Route("east", tier=0), Route("west", tier=1))
# Breakers that stay closed through a test's few failures, so each request meets east first.
# A breaker once open stays open for the rest of the test (no test waits out its cool-down).
PATIENT_BREAKERS = {
    "breaker": "{failure_threshold: 50, base_cooldown_ms: 600000, max_cooldown_ms: 600000}"
}
ON_GRANT = {"granted": "{failover: on_grant}"}
NOT_GRANTED_WORDS = "failover_not_granted, the model group fails over only on grant"


async def _decisions(gw: Gateway, request_id: str) -> list[dict[str, Any]]:
    events = await gw.events(request_id)
    return [e.data for e in events if e.type == "FailoverDecided"]


async def _explained(gw: Gateway, request_id: str) -> str:
    async with gw.http() as http:
        explained = await http.get(f"/v1/requests/{request_id}/explain", params={"format": "text"})
    assert explained.status_code == 200, explained.text
    return " ".join(explained.text.split())  # the text wraps at 100 columns


async def test_a_group_failing_over_on_grant_stops_without_the_grant(database_url: str) -> None:
    async with running_gateway(
        database_url, ["east", "west"], ROUTES, defaults=PATIENT_BREAKERS, policies=ON_GRANT
    ) as gw:
        gw.upstreams["east"].set_default(Behavior.server_error(503))
        client = gw.client()
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="granted", messages=MESSAGES)
        assert caught.value.status_code == 503
        assert (gw.upstreams["east"].hits, gw.upstreams["west"].hits) == (1, 0)
        request_id = caught.value.response.headers["x-request-id"]
        [decided] = await _decisions(gw, request_id)
        assert (decided["action"], decided["reason"], decided["policy"]) == (
            "stop",
            "failover_not_granted",
            "failover=on_grant",
        )
        assert NOT_GRANTED_WORDS in await _explained(gw, request_id)

        # The grant moves the same request on; the explanation says the caller gave it.
        granted = await client.chat.completions.with_raw_response.create(
            model="granted",
            messages=MESSAGES,
            extra_headers={"X-Waybill-Allow-Failover": "true"},
        )
        assert granted.headers["x-waybill-endpoint"] == "west"
        request_id = granted.headers["x-request-id"]
        [decided] = await _decisions(gw, request_id)
        assert decided["action"] == "failover"
        assert "failover granted by the caller" in await _explained(gw, request_id)

        # A group without the policy fails over as before, no header needed.
        plain = await client.chat.completions.with_raw_response.create(
            model="chat", messages=MESSAGES
        )
        assert plain.headers["x-waybill-endpoint"] == "west"
        assert (gw.upstreams["east"].hits, gw.upstreams["west"].hits) == (3, 2)


async def test_failover_false_still_names_the_header_under_on_grant(database_url: str) -> None:
    async with running_gateway(
        database_url, ["east", "west"], ROUTES, defaults=PATIENT_BREAKERS, policies=ON_GRANT
    ) as gw:
        gw.upstreams["east"].set_default(Behavior.server_error(503))
        async with gw.http() as http:
            response = await http.post(
                "/v1/chat/completions",
                json={"model": "granted", "messages": MESSAGES},
                headers={"X-Waybill-Allow-Failover": "false"},
            )
        assert response.status_code == 503, response.text
        [decided] = await _decisions(gw, response.headers["x-request-id"])
        assert decided["reason"] == "failover_forbidden_by_header"


QUOTA_FAILOVER = {"approved": "{on_quota_exhausted: failover}"}


async def test_quota_failover_is_an_approved_policy(database_url: str) -> None:
    async with running_gateway(
        database_url, ["east", "west"], ROUTES, defaults=PATIENT_BREAKERS, policies=QUOTA_FAILOVER
    ) as gw:
        gw.upstreams["east"].set_default(Behavior.insufficient_quota())
        client = gw.client()
        # The default policy stops and names the cause.
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="chat", messages=MESSAGES)
        assert caught.value.status_code == 502
        [decided] = await _decisions(gw, caught.value.response.headers["x-request-id"])
        assert (decided["reason"], decided["policy"]) == (
            "quota_exhausted_stops",
            "on_quota_exhausted=stop",
        )

        # The approved policy moves to another provider account at once.
        moved = await client.chat.completions.with_raw_response.create(
            model="approved", messages=MESSAGES
        )
        assert moved.headers["x-waybill-endpoint"] == "west"
        assert (gw.upstreams["east"].hits, gw.upstreams["west"].hits) == (2, 1)
        request_id = moved.headers["x-request-id"]
        [decided] = await _decisions(gw, request_id)
        assert (decided["action"], decided["reason"], decided["policy"]) == (
            "failover",
            "quota_failover_policy",
            "on_quota_exhausted=failover",
        )
        events = await gw.events(request_id)
        _, second = [e.data for e in events if e.type == "RouteEvaluated"]
        [east] = [c for c in second["candidates"] if c["endpoint"] == "east"]
        assert (east["reason_code"], east["detail"]) == (
            "quota_exhausted",
            "east answered insufficient_quota",
        )
        explained = await _explained(gw, request_id)
        assert "quota_failover_policy" in explained and "quota_exhausted" in explained

        # The quota failure opened east's breaker at once: the next request does not try
        # east while it cools down, and says why.
        after = await client.chat.completions.with_raw_response.create(
            model="approved", messages=MESSAGES
        )
        assert after.headers["x-waybill-endpoint"] == "west"
        assert (gw.upstreams["east"].hits, gw.upstreams["west"].hits) == (2, 2)
        events = await gw.events(after.headers["x-request-id"])
        [evaluated] = [e.data for e in events if e.type == "RouteEvaluated"]
        [east] = [c for c in evaluated["candidates"] if c["endpoint"] == "east"]
        assert (east["reason_code"], east["detail"]) == (
            "quota_exhausted",
            "east answered insufficient_quota; its breaker is cooling down",
        )
