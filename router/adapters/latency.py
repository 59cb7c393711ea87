"""How fast each mapping answers, for the ``least_latency`` selection strategy (contract §4).

One exponentially weighted moving average per mapping (endpoint and upstream model) of the
time its attempts took to produce their first content (a stream) or their answer (buffered):
``ewma = ALPHA * sample + (1 - ALPHA) * ewma``, the first sample taken as it is. Kept in
process, or shared by every replica through Redis when ``WAYBILL_REDIS_URL`` is set, under the
config generation like the breakers (a new generation starts without figures).

Reading is one round trip for a whole model group; a figure that cannot be read (Redis down)
is simply absent, and selection treats an absent figure as "not measured yet": routing never
fails because latency figures are missing.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Final

import redis.asyncio as aioredis
from redis.exceptions import RedisError

__all__ = ["ALPHA", "InProcessLatency", "LatencyBoard", "RedisLatency", "ewma", "latency_board"]

ALPHA: Final = 0.2
"""The weight of the newest sample: about the last ten answers count."""

_KEY_TTL_S: Final = 24 * 60 * 60
_REDIS_TIMEOUT_S: Final = 0.5

log = logging.getLogger("waybill.latency")

Place = tuple[str, str]
"""(endpoint id, upstream model): one mapping."""


def ewma(previous: float | None, sample: float) -> float:
    """The moving average after ``sample`` (the first sample is taken as it is)."""
    if previous is None:
        return float(sample)
    return ALPHA * sample + (1 - ALPHA) * previous


class LatencyBoard(ABC):
    @abstractmethod
    async def observe(self, place: Place, ms: float) -> None:
        """One attempt's time to its first content (or answer), in milliseconds."""

    @abstractmethod
    async def read(self, places: Sequence[Place]) -> dict[Place, float]:
        """The figures known for ``places`` (a place without one is left out)."""

    async def aclose(self) -> None:
        return None


class InProcessLatency(LatencyBoard):
    def __init__(self) -> None:
        self._figures: dict[Place, float] = {}

    async def observe(self, place: Place, ms: float) -> None:
        self._figures[place] = ewma(self._figures.get(place), ms)

    async def read(self, places: Sequence[Place]) -> dict[Place, float]:
        return {p: self._figures[p] for p in places if p in self._figures}


# The update runs in Redis, so that replicas observing at once never lose a sample.
_OBSERVE: Final = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
local sample = tonumber(ARGV[2])
local new = sample
if old then new = tonumber(ARGV[3]) * sample + (1 - tonumber(ARGV[3])) * tonumber(old) end
redis.call('HSET', KEYS[1], ARGV[1], tostring(new))
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
return tostring(new)
"""


class RedisLatency(LatencyBoard):
    def __init__(self, url: str, generation: str, *, prefix: str = "waybill") -> None:
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=_REDIS_TIMEOUT_S, socket_connect_timeout=_REDIS_TIMEOUT_S
        )
        self._key = f"{prefix}:latency:{generation}"
        self._observe = self._redis.register_script(_OBSERVE)

    async def observe(self, place: Place, ms: float) -> None:
        try:
            await self._observe(keys=[self._key], args=[_field(place), ms, ALPHA, _KEY_TTL_S])
        except (RedisError, OSError) as error:
            log.warning("cannot record a latency figure in Redis: %s", error)

    async def read(self, places: Sequence[Place]) -> dict[Place, float]:
        if not places:
            return {}
        try:
            values = await self._redis.hmget(self._key, [_field(p) for p in places])
        except (RedisError, OSError) as error:
            log.warning("cannot read latency figures from Redis: %s", error)
            return {}
        return {p: float(v) for p, v in zip(places, values, strict=True) if v is not None}

    async def aclose(self) -> None:
        await self._redis.aclose()


def _field(place: Place) -> str:
    endpoint, model = place
    return f"{endpoint}/{model}"


def latency_board(generation: str, redis_url: str | None, **kw: str) -> LatencyBoard:
    """Shared through Redis when a URL is set, else in-process (``kw``: ``prefix``)."""
    if redis_url:
        return RedisLatency(redis_url, generation, **kw)
    return InProcessLatency()
