"""The latency figures behind the least_latency strategy (router/adapters/latency.py): in process
and
shared through Redis (``WAYBILL_TEST_REDIS_URL``, default ``redis://127.0.0.1:6379/15``)."""

from __future__ import annotations

import uuid

import pytest
import redis

from router.adapters.latency import ALPHA, InProcessLatency, RedisLatency, ewma
from tests.helpers import REDIS_URL, redis_up

EAST, WEST = ("east", "small"), ("west", "claude")


def test_the_first_sample_is_taken_as_it_is_then_averaged():
    assert ewma(None, 100) == 100
    assert ewma(100, 200) == pytest.approx(ALPHA * 200 + (1 - ALPHA) * 100)


async def test_in_process_figures_follow_the_samples():
    board = InProcessLatency()
    assert await board.read([EAST]) == {}
    await board.observe(EAST, 100)
    await board.observe(EAST, 300)
    assert await board.read([EAST, WEST]) == {EAST: pytest.approx(ewma(100, 300))}


@pytest.mark.skipif(not redis_up(), reason="no Redis at WAYBILL_TEST_REDIS_URL")
async def test_replicas_share_their_figures_through_redis():
    generation = f"test-{uuid.uuid4().hex}"
    one, two = RedisLatency(REDIS_URL, generation), RedisLatency(REDIS_URL, generation)
    try:
        await one.observe(EAST, 100)
        await two.observe(EAST, 300)
        assert await one.read([EAST, WEST]) == {EAST: pytest.approx(ewma(100, 300))}
        other = RedisLatency(REDIS_URL, f"{generation}-next")  # a new generation starts empty
        assert await other.read([EAST]) == {}
        await other.aclose()
    finally:
        client = redis.Redis.from_url(REDIS_URL)
        client.delete(f"waybill:latency:{generation}")
        client.close()
        await one.aclose()
        await two.aclose()


async def test_an_unreachable_redis_gives_no_figures_and_no_error():
    board = RedisLatency("redis://127.0.0.1:1/0", "g")
    await board.observe(EAST, 10)
    assert await board.read([EAST]) == {}
    await board.aclose()
