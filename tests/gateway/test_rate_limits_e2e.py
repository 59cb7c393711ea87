"""Rate limits per key and per workspace (config ``limits``, ``key_limits``) over HTTP, on both
ledger backends, in process and shared through Redis: a refusal is a recorded 429
``rate_limited`` with Retry-After that never reaches an upstream or a breaker, and tokens count
the worst case at admission, corrected at settlement."""

from __future__ import annotations

import asyncio
import re
import time

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.gateway.harness import Route, running_gateway
from tests.helpers import REDIS_URL, eventually, redis_up

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


async def _fresh_window() -> None:
    # The limits count aligned minutes: start where no minute ends within the test.
    left = 60 - time.time() % 60
    if left < 15:
        await asyncio.sleep(left + 0.1)


async def test_a_workspace_over_its_requests_per_minute_gets_a_recorded_429(database_url):
    limits = "    limits: {requests_per_minute: 2}\n"
    async with running_gateway(
        database_url, ["east"], [Route("east")], workspace_extra=limits
    ) as gw:
        await _fresh_window()
        client = gw.client()
        for _ in range(2):
            await client.chat.completions.create(model="chat", messages=MESSAGES)
        with pytest.raises(openai.RateLimitError) as refused:
            await client.chat.completions.create(model="chat", messages=MESSAGES)
        response = refused.value.response
        assert response.json()["error"]["code"] == "rate_limited"
        assert 1 <= int(response.headers["retry-after"]) <= 60
        assert len(gw.upstreams["east"].requests) == 2  # the third never left
        request_id = response.headers["x-request-id"]
        events = await gw.events(request_id)
        assert [e.type for e in events] == ["RequestReceived", "RateLimitExceeded", "RequestFailed"]
        exceeded = events[1].data
        assert exceeded["subject"] == "workspace:acme"
        assert (exceeded["limit_name"], exceeded["limit"], exceeded["window_s"]) == (
            "requests_per_minute",
            2,
            60,
        )
        assert exceeded["window_start"].endswith(":00Z")
        failed = events[2].data
        assert (failed["http_status"], failed["error_code"], failed["attempts"]) == (
            429,
            "rate_limited",
            0,
        )
        async with gw.http() as http:  # the refused request reads like any other

            async def projected() -> bool:
                return (await http.get(f"/v1/requests/{request_id}")).status_code == 200

            await eventually(projected)
            shown = (await http.get(f"/v1/requests/{request_id}")).json()
            explained = await http.get(f"/v1/requests/{request_id}/explain")
        assert shown["status"] == "failed", shown
        assert explained.status_code == 200, explained.text
        async with gw.http() as http:
            metrics = (await http.get("/metrics", headers={"authorization": ""})).text
        refusals = re.search(r"waybill_rate_limit_rejections_total{([^}]*)} (\S+)", metrics)
        assert refusals is not None and refusals.group(2) == "1.0", metrics
        assert 'waybill_rate_limit_subject="workspace"' in refusals.group(1)
        assert 'waybill_rate_limit_name="requests_per_minute"' in refusals.group(1)


async def _tokens_per_minute(gw) -> None:
    await _fresh_window()
    client = gw.client()
    # worst case: ~1 input token + 100 output; the answer uses a handful, so the second fits
    # only because the first was corrected at its settlement
    for _ in range(2):
        await client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=100)
    with pytest.raises(openai.RateLimitError) as refused:
        await client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=200)
    request_id = refused.value.response.headers["x-request-id"]
    (exceeded,) = [e.data for e in await gw.events(request_id) if e.type == "RateLimitExceeded"]
    assert exceeded["subject"] == f"key:{gw.key_id}"
    assert (exceeded["limit_name"], exceeded["limit"]) == ("tokens_per_minute", 150)
    assert exceeded["tokens"] > 150
    assert len(gw.upstreams["east"].requests) == 2


async def test_a_keys_tokens_per_minute_count_the_worst_case_corrected_at_settlement(
    database_url,
):
    limits = "    key_limits: {tokens_per_minute: 150}\n"
    async with running_gateway(
        database_url, ["east"], [Route("east")], workspace_extra=limits
    ) as gw:
        await _tokens_per_minute(gw)


@pytest.mark.skipif(not redis_up(), reason="no Redis at WAYBILL_TEST_REDIS_URL")
async def test_rate_limits_are_counted_in_redis_when_it_is_set(sqlite_url):
    limits = "    key_limits: {tokens_per_minute: 150}\n"
    async with running_gateway(
        sqlite_url, ["east"], [Route("east")], workspace_extra=limits, redis_url=REDIS_URL
    ) as gw:
        await _tokens_per_minute(gw)
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        try:
            assert client.keys(f"waybill:rate:key:{gw.key_id}:*")
        finally:
            client.close()
