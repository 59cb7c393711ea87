"""The Responses door end to end (contract §3 "The Responses door"): the ``openai`` SDK's
``client.responses`` as the client, a real gateway on both backends, the fake kit's OpenAI and
Anthropic upstreams over real HTTP; stateless requests translated to chat completions."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import openai
import pytest

from ledger import apikeys
from ledger import events as ev
from router.fake_provider import Behavior, FakeUpstream
from tests.gateway.harness import Gateway, Route, running_gateway
from tests.helpers import eventually

DIALECTS = ("openai", "anthropic")
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
PLACE: Any = {"format": {"type": "json_schema", "name": "place", "schema": SCHEMA, "strict": True}}


@asynccontextmanager
async def door(
    database_url: str, driver: str = "openai", **options: Any
) -> AsyncIterator[tuple[Gateway, openai.AsyncOpenAI]]:
    routes = options.pop("routes", [Route("up")])
    names = options.pop("names", ["up"])
    drivers = options.pop("drivers", {name: driver for name in names})
    async with running_gateway(database_url, names, routes, drivers=drivers, **options) as gw:
        yield gw, gw.client()


def sent(upstream: FakeUpstream) -> dict[str, Any]:
    return upstream.requests[-1].json  # type: ignore[no-any-return]


async def received(gw: Gateway, request_id: str) -> ev.RequestReceived:
    first = (await gw.events(request_id))[0].event()
    assert isinstance(first, ev.RequestReceived)
    return first


@pytest.mark.parametrize("driver", DIALECTS)
async def test_a_buffered_response_through_either_dialect(database_url, driver):
    async with door(database_url, driver) as (gw, client):
        raw = await client.responses.with_raw_response.create(
            model="chat", instructions="be brief", input="hi", max_output_tokens=100
        )
        response = raw.parse()
        assert response.object == "response" and response.status == "completed"
        assert response.id.startswith("resp_")
        assert response.output[0].type == "message"
        assert response.output_text.startswith("Hello from up")
        assert response.usage is not None
        assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0
        assert response.usage.input_tokens_details.cached_tokens == 0
        assert response.usage.output_tokens_details.reasoning_tokens == 0
        assert response.to_dict()["store"] is False and response.instructions == "be brief"
        assert raw.headers["x-waybill-endpoint"] == "up"
        assert raw.headers["x-waybill-attempts"] == "1"
        request_id = raw.headers["x-request-id"]
        assert response.id == "resp_" + request_id.removeprefix("req_")
        types = await gw.wait_for_types(request_id, "RequestCompleted")
        assert "BudgetSettled" in types
        record = await received(gw, request_id)
        assert record.api == "openai.responses"
        assert record.requirements.max_output_tokens == 100
        if driver == "openai":
            body = sent(gw.upstreams["up"])
            assert body["messages"] == [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
            ]
            assert body["max_completion_tokens"] == 100


async def test_cached_and_reasoning_tokens_are_named_in_the_usage(database_url):
    async with door(database_url) as (gw, client):
        gw.upstreams["up"].set_plan([Behavior.ok(cached_tokens=3, reasoning_tokens=2)])
        response = await client.responses.create(model="chat", input="hi " * 20)
        assert response.usage is not None
        assert response.usage.input_tokens_details.cached_tokens == 3
        assert response.usage.output_tokens_details.reasoning_tokens == 2


@pytest.mark.parametrize("driver", DIALECTS)
async def test_a_streamed_response_through_either_dialect(database_url, driver):
    async with door(database_url, driver) as (_, client):
        kinds: list[str] = []
        completed = None
        stream = await client.responses.create(model="chat", input="hi", stream=True)
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.completed":
                completed = event.response
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == "response.completed"
        assert kinds[2:6] == [
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
        ]
        assert kinds[-4:-1] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
        ]
        assert completed is not None
        assert completed.output_text == "Hello from up: héllo 日本 🚀"
        assert completed.usage is not None and completed.usage.output_tokens == 6


async def test_the_sdks_stream_helper_assembles_the_response(database_url):
    async with door(database_url) as (_, client):
        async with client.responses.stream(model="chat", input="hi") as stream:
            async for _ in stream:
                pass
            final = await stream.get_final_response()
        assert final.output_text == "Hello from up: héllo 日本 🚀"


async def test_a_failure_after_the_stream_committed_is_response_failed(database_url):
    async with door(database_url) as (gw, client):
        gw.upstreams["up"].set_plan([Behavior.mid_stream_disconnect(after_content=2)])
        kinds: list[str] = []
        last: Any = None
        stream = await client.responses.create(model="chat", input="hi", stream=True)
        async for event in stream:
            kinds.append(event.type)
            last = event
        assert "response.output_text.delta" in kinds
        assert kinds[-1] == "response.failed", kinds
        assert last.response.status == "failed"
        assert last.response.error is not None


@pytest.mark.parametrize("driver", DIALECTS)
async def test_a_function_tool_round_trip(database_url, driver):
    async with door(database_url, driver) as (gw, client):
        gw.upstreams["up"].set_plan([Behavior.tool_call("get_weather")])
        asked = await client.responses.create(model="chat", input="weather?", tools=[WEATHER])
        (call,) = [item for item in asked.output if item.type == "function_call"]
        assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
        history: Any = [
            {"role": "user", "content": "weather?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ]
        answered = await client.responses.create(
            model="chat", input=history, tools=[WEATHER], tool_choice="auto"
        )
        assert answered.output_text.startswith("Hello from up")
        if driver == "openai":
            body = sent(gw.upstreams["up"])
            assert [m["role"] for m in body["messages"]] == ["user", "assistant", "tool"]
            assert body["messages"][1]["tool_calls"][0]["id"] == call.call_id
            assert body["messages"][2] == {
                "role": "tool",
                "tool_call_id": call.call_id,
                "content": "sunny",
            }
            assert body["tools"][0]["function"]["name"] == "get_weather"


async def test_a_streamed_function_call(database_url):
    async with door(database_url) as (gw, client):
        gw.upstreams["up"].set_plan([Behavior.tool_call("get_weather")])
        kinds: list[str] = []
        done: Any = None
        stream = await client.responses.create(
            model="chat", input="weather?", tools=[WEATHER], stream=True
        )
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.function_call_arguments.done":
                done = event
        assert "response.function_call_arguments.delta" in kinds
        assert done is not None and json.loads(done.arguments) == {"city": "Paris"}
        assert kinds[-1] == "response.completed"


async def test_text_format_json_schema_is_validated(database_url):
    routes = [Route("east"), Route("west", tier=1)]
    async with door(database_url, names=["east", "west"], routes=routes) as (gw, client):
        gw.upstreams["east"].set_default(Behavior.ok(text="Paris, I think"))
        gw.upstreams["west"].set_default(Behavior.ok(text=json.dumps({"city": "Paris"})))
        raw = await client.responses.with_raw_response.create(
            model="chat", input="where?", text=PLACE
        )
        response = raw.parse()
        assert json.loads(response.output_text) == {"city": "Paris"}
        assert raw.headers["x-waybill-endpoint"] == "west"
        sent_format = sent(gw.upstreams["west"])["response_format"]
        assert sent_format["type"] == "json_schema"
        assert sent_format["json_schema"]["schema"] == SCHEMA
        events = await gw.events(raw.headers["x-request-id"])
        finished = [e.data for e in events if e.type == "AttemptFinished"]
        assert finished[0]["failure_class"] == "invalid_output"


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": [{"type": "web_search"}]},
        {"extra_body": {"conversation": "conv_1"}},
        {"store": True},
        {"background": True},
    ],
)
async def test_what_needs_the_providers_state_is_refused_where_no_mapping_declares_responses(
    database_url, extra
):
    async with door(database_url) as (gw, client):
        with pytest.raises(openai.UnprocessableEntityError) as caught:
            await client.responses.create(model="chat", input="hi", **extra)
        assert caught.value.code == "no_eligible_route"
        assert not gw.upstreams["up"].requests, "no upstream called"
        request_id = caught.value.response.headers["x-request-id"]
        evaluated = [e.data for e in await gw.events(request_id) if e.type == "RouteEvaluated"]
        (candidate,) = evaluated[0]["candidates"]
        assert candidate["reason_code"] == "missing_capability"
        assert candidate["detail"] == "responses"


async def test_an_unknown_field_is_a_400_naming_it(database_url):
    async with door(database_url) as (_, client):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(model="chat", input="hi", extra_body={"nope": 1})
        assert caught.value.code == "invalid_request"
        assert "nope" in str(caught.value)


# --- natively, where a mapping declares `responses` ---

NATIVE = (*Route("x").capabilities, "responses")


SEARCH_PRICED = "{input_per_mtok: 1.0, output_per_mtok: 2.0, web_search: {per_choice_usd: 0.01}}"


def native_routes(*names: str) -> list[Route]:
    return [Route(name, capabilities=NATIVE, price=SEARCH_PRICED) for name in names]


async def test_built_in_tools_go_natively_to_the_mapping_that_declares_responses(database_url):
    routes = [Route("plain", price=SEARCH_PRICED), *native_routes("native")]
    async with door(database_url, names=["plain", "native"], routes=routes) as (gw, client):
        tools: Any = [{"type": "web_search"}]
        raw = await client.responses.with_raw_response.create(
            model="chat", input="news?", tools=tools, store=False
        )
        response = raw.parse()
        assert raw.headers["x-waybill-endpoint"] == "native"
        asked = gw.upstreams["native"].requests[-1]
        assert asked.path == "/v1/responses"
        assert asked.json["tools"] == tools and asked.json["input"] == "news?"
        assert asked.json["model"] == "fake-model"
        assert not gw.upstreams["plain"].requests
        assert response.id == "resp_" + asked.request_id.removeprefix("req_"), "the provider's"
        assert response.output_text.startswith("Hello from native")
        request_id = raw.headers["x-request-id"]
        await gw.wait_for_types(request_id, "RequestCompleted")
        events = await gw.events(request_id)
        record = events[0].event()
        assert isinstance(record, ev.RequestReceived)
        assert record.requirements.server_side_effects, "built-in tools are strict"
        assert record.requirements.web_search, "priced per search"
        (plain, _) = next(e.data for e in events if e.type == "RouteEvaluated")["candidates"]
        assert (plain["reason_code"], plain["detail"]) == ("missing_capability", "responses")
        finished = next(e.data for e in events if e.type == "AttemptFinished")
        assert finished["response_id"] == response.id
        assert finished["usage"]["input_tokens"] > 0


async def test_a_stored_response_streams_the_providers_own_events(database_url):
    async with door(database_url, routes=native_routes("up")) as (gw, client):
        kinds: list[str] = []
        completed: Any = None
        stream = await client.responses.create(model="chat", input="hi", store=True, stream=True)
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.completed":
                completed = event.response
        assert gw.upstreams["up"].requests[-1].path == "/v1/responses"
        assert kinds[:3] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
        ]
        assert kinds[-1] == "response.completed"
        assert completed.output_text == "Hello from up: héllo 日本 🚀"
        assert completed.usage.output_tokens == 6
        assert completed.id.startswith("resp_")


async def test_previous_response_id_is_served_by_the_endpoint_that_answered_it(database_url):
    routes = native_routes("east", "west")
    async with door(database_url, names=["east", "west"], routes=routes) as (gw, client):
        first = await client.responses.with_raw_response.create(
            model="chat", input="hi", store=True
        )
        held_by = first.headers["x-waybill-endpoint"]
        other = "west" if held_by == "east" else "east"
        previous = first.parse().id
        for _ in range(2):  # weighted round-robin would take the other one in turn
            raw = await client.responses.with_raw_response.create(
                model="chat", input="and then?", previous_response_id=previous
            )
            assert raw.headers["x-waybill-endpoint"] == held_by
            asked = gw.upstreams[held_by].requests[-1]
            assert asked.json["previous_response_id"] == previous
        events = await gw.events(raw.headers["x-request-id"])
        record = events[0].event()
        assert isinstance(record, ev.RequestReceived)
        assert record.requirements.affinity_endpoint == held_by
        candidates = next(e.data for e in events if e.type == "RouteEvaluated")["candidates"]
        excluded = next(c for c in candidates if c["endpoint"] == other)
        assert excluded["reason_code"] == "response_affinity"
        assert held_by in excluded["detail"]
        # The endpoint that holds it failing is the request's end: no other can know it.
        gw.upstreams[held_by].set_plan([Behavior.server_error(500)])
        before = len(gw.upstreams[other].requests)
        with pytest.raises(openai.APIStatusError):
            await client.responses.create(
                model="chat", input="again?", previous_response_id=previous
            )
        assert len(gw.upstreams[other].requests) == before, "never failed over"


async def test_an_unknown_previous_response_id_is_a_404(database_url):
    async with door(database_url, routes=native_routes("up")) as (gw, client):
        with pytest.raises(openai.NotFoundError) as caught:
            await client.responses.create(
                model="chat", input="hi", previous_response_id="resp_never"
            )
        assert caught.value.code == "response_not_found"
        assert "previous_response_id" in str(caught.value.body)
        assert not gw.upstreams["up"].requests


async def test_another_workspaces_response_is_not_found(database_url):
    async with door(database_url, routes=native_routes("up")) as (gw, client):
        first = await client.responses.create(model="chat", input="hi", store=True)
        key = await apikeys.create_key(gw.store, "other", "client")
        with pytest.raises(openai.NotFoundError):
            await gw.client(key.secret).responses.create(
                model="chat", input="hi", previous_response_id=first.id
            )


async def test_built_in_tools_are_not_failed_over_after_an_unknown_outcome(database_url):
    routes = [
        Route("east", capabilities=NATIVE, price=SEARCH_PRICED),
        Route("west", tier=1, capabilities=NATIVE, price=SEARCH_PRICED),
    ]
    async with door(database_url, names=["east", "west"], routes=routes) as (gw, client):
        gw.upstreams["east"].set_plan([Behavior.server_error(500)])
        with pytest.raises(openai.APIStatusError) as caught:
            await client.responses.create(
                model="chat", input="search", tools=[{"type": "web_search"}]
            )
        assert not gw.upstreams["west"].requests, "a search may have run: strict"
        request_id = caught.value.response.headers["x-request-id"]
        decided = [e.data for e in await gw.events(request_id) if e.type == "FailoverDecided"]
        assert decided and decided[-1]["action"] == "stop"


# --- the ledger, the books and the headers, as for chat ---


async def test_idempotency_budgets_spend_and_explain_as_for_chat(database_url):
    async with door(database_url) as (gw, client):
        key = {"Idempotency-Key": "order-1"}
        first = await client.responses.with_raw_response.create(
            model="chat", input="hi", extra_headers=key
        )
        again = await client.responses.with_raw_response.create(
            model="chat", input="hi", extra_headers=key
        )
        assert again.headers["idempotent-replayed"] == "true"
        assert again.parse().id == first.parse().id
        assert len(gw.upstreams["up"].requests) == 1, "replayed, never sent again"
        with pytest.raises(openai.APIStatusError) as caught:
            await client.responses.create(
                model="chat", input="hi", extra_headers={"X-Waybill-Max-Cost-Usd": "0.000000001"}
            )
        assert caught.value.status_code == 402 and caught.value.code == "budget_exceeded"
        request_id = first.headers["x-request-id"]
        await gw.wait_for_types(request_id, "RequestCompleted")
        async with gw.http() as http:
            explained = await http.get(f"/v1/requests/{request_id}/explain")
            assert explained.status_code == 200, explained.text

            async def counted() -> bool:
                response = await http.get("/v1/spend?group_by=api")
                rows = {r["api"]: r for r in response.json()["data"]}
                return bool(rows.get("openai.responses", {}).get("requests") == 1)

            await eventually(counted)


async def test_a_broken_native_stream_is_not_resumed_and_ends_in_response_failed(database_url):
    routes = [Route("up", capabilities=NATIVE, resume="assistant_prefill")]
    async with door(database_url, routes=routes) as (gw, client):
        gw.upstreams["up"].set_plan([Behavior.mid_stream_disconnect(after_content=2)])
        kinds: list[str] = []
        stream = await client.responses.create(model="chat", input="hi", store=True, stream=True)
        async for event in stream:
            kinds.append(event.type)
        assert "response.output_text.delta" in kinds
        assert kinds[-1] == "response.failed"
        assert len(gw.upstreams["up"].requests) == 1, "a stored response has no prefill"
