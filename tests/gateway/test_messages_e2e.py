"""The Anthropic door end to end (contract §3 "The Anthropic door"): the ``anthropic`` SDK as
the client, a real gateway on both backends, the fake kit's Anthropic and OpenAI upstreams
over real HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anthropic
import pytest

from ledger import events as ev
from router.fake_provider import THINKING_PIECES, Behavior, FakeUpstream, Kind, reply_pieces
from tests.gateway.harness import Gateway, Route, running_gateway

DIALECTS = ("anthropic", "openai")
PRICED = (
    "{input_per_mtok: 1.0, output_per_mtok: 2.0, image_input: {tokens: 2000}, "
    "file_input: {tokens: 5000}}"
)
HI: Any = [{"role": "user", "content": "hi"}]


@asynccontextmanager
async def door(
    database_url: str, driver: str, **options: Any
) -> AsyncIterator[tuple[Gateway, anthropic.AsyncAnthropic]]:
    routes = options.pop("routes", [Route("up", price=PRICED)])
    names = options.pop("names", ["up"])
    drivers = options.pop("drivers", {"up": driver})
    async with running_gateway(database_url, names, routes, drivers=drivers, **options) as gw:
        client = anthropic.AsyncAnthropic(base_url=gw.url, api_key=gw.secret, max_retries=0)
        try:
            yield gw, client
        finally:
            await client.close()


def sent(upstream: FakeUpstream) -> dict[str, Any]:
    """The body the upstream received last."""
    return upstream.requests[-1].json  # type: ignore[no-any-return]


async def received(gw: Gateway, request_id: str) -> ev.RequestReceived:
    first = (await gw.events(request_id))[0].event()
    assert isinstance(first, ev.RequestReceived)
    return first


@pytest.mark.parametrize("driver", DIALECTS)
async def test_a_buffered_message_through_either_dialect(database_url, driver):
    async with door(database_url, driver) as (gw, client):
        raw = await client.messages.with_raw_response.create(
            model="chat", max_tokens=100, system="be brief", messages=HI
        )
        message = await raw.parse()
        assert message.type == "message" and message.role == "assistant"
        assert message.id.startswith("msg_")
        assert message.content[0].type == "text"
        assert message.content[0].text.startswith("Hello from up")
        assert message.stop_reason == "end_turn"
        assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
        assert raw.headers["x-waybill-endpoint"] == "up"
        assert raw.headers["x-waybill-attempts"] == "1"
        request_id = raw.headers["x-request-id"]
        types = await gw.wait_for_types(request_id, "RequestCompleted")
        assert "BudgetSettled" in types
        record = await received(gw, request_id)
        assert record.api == "anthropic.messages"
        assert record.requirements.native == "anthropic"
        body = sent(gw.upstreams["up"])
        assert body["model"] == "fake-model"
        if driver == "anthropic":
            assert body["system"] == "be brief" and body["messages"] == HI  # natively
        else:
            assert body["messages"][0] == {"role": "system", "content": "be brief"}


@pytest.mark.parametrize("driver", DIALECTS)
async def test_a_streamed_message_through_either_dialect(database_url, driver):
    async with door(database_url, driver) as (_, client):
        kinds: list[str] = []
        async with client.messages.stream(model="chat", max_tokens=100, messages=HI) as stream:
            async for event in stream:
                kinds.append(event.type)
            final = await stream.get_final_message()
        assert kinds[0] == "message_start"
        assert kinds[-1] == "message_stop"
        assert {"content_block_start", "content_block_delta", "content_block_stop"} <= set(kinds)
        assert "message_delta" in kinds
        assert final.content[0].type == "text"
        assert final.content[0].text == "Hello from up: héllo 日本 🚀"
        assert final.stop_reason == "end_turn"
        assert final.usage.output_tokens == 6 and final.usage.input_tokens > 0


WEATHER: Any = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.mark.parametrize("driver", DIALECTS)
async def test_a_tool_round_trip(database_url, driver):
    async with door(database_url, driver) as (gw, client):
        gw.upstreams["up"].set_plan([Behavior.tool_call("get_weather")])
        asked = await client.messages.create(
            model="chat", max_tokens=100, tools=[WEATHER], messages=HI
        )
        assert asked.stop_reason == "tool_use"
        (use,) = [block for block in asked.content if block.type == "tool_use"]
        assert (use.name, use.input) == ("get_weather", {"city": "Paris"})
        history: Any = [
            *HI,
            {"role": "assistant", "content": [b.model_dump() for b in asked.content]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"},
                    {"type": "text", "text": "and tomorrow?"},
                ],
            },
        ]
        answered = await client.messages.create(
            model="chat",
            max_tokens=100,
            tools=[WEATHER],
            tool_choice={"type": "auto"},
            messages=history,
        )
        assert answered.stop_reason == "end_turn" and answered.content[0].type == "text"
        body = sent(gw.upstreams["up"])
        if driver == "anthropic":
            assert body["messages"] == history and body["tool_choice"] == {"type": "auto"}
        else:  # tool_use -> tool_calls, tool_result -> a tool message, then the text
            roles = [m["role"] for m in body["messages"]]
            assert roles == ["user", "assistant", "tool", "user"]
            assert body["messages"][1]["tool_calls"][0]["function"]["name"] == "get_weather"
            assert body["messages"][2] == {
                "role": "tool",
                "tool_call_id": use.id,
                "content": "sunny",
            }
            assert body["tools"][0]["function"]["parameters"] == WEATHER["input_schema"]
            assert body["tool_choice"] == "auto"


@pytest.mark.parametrize("driver", DIALECTS)
async def test_a_streamed_tool_call(database_url, driver):
    async with door(database_url, driver) as (gw, client):
        gw.upstreams["up"].set_plan([Behavior.tool_call("get_weather")])
        async with client.messages.stream(
            model="chat", max_tokens=100, tools=[WEATHER], messages=HI
        ) as stream:
            final = await stream.get_final_message()
        (use,) = final.content
        assert use.type == "tool_use" and use.input == {"city": "Paris"}
        assert final.stop_reason == "tool_use"


PIXEL = (  # a 1x1 PNG
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)


@pytest.mark.parametrize("driver", DIALECTS)
async def test_an_image(database_url, driver):
    async with door(database_url, driver) as (gw, client):
        image: Any = {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": PIXEL},
        }
        raw = await client.messages.with_raw_response.create(
            model="chat",
            max_tokens=100,
            messages=[{"role": "user", "content": [image, {"type": "text", "text": "what?"}]}],
        )
        message = await raw.parse()
        assert message.content[0].type == "text"
        record = await received(gw, raw.headers["x-request-id"])
        assert record.requirements.image_inputs == 1
        assert "vision" in record.requirements.capabilities
        part = sent(gw.upstreams["up"])["messages"][0]["content"][0]
        if driver == "anthropic":
            assert part == image
        else:
            assert part == {
                "type": "image_url",
                "image_url": {"url": f"data:image/png;base64,{PIXEL}"},
            }
        # Billed for the image at the mapping's price key (the fake bills 765 tokens for it).
        assert message.usage.input_tokens > 765


THINKING: Any = {"type": "enabled", "budget_tokens": 1024}


async def test_thinking_from_an_anthropic_endpoint_keeps_its_signature(database_url):
    async with door(database_url, "anthropic") as (gw, client):
        message = await client.messages.create(
            model="chat", max_tokens=2048, thinking=THINKING, messages=HI
        )
        thinking, text = message.content
        assert thinking.type == "thinking" and thinking.thinking == "".join(THINKING_PIECES)
        assert thinking.signature.startswith("sig_")
        assert text.type == "text"
        async with client.messages.stream(
            model="chat", max_tokens=2048, thinking=THINKING, messages=HI
        ) as stream:
            deltas = [e.delta.type async for e in stream if e.type == "content_block_delta"]
            final = await stream.get_final_message()
        assert deltas[:4] == ["thinking_delta"] * 3 + ["signature_delta"]
        thought, said = final.content
        assert thought.type == "thinking" and thought.signature.startswith("sig_")
        assert thought.thinking == "".join(THINKING_PIECES)
        assert said.type == "text" and said.text.startswith("Hello from up")
        # The next turn sends the signed block back, natively.
        history: Any = [
            *HI,
            {"role": "assistant", "content": [b.model_dump() for b in final.content]},
            {"role": "user", "content": "more"},
        ]
        await client.messages.create(
            model="chat", max_tokens=2048, thinking=THINKING, messages=history
        )
        assert sent(gw.upstreams["up"])["messages"][1]["content"][0]["signature"] == (
            thought.signature
        )


async def test_thinking_excludes_an_openai_endpoint_naming_the_feature(database_url):
    async with door(database_url, "openai") as (gw, client):
        with pytest.raises(anthropic.UnprocessableEntityError) as refused:
            await client.messages.create(
                model="chat", max_tokens=2048, thinking=THINKING, messages=HI
            )
        error = refused.value.body["error"]  # type: ignore[index]
        assert error["type"] == "invalid_request_error"
        assert error["code"] == "no_eligible_route"
        request_id = refused.value.response.headers["x-request-id"]
        types = await gw.wait_for_types(request_id, "RequestFailed")
        evaluated = [e.event() for e in await gw.events(request_id)]
        route = next(e for e in evaluated if isinstance(e, ev.RouteEvaluated))
        (candidate,) = route.candidates
        assert candidate.reason_code == ev.ReasonCode.DIALECT_UNSUPPORTED
        assert candidate.detail == "thinking"
        assert "AttemptStarted" not in types
        assert gw.upstreams["up"].hits == 0
        # Adaptive thinking is the model's choice: an OpenAI endpoint may answer without.
        message = await client.messages.create(
            model="chat", max_tokens=2048, thinking={"type": "adaptive"}, messages=HI
        )
        assert message.content[0].type == "text"


async def test_a_group_with_both_dialects_sends_thinking_to_the_anthropic_endpoint(
    database_url,
):
    routes = [Route("oa", price=PRICED), Route("an", price=PRICED, tier=1)]
    async with door(
        database_url,
        "",
        names=["oa", "an"],
        routes=routes,
        drivers={"oa": "openai", "an": "anthropic"},
    ) as (gw, client):
        raw = await client.messages.with_raw_response.create(
            model="chat", max_tokens=2048, thinking=THINKING, messages=HI
        )
        assert raw.headers["x-waybill-endpoint"] == "an"
        assert gw.upstreams["oa"].hits == 0
        plain = await client.messages.with_raw_response.create(
            model="chat", max_tokens=100, messages=HI
        )
        assert plain.headers["x-waybill-endpoint"] == "oa"  # tier 0 takes what it can carry


# --- errors ---


def error_of(raised: pytest.ExceptionInfo[anthropic.APIStatusError]) -> dict[str, Any]:
    body = raised.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    return body["error"]  # type: ignore[no-any-return]


async def test_each_error_in_anthropics_shape_with_waybills_code(database_url):
    # (upstream plan, SDK class, status, Anthropic type, Waybill code, request fields), in
    # an order no breaker interferes with (the upstream's failures come last, the 429 last
    # of all: it opens the endpoint's breaker at once, and a request that breaker refuses
    # never reaches the upstream, a retryable 503 of its own).
    cases: list[tuple[Any, type[anthropic.APIStatusError], int, str, str, dict[str, Any]]] = [
        (None, anthropic.BadRequestError, 400, "invalid_request_error", "invalid_request",
         {"max_tokens": 0}),
        (None, anthropic.NotFoundError, 404, "not_found_error", "model_not_found",
         {"model": "nope"}),
        ([Behavior(Kind.CONTENT_POLICY)], anthropic.InternalServerError, 502, "api_error",
         "upstream_policy_denied", {}),
        ([Behavior.server_error(503)], anthropic.OverloadedError, 529, "overloaded_error",
         "upstream_unavailable", {}),
        ([Behavior.rate_limited(retry_after=1)], anthropic.RateLimitError, 429,
         "rate_limit_error", "upstream_rate_limited", {}),
    ]  # fmt: skip
    async with door(database_url, "anthropic") as (gw, client):
        # The key: 401, in x-api-key or as a Bearer token.
        for wrong in (
            anthropic.AsyncAnthropic(base_url=gw.url, api_key="wb-wrong", max_retries=0),
            anthropic.AsyncAnthropic(base_url=gw.url, auth_token="wb-wrong", max_retries=0),
        ):
            with pytest.raises(anthropic.AuthenticationError) as denied:
                await wrong.messages.create(model="chat", max_tokens=10, messages=HI)
            assert error_of(denied)["type"] == "authentication_error"
            assert error_of(denied)["code"] == "invalid_api_key"
            await wrong.close()
        bearer = anthropic.AsyncAnthropic(base_url=gw.url, auth_token=gw.secret, max_retries=0)
        assert (await bearer.messages.create(model="chat", max_tokens=10, messages=HI)).content
        await bearer.close()
        # Too large: 413 request_too_large.
        with pytest.raises(anthropic.RequestTooLargeError) as too_large:
            big: Any = [{"role": "user", "content": "x" * (5 * 1024 * 1024)}]
            await client.messages.create(model="chat", max_tokens=10, messages=big)
        assert error_of(too_large)["type"] == "request_too_large"
        for plan, kind, status, anthropic_type, code, fields in cases:
            if plan is not None:
                gw.upstreams["up"].set_plan(plan)
            with pytest.raises(kind) as raised:
                await client.messages.create(
                    **{"model": "chat", "max_tokens": 100, "messages": HI, **fields}
                )
            assert raised.value.status_code == status, code
            error = error_of(raised)
            assert (error["type"], error["code"]) == (anthropic_type, code)
            assert raised.value.response.headers["x-should-retry"] == "false"
            body: Any = raised.value.body
            assert body["request_id"] == raised.value.response.headers["x-request-id"]


async def test_a_budget_refusal_is_a_billing_error(database_url):
    async with door(
        database_url, "anthropic", workspace_extra="    budget: {limit_usd: 0.000001, window: day}"
    ) as (_, client):
        with pytest.raises(anthropic.APIStatusError) as raised:
            await client.messages.create(model="chat", max_tokens=100, messages=HI)
        assert raised.value.status_code == 402
        assert (error_of(raised)["type"], error_of(raised)["code"]) == (
            "billing_error",
            "budget_exceeded",
        )


async def test_a_field_outside_the_api_is_refused_naming_it_unless_its_beta_is_named(
    database_url,
):
    async with door(database_url, "anthropic") as (gw, client):
        with pytest.raises(anthropic.BadRequestError) as raised:
            await client.messages.create(
                model="chat", max_tokens=10, messages=HI, extra_body={"context_management": {}}
            )
        assert error_of(raised)["param"] == "context_management"
        assert "context_management" in error_of(raised)["message"]
        assert gw.upstreams["up"].hits == 0
        management = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
        betas = "context-management-2025-06-27,effort-2025-11-24"
        await client.messages.create(
            model="chat",
            max_tokens=10,
            messages=HI,
            extra_body={"context_management": management, "output_config": {"effort": "high"}},
            extra_headers={"anthropic-beta": betas},
        )
        natively = gw.upstreams["up"].requests[-1]
        assert natively.json["context_management"] == management
        assert natively.json["output_config"] == {"effort": "high"}
        assert natively.headers.get("anthropic-beta") == betas


async def test_beta_fields_are_translated_or_exclude_an_openai_endpoint(database_url):
    async with door(database_url, "openai") as (gw, client):
        betas = {"anthropic-beta": "context-management-2025-06-27, effort-2025-11-24"}
        await client.messages.create(
            model="chat",
            max_tokens=10,
            messages=HI,
            extra_body={
                "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
                "output_config": {"effort": "low"},
            },
            extra_headers=betas,
        )
        body = sent(gw.upstreams["up"])
        assert body["reasoning_effort"] == "low"
        assert "context_management" not in body and "output_config" not in body
        assert "anthropic-beta" not in gw.upstreams["up"].requests[-1].headers
        with pytest.raises(anthropic.UnprocessableEntityError) as raised:
            await client.messages.create(
                model="chat",
                max_tokens=10,
                messages=HI,
                extra_body={
                    "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}
                },
                extra_headers=betas,
            )
        assert error_of(raised)["code"] == "no_eligible_route"


async def test_cache_control_goes_natively_and_cache_usage_comes_back(database_url):
    cached = (
        "{input_per_mtok: 1.0, output_per_mtok: 2.0, cache_write_per_mtok: 1.25, "
        "cache_write_1h_per_mtok: 2.0}"
    )
    async with door(database_url, "anthropic", routes=[Route("up", price=cached)]) as (
        gw,
        client,
    ):
        gw.upstreams["up"].set_plan([Behavior.ok(cached_tokens=1, cache_write_tokens=50)] * 2)
        marker = {"type": "ephemeral", "ttl": "1h"}
        system: Any = [{"type": "text", "text": "x" * 400, "cache_control": marker}]
        raw = await client.messages.with_raw_response.create(
            model="chat", max_tokens=10, system=system, messages=HI
        )
        message = await raw.parse()
        assert sent(gw.upstreams["up"])["system"] == system
        record = await received(gw, raw.headers["x-request-id"])
        assert record.requirements.cache_writes == ("1h",)
        usage = message.usage
        assert (usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (1, 50)
        async with client.messages.stream(
            model="chat", max_tokens=10, system=system, messages=HI
        ) as stream:
            final = await stream.get_final_message()
        assert final.usage.cache_read_input_tokens == 1
        assert final.usage.cache_creation_input_tokens == 50
        assert final.usage.input_tokens == usage.input_tokens


async def test_a_cache_write_without_its_price_skips_the_anthropic_endpoint(database_url):
    async with door(database_url, "anthropic") as (gw, client):
        system: Any = [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]
        with pytest.raises(anthropic.UnprocessableEntityError) as raised:
            await client.messages.create(model="chat", max_tokens=10, system=system, messages=HI)
        request_id = raised.value.response.headers["x-request-id"]
        await gw.wait_for_types(request_id, "RequestFailed")
        events = [e.event() for e in await gw.events(request_id)]
        route = next(e for e in events if isinstance(e, ev.RouteEvaluated))
        assert (route.candidates[0].reason_code, route.candidates[0].detail) == (
            ev.ReasonCode.UNPRICED_INPUT,
            "cache_write_per_mtok",
        )


# --- streams that break ---


async def test_a_failure_after_the_stream_committed_is_an_error_event(database_url):
    async with door(database_url, "anthropic") as (gw, client):
        gw.upstreams["up"].set_plan([Behavior.mid_stream_disconnect(after_content=2)])
        seen: list[str] = []
        with pytest.raises(anthropic.APIStatusError) as raised:
            async with client.messages.stream(model="chat", max_tokens=100, messages=HI) as s:
                async for event in s:
                    seen.append(event.type)
        assert "content_block_delta" in seen and "message_stop" not in seen
        assert error_of(raised)["code"] == "upstream_error"


@pytest.mark.parametrize("driver", DIALECTS)
async def test_a_broken_stream_is_resumed_on_the_same_model(database_url, driver):
    async with door(
        database_url, driver, routes=[Route("up", price=PRICED, resume="assistant_prefill")]
    ) as (gw, client):
        up = gw.upstreams["up"]
        up.set_continuation("assistant_prefill")
        up.set_plan([Behavior.mid_stream_disconnect(after_content=3)])
        async with client.messages.stream(model="chat", max_tokens=100, messages=HI) as stream:
            final = await stream.get_final_message()
            request_id = stream.response.headers["x-request-id"]
        assert final.content[0].text == "".join(reply_pieces("up"))  # type: ignore[union-attr]
        assert len(final.content) == 1 and final.stop_reason == "end_turn"
        assert up.requests[-1].continuation_chars == len("".join(reply_pieces("up")[:3]).rstrip())
        types = await gw.wait_for_types(request_id, "RequestCompleted")
        assert types.count("AttemptStarted") == 2


# --- count_tokens ---


async def test_count_tokens_asks_an_anthropic_endpoint_never_billed(database_url):
    async with door(database_url, "anthropic") as (gw, client):
        raw = await client.messages.with_raw_response.count_tokens(
            model="chat", system="be brief", messages=HI, tools=[WEATHER]
        )
        counted = await raw.parse()
        asked = gw.upstreams["up"].requests[-1]
        assert asked.path == "/v1/messages/count_tokens"
        assert asked.json["model"] == "fake-model" and asked.json["tools"] == [WEATHER]
        assert counted.input_tokens > 0
        assert raw.headers["x-waybill-token-count"] == "endpoint"
        assert raw.headers["x-waybill-endpoint"] == "up"
        assert gw.upstreams["up"].hits == 0  # no inference
        assert not await gw.store.read_stream(f"request-{raw.headers['x-request-id']}")


async def test_count_tokens_is_the_gateways_estimate_without_an_anthropic_endpoint(
    database_url,
):
    async with door(database_url, "openai") as (gw, client):
        raw = await client.messages.with_raw_response.count_tokens(model="chat", messages=HI)
        assert raw.headers["x-waybill-token-count"] == "estimate"
        assert (await raw.parse()).input_tokens > 0
        assert gw.upstreams["up"].requests == []
        with pytest.raises(anthropic.NotFoundError) as raised:
            await client.messages.count_tokens(model="nope", messages=HI)
        assert error_of(raised)["code"] == "model_not_found"


# --- the rest of the house, through this door ---


async def test_the_beta_client_and_its_query_string(database_url):
    async with door(database_url, "anthropic") as (gw, client):
        management: Any = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
        message = await client.beta.messages.create(
            model="chat",
            max_tokens=10,
            messages=HI,
            betas=["context-management-2025-06-27"],
            context_management=management,
        )
        assert message.content[0].type == "text"
        natively = gw.upstreams["up"].requests[-1]
        assert natively.json["context_management"] == management
        assert natively.headers.get("anthropic-beta") == "context-management-2025-06-27"


async def test_an_idempotency_key_replays_the_anthropic_answer(database_url):
    async with door(database_url, "openai") as (gw, client):
        key = {"Idempotency-Key": "order-42"}
        first = await client.messages.with_raw_response.create(
            model="chat", max_tokens=10, messages=HI, extra_headers=key
        )
        again = await client.messages.with_raw_response.create(
            model="chat", max_tokens=10, messages=HI, extra_headers=key
        )
        assert again.headers["idempotent-replayed"] == "true"
        assert (await again.parse()).model_dump() == (await first.parse()).model_dump()
        assert gw.upstreams["up"].hits == 1
        with pytest.raises(anthropic.ConflictError) as raised:
            await client.messages.create(
                model="chat", max_tokens=11, messages=HI, extra_headers=key
            )
        assert (error_of(raised)["type"], error_of(raised)["code"]) == (
            "invalid_request_error",
            "idempotency_conflict",
        )


async def test_explain_names_the_feature_a_dialect_lacks(database_url):
    async with door(database_url, "openai") as (gw, client):
        with pytest.raises(anthropic.UnprocessableEntityError) as raised:
            await client.messages.create(
                model="chat", max_tokens=2048, thinking=THINKING, messages=HI
            )
        request_id = raised.value.response.headers["x-request-id"]
        await gw.wait_for_types(request_id, "RequestFailed")
        async with gw.http() as http:
            explained = await http.get(f"/v1/requests/{request_id}/explain?format=text")
        assert explained.status_code == 200
        assert "dialect_unsupported" in explained.text and "thinking" in explained.text


async def test_the_chat_door_carries_an_anthropic_upstreams_cache_usage_too(database_url):
    async with door(database_url, "anthropic") as (gw, _):
        gw.upstreams["up"].set_plan([Behavior.ok(cached_tokens=2)])
        completion = await gw.client().chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hi there, how are you"}]
        )
        usage = completion.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens == 2
        assert (usage.model_extra or {})["cache_read_input_tokens"] == 2


async def test_a_client_that_hangs_up_mid_stream_is_recorded(database_url):
    async with door(database_url, "anthropic") as (gw, _):
        gw.upstreams["up"].set_default(Behavior.ok(chunk_delay_ms=200))
        body = {"model": "chat", "max_tokens": 100, "messages": HI, "stream": True}
        async with (
            gw.http() as http,
            http.stream("POST", "/v1/messages", json=body) as response,
        ):
            assert response.status_code == 200
            request_id = response.headers["x-request-id"]
            async for piece in response.aiter_raw():
                if b"content_block_delta" in piece:
                    break  # the first content arrived: hang up
        await gw.wait_for_types(request_id, "RequestFailed")
        failed = next(e.data for e in await gw.events(request_id) if e.type == "RequestFailed")
        assert (failed["http_status"], failed["error_code"]) == (499, "client_canceled")
        await gw.upstreams["up"].wait_for_async(lambda up: up.client_gone >= 1)
