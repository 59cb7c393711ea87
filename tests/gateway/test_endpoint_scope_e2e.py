"""Callers narrow by endpoint and provider (contract §4 "Endpoint scope"), and a request whose
every candidate refused admission is a 503 (contract §3), over HTTP with the ``openai`` SDK,
on both backends.

Three endpoints serve model group ``chat``: ``east`` (tier 0), ``west`` (tier 1), both
OpenAI-compatible, and ``claude`` (tier 2, the Anthropic driver).
"""

from __future__ import annotations

import asyncio
from typing import Any

import anthropic
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from ledger import apikeys
from router.fake_provider import Behavior
from tests.gateway.harness import Gateway, Route, running_gateway
from tests.ledger.test_cli import waybill

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
ROUTES = [Route("east"), Route("west", tier=1), Route("claude", tier=2)]
NAMES = ["east", "west", "claude"]
DRIVERS = {"claude": "anthropic"}


async def _served(gw: Gateway, headers: dict[str, str], secret: str | None = None) -> Any:
    return await gw.client(secret).chat.completions.with_raw_response.create(
        model="chat", messages=MESSAGES, extra_headers=headers
    )


async def _first(gw: Gateway, request_id: str, event_type: str) -> dict[str, Any]:
    return next(e.data for e in await gw.events(request_id) if e.type == event_type)


def _reasons(evaluation: dict[str, Any]) -> dict[str, str | None]:
    return {c["endpoint"]: c["reason_code"] for c in evaluation["candidates"]}


async def test_the_endpoints_header_narrows_to_ids_and_provider_labels(database_url):
    async with running_gateway(database_url, NAMES, ROUTES, drivers=DRIVERS) as gw:
        raw = await _served(gw, {"X-Waybill-Endpoints": "provider:anthropic"})
        assert raw.headers["x-waybill-endpoint"] == "claude"
        request_id = raw.headers["x-request-id"]
        received = await _first(gw, request_id, "RequestReceived")
        assert received["requirements"]["endpoints"] == ["provider:anthropic"]
        evaluation = await _first(gw, request_id, "RouteEvaluated")
        assert _reasons(evaluation) == {
            "east": "out_of_scope",
            "west": "out_of_scope",
            "claude": None,
        }
        raw = await _served(gw, {"X-Waybill-Endpoints": "west, provider:anthropic"})
        assert raw.headers["x-waybill-endpoint"] == "west", "the best tier in scope"
        assert (gw.upstreams["east"].hits, gw.upstreams["west"].hits) == (0, 1)


async def test_a_keys_standing_scope_narrows_every_request_and_a_header_only_narrows_it(
    database_url,
):
    async with running_gateway(database_url, NAMES, ROUTES, drivers=DRIVERS) as gw:
        key = await apikeys.create_key(gw.store, "acme", endpoints=("west", "provider:anthropic"))
        raw = await _served(gw, {}, key.secret)
        assert raw.headers["x-waybill-endpoint"] == "west"
        received = await _first(gw, raw.headers["x-request-id"], "RequestReceived")
        assert received["requirements"]["key_endpoints"] == ["west", "provider:anthropic"]
        raw = await _served(gw, {"X-Waybill-Endpoints": "claude,east"}, key.secret)
        assert raw.headers["x-waybill-endpoint"] == "claude", "east is outside the key's scope"
        # A header naming only what the key excludes leaves nothing: refused, never widened.
        with pytest.raises(openai.UnprocessableEntityError) as refused:
            await _served(gw, {"X-Waybill-Endpoints": "east"}, key.secret)
        error = refused.value.body
        assert isinstance(error, dict) and error["code"] == "no_eligible_route"
        assert "scope_empty" in error["message"]
        assert gw.upstreams["east"].hits == 0


async def test_an_empty_scope_is_422_scope_empty_and_nothing_is_called(database_url):
    async with running_gateway(database_url, NAMES, ROUTES, drivers=DRIVERS) as gw:
        with pytest.raises(openai.UnprocessableEntityError) as refused:
            await _served(gw, {"X-Waybill-Endpoints": "no-such-endpoint"})
        response = refused.value.response
        assert response.headers["x-should-retry"] == "false"
        evaluation = await _first(gw, response.headers["x-request-id"], "RouteEvaluated")
        assert set(_reasons(evaluation).values()) == {"scope_empty"}
        assert sum(up.hits for up in gw.upstreams.values()) == 0
        # A provider no endpoint of the group has matches nothing either.
        with pytest.raises(openai.UnprocessableEntityError):
            await _served(gw, {"X-Waybill-Endpoints": "provider:gemini"})


async def test_a_preferred_endpoint_is_chosen_when_eligible_and_overruled_when_not(
    database_url,
):
    routes = [Route("east", tier=1), Route("west", capabilities=("text", "stream"))]
    async with running_gateway(database_url, ["east", "west"], routes) as gw:
        raw = await _served(gw, {"X-Waybill-Prefer-Endpoint": "east"})
        assert raw.headers["x-waybill-endpoint"] == "east", "preferred ahead of its tier"
        evaluation = await _first(gw, raw.headers["x-request-id"], "RouteEvaluated")
        assert evaluation["chosen"]["preferred"] is True
        # west cannot call tools: preferred, it is overruled, and the explanation says why.
        tools: list[ChatCompletionToolParam] = [
            {"type": "function", "function": {"name": "f", "parameters": {}}}
        ]
        raw = await gw.client().chat.completions.with_raw_response.create(
            model="chat",
            messages=MESSAGES,
            tools=tools,
            extra_headers={"X-Waybill-Prefer-Endpoint": "west"},
        )
        assert raw.headers["x-waybill-endpoint"] == "east"
        request_id = raw.headers["x-request-id"]
        received = await _first(gw, request_id, "RequestReceived")
        requirements = received["requirements"]
        assert requirements["prefer_endpoint"] == "west"
        assert "require_endpoint" not in requirements, "left out of the record while unset"
        evaluation = await _first(gw, request_id, "RouteEvaluated")
        assert _reasons(evaluation)["west"] == "missing_capability"
        assert "preferred" not in evaluation["chosen"], "left out of the record while False"
        async with gw.http() as http:
            explained = (await http.get(f"/v1/requests/{request_id}/explain")).json()
        assert "prefers endpoint west" in explained["decision_path"][0]["text"]


async def test_a_pinned_request_that_fails_is_never_moved(database_url):
    async with running_gateway(database_url, ["east", "west"], ROUTES[:2]) as gw:
        gw.upstreams["west"].set_default(Behavior.server_error(503))
        with pytest.raises(openai.InternalServerError) as failed:
            await _served(gw, {"X-Waybill-Require-Endpoint": "west"})
        response = failed.value.response
        assert response.status_code == 503
        body = failed.value.body
        assert isinstance(body, dict) and body["code"] == "upstream_unavailable"
        assert [a["endpoint"] for a in body["attempts"]] == ["west"]
        assert (gw.upstreams["east"].hits, gw.upstreams["west"].hits) == (0, 1)
        request_id = response.headers["x-request-id"]
        decided = await _first(gw, request_id, "FailoverDecided")
        assert (decided["action"], decided["reason"]) == ("stop", "failover_forbidden_by_header")
        received = await _first(gw, request_id, "RequestReceived")
        assert received["requirements"]["require_endpoint"] == "west"
        evaluation = await _first(gw, request_id, "RouteEvaluated")
        assert _reasons(evaluation)["east"] == "out_of_scope"
        await _verified(database_url)


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "stream"])
async def test_every_attempt_refused_before_io_is_503_with_retry_after(database_url, stream):
    async with running_gateway(
        database_url,
        ["east", "west"],
        ROUTES[:2],
        endpoint_extra={"east": "    max_in_flight: 1\n"},
    ) as gw:
        east = gw.upstreams["east"]
        east.set_default(Behavior.ok(latency_ms=1500))
        holding = asyncio.ensure_future(_served(gw, {}))
        await east.wait_for_async(lambda up: up.hits >= 1)  # its one slot is taken
        # Pinned to east (west would serve otherwise): refused at admission, nothing sent.
        with pytest.raises(openai.InternalServerError) as refused:
            await gw.client().chat.completions.create(
                model="chat",
                messages=MESSAGES,
                stream=stream,
                extra_headers={"X-Waybill-Require-Endpoint": "east"},
            )
        response = refused.value.response
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        assert response.headers["x-should-retry"] == "true"
        body = refused.value.body
        assert isinstance(body, dict) and body["code"] == "upstream_unavailable"
        assert "endpoint_saturated" in body["message"] and body["attempts"] == []
        assert (east.hits, gw.upstreams["west"].hits) == (1, 0)
        evaluation = await _first(gw, response.headers["x-request-id"], "RouteEvaluated")
        assert _reasons(evaluation) == {"east": "endpoint_saturated", "west": "out_of_scope"}
        assert (await holding).headers["x-waybill-endpoint"] == "east"
        await _verified(database_url)


async def test_a_refusal_at_admission_is_not_the_idempotent_answer(database_url):
    async with running_gateway(
        database_url, ["east"], ROUTES[:1], endpoint_extra={"east": "    max_in_flight: 1\n"}
    ) as gw:
        east = gw.upstreams["east"]
        east.set_default(Behavior.ok(latency_ms=1500))
        holding = asyncio.ensure_future(_served(gw, {}))
        await east.wait_for_async(lambda up: up.hits >= 1)
        again = {"Idempotency-Key": "scope-retry-1"}
        with pytest.raises(openai.InternalServerError) as refused:
            await _served(gw, again)
        assert refused.value.response.headers["x-should-retry"] == "true"
        await holding  # the slot is free again
        east.set_default(Behavior.ok())
        raw = await _served(gw, again)  # the client's retry runs, it is not a replay
        assert raw.headers["x-waybill-endpoint"] == "east"
        assert "idempotent-replayed" not in raw.headers
        assert east.hits == 2


async def _verified(database_url: str) -> None:
    """``waybill verify`` holds every request to what its decisions said (contract §4)."""
    verified = await asyncio.to_thread(waybill, "verify", database_url=database_url)
    assert verified.returncode == 0, verified.stdout + verified.stderr


async def test_the_anthropic_door_narrows_and_pins_as_the_chat_door_does(database_url):
    async with running_gateway(database_url, NAMES, ROUTES, drivers=DRIVERS) as gw:
        key = await apikeys.create_key(gw.store, "acme", endpoints=("provider:anthropic", "west"))
        client = anthropic.AsyncAnthropic(base_url=gw.url, api_key=key.secret, max_retries=0)
        try:
            raw = await client.messages.with_raw_response.create(
                model="chat",
                max_tokens=50,
                messages=[{"role": "user", "content": "hi"}],
                extra_headers={"X-Waybill-Endpoints": "provider:anthropic"},
            )
            assert raw.headers["x-waybill-endpoint"] == "claude"
            received = await _first(gw, raw.headers["x-request-id"], "RequestReceived")
            assert received["requirements"]["endpoints"] == ["provider:anthropic"]
            assert received["requirements"]["key_endpoints"] == ["provider:anthropic", "west"]
            with pytest.raises(anthropic.UnprocessableEntityError):
                await client.messages.create(
                    model="chat",
                    max_tokens=50,
                    messages=[{"role": "user", "content": "hi"}],
                    extra_headers={"X-Waybill-Require-Endpoint": "east"},  # outside the key's
                )
        finally:
            await client.close()
        assert gw.upstreams["east"].hits == 0
