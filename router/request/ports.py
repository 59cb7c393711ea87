"""What the request core asks of the world, as narrow interfaces: the drivers, the breakers,
the endpoints' slots, the request's budget and journal, disabled endpoints, latency figures and
the clock. The executor (:mod:`router.request.executor`) knows nothing else of them, so its
unit tests give it in-memory fakes (tests/request/fakes.py), and the gateway
(:mod:`router.request.gateway`) gives it the real ones of one config generation.

:class:`Ports` is what a generation hands each of its requests: these, the config, and the
state its requests share (the weighted round-robin, the first-answer times, the random
source the walk draws from).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Protocol, TypeVar

from ledger import events as ev
from ledger.books.accounting import BudgetDenied, Effect, Hold
from ledger.endpoints import DisabledEndpoint
from ledger.store import RecordedEvent
from ledger.store.outage import Outage
from router.adapters.breakers import Admission, BreakerKey, Standing
from router.adapters.rate_limits import RateLimit, Refusal, Window
from router.config import Config
from router.drivers import AttemptBinding, ChatRequest, DriverResult, DriverStream, PreparedCall
from router.request.budget import StepRecord
from router.request.classify import Classification
from router.request.policy import FirstAnswerTimes
from router.request.selection import OverBudget, WeightedRoundRobin

__all__ = [
    "Breakers",
    "Budget",
    "Clock",
    "DisabledEndpoints",
    "Journal",
    "Latency",
    "Ports",
    "RequestLedger",
    "Slots",
    "SystemClock",
    "Timer",
    "UpstreamDriver",
]

_S = TypeVar("_S")


class UpstreamDriver(Protocol):
    """One endpoint's driver (:class:`router.drivers.Driver`)."""

    @property
    def requires_max_tokens(self) -> bool: ...

    def prepare(self, request: ChatRequest, binding: AttemptBinding) -> PreparedCall: ...

    async def complete(self, call: PreparedCall) -> DriverResult: ...

    async def stream(self, call: PreparedCall) -> DriverStream: ...


class Breakers(Protocol):
    """The breakers of one generation; what they say is recorded (``BreakerTransitioned``,
    with the request that caused it) by the port itself."""

    def standing(self, keys: Sequence[BreakerKey]) -> Awaitable[Mapping[BreakerKey, Standing]]:
        """For evaluation, read-only: whether each key would refuse an attempt now, and the
        share of its weight it gives while ramping up after a close."""
        ...

    async def admit(self, key: BreakerKey, request_id: str) -> Admission:
        """Atomically admit one attempt (the half-open probe is taken here)."""
        ...

    def probe_in(self, keys: Sequence[BreakerKey]) -> Awaitable[Mapping[BreakerKey, int | None]]:
        """Read-only: for each key whose breaker is open, how long (ms) until it admits a
        probe; None for one that is not open."""
        ...

    async def succeeded(
        self, keys: Sequence[BreakerKey], duration_ms: int, request_id: str
    ) -> None: ...

    async def failed(
        self,
        key: BreakerKey,
        classification: Classification,
        duration_ms: int,
        request_id: str,
        workspace: str,
    ) -> bool:
        """Count a failure of ``key``'s scope, by a request of ``workspace`` (an
        ``invalid_output`` counts only when another workspace's is in the breaker's window:
        contract §5); True if that opened (or re-opened) it."""
        ...

    async def release_probes(self, keys: Sequence[BreakerKey]) -> None:
        """Give back the probe leases of ``keys`` without a verdict (the attempt's outcome
        is one no breaker counts, or it never ran): the next attempt probes at once."""
        ...

    def quota_opened(self) -> frozenset[str]:
        """The endpoints whose own breaker an ``insufficient_quota`` opened last (as this
        process saw it): while that breaker blocks, they are excluded ``quota_exhausted``."""
        ...


class Slots(Protocol):
    """Endpoints' ``max_in_flight`` slots (:class:`router.adapters.slots.EndpointSlots`)."""

    async def in_use(self, endpoints: Sequence[str]) -> Mapping[str, int]: ...

    async def take(self, endpoint: str, slot: str, limit: int) -> bool: ...

    async def give_back(self, endpoint: str, slot: str) -> None: ...


class RateCounting(Protocol):
    """Rate limits' counters (:class:`router.adapters.rate_counters.RateCounters`)."""

    async def take(
        self, limits: Sequence[RateLimit], tokens: int, now: float
    ) -> tuple[Window, Refusal | None]: ...

    async def correct(self, subjects: Sequence[str], window: Window, tokens: int) -> None: ...


class DisabledEndpoints(Protocol):
    """Endpoints disabled after a refused key, as this generation sees them
    (:class:`router.adapters.disabling.ConfigView`)."""

    async def current(self) -> Mapping[str, DisabledEndpoint]: ...

    async def disable(
        self,
        endpoint_id: str,
        *,
        http_status: int | None,
        error_code: str | None,
        request_id: str,
        attempt_id: str,
    ) -> bool:
        """False if it could not be recorded (the endpoint's breaker counts it instead)."""
        ...


class Latency(Protocol):
    """Each mapping's latency, for ``least_latency`` (:class:`router.adapters.latency`)."""

    async def observe(self, place: tuple[str, str], ms: float) -> None: ...

    async def read(self, places: Sequence[tuple[str, str]]) -> Mapping[tuple[str, str], float]: ...


class Budget(Protocol):
    """The request's budget (:class:`router.request.budget.RequestBudget`): the over-budget
    check of evaluation, and the events and book effects of each step of an attempt's hold."""

    async def over_budget_check(self) -> OverBudget | None: ...

    def reserve(
        self, attempt_id: str, endpoint: str, model: str, amount: Decimal
    ) -> StepRecord: ...

    def denied(self, refusal: BudgetDenied, endpoint: str, model: str) -> ev.Event: ...

    def denied_candidate(self, candidate: ev.Candidate) -> ev.Event: ...

    def settle(self, attempt_id: str, cost: Decimal, usage: ev.Usage) -> StepRecord: ...

    def release(self, attempt_id: str, reason: str) -> StepRecord: ...

    def hold_unknown(self, attempt_id: str, cause: str) -> StepRecord: ...

    def has_hold(self, attempt_id: str) -> bool: ...

    def adopt(self, hold: Hold) -> None: ...

    def forget(self, attempt_id: str) -> None: ...


class Journal(Protocol[_S]):
    """The request's appends to its ledger stream (:class:`router.request.journal.Journal`):
    events queued go out, in order, with the next append. ``submit`` sends one and returns
    what ``committed`` awaits (None: nothing to send), so that work between the two overlaps
    the commit; a refusal (``BudgetDenied``, ``LedgerUnavailable``, ...) is raised by
    ``committed``, and what was queued stays queued."""

    def queue(self, event: ev.Event) -> None: ...

    def record(self, step: StepRecord) -> None:
        """Queue a budget step: its events and their book effects."""
        ...

    @property
    def has_effects(self) -> bool:
        """Book effects are queued (a balance is about to change)."""
        ...

    async def submit(self, *more: ev.Event, step: StepRecord | None = None) -> _S | None: ...

    async def committed(self, submitted: _S) -> None: ...

    async def flush(self, *more: ev.Event, step: StepRecord | None = None) -> None: ...

    async def flush_patiently(self, *more: ev.Event) -> None:
        """The end of an abandoned request, retried while the ledger is unreachable."""
        ...


class RequestLedger(Protocol):
    """What the journal needs of the store (:class:`ledger.store.EventStore`)."""

    outage: Outage  # told of a request's end it could not record at once

    def submit(
        self,
        stream_id: str,
        expected_version: int | None,
        new_events: Sequence[ev.Event],
        *,
        metadata: Mapping[str, Any] | None = None,
        effects: Sequence[Effect] = (),
        requires: Mapping[str, int] | None = None,
    ) -> asyncio.Future[list[RecordedEvent]]: ...

    async def read_stream(self, stream_id: str, after_version: int = 0) -> list[RecordedEvent]: ...


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """Time as the request path reads it: ``monotonic`` seconds for deadlines and durations,
    ``now`` for prices in force, and waiting."""

    def monotonic(self) -> float: ...

    def now(self) -> datetime: ...

    async def sleep(self, seconds: float) -> None: ...

    def call_later(self, seconds: float, callback: Callable[[], None]) -> Timer: ...

    def timeout_at(self, deadline: float) -> AbstractAsyncContextManager[object]:
        """Cancel the block at ``deadline`` (on ``monotonic``), raising ``TimeoutError``."""
        ...


class SystemClock:
    """The machine's clocks and the running event loop."""

    __slots__ = ()

    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> datetime:
        return datetime.now(UTC)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def call_later(self, seconds: float, callback: Callable[[], None]) -> Timer:
        return asyncio.get_running_loop().call_later(seconds, callback)

    def timeout_at(self, deadline: float) -> AbstractAsyncContextManager[object]:
        loop_deadline = asyncio.get_running_loop().time() + (deadline - time.monotonic())
        return asyncio.timeout_at(loop_deadline)


@dataclass(frozen=True, slots=True)
class Ports:
    """What one config generation gives each of its requests."""

    config: Config
    drivers: Mapping[str, UpstreamDriver]  # by endpoint id
    breakers: Breakers
    slots: Slots
    disabled: DisabledEndpoints
    latency: Latency
    clock: Clock
    keep: Callable[[Coroutine[Any, Any, Any]], None]
    """Run work that must finish even if the request's task is cancelled (recording the end
    of a stream the client walked away from), in a task of its own."""
    first_answers: FirstAnswerTimes
    rr: WeightedRoundRobin
    rng: random.Random
    instance_id: str  # the owner of the holds this gateway takes
    rate_counters: RateCounting | None = None  # None: no rate limit is counted
