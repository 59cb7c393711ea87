"""The drivers' embeddings call (contract §3 "Embeddings"): an OpenAI-compatible upstream's
``/embeddings`` over real HTTP, its usage read as input only; a dialect without an
embeddings API cannot be sent one."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from router.config import Endpoint
from router.drivers import (
    AnthropicDriver,
    AttemptBinding,
    AttemptTimeouts,
    ChatRequest,
    OpenAIDriver,
    UpstreamFailure,
)
from router.drivers.openai import embeddings_usage
from router.fake_provider import Behavior, FakeUpstream, embedding, embedding_tokens

SECRET = "sk-test-very-secret-0123456789"


@pytest.fixture
async def up() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream("east") as upstream:
        yield upstream


def _binding(up: FakeUpstream, driver: str = "openai") -> AttemptBinding:
    endpoint = Endpoint.model_validate(
        {
            "id": "east",
            "driver": driver,
            "base_url": up.base_url,
            "api_key": "${env:KEY}",
            "region": "eu",
            "data_classes": ["internal"],
        },
        context={"environ": {"KEY": SECRET}},
    )
    return AttemptBinding(endpoint, "text-embedding-3-small", "att_1", AttemptTimeouts(5.0))


def _request(**body: object) -> ChatRequest:
    return ChatRequest(
        body={"model": "embed", **body}, upstream_model="text-embedding-3-small", kind="embeddings"
    )


async def test_openai_driver_posts_to_embeddings_and_settles_on_prompt_tokens(up):
    driver = OpenAIDriver()
    try:
        result = await driver.complete(driver.prepare(_request(input=["a b", "c"]), _binding(up)))
    finally:
        await driver.aclose()
    sent = up.requests[-1]
    assert sent.path == "/v1/embeddings"
    assert sent.json == {"model": "text-embedding-3-small", "input": ["a b", "c"]}
    assert sent.headers["authorization"] == f"Bearer {SECRET}"
    assert [d["embedding"] for d in result.response["data"]] == [embedding("a b"), embedding("c")]
    tokens = embedding_tokens("a b") + embedding_tokens("c")
    assert result.usage is not None
    assert (result.usage.input_tokens, result.usage.output_tokens) == (tokens, 0)
    assert result.finish_reason is None and result.status == 200


async def test_an_upstream_error_is_classified_as_for_chat(up):
    up.set_plan([Behavior.rate_limited(retry_after=2)])
    driver = OpenAIDriver()
    try:
        with pytest.raises(UpstreamFailure) as failed:
            await driver.complete(driver.prepare(_request(input="x"), _binding(up)))
    finally:
        await driver.aclose()
    assert failed.value.failure_class == "rate_limited"
    assert failed.value.outcome.retry_after_ms == 2000


async def test_a_200_that_is_not_an_embeddings_list_fails_the_attempt(up):
    up.set_plan([Behavior.malformed_event()])  # a 200 whose body is cut in half
    driver = OpenAIDriver()
    try:
        with pytest.raises(UpstreamFailure) as failed:
            await driver.complete(driver.prepare(_request(input="x"), _binding(up)))
    finally:
        await driver.aclose()
    assert failed.value.failure_class == "upstream_unavailable"


async def test_the_anthropic_dialect_cannot_be_sent_an_embeddings_request(up):
    driver = AnthropicDriver()
    try:
        with pytest.raises(ValueError, match="no embeddings API"):
            driver.prepare(_request(input="x"), _binding(up, "anthropic"))
    finally:
        await driver.aclose()


@pytest.mark.parametrize(
    ("raw", "tokens"),
    [
        ({"prompt_tokens": 7, "total_tokens": 7}, 7),
        ({"prompt_tokens": 7}, 7),
        ({"prompt_tokens": 7, "total_tokens": 9}, 9),  # never understated
        ({"total_tokens": 4}, 4),
        ({}, None),
        (None, None),
        ({"prompt_tokens": -1}, None),
    ],
)
def test_embeddings_usage_is_input_only(raw, tokens):
    usage = embeddings_usage(raw)
    if tokens is None:
        assert usage is None
    else:
        assert usage is not None
        assert (usage.input_tokens, usage.output_tokens) == (tokens, 0)
