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
from router.fake_provider import FakeUpstream
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
