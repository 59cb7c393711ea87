"""Anthropic's prompt-cache writes are settled at their own prices whichever door a request
came through: an Anthropic upstream's `cache_creation_input_tokens` (5-minute and hour-long,
by its `cache_creation` split) at `price.cache_write_per_mtok` / `cache_write_1h_per_mtok`,
its cache reads at `cached_input_per_mtok`, the rest of the prompt at the input price —
and the reservation covers a prompt written whole to the cache at the dearest of them."""

from __future__ import annotations

from decimal import Decimal

import pytest
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletionMessageParam

from ledger.events import Usage
from router.fake_provider.behavior import Behavior
from tests.gateway.door_traffic import served_through
from tests.gateway.harness import Route, running_gateway

D = Decimal
PRICE = (
    "{input_per_mtok: 1.0, output_per_mtok: 2.0, cached_input_per_mtok: 0.1, "
    "cache_write_per_mtok: 1.25, cache_write_1h_per_mtok: 3.0}"
)
PROMPT = "Tell me about the weather in Paris, Lyon and Marseille today. " * 3


@pytest.mark.parametrize("stream", [False, True])
async def test_an_anthropic_upstreams_cache_writes_settle_at_the_cache_write_prices(
    database_url: str, stream: bool
) -> None:
    async with running_gateway(
        database_url, ["west"], [Route("west", price=PRICE)], drivers={"west": "anthropic"}
    ) as gw:
        gw.upstreams["west"].set_default(
            Behavior.ok(cached_tokens=5, cache_write_tokens=7, cache_write_1h_tokens=3)
        )
        client = gw.client()
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": PROMPT}]
        if stream:
            streamed = await client.chat.completions.with_raw_response.create(
                model="chat",
                messages=messages,
                max_tokens=50,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in streamed.parse()]
            answer_usage: CompletionUsage | None = next(c.usage for c in chunks if c.usage)
            headers = streamed.headers
        else:
            buffered = await client.chat.completions.with_raw_response.create(
                model="chat", messages=messages, max_tokens=50
            )
            answer_usage = buffered.parse().usage
            headers = buffered.headers
        request_id = headers["x-request-id"]
        await gw.wait_for_types(request_id, "RequestCompleted")
        events = await gw.events(request_id)
        settled = next(e.data for e in events if e.type == "BudgetSettled")
        reserved = next(e.data for e in events if e.type == "BudgetReserved")
        usage = Usage.model_validate(settled["usage"])
        assert (
            usage.cached_input_tokens,
            usage.cache_write_input_tokens,
            usage.cache_write_1h_input_tokens,
        ) == (5, 7, 3)
        assert answer_usage is not None and answer_usage.prompt_tokens == usage.input_tokens
        plain = usage.input_tokens - 5 - 7 - 3
        assert plain > 0
        expected = (
            D(plain) * D("1.0")
            + 5 * D("0.1")
            + 7 * D("1.25")
            + 3 * D("3.0")
            + usage.output_tokens * D("2.0")
        ) / 10**6
        assert D(settled["settled_usd"]) == expected
        completed = next(e.data for e in events if e.type == "RequestCompleted")
        assert D(completed["cost_usd"]) == expected
        # The reservation priced the whole prompt at the dearest input rate, the hour's write.
        received = next(e.data for e in events if e.type == "RequestReceived")
        estimated = received["requirements"]["estimated_input_tokens"]
        assert D(reserved["amount_usd"]) == (D(estimated) * 3 + 50 * 2) / 10**6
        assert "BudgetOverrun" not in [e.type for e in events]


async def test_cache_writes_without_a_price_settle_at_the_input_price_as_before(
    sqlite_url: str,
) -> None:
    # A request through the chat door carries no cache_control marker, so it cannot ask for
    # writes and its mapping needs no cache-write price; an upstream that reports some anyway
    # is settled at the next price the mapping has (documented in router/request/worst_case.py).
    price = "{input_per_mtok: 1.0, output_per_mtok: 2.0, cached_input_per_mtok: 0.1}"
    async with running_gateway(
        sqlite_url, ["west"], [Route("west", price=price)], drivers={"west": "anthropic"}
    ) as gw:
        gw.upstreams["west"].set_default(Behavior.ok(cached_tokens=2, cache_write_tokens=4))
        raw = await gw.client().chat.completions.with_raw_response.create(
            model="chat", messages=[{"role": "user", "content": PROMPT}], max_tokens=20
        )
        assert raw.http_response.status_code == 200
        events = await gw.events(raw.headers["x-request-id"])
        settled = next(e.data for e in events if e.type == "BudgetSettled")
        usage = Usage.model_validate(settled["usage"])
        assert usage.cache_write_input_tokens == 4
        expected = (D(usage.input_tokens - 2) * 1 + 2 * D("0.1") + usage.output_tokens * 2) / 10**6
        assert D(settled["settled_usd"]) == expected


async def test_a_request_asking_for_cache_writes_skips_an_anthropic_mapping_without_their_price(
    sqlite_url: str,
) -> None:
    # An Anthropic endpoint priced for 5-minute writes only, and an OpenAI one (which bills
    # no write): a request whose cache_control markers ask for an hour's write, handed to the
    # core as the Messages door hands it over, never goes where its writes have no price.
    five_only = "{input_per_mtok: 1.0, output_per_mtok: 2.0, cache_write_per_mtok: 1.25}"
    async with running_gateway(
        sqlite_url,
        ["west", "east"],
        [Route("west", price=five_only), Route("east", tier=1)],
        drivers={"west": "anthropic"},
    ) as gw:
        body = {"model": "chat", "messages": [{"role": "user", "content": PROMPT}]}
        hour = await served_through(gw, "anthropic.messages", body, cache_writes=("1h",))
        events = await gw.events(hour)
        (evaluated,) = [e.data for e in events if e.type == "RouteEvaluated"]
        west = next(c for c in evaluated["candidates"] if c["endpoint"] == "west")
        assert (west["reason_code"], west["detail"]) == (
            "unpriced_input",
            "cache_write_1h_per_mtok",
        )
        assert gw.upstreams["west"].hits == 0 and gw.upstreams["east"].hits == 1
        five = await served_through(gw, "anthropic.messages", body, cache_writes=("5m",))
        assert gw.upstreams["west"].hits == 1
        completed = next(e.data for e in await gw.events(five) if e.type == "RequestCompleted")
        assert completed["endpoint"] == "west"
