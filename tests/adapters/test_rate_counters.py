"""Rate limit counters (router/adapters/rate_counters.py): in process and shared through Redis
(``WAYBILL_TEST_REDIS_URL``, default ``redis://127.0.0.1:6379/15``)."""

from __future__ import annotations

import uuid

import pytest

from router.adapters.rate_counters import (
    InProcessRateCounters,
    RateCounters,
    RedisRateCounters,
)
from router.adapters.rate_limits import RateLimit
from tests.helpers import REDIS_URL, redis_up

T = 1_764_504_000.0
LIMITS = (
    RateLimit("workspace:acme", requests_per_minute=3),
    RateLimit("key:k_1", tokens_per_minute=1000),
)


async def _counts_and_corrects(one: RateCounters, two: RateCounters) -> None:
    window, refused = await one.take(LIMITS, 600, T + 1)
    assert refused is None
    # the other replica sees the worst case counted: 600 + 600 > 1000
    _, refused = await two.take(LIMITS, 600, T + 2)
    assert refused is not None and refused.limit_name == "tokens_per_minute"
    assert (refused.subject, refused.retry_after_s) == ("key:k_1", 58)
    # settled at 100 tokens: 500 given back, so 600 more fit (and the refusal counted nothing)
    await one.correct([limit.subject for limit in LIMITS], window, 100 - 600)
    _, refused = await two.take(LIMITS, 600, T + 3)
    assert refused is None
    _, refused = await one.take(LIMITS, 0, T + 4)
    assert refused is None  # the third request
    _, refused = await two.take(LIMITS, 0, T + 5)
    assert refused is not None and refused.limit_name == "requests_per_minute"
    # the next minute starts afresh
    _, refused = await one.take(LIMITS, 900, T + 61)
    assert refused is None


async def test_in_process_counters_count_take_refuse_and_correct() -> None:
    counters = InProcessRateCounters()
    await _counts_and_corrects(counters, counters)


@pytest.mark.skipif(not redis_up(), reason="no Redis at WAYBILL_TEST_REDIS_URL")
async def test_replicas_share_rate_counters_through_redis() -> None:
    prefix = f"test-{uuid.uuid4().hex}"
    one, two = (
        RedisRateCounters(REDIS_URL, prefix=prefix),
        RedisRateCounters(REDIS_URL, prefix=prefix),
    )
    try:
        await _counts_and_corrects(one, two)
    finally:
        await one.aclose()
        await two.aclose()


async def test_unreachable_redis_refuses() -> None:
    counters = RedisRateCounters("redis://127.0.0.1:1/0")
    try:
        _, refused = await counters.take(LIMITS, 1, T)
        assert refused is not None and refused.subject == "workspace:acme"
    finally:
        await counters.aclose()
