"""The counters behind rate limits (issue 43 item 2): requests and tokens per subject and
one-minute window, in process by default and shared by every replica and worker through Redis
when ``WAYBILL_REDIS_URL`` is set.

Taking counts first and decides after (``router.adapters.rate_limits.decide`` on what was
counted before this request), giving the count back when it refuses: one atomic step per
take, at the price that a request racing a refused one may see its count for an instant and
be refused too — a limit is never exceeded, only, rarely, met early. A window's counters
expire two windows after it starts. If Redis cannot be reached the take is refused, as
endpoint slots are (``router.adapters.slots``): a limit fails closed.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Final

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from router.adapters.rate_limits import (
    WINDOW_S,
    Counted,
    RateLimit,
    Refusal,
    Window,
    decide,
    unreachable,
    window_at,
)

__all__ = ["InProcessRateCounters", "RateCounters", "RedisRateCounters", "rate_counters"]

_REDIS_TIMEOUT_S: Final = 0.5

log = logging.getLogger("waybill.rate_limits")


class Unavailable(Exception):
    """The shared counters cannot be reached."""


class RateCounters(ABC):
    async def take(
        self, limits: Sequence[RateLimit], tokens: int, now: float
    ) -> tuple[Window, Refusal | None]:
        """Count one request of ``tokens`` worst-case tokens against every subject of
        ``limits`` in the window of ``now``, unless that would exceed a limit: then nothing
        stays counted and the refusal says which."""
        window = window_at(now)
        subjects = [limit.subject for limit in limits]
        try:
            after = await self._add(subjects, window, 1, tokens)
        except Unavailable:
            return window, unreachable(limits[0], window, now)
        before = tuple(Counted(c.requests - 1, c.tokens - tokens) for c in after)
        refusal = decide(tuple(limits), before, tokens, window, now)
        if refusal is not None:
            await self._add_quietly(subjects, window, -1, -tokens)
        return window, refusal

    async def correct(self, subjects: Sequence[str], window: Window, tokens: int) -> None:
        """Add ``tokens`` (negative: give back) to the window a request was admitted in, once
        its settlement knows what it used instead of its worst case."""
        if tokens:
            await self._add_quietly(subjects, window, 0, tokens)

    async def _add_quietly(
        self, subjects: Sequence[str], window: Window, requests: int, tokens: int
    ) -> None:
        try:
            await self._add(subjects, window, requests, tokens)
        except Unavailable:  # the window's end forgets it anyway
            log.warning("cannot correct rate limit counters in Redis")

    @abstractmethod
    async def _add(
        self, subjects: Sequence[str], window: Window, requests: int, tokens: int
    ) -> list[Counted]:
        """Add to each subject's counters, atomically; what each holds after."""

    async def aclose(self) -> None:
        return None


class InProcessRateCounters(RateCounters):
    def __init__(self) -> None:
        self._counted: dict[tuple[str, int], Counted] = {}

    async def _add(
        self, subjects: Sequence[str], window: Window, requests: int, tokens: int
    ) -> list[Counted]:
        # No await in here: the event loop makes this one step.
        stale = window.start - WINDOW_S
        for key in [k for k in self._counted if k[1] < stale]:
            del self._counted[key]
        after = []
        for subject in subjects:
            was = self._counted.get((subject, window.start), Counted())
            now = Counted(was.requests + requests, was.tokens + tokens)
            self._counted[(subject, window.start)] = now
            after.append(now)
        return after


class RedisRateCounters(RateCounters):
    def __init__(self, url: str, *, prefix: str = "waybill") -> None:
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=_REDIS_TIMEOUT_S, socket_connect_timeout=_REDIS_TIMEOUT_S
        )
        self._prefix = prefix

    def _key(self, subject: str, window: Window) -> str:
        return f"{self._prefix}:rate:{subject}:{window.start}"

    async def _add(
        self, subjects: Sequence[str], window: Window, requests: int, tokens: int
    ) -> list[Counted]:
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                for subject in subjects:
                    key = self._key(subject, window)
                    pipe.hincrby(key, "requests", requests)
                    pipe.hincrby(key, "tokens", tokens)
                    pipe.expire(key, 2 * WINDOW_S)
                replies = await pipe.execute()
        except (RedisError, OSError) as error:
            log.warning("cannot count rate limits in Redis: %s", error)
            raise Unavailable from error
        return [Counted(int(replies[3 * i]), int(replies[3 * i + 1])) for i in range(len(subjects))]

    async def aclose(self) -> None:
        await self._redis.aclose()


def rate_counters(redis_url: str | None, **kw: str) -> RateCounters:
    """Shared through Redis when a URL is set, else in process (``kw``: ``prefix``)."""
    if redis_url:
        return RedisRateCounters(redis_url, **kw)
    return InProcessRateCounters()
