"""In-memory fakes of the executor's ports (router/request/ports.py), and a world that wires
them: the executor runs against them with no socket and no database, and a test asserts on
what the journal received and on what each port was asked."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, cast

import orjson

from ledger import events as ev
from ledger.books.accounting import Effect
from ledger.endpoints import DisabledEndpoint
from router.adapters.breakers import Admission, BreakerKey, Standing
from router.config import Config, parse_config
from router.doors.chat import parse_body, read_headers, to_core
from router.drivers import (
    AttemptBinding,
    ChatRequest,
    DriverResult,
    DriverStream,
    PreparedCall,
    UpstreamFailure,
)
from router.request.budget import RequestBudget, StepRecord
from router.request.call import Call, Caller
from router.request.classify import Classification, UpstreamOutcome, classify
from router.request.executor import Executor
from router.request.policy import FirstAnswerTimes
from router.request.ports import Ports, Timer
from router.request.routing import GroupPlan, plan_for
from router.request.selection import WeightedRoundRobin

ENV = {"KEY": "sk-test"}
USAGE = ev.Usage(input_tokens=12, output_tokens=5)


def config(defaults: str = "", east_resume: str = "none", west_resume: str = "none") -> Config:
    """Two endpoints serving one upstream model ``m``: east (tier 0) and west (tier 1)."""
    mappings = "".join(
        f"""      - endpoint: {name}
        model: m
        tier: {tier}
        capabilities: [text, stream, tools, json_schema]
        context_window: 32000
        max_output_tokens: 1000
        resume: {resume}
        price: {{input_per_mtok: 1, output_per_mtok: 2}}
"""
        for name, tier, resume in (("east", 0, east_resume), ("west", 1, west_resume))
    )
    endpoints = "".join(
        f"""  - id: {name}
    driver: openai
    base_url: https://{name}.invalid/v1
    api_key: ${{env:KEY}}
    region: us-east
    data_classes: [public, internal]
"""
        for name in ("east", "west")
    )
    text = f"""generation: unit-1
defaults:
  deadline_ms: 20000
{defaults}
endpoints:
{endpoints}
models:
  - name: chat
    mappings:
{mappings}
workspaces:
  - id: acme
    models: [chat]
    regions: [us-east]
    data_class: internal
"""
    return parse_config(text, environ=ENV)


def failure(status: int | None = None, **outcome: Any) -> UpstreamFailure:
    """An upstream failure as a driver raises it, classified by contract §5's table."""
    seen = UpstreamOutcome(http_status=status, **outcome)
    return UpstreamFailure(seen, classify(seen, trust_not_started=False))


# --- drivers --------------------------------------------------------------------------------


@dataclass
class Play:
    """What a fake upstream does with one call: answer (buffered), stream ``pieces`` of text
    (cut after ``cut_after`` of them if given), or raise ``fail``; after ``gate`` opens, if
    given."""

    text: str = "hello"
    pieces: tuple[str, ...] = ()
    cut_after: int | None = None
    fail: UpstreamFailure | None = None
    gate: asyncio.Event | None = None


def answer(text: str = "hello", gate: asyncio.Event | None = None) -> Play:
    return Play(text=text, gate=gate)


def stream(*pieces: str, cut_after: int | None = None) -> Play:
    return Play(pieces=pieces, cut_after=cut_after)


def fail(error: UpstreamFailure, gate: asyncio.Event | None = None) -> Play:
    return Play(fail=error, gate=gate)


class FakeDriver:
    """One endpoint's upstream: plays its script, a call at a time."""

    requires_max_tokens = False

    def __init__(self, name: str) -> None:
        self.name = name
        self.plays: deque[Play] = deque()
        self.sent: list[ChatRequest] = []  # what it was asked, in order
        self.called = asyncio.Event()  # it was asked at least once
        self.streams: list[FakeStream] = []

    def then(self, *plays: Play) -> None:
        self.plays.extend(plays)

    def prepare(self, request: ChatRequest, binding: AttemptBinding) -> PreparedCall:
        return PreparedCall(request, binding, cast(Any, None))

    async def complete(self, call: PreparedCall) -> DriverResult:
        play = await self._next(call)
        response = {
            "id": f"resp-{self.name}",
            "model": "m-2026",
            "choices": [{"message": {"role": "assistant", "content": play.text}}],
        }
        return DriverResult(response, USAGE, "stop", f"up-{self.name}", f"resp-{self.name}", 200)

    async def stream(self, call: PreparedCall) -> DriverStream:
        play = await self._next(call)
        upstream = FakeStream(self.name, play.pieces, play.cut_after)
        self.streams.append(upstream)
        return upstream

    async def _next(self, call: PreparedCall) -> Play:
        self.sent.append(call.request)
        self.called.set()
        play = self.plays.popleft()
        if play.gate is not None:
            await play.gate.wait()
        if play.fail is not None:
            raise play.fail
        return play


class FakeStream(DriverStream):
    """A stream of text pieces, a chunk a read; cut (a broken stream) after ``cut_after``."""

    def __init__(self, name: str, pieces: Sequence[str], cut_after: int | None) -> None:
        self._name = name
        self._pieces = pieces
        self._cut_after = cut_after
        self._ended = False
        self.closed = False

    @property
    def invalid_events(self) -> int:
        return 0

    @property
    def ended(self) -> bool:
        return self._ended

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return {"id": f"chatcmpl-{self._name}", "model": "m-2026", "choices": [choice]}

    async def batches(self) -> AsyncIterator[list[dict[str, Any]]]:
        yield [self._chunk({"role": "assistant"})]
        for i, piece in enumerate(self._pieces):
            if self._cut_after is not None and i == self._cut_after:
                seen = UpstreamOutcome(transport="broken_stream")
                raise UpstreamFailure(seen, classify(seen, trust_not_started=False))
            self.time_to_first_chunk_ms = self.time_to_first_chunk_ms or 7
            yield [self._chunk({"content": piece})]
        self.finish_reason, self.usage, self.response_id = "stop", USAGE, f"resp-{self._name}"
        self._ended = True
        yield [self._chunk({}, "stop")]

    async def aclose(self) -> None:
        self.closed = True


# --- breakers, slots, disabled endpoints, latency -------------------------------------------


@dataclass
class FakeBreakers:
    """Every breaker closed, unless ``open`` (blocked at evaluation), ``deny`` (refused at
    admission), ``probe`` (admitted as its half-open probe) or ``opens`` (opened by the
    next failure it hears) names it; what they heard is kept."""

    open: set[BreakerKey] = field(default_factory=set)
    deny: set[BreakerKey] = field(default_factory=set)
    probe: set[BreakerKey] = field(default_factory=set)
    opens: set[BreakerKey] = field(default_factory=set)
    admitted: list[BreakerKey] = field(default_factory=list)
    successes: list[tuple[BreakerKey, int]] = field(default_factory=list)
    failures: list[tuple[BreakerKey, ev.FailureClass]] = field(default_factory=list)
    released: list[BreakerKey] = field(default_factory=list)

    ramping: dict[BreakerKey, Decimal] = field(default_factory=dict)  # key → its share

    async def standing(self, keys: Sequence[BreakerKey]) -> Mapping[BreakerKey, Standing]:
        return {key: Standing(key in self.open, self.ramping.get(key, Decimal(1))) for key in keys}

    async def probe_in(self, keys: Sequence[BreakerKey]) -> Mapping[BreakerKey, int | None]:
        return {key: 60_000 if key in self.open else None for key in keys}

    async def admit(self, key: BreakerKey, request_id: str) -> Admission:
        if key in self.deny:
            return Admission.DENIED
        self.admitted.append(key)
        return Admission.PROBE if key in self.probe else Admission.ALLOWED

    async def succeeded(
        self, keys: Sequence[BreakerKey], duration_ms: int, request_id: str
    ) -> None:
        self.successes += [(key, duration_ms) for key in keys]

    async def failed(
        self,
        key: BreakerKey,
        classification: Classification,
        duration_ms: int,
        request_id: str,
        workspace: str,
    ) -> bool:
        self.failures.append((key, classification.failure_class))
        if key in self.opens:
            self.opens.discard(key)
            self.deny.add(key)  # open from now on: a retry there would be refused
            return True
        return False

    async def release_probes(self, keys: Sequence[BreakerKey]) -> None:
        self.released += keys

    def quota_opened(self) -> frozenset[str]:
        return frozenset()


class FakeSlots:
    async def in_use(self, endpoints: Sequence[str]) -> Mapping[str, int]:
        return {}

    async def take(self, endpoint: str, slot: str, limit: int) -> bool:
        return True

    async def give_back(self, endpoint: str, slot: str) -> None:
        return None


@dataclass
class FakeDisabled:
    disabled: dict[str, DisabledEndpoint] = field(default_factory=dict)
    asked: list[str] = field(default_factory=list)

    async def current(self) -> Mapping[str, DisabledEndpoint]:
        return self.disabled

    async def disable(
        self,
        endpoint_id: str,
        *,
        http_status: int | None,
        error_code: str | None,
        request_id: str,
        attempt_id: str,
    ) -> bool:
        self.asked.append(endpoint_id)
        return True


@dataclass
class FakeLatency:
    observed: list[tuple[tuple[str, str], float]] = field(default_factory=list)

    async def observe(self, place: tuple[str, str], ms: float) -> None:
        self.observed.append((place, ms))

    async def read(self, places: Sequence[tuple[str, str]]) -> Mapping[tuple[str, str], float]:
        return {}


# --- the clock ------------------------------------------------------------------------------


class FakeTimer:
    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback: Callable[[], None] | None = callback

    def cancel(self) -> None:
        self.callback = None


class FakeClock:
    """Time that moves only when waited on: a back-off is recorded, never slept; a timer
    fires when the test says so."""

    def __init__(self) -> None:
        self.time = 1000.0
        self.sleeps: list[float] = []
        self.timers: list[tuple[float, FakeTimer]] = []
        self.armed = asyncio.Event()  # a timer was set

    def monotonic(self) -> float:
        return self.time

    def now(self) -> datetime:
        return datetime(2026, 3, 1, tzinfo=UTC)

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.time += seconds
        await asyncio.sleep(0)

    def call_later(self, seconds: float, callback: Callable[[], None]) -> Timer:
        timer = FakeTimer(callback)
        self.timers.append((seconds, timer))
        self.armed.set()
        return timer

    def timeout_at(self, deadline: float) -> AbstractAsyncContextManager[object]:
        return contextlib.nullcontext()

    def fire(self) -> None:
        """Run the timers not cancelled (the hedge delay ran out)."""
        for _, timer in self.timers:
            if timer.callback is not None:
                timer.callback()
                timer.callback = None


# --- the journal ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Submitted:
    events: tuple[ev.Event, ...]
    pending: list[ev.Event]
    effects: list[Effect]


class FakeJournal:
    """The request's appends, kept in memory. :meth:`refuse` makes the next append that
    carries an event of a type raise an error instead (what was queued before it stays
    queued, as the real journal keeps it)."""

    def __init__(self) -> None:
        self.appends: list[tuple[ev.Event, ...]] = []
        self._pending: list[ev.Event] = []
        self._effects: list[Effect] = []
        self._refusals: deque[tuple[type[ev.Event], BaseException]] = deque()

    @property
    def events(self) -> list[ev.Event]:
        return [event for append in self.appends for event in append]

    def types(self) -> list[str]:
        return [event.type for event in self.events]

    def of(self, kind: type[Any]) -> list[Any]:
        return [event for event in self.events if isinstance(event, kind)]

    def refuse(self, carrying: type[ev.Event], error: BaseException, times: int = 1) -> None:
        self._refusals.extend([(carrying, error)] * times)

    def queue(self, event: ev.Event) -> None:
        self._pending.append(event)

    def record(self, step: StepRecord) -> None:
        self._pending.extend(step.events)
        self._effects.extend(step.effects)

    @property
    def has_effects(self) -> bool:
        return bool(self._effects)

    async def submit(self, *more: ev.Event, step: StepRecord | None = None) -> _Submitted | None:
        pending, effects = self._pending, self._effects
        events = (*pending, *(step.events if step else ()), *more)
        self._pending, self._effects = [], []
        return _Submitted(events, pending, effects) if events else None

    async def committed(self, submitted: _Submitted) -> None:
        await asyncio.sleep(0)  # a commit takes a turn of the loop at least
        if self._refusals:
            carrying, error = self._refusals[0]
            if any(isinstance(event, carrying) for event in submitted.events):
                self._refusals.popleft()
                self._pending = [*submitted.pending, *self._pending]
                self._effects = [*submitted.effects, *self._effects]
                raise error
        self.appends.append(submitted.events)

    async def flush(self, *more: ev.Event, step: StepRecord | None = None) -> None:
        submitted = await self.submit(*more, step=step)
        if submitted is not None:
            await self.committed(submitted)

    async def flush_patiently(self, *more: ev.Event) -> None:
        await self.flush(*more)


# --- the world ------------------------------------------------------------------------------


class FakeBalances:
    async def used(self, account_ids: Sequence[str]) -> Mapping[str, Decimal]:
        return {}


class Kept:
    """What the executor runs in tasks of their own (Ports.keep), to be awaited."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Future[Any]] = []

    def __call__(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        self.tasks.append(asyncio.ensure_future(coroutine))

    async def drain(self) -> None:
        while not all(task.done() for task in self.tasks):
            await asyncio.gather(*self.tasks)


class World:
    """One config generation's ports, all fakes, and the requests made in it."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.drivers = {name: FakeDriver(name) for name in ("east", "west")}
        self.breakers = FakeBreakers()
        self.disabled = FakeDisabled()
        self.latency = FakeLatency()
        self.clock = FakeClock()
        self.kept = Kept()
        self.journal = FakeJournal()
        self.ports = Ports(
            config=config,
            drivers=self.drivers,
            breakers=self.breakers,
            slots=FakeSlots(),
            disabled=self.disabled,
            latency=self.latency,
            clock=self.clock,
            keep=self.kept,
            first_answers=FirstAnswerTimes(),
            rr=WeightedRoundRobin(),
            rng=random.Random(7),
            instance_id="gw-test",
        )

    def executor(
        self, *, stream: bool = False, plan: GroupPlan | None = None, **body: Any
    ) -> Executor:
        """A request to group ``chat`` (served by ``plan``, else the config's), its body's
        other fields ``body``."""
        group = self.config.model_group("chat")
        workspace = self.config.workspace("acme")
        assert group is not None and workspace is not None
        raw = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], **body}
        if stream:
            raw["stream"] = True
        call: Call = to_core(parse_body(orjson.dumps(raw)), read_headers({}), workspace)
        caller = Caller("key-1", workspace, "client")
        budget = RequestBudget(
            FakeBalances(),
            request_id="req-1",
            workspace=workspace,
            key_id=caller.key_id,
            model_group="chat",
            request_limit=None,
            owner="gw-test",
        )
        plan = plan or plan_for(self.config, group)
        return Executor(
            self.ports, plan, caller, call, "req-1", budget=budget, journal=self.journal
        )
