"""Circuit breakers (contract §5): per endpoint and per mapping, in-process or shared through Redis.

What a breaker does is ``router.adapters.breaker_policy``: one state machine (closed, open,
half-open) under one of two policies, ``consecutive`` or ``rolling``, as pure functions. A
board holds every breaker of one config generation and applies them atomically:

- :class:`InProcessBreakers` keeps the records in this process's memory and calls the
  functions directly;
- :class:`RedisBreakers` keeps them in Redis, shared by every gateway process, and runs the
  same functions written in Lua, one script per operation.

Each endpoint's breakers (its own and its mappings') run by the endpoint's settings when the
config gives it some (``endpoints[].breaker``), else by ``defaults.breaker``. State lives under
the config generation, so a new generation starts with every breaker closed.
Every operation returns the :class:`Transition` objects it caused; the routing core records
each one as a ``BreakerTransitioned`` ledger event.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, TypeVar

from router.adapters.breaker_interface import (
    BreakerBoard,
    BreakerKey,
    BreakerStoreUnavailable,
    BreakerView,
    EndpointSettings,
    Scope,
    Standing,
    Transition,
)
from router.adapters.breaker_policy import Admission, BreakerSettings, BreakerState, Call
from router.adapters.breakers_memory import InProcessBreakers
from router.adapters.breakers_redis import RedisBreakers
from router.config import Breaker

__all__ = [
    "Admission",
    "BreakerBoard",
    "BreakerKey",
    "BreakerState",
    "BreakerStoreUnavailable",
    "BreakerView",
    "EndpointSettings",
    "FallbackBreakers",
    "InProcessBreakers",
    "RedisBreakers",
    "Scope",
    "Standing",
    "Transition",
    "breaker_board",
]

_FIRST_RETRY_S: Final = 1.0  # an unreachable store is tried again after this, doubling ...
_LAST_RETRY_S: Final = 30.0  # ... up to this
_log = logging.getLogger("waybill.breakers")

_T = TypeVar("_T")


class FallbackBreakers(BreakerBoard):
    """Breakers that outlive their shared store: ``shared`` (Redis) while it can be reached,
    ``local`` (this process's memory) while it cannot.

    The breakers are what protects the upstreams, not what serves a request: a request must
    not fail because Redis is down. While it cannot be reached this gateway keeps its
    breakers in-process, as a gateway without Redis does, and goes back to the shared ones
    once Redis answers again (they resume as they were left; what the in-process ones learned
    stays in this process). An unreachable store is not asked on every call, each of which
    could wait for its connect timeout: after a failure it is tried again after 1 s, then 2,
    4, ... up to 30 s. The outage and the return are logged once each.
    """

    def __init__(
        self,
        shared: BreakerBoard,
        local: BreakerBoard,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.generation = shared.generation
        self.settings = shared.settings
        self.shared = shared
        self.local = local
        self._clock = clock
        self._retry_s = 0.0  # 0: the shared store answered the last time it was asked
        self._retry_at = 0.0

    @property
    def sharing(self) -> bool:
        """Whether the shared store answered the last time it was asked."""
        return self._retry_s == 0.0

    def settings_for(self, key: BreakerKey) -> BreakerSettings:
        return self.shared.settings_for(key)

    async def _on_either(self, call: Callable[[BreakerBoard], Awaitable[_T]]) -> _T:
        if self._clock() >= self._retry_at:
            try:
                answer = await call(self.shared)
            except BreakerStoreUnavailable as error:
                if self.sharing:
                    _log.warning("%s: breakers are this process's own until it answers", error)
                self._retry_s = min(_LAST_RETRY_S, max(_FIRST_RETRY_S, self._retry_s * 2))
                self._retry_at = self._clock() + self._retry_s
            else:
                if not self.sharing:
                    _log.warning("breaker store reachable again: breakers are shared again")
                    self._retry_s = 0.0
                return answer
        return await call(self.local)

    async def standing(self, keys: Sequence[BreakerKey]) -> dict[BreakerKey, Standing]:
        return await self._on_either(lambda board: board.standing(keys))

    async def admit(self, key: BreakerKey) -> tuple[Admission, list[Transition]]:
        return await self._on_either(lambda board: board.admit(key))

    async def hear(self, key: BreakerKey, call: Call) -> list[Transition]:
        return await self._on_either(lambda board: board.hear(key, call))

    async def release_probe(self, key: BreakerKey) -> None:
        await self._on_either(lambda board: board.release_probe(key))

    async def inspect(self, keys: Sequence[BreakerKey]) -> dict[BreakerKey, BreakerView]:
        return await self._on_either(lambda board: board.inspect(keys))

    async def state(self, key: BreakerKey) -> BreakerState:
        return await self._on_either(lambda board: board.state(key))

    async def aclose(self) -> None:
        try:
            await self.shared.aclose()
        finally:
            await self.local.aclose()


def breaker_board(
    settings: Breaker | BreakerSettings, generation: str, redis_url: str | None, **kw: Any
) -> BreakerBoard:
    """The board contract §5 asks for: shared through Redis when a URL is set (in-process
    while Redis cannot be reached: :class:`FallbackBreakers`), else in-process.

    ``kw`` goes to the boards (``endpoints``, ``probe_lease_ms``; ``prefix`` for Redis,
    ``clock`` for either).
    """
    if not redis_url:
        return InProcessBreakers(settings, generation, **kw)
    local = {k: v for k, v in kw.items() if k != "prefix" and v is not None}
    return FallbackBreakers(
        RedisBreakers(redis_url, settings, generation, **kw),
        InProcessBreakers(settings, generation, **local),
    )
