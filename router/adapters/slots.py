"""Per-endpoint concurrency (contract §4, endpoint ``max_in_flight``): how many attempts are in
flight to an endpoint, and taking or giving back one of its slots.

An attempt takes a slot before it starts and gives it back when it ends, whatever the end.
In process by default; shared by every replica through Redis when ``WAYBILL_REDIS_URL`` is
set, so the limit holds for the whole deployment. A slot in Redis is a lease (a sorted-set
member scored by its expiry): one whose gateway died frees itself when the lease ends, and a
slot is never kept by a crash for longer than :data:`LEASE_S`.

Slots are not kept per config generation: the attempts of a retiring generation still load
the upstream. If Redis cannot be reached, taking a slot is refused (the endpoint counts as
saturated): a limit exists to protect an upstream, and it fails closed.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Final

import redis.asyncio as aioredis
from redis.exceptions import RedisError

__all__ = ["LEASE_S", "EndpointSlots", "InProcessSlots", "RedisSlots", "endpoint_slots"]

LEASE_S: Final = 600
"""How long a slot taken through Redis lasts if its gateway never gives it back."""

_REDIS_TIMEOUT_S: Final = 0.5

log = logging.getLogger("waybill.slots")


class EndpointSlots(ABC):
    @abstractmethod
    async def in_use(self, endpoints: Sequence[str]) -> dict[str, int]:
        """The slots taken at each of ``endpoints`` (a read: another request may take one)."""

    @abstractmethod
    async def take(self, endpoint: str, slot: str, limit: int) -> bool:
        """Take ``slot`` at ``endpoint`` if fewer than ``limit`` are taken, atomically."""

    @abstractmethod
    async def give_back(self, endpoint: str, slot: str) -> None: ...

    async def aclose(self) -> None:
        return None


class InProcessSlots(EndpointSlots):
    def __init__(self) -> None:
        self._taken: dict[str, set[str]] = {}

    async def in_use(self, endpoints: Sequence[str]) -> dict[str, int]:
        return {e: len(self._taken.get(e, ())) for e in endpoints}

    async def take(self, endpoint: str, slot: str, limit: int) -> bool:
        taken = self._taken.setdefault(endpoint, set())
        if len(taken) >= limit:
            return False
        taken.add(slot)
        return True

    async def give_back(self, endpoint: str, slot: str) -> None:
        self._taken.get(endpoint, set()).discard(slot)


_TAKE: Final = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[5]))
return 1
"""


class RedisSlots(EndpointSlots):
    def __init__(self, url: str, *, prefix: str = "waybill") -> None:
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=_REDIS_TIMEOUT_S, socket_connect_timeout=_REDIS_TIMEOUT_S
        )
        self._prefix = prefix
        self._take = self._redis.register_script(_TAKE)

    def _key(self, endpoint: str) -> str:
        return f"{self._prefix}:slots:{endpoint}"

    async def in_use(self, endpoints: Sequence[str]) -> dict[str, int]:
        now = time.time()
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for endpoint in endpoints:
                    pipe.zcount(self._key(endpoint), now, "+inf")
                counts = await pipe.execute()
        except (RedisError, OSError) as error:
            log.warning("cannot read endpoint slots from Redis: %s", error)
            return {}
        return {e: int(c) for e, c in zip(endpoints, counts, strict=True)}

    async def take(self, endpoint: str, slot: str, limit: int) -> bool:
        now = time.time()
        try:
            taken = await self._take(
                keys=[self._key(endpoint)],
                args=[now, limit, now + LEASE_S, slot, LEASE_S * 2],
            )
        except (RedisError, OSError) as error:
            log.warning("cannot take an endpoint slot in Redis: %s", error)
            return False
        return bool(taken)

    async def give_back(self, endpoint: str, slot: str) -> None:
        try:
            await self._redis.zrem(self._key(endpoint), slot)
        except (RedisError, OSError) as error:  # its lease ends it
            log.warning("cannot give an endpoint slot back in Redis: %s", error)

    async def aclose(self) -> None:
        await self._redis.aclose()


def endpoint_slots(redis_url: str | None, **kw: str) -> EndpointSlots:
    """Shared through Redis when a URL is set, else in-process (``kw``: ``prefix``)."""
    if redis_url:
        return RedisSlots(redis_url, **kw)
    return InProcessSlots()
