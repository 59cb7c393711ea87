"""An endpoint's max_in_flight over HTTP (contract §4): a saturated endpoint is excluded
``endpoint_saturated`` while its attempts are in flight, and takes requests again after."""

from __future__ import annotations

import asyncio
from typing import Any

from openai.types.chat import ChatCompletionMessageParam

from router.fake_provider import Behavior
from tests.gateway.harness import Route, running_gateway

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
LIMITED = {"east": "    max_in_flight: 1\n"}


async def _served_by(gw: Any) -> tuple[str, str]:
    raw = await gw.client().chat.completions.with_raw_response.create(
        model="chat", messages=MESSAGES
    )
    return raw.headers["x-waybill-endpoint"], raw.headers["x-request-id"]


async def test_a_saturated_endpoint_is_excluded_until_its_attempt_ends(database_url):
    async with running_gateway(
        database_url,
        ["east", "west"],
        [Route("east"), Route("west", tier=1)],
        endpoint_extra=LIMITED,
    ) as gw:
        east = gw.upstreams["east"]
        east.set_default(Behavior.ok(latency_ms=1500))
        first = asyncio.ensure_future(_served_by(gw))
        await east.wait_for_async(lambda up: up.hits >= 1)  # its slot is taken
        endpoint, request_id = await _served_by(gw)
        assert endpoint == "west"
        events = await gw.events(request_id)
        evaluation = next(e.data for e in events if e.type == "RouteEvaluated")
        east_candidate = next(c for c in evaluation["candidates"] if c["endpoint"] == "east")
        assert east_candidate["reason_code"] == "endpoint_saturated"
        assert east_candidate["detail"] == "1 of 1 in flight"
        assert (await first)[0] == "east"
        east.set_default(Behavior.ok())
        assert (await _served_by(gw))[0] == "east", "the slot was given back"


async def test_a_stream_holds_its_slot_until_it_ends(database_url):
    async with running_gateway(
        database_url,
        ["east", "west"],
        [Route("east"), Route("west", tier=1)],
        endpoint_extra=LIMITED,
    ) as gw:
        east = gw.upstreams["east"]
        east.set_default(Behavior.ok(chunk_delay_ms=300))
        stream = await gw.client().chat.completions.create(
            model="chat", messages=MESSAGES, stream=True
        )
        first_chunk = await anext(aiter(stream))
        assert first_chunk  # committed to east, still streaming
        assert (await _served_by(gw))[0] == "west"
        _ = [chunk async for chunk in stream]
        east.set_default(Behavior.ok())
        assert (await _served_by(gw))[0] == "east"
