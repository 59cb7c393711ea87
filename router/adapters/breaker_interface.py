"""The breaker board's interface (contract §5): which breaker (:class:`BreakerKey`), what it
reports (:class:`Transition`, :class:`BreakerView`), the :class:`BreakerBoard` every board
implements, and the helpers the boards share. The boards are ``breakers_memory`` (in process)
and ``breakers_redis`` (shared through Redis); ``breakers`` chooses one.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Final, Literal

from router.adapters import breaker_policy as policy
from router.adapters.breaker_policy import (
    Admission,
    BreakerSettings,
    BreakerState,
    Call,
    Figures,
    Record,
    Step,
    clamp_retry_after,
)
from router.config import Breaker

__all__ = [
    "DEFAULT_PROBE_LEASE_MS",
    "FULL_STANDING",
    "BreakerBoard",
    "BreakerKey",
    "BreakerStoreUnavailable",
    "BreakerView",
    "EndpointSettings",
    "Scope",
    "Standing",
    "Transition",
    "settings_by_endpoint",
    "settings_of",
    "transitions",
    "view_of",
]

Scope = Literal["endpoint", "mapping"]

DEFAULT_PROBE_LEASE_MS: Final = 60_000


@dataclass(frozen=True)
class BreakerKey:
    """Which breaker: an endpoint's, or a mapping's (an endpoint and an upstream model). The
    two are kept apart, not joined in ``target``, so that a mapping's breaker finds its
    endpoint's settings even when a name holds a ``/``."""

    scope: Scope
    endpoint_id: str
    upstream_model: str | None = None  # mapping scope

    # One key per breaker, made once: a request names each of its mappings' keys several
    # times (admission, the evaluation's look-up, the outcome), and keys are immutable.
    @staticmethod
    @functools.lru_cache(maxsize=4096)
    def endpoint(endpoint_id: str) -> BreakerKey:
        return BreakerKey("endpoint", endpoint_id)

    @staticmethod
    @functools.lru_cache(maxsize=4096)
    def mapping(endpoint_id: str, upstream_model: str) -> BreakerKey:
        return BreakerKey("mapping", endpoint_id, upstream_model)

    @property
    def target(self) -> str:
        """As ``BreakerTransitioned`` names it: the endpoint id, or
        ``"endpoint_id/upstream_model"``."""
        if self.upstream_model is None:
            return self.endpoint_id
        return f"{self.endpoint_id}/{self.upstream_model}"


@dataclass(frozen=True)
class Transition:
    """One change of a breaker's state; the core records it as a ``BreakerTransitioned``."""

    key: BreakerKey
    from_state: BreakerState
    to_state: BreakerState
    failure_class: str | None
    consecutive_failures: int
    cooldown_ms: int | None
    reason: str | None = None  # a breaker_policy.StepReason
    figures: Figures | None = None  # the rolling window, when it opened a closed breaker
    duration_ms: int | None = None  # the latency of the call that caused it


@dataclass(frozen=True)
class BreakerView:
    """One breaker as it stands, for ``GET /v1/endpoints``."""

    state: BreakerState
    blocked: bool  # an attempt would be refused now
    consecutive_failures: int
    trips: int
    cooldown_ms: int | None  # the last cool-down, while open or half-open
    probe_in_ms: int | None  # while open: how long until a probe may go
    figures: Figures | None  # rolling: the window as it stands
    # While ramping up after a probe closed it (ramp_up_ms): the share of its weight its
    # endpoint or mapping gets now; None at full weight.
    ramp_share: Decimal | None = None


@dataclass(frozen=True, slots=True)
class Standing:
    """What route evaluation reads of one breaker: whether it would refuse an attempt now
    (``breaker_policy.blocked``), and the share of its configured weight its endpoint or
    mapping gets now (``breaker_policy.ramp_share``: below 1 while ramping up after a
    close)."""

    blocked: bool
    share: Decimal = Decimal(1)


FULL_STANDING: Final = Standing(False)
"""A closed breaker that is not ramping up."""


class BreakerStoreUnavailable(Exception):
    """The shared breaker store (Redis) cannot be reached; the caller decides what follows."""


def transitions(key: BreakerKey, step: Step | None, call: Call | None = None) -> list[Transition]:
    if step is None:
        return []
    opened = step.to_state == "open" and call is not None
    return [
        Transition(
            key,
            step.from_state,
            step.to_state,
            call.failure_class if opened and call is not None else None,
            step.failures,
            step.cooldown_ms,
            step.reason.value,
            step.figures,
            call.duration_ms if call is not None else None,
        )
    ]


def view_of(record: Record, settings: BreakerSettings, now: int) -> BreakerView:
    cooling = record.state != "closed"
    return BreakerView(
        state=record.state,
        blocked=policy.blocked(record, now),
        consecutive_failures=record.failures,
        trips=record.trips,
        cooldown_ms=record.cooldown_ms if cooling else None,
        probe_in_ms=max(0, record.cooldown_until - now) if record.state == "open" else None,
        figures=policy.figures(record, settings, now) if settings.policy == "rolling" else None,
        ramp_share=share if (share := policy.ramp_share(record, settings, now)) < 1 else None,
    )


class BreakerBoard(ABC):
    """Every breaker of one config generation."""

    generation: str
    settings: BreakerSettings
    """``defaults.breaker``'s: what every endpoint without settings of its own runs by."""
    _by_endpoint: Mapping[str, BreakerSettings]

    def settings_for(self, key: BreakerKey) -> BreakerSettings:
        """The settings ``key``'s breaker runs by: its endpoint's own, else the defaults'."""
        return self._by_endpoint.get(key.endpoint_id, self.settings)

    @abstractmethod
    async def standing(self, keys: Sequence[BreakerKey]) -> dict[BreakerKey, Standing]:
        """For route evaluation, read-only, in one read: each key's :class:`Standing`.

        Blocked while open and cooling down, or half-open with a live probe lease; not when
        closed, or when the cool-down has passed and a probe is free to take.
        """

    async def blocked(self, keys: Sequence[BreakerKey]) -> dict[BreakerKey, bool]:
        """Whether each key would refuse an attempt now (:meth:`standing`'s ``blocked``)."""
        return {key: s.blocked for key, s in (await self.standing(keys)).items()}

    @abstractmethod
    async def admit(self, key: BreakerKey) -> tuple[Admission, list[Transition]]:
        """Atomically admit one attempt: closed → ALLOWED; cooled down and no live probe →
        PROBE (the caller now holds the probe lease); otherwise DENIED."""

    @abstractmethod
    async def hear(self, key: BreakerKey, call: Call) -> list[Transition]:
        """Atomically apply one attempt's outcome (``breaker_policy.hear``)."""

    @abstractmethod
    async def release_probe(self, key: BreakerKey) -> None:
        """The probe lease taken by :meth:`admit` goes back without a verdict
        (``breaker_policy.release``): however a probe ends, the breaker is judged
        (:meth:`hear`) or its lease returned, never left to run out.

        Call it only for a key the attempt was admitted to as the probe. A holder that
        outlived its lease (60 s by default) may give back a later holder's: that probe then
        goes to the next attempt, which is harmless (a breaker never has two verdicts)."""

    @abstractmethod
    async def inspect(self, keys: Sequence[BreakerKey]) -> dict[BreakerKey, BreakerView]:
        """Each breaker as it stands now, read-only."""

    @abstractmethod
    async def state(self, key: BreakerKey) -> BreakerState:
        """The stored state, for tests and diagnostics (an open breaker stays "open" here
        after its cool-down, until someone takes the probe)."""

    @abstractmethod
    async def aclose(self) -> None: ...

    async def record_success(
        self, key: BreakerKey, *, duration_ms: int | None = None
    ) -> list[Transition]:
        """A success: a closed breaker counts it (``consecutive``: resets the count), a
        half-open one closes (re-opens, under ``rolling``, if it was slow). Reported while
        open (an attempt admitted before the trip), it changes nothing."""
        return await self.hear(key, Call(failed=False, duration_ms=duration_ms))

    async def record_failure(
        self,
        key: BreakerKey,
        failure_class: str,
        *,
        opens_at_once: bool,
        retry_after_ms: int | None,
        duration_ms: int | None = None,
        workspace: str | None = None,
    ) -> list[Transition]:
        """A failure of the breaker's scope: counted; a closed breaker opens at its policy's
        threshold (or at once), a half-open one re-opens. While open it only counts. A class
        counted only when shared (``invalid_output``) is counted only when the window holds
        one of another workspace than ``workspace``'s (``breaker_policy.hear``)."""
        call = Call(
            failed=True,
            failure_class=failure_class,
            opens_at_once=opens_at_once,
            retry_after_ms=clamp_retry_after(retry_after_ms),
            duration_ms=duration_ms,
            workspace=workspace,
        )
        return await self.hear(key, call)


def settings_of(settings: Breaker | BreakerSettings) -> BreakerSettings:
    return settings.settings() if isinstance(settings, Breaker) else settings


EndpointSettings = Mapping[str, Breaker | BreakerSettings]
"""The settings of the endpoints that have their own (``Config.endpoint_breakers``), by id."""


def settings_by_endpoint(endpoints: EndpointSettings | None) -> dict[str, BreakerSettings]:
    return {endpoint: settings_of(s) for endpoint, s in (endpoints or {}).items()}
