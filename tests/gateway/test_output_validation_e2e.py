"""Output validation over HTTP (contract §5 "Output validation"): a buffered answer that
breaks the shape its request demanded is ``invalid_output`` — failed over, or returned as it
is with ``on_invalid_output: return`` — its usage settled, the violation recorded without
the content."""

from __future__ import annotations

import json
from typing import Any

from ledger.store import RecordedEvent
from router.fake_provider import Behavior
from tests.gateway.harness import Route, running_gateway

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
BODY: dict[str, Any] = {
    "model": "chat",
    "messages": [{"role": "user", "content": "where?"}],
    "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "place", "schema": SCHEMA, "strict": True},
    },
}
ROUTES = [Route("east"), Route("west", tier=1)]
VALID = json.dumps({"city": "Paris"})


def _of(events: list[RecordedEvent], kind: str) -> list[dict[str, Any]]:
    return [e.data for e in events if e.type == kind]


async def test_an_answer_that_breaks_the_schema_fails_over_and_is_paid_for(database_url):
    async with running_gateway(database_url, ["east", "west"], ROUTES) as gw, gw.http() as http:
        gw.upstreams["west"].set_default(Behavior.ok(text=VALID))
        response = await http.post("/v1/chat/completions", json=BODY)
        assert response.status_code == 200, response.text
        assert json.loads(response.json()["choices"][0]["message"]["content"]) == {"city": "Paris"}
        assert response.headers["x-waybill-endpoint"] == "west"
        events = await gw.events(response.headers["x-request-id"])
        failed, served = _of(events, "AttemptFinished")
        assert (failed["status"], failed["failure_class"]) == ("failed", "invalid_output")
        assert "the content is not JSON" in failed["invalid_output"]
        assert "Hello" not in failed["invalid_output"], "never the content"
        assert failed["usage"] is not None
        assert served["status"] == "succeeded" and served["invalid_output"] is None
        decided = _of(events, "FailoverDecided")[0]
        assert (decided["action"], decided["reason"], decided["policy"]) == (
            "failover",
            "invalid_output_policy_failover",
            "on_invalid_output=failover",
        )
        settled = {s["attempt_id"] for s in _of(events, "BudgetSettled")}
        assert failed["attempt_id"] in settled, "it answered and said what it used"
        assert not _of(events, "UnknownUsageOpened")


async def test_nothing_valid_anywhere_is_a_502_naming_the_cause(database_url):
    async with running_gateway(database_url, ["east", "west"], ROUTES) as gw, gw.http() as http:
        response = await http.post("/v1/chat/completions", json=BODY)
        assert response.status_code == 502, response.text
        assert response.json()["error"]["code"] == "upstream_error"
        assert "invalid_output" in response.json()["error"]["message"]


async def test_on_invalid_output_return_gives_the_answer_as_it_is(database_url):
    async with (
        running_gateway(
            database_url, ["east", "west"], ROUTES, defaults={"on_invalid_output": "return"}
        ) as gw,
        gw.http() as http,
    ):
        response = await http.post("/v1/chat/completions", json=BODY)
        assert response.status_code == 200, response.text
        assert response.headers["x-waybill-endpoint"] == "east"
        events = await gw.events(response.headers["x-request-id"])
        [finished] = _of(events, "AttemptFinished")
        assert finished["status"] == "succeeded"
        assert "the content is not JSON" in finished["invalid_output"]


async def test_a_required_tool_call_that_never_comes_fails_over(database_url):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    body = {**BODY, "tools": tools, "tool_choice": "required"}
    del body["response_format"]
    async with running_gateway(database_url, ["east", "west"], ROUTES) as gw, gw.http() as http:
        gw.upstreams["west"].set_default(Behavior.tool_call("get_weather"))
        response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["tool_calls"]
        assert response.headers["x-waybill-endpoint"] == "west"


async def test_a_valid_answer_is_served_once(database_url):
    async with running_gateway(database_url, ["east", "west"], ROUTES) as gw, gw.http() as http:
        gw.upstreams["east"].set_default(Behavior.ok(text=VALID))
        response = await http.post("/v1/chat/completions", json=BODY)
        assert response.status_code == 200
        assert gw.upstreams["west"].hits == 0
