"""The in-process breaker board: every breaker in this process's memory, for a gateway
running alone; ``breaker_policy``'s functions called directly."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from router.adapters import breaker_policy as policy
from router.adapters.breaker_interface import (
    DEFAULT_PROBE_LEASE_MS,
    FULL_STANDING,
    BreakerBoard,
    BreakerKey,
    BreakerView,
    EndpointSettings,
    Standing,
    Transition,
    settings_by_endpoint,
    settings_of,
    transitions,
    view_of,
)
from router.adapters.breaker_policy import Admission, BreakerSettings, BreakerState, Call, Record
from router.config import Breaker

__all__ = ["InProcessBreakers"]


class InProcessBreakers(BreakerBoard):
    """Breakers held in this process's memory, for a gateway running alone.

    Every method reads and writes its record without an ``await`` in between, so on the event
    loop each one is atomic: two tasks can never both take the probe or lose a count.
    """

    def __init__(
        self,
        settings: Breaker | BreakerSettings,
        generation: str,
        *,
        endpoints: EndpointSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
        probe_lease_ms: int = DEFAULT_PROBE_LEASE_MS,
    ) -> None:
        self.generation = generation
        self.settings = settings_of(settings)
        self._by_endpoint = settings_by_endpoint(endpoints)
        self._clock = clock
        self._probe_lease_ms = probe_lease_ms
        self._records: dict[BreakerKey, Record] = {}

    def _now(self) -> int:
        return round(self._clock() * 1000)

    def _put(self, key: BreakerKey, record: Record) -> None:
        if record is policy.CLOSED or record == policy.CLOSED:
            self._records.pop(key, None)
        else:
            self._records[key] = record

    async def standing(self, keys: Sequence[BreakerKey]) -> dict[BreakerKey, Standing]:
        now, records = self._now(), self._records
        # The usual breaker has no record: closed, not ramping.
        return {
            key: FULL_STANDING if (held := records.get(key)) is None else self._of(key, held, now)
            for key in keys
        }

    def _of(self, key: BreakerKey, record: Record, now: int) -> Standing:
        share = policy.ramp_share(record, self.settings_for(key), now)
        return Standing(policy.blocked(record, now), share)

    async def admit(self, key: BreakerKey) -> tuple[Admission, list[Transition]]:
        record = self._records.get(key, policy.CLOSED)
        admission, record, step = policy.admit(record, self._now(), self._probe_lease_ms)
        self._put(key, record)
        return admission, transitions(key, step)

    async def hear(self, key: BreakerKey, call: Call) -> list[Transition]:
        record = self._records.get(key, policy.CLOSED)
        record, step = policy.hear(record, call, self.settings_for(key), self._now())
        self._put(key, record)
        return transitions(key, step, call)

    async def release_probe(self, key: BreakerKey) -> None:
        record = self._records.get(key)
        if record is not None:
            self._put(key, policy.release(record))

    async def inspect(self, keys: Sequence[BreakerKey]) -> dict[BreakerKey, BreakerView]:
        now = self._now()
        return {
            key: view_of(self._records.get(key, policy.CLOSED), self.settings_for(key), now)
            for key in keys
        }

    async def state(self, key: BreakerKey) -> BreakerState:
        return self._records.get(key, policy.CLOSED).state

    async def aclose(self) -> None:
        self._records.clear()
