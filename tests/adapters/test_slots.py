"""Endpoint slots for max_in_flight (router/adapters/slots.py): in process and shared through Redis
(``WAYBILL_TEST_REDIS_URL``, default ``redis://127.0.0.1:6379/15``)."""

from __future__ import annotations

import uuid

import pytest
import redis

from router.adapters.slots import InProcessSlots, RedisSlots
from tests.helpers import REDIS_URL, redis_up


async def test_in_process_slots_are_taken_up_to_the_limit_and_given_back():
    slots = InProcessSlots()
    assert await slots.take("east", "a", 2) and await slots.take("east", "b", 2)
    assert not await slots.take("east", "c", 2)
    assert await slots.in_use(["east", "west"]) == {"east": 2, "west": 0}
    await slots.give_back("east", "a")
    assert await slots.take("east", "c", 2)


@pytest.mark.skipif(not redis_up(), reason="no Redis at WAYBILL_TEST_REDIS_URL")
async def test_replicas_share_an_endpoints_slots_through_redis():
    prefix = f"test-{uuid.uuid4().hex}"
    one, two = RedisSlots(REDIS_URL, prefix=prefix), RedisSlots(REDIS_URL, prefix=prefix)
    try:
        assert await one.take("east", "a", 2)
        assert await two.take("east", "b", 2)
        assert not await one.take("east", "c", 2)  # the limit holds across both
        assert await two.in_use(["east", "west"]) == {"east": 2, "west": 0}
        await one.give_back("east", "b")
        assert await two.take("east", "c", 2)
    finally:
        client = redis.Redis.from_url(REDIS_URL)
        client.delete(f"{prefix}:slots:east")
        client.close()
        await one.aclose()
        await two.aclose()


async def test_an_unreachable_redis_refuses_a_slot():
    slots = RedisSlots("redis://127.0.0.1:1/0")
    assert not await slots.take("east", "a", 5)  # a limit protects an upstream: fail closed
    assert await slots.in_use(["east"]) == {}
    await slots.aclose()
