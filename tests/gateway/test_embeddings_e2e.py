"""The embeddings door end to end (contract §3 "Embeddings"): the ``openai`` SDK's
``client.embeddings.create`` through a real gateway on both backends, the fake kit's OpenAI
upstreams over real HTTP."""

from __future__ import annotations

import base64
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from decimal import Decimal
from typing import Any

import openai
import pytest

from ledger import events as ev
from router.fake_provider import Behavior, embedding, embedding_tokens
from tests.gateway.harness import Gateway, Route, running_gateway

PRICE = "{input_per_mtok: 0.02, output_per_mtok: 0}"
INPUT_RATE = Decimal("0.02") / 1_000_000


def embed_route(upstream: str, **options: Any) -> Route:
    return Route(
        upstream,
        model=options.pop("model", "fake-embed"),
        capabilities=("embeddings",),
        context_window=options.pop("context_window", 8191),
        max_output_tokens=1,
        price=PRICE,
        **options,
    )


@asynccontextmanager
async def door(
    database_url: str, names: tuple[str, ...] = ("a",), **options: Any
) -> AsyncIterator[tuple[Gateway, openai.AsyncOpenAI]]:
    routes = options.pop("embedding_routes", [embed_route(names[0])])
    async with running_gateway(
        database_url, names, [Route(names[0])], embedding_routes=routes, **options
    ) as gw:
        yield gw, gw.client()


async def events_of(gw: Gateway, request_id: str) -> list[ev.Event]:
    await gw.wait_for_types(request_id, "RequestCompleted")
    return [e.event() for e in await gw.events(request_id)]


def one(events: list[ev.Event], kind: type[ev.Event]) -> Any:
    (found,) = [e for e in events if isinstance(e, kind)]
    return found


async def test_one_input_is_embedded_reserved_and_settled_at_the_input_price(database_url):
    async with door(database_url) as (gw, client):
        raw = await client.embeddings.with_raw_response.create(
            model="embed", input="hello world", encoding_format="float"
        )
        answer = raw.parse()
        assert answer.object == "list" and len(answer.data) == 1
        assert answer.data[0].embedding == embedding("hello world")
        tokens = embedding_tokens("hello world")
        assert answer.usage.prompt_tokens == tokens == answer.usage.total_tokens
        assert raw.headers["x-waybill-endpoint"] == "a"
        assert raw.headers["x-waybill-attempts"] == "1"
        assert Decimal(raw.headers["x-waybill-cost-usd"]) == tokens * INPUT_RATE
        sent = gw.upstreams["a"].requests[-1]
        assert sent.path == "/v1/embeddings"
        wanted = {"model": "fake-embed", "input": "hello world", "encoding_format": "float"}
        assert sent.json == wanted
        events = await events_of(gw, raw.headers["x-request-id"])
        received = one(events, ev.RequestReceived)
        assert received.api == "openai.embeddings"
        assert received.requirements.kind == "embeddings"
        assert received.requirements.capabilities == ("embeddings",)
        assert received.requirements.max_output_tokens == 0
        # Text is bounded by its bytes: a token covers at least one.
        assert received.requirements.estimated_input_tokens == len(b"hello world")
        reserved = one(events, ev.BudgetReserved)
        assert reserved.amount_usd == len(b"hello world") * INPUT_RATE
        settled = one(events, ev.BudgetSettled)
        assert settled.settled_usd == tokens * INPUT_RATE


async def test_a_batch_comes_back_in_order_through_the_sdks_default_base64(database_url):
    texts = ["first", "second one", "日本 🚀"]
    async with door(database_url) as (gw, client):
        # The SDK asks for base64 when not told otherwise, and decodes it to floats.
        answer = await client.embeddings.create(model="embed", input=texts, dimensions=4)
        assert [d.index for d in answer.data] == [0, 1, 2]
        assert [d.embedding for d in answer.data] == [embedding(t, 4) for t in texts]
        assert answer.usage.prompt_tokens == sum(embedding_tokens(t) for t in texts)
        sent = gw.upstreams["a"].requests[-1].json
        assert sent["encoding_format"] == "base64" and sent["dimensions"] == 4


async def test_base64_asked_for_is_answered_as_base64(database_url):
    async with door(database_url) as (_, client):
        answer = await client.embeddings.create(
            model="embed", input="hello", encoding_format="base64"
        )
        encoded: Any = answer.data[0].embedding  # the SDK's type says floats; it is the text
        assert isinstance(encoded, str)
        decoded = struct.unpack("<8f", base64.b64decode(encoded))
        assert list(decoded) == embedding("hello")


async def test_token_arrays_are_reserved_exactly(database_url):
    tokens = [[1, 2, 3], [40, 50]]
    async with door(database_url) as (gw, client):
        raw = await client.embeddings.with_raw_response.create(
            model="embed", input=tokens, encoding_format="float"
        )
        answer = raw.parse()
        assert [d.embedding for d in answer.data] == [embedding(t) for t in tokens]
        assert answer.usage.prompt_tokens == 5
        events = await events_of(gw, raw.headers["x-request-id"])
        received = one(events, ev.RequestReceived)
        assert received.requirements.estimated_input_tokens == 5
        assert received.requirements.largest_input_tokens == 3
        assert received.message_count == 2
        assert one(events, ev.BudgetReserved).amount_usd == 5 * INPUT_RATE
        assert one(events, ev.BudgetSettled).released_usd == 0


async def test_a_request_budget_below_the_input_is_refused_before_any_call(database_url):
    async with door(database_url) as (gw, client):
        with pytest.raises(openai.APIStatusError) as raised:
            await client.embeddings.create(
                model="embed",
                input="hello world",
                extra_headers={"X-Waybill-Max-Cost-Usd": "0.0000000001"},
            )
        assert raised.value.status_code == 402
        assert raised.value.body["code"] == "budget_exceeded"  # type: ignore[index]
        assert gw.upstreams["a"].hits == 0


async def test_a_failed_embedding_fails_over_to_the_next_mapping(database_url):
    routes = [embed_route("a"), embed_route("b", tier=1)]
    async with door(database_url, ("a", "b"), embedding_routes=routes) as (gw, client):
        gw.upstreams["a"].set_plan([Behavior.server_error()])
        raw = await client.embeddings.with_raw_response.create(model="embed", input="hi")
        assert raw.headers["x-waybill-endpoint"] == "b"
        assert raw.headers["x-waybill-attempts"] == "2"
        assert raw.parse().data[0].embedding == embedding("hi")
        events = await events_of(gw, raw.headers["x-request-id"])
        decided = one(events, ev.FailoverDecided)
        assert decided.failure_class == "upstream_unavailable"
        assert len([e for e in events if isinstance(e, ev.AttemptStarted)]) == 2


async def test_a_group_of_the_other_kind_is_refused_model_kind_mismatch(database_url):
    async with door(database_url) as (gw, client):
        with pytest.raises(openai.BadRequestError) as raised:
            await client.embeddings.create(model="chat", input="hi")
        assert raised.value.body["code"] == "model_kind_mismatch"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as raised:
            await client.chat.completions.create(
                model="embed", messages=[{"role": "user", "content": "hi"}]
            )
        assert raised.value.body["code"] == "model_kind_mismatch"  # type: ignore[index]
        assert raised.value.body["param"] == "model"  # type: ignore[index]
        # The Anthropic door's routes serve chat groups alone too.
        message = {
            "model": "embed",
            "max_tokens": 10,
            "messages": [{"role": "user", "content": "hi"}],
        }
        async with gw.http() as http:
            for path in ("/v1/messages", "/v1/messages/count_tokens"):
                refused = await http.post(path, json=message)
                assert refused.status_code == 400, (path, refused.text)
                assert refused.json()["error"]["code"] == "model_kind_mismatch"
        assert gw.upstreams["a"].hits == 0


async def test_a_malformed_input_is_refused_naming_it(database_url):
    async with door(database_url) as (gw, client):
        with pytest.raises(openai.BadRequestError) as raised:
            await client.embeddings.create(model="embed", input=["ok", ""])
        assert raised.value.body["param"] == "input[1]"  # type: ignore[index]
        assert gw.upstreams["a"].hits == 0


async def test_an_embeddings_request_is_explained_replayed_and_held_to_its_deadline(
    database_url,
):
    async with door(database_url) as (gw, client):
        key = {"Idempotency-Key": "embed-once"}
        first = await client.embeddings.with_raw_response.create(
            model="embed", input="hello", encoding_format="float", extra_headers=key
        )
        again = await client.embeddings.with_raw_response.create(
            model="embed", input="hello", encoding_format="float", extra_headers=key
        )
        assert again.headers["idempotent-replayed"] == "true"
        assert again.parse().data[0].embedding == first.parse().data[0].embedding
        assert gw.upstreams["a"].hits == 1

        request_id = first.headers["x-request-id"]
        await gw.wait_for_types(request_id, "RequestCompleted")
        async with gw.http() as http:
            explained = (await http.get(f"/v1/requests/{request_id}/explain")).json()
            text = (await http.get(f"/v1/requests/{request_id}/explain?format=text")).text
        assert explained["api"] == "openai.embeddings" and explained["status"] == "succeeded"
        assert explained["requirements"]["kind"] == "embeddings"
        assert [a["endpoint"] for a in explained["attempts"]] == ["a"]
        assert "received through openai.embeddings" in text

        gw.upstreams["a"].set_plan([Behavior.stall(stall_s=10)])
        with pytest.raises(openai.APIStatusError) as raised:
            await client.embeddings.create(
                model="embed", input="slow", extra_headers={"X-Waybill-Deadline-Ms": "300"}
            )
        assert raised.value.status_code == 504
        assert raised.value.body["code"] == "deadline_exceeded"  # type: ignore[index]
