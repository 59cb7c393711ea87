"""The request path: evaluate → select → attempt → decide, with every step on the ledger.

:class:`Gateway` owns what lives as long as a config generation: the config, one driver
per endpoint, the breaker board, the weighted round-robin state. Each request is one
:class:`_Run`, which walks contract §4's path using the pure decisions of
:mod:`router.request.selection` and records each fact in the request's stream (``request-<id>``).

Durability: the events of a request are appended in two group-committed batches per
attempt — before the upstream call (``RequestReceived``, ``RouteEvaluated``,
``AttemptStarted``, and the previous attempt's outcome) and before the answer is given
(``AttemptFinished``, ``RequestCompleted``/``RequestFailed``) — so an upstream is never
called for an attempt the ledger does not know, and an answered request is never missing.

Streams (contract §5): response headers and any role-only preamble are held until the first
chunk with content; until then a failure can still fail over unseen. Then ``StreamCommitted``
is appended, and only once it is durable does the client get its first byte. From there the
endpoint is fixed; a later failure ends the stream with an SSE ``error`` event and is
recorded as a partial failure (by crash recovery, if the gateway died).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Final, Literal, TypeVar
from urllib.parse import urlsplit

from ledger import events as ev
from ledger.apikeys import key_stream
from ledger.books.accounting import BudgetDenied, Effect, HoldStateError, Reserve, usage_cost
from ledger.store import (
    ANY_VERSION,
    NO_STREAM,
    EventStore,
    LedgerUnavailable,
    RecordedEvent,
    WrongExpectedVersion,
)
from ledger.support.frozen import evolve
from otel.ids import attempt_span_id, request_trace_id, upstream_traceparent
from router.adapters.breakers import Admission, BreakerBoard, BreakerKey, Transition
from router.adapters.disabling import Disabling
from router.adapters.disabling import detail as disabled_detail
from router.adapters.latency import InProcessLatency, LatencyBoard
from router.adapters.slots import EndpointSlots, InProcessSlots
from router.config import Config, ModelGroup, Workspace
from router.config import Driver as DriverName
from router.config import Mapping as ModelMapping
from router.drivers import (
    AttemptBinding,
    AttemptTimeouts,
    ChatRequest,
    Driver,
    DriverResult,
    DriverStream,
    PreparedCall,
    UpstreamFailure,
    driver_for,
)
from router.drivers.sse import DONE_FRAME, encode_json
from router.errors import (
    AttemptSummary,
    ErrorCode,
    GatewayError,
    client_canceled,
    internal_error,
    ledger_unavailable,
)
from router.request.budget import RequestBudget, StepRecord
from router.request.call import Call, Caller
from router.request.classify import Classification
from router.request.final_error import Tally, final_error
from router.request.output_check import INVALID_OUTPUT, demands_a_shape, output_violation
from router.request.policy import FirstAnswerTimes, group_targets, hedge_p95, walk_policy
from router.request.records import (
    AttemptEnd,
    attempt_finished,
    attempt_started,
    breaker_transitioned,
    failed_end,
    failover_decided,
    request_completed,
    request_failed,
    request_received,
    route_evaluated,
    stream_committed,
)
from router.request.resume import Seam, continuation_body
from router.request.selection import (
    Decision,
    RouteContext,
    WeightedRoundRobin,
    evaluate,
    select,
)
from router.request.walk import (
    Answered,
    ArmHedge,
    Begin,
    BudgetRaced,
    Cancel,
    Commit,
    Content,
    Decided,
    Deliver,
    Fail,
    Failed,
    Happening,
    HedgeDue,
    Kind,
    Purpose,
    Route,
    Routed,
    Run,
    Start,
    Started,
    Target,
    Unroutable,
    Wait,
    Walk,
    advance,
)
from router.request.worst_case import billed_usage, settlement_rates, worst_case_cost
from router.support.ids import new_id

__all__ = ["Caller", "Completion", "Gateway", "KeyMoved", "StreamingCompletion"]

log = logging.getLogger("waybill.gateway")

_T = TypeVar("_T")

_DEADLINE: Final = Classification(
    failure_class=ev.FailureClass.DEADLINE_EXCEEDED,
    evidence=ev.Evidence.UNKNOWN,
    breaker_scope=None,
    breaker_opens_at_once=False,
    may_fail_over="no",
)


class KeyMoved(Exception):
    """The request's first append was refused: its key's ledger stream moved (the key was
    revoked) since the key was read. Nothing was recorded and no upstream call made; the
    caller reads the key again."""


@dataclass(frozen=True, slots=True)
class Completion:
    """A buffered answer."""

    request_id: str
    response: dict[str, Any]
    endpoint: str
    attempts: int
    cost_usd: Decimal | None


@dataclass(frozen=True, slots=True)
class StreamingCompletion:
    """A stream committed to one endpoint: its headers are final, its body is to be sent."""

    request_id: str
    endpoint: str
    attempts: int
    body: AsyncGenerator[bytes, None]
    write_directly: Callable[[Callable[[bytes], bool]], None]
    """Given the server's writer of the started response's body (``router.serving.server``
    ``BodyWriter``), the body's reads that pass through unchanged go to the client from the
    upstream connection's callback, through it, rather than through ``body`` (whose pieces
    then are the rest, in order): the relay's cost per read is then a parse and a write."""


@dataclass(frozen=True, slots=True)
class _Route:
    """One attempt's binding: chosen at selection, never redirected by a config reload."""

    choice: ev.RouteChoice
    mapping: ModelMapping
    driver: Driver
    driver_name: DriverName  # the endpoint's `driver`: what it sends on, so may be billed
    cause: Literal["first", "retry", "failover", "hedge"]
    worst_case_usd: Decimal


@dataclass(slots=True)
class _Attempt:
    route: _Route
    attempt_id: str
    started_at: float
    call: PreparedCall | None  # built while its start committed (None: build it to send)
    kind: Kind = "call"
    seam: Seam | None = None  # a resume's join to the text the client has
    invalid_output: str | None = None  # how its answer broke the shape demanded
    slot: str | None = None  # the endpoint slot it holds (max_in_flight), until it ends
    stream_committed: bool = False
    task: asyncio.Task[None] | None = None
    # What its task found: an answer, a stream up to its first content, or a failure.
    result: DriverResult | None = None
    upstream: DriverStream | None = None
    batches: AsyncIterator[list[dict[str, Any]]] | None = None
    held: list[dict[str, Any]] = field(default_factory=list)
    held_raw: bytes | None = None  # the held chunks as the upstream's bytes, if it has them
    classification: Classification | None = None
    failure: UpstreamFailure | None = None
    error_code: str | None = None  # the gateway's own, where the upstream gave none
    error: Exception | None = None  # not a failure of the upstream: raised by the request

    def response_bytes(self) -> int:
        """The upstream's body as far as this attempt read it, answered or failed."""
        if self.result is not None:
            return self.result.response_bytes
        if self.upstream is not None:
            return self.upstream.response_bytes
        return self.failure.response_bytes if self.failure is not None else 0


class _SeamBroken(Exception):
    """A resume's continuation cannot be joined to the text the client has."""


@dataclass(frozen=True, slots=True)
class _Unsure:
    """An append that failed with the ledger unavailable: maybe committed, maybe not."""

    version: int  # the stream's version it expected
    events: tuple[ev.Event, ...]
    effects: tuple[Effect, ...]


@dataclass(frozen=True, slots=True)
class _Submitted:
    """An append on its way to the ledger, and what to restore if it is refused."""

    future: asyncio.Future[list[RecordedEvent]]
    version: int  # the stream's version it expects
    pending: list[ev.Event]  # what was queued before it was sent
    pending_effects: list[Effect]
    events: tuple[ev.Event, ...]  # all it sends
    effects: tuple[Effect, ...]


class Gateway:
    """Everything one config generation needs to serve requests."""

    def __init__(
        self,
        config: Config,
        store: EventStore,
        breakers: BreakerBoard,
        *,
        drivers: Mapping[str, Driver] | None = None,
        rng: random.Random | None = None,
        instance_id: str | None = None,
        latency: LatencyBoard | None = None,
        slots: EndpointSlots | None = None,
        disabling: Disabling | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.breakers = breakers
        self.latency = latency or InProcessLatency()  # for the least_latency strategy
        # Endpoints' max_in_flight: owned by the app, shared by every config generation (a
        # retiring one's attempts still load the upstreams).
        self.slots = slots or InProcessSlots()
        # Disabled endpoints outlive a generation (one Disabling per process, the app's);
        # this generation sees those disabled for the keys it gives them.
        self.disabling = disabling or Disabling(store)
        self.disabled = self.disabling.view(config)
        self.instance_id = instance_id or new_id("gw")  # owner of the holds it takes
        self._drivers = dict(drivers) if drivers else {}
        for endpoint in config.endpoints:
            if endpoint.id not in self._drivers:
                self._drivers[endpoint.id] = driver_for(endpoint.driver)
        self._rr = WeightedRoundRobin()
        self.latencies = FirstAnswerTimes()
        self._rng = rng or random.Random()
        self._background: set[asyncio.Task[None]] = set()
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    # A reload retires this gateway: it finishes the requests it began (an attempt is never
    # redirected by a reload), then closes.
    def begin(self) -> None:
        self._active += 1
        self._idle.clear()

    def end(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._idle.set()

    async def retire(self) -> None:
        await self._idle.wait()
        await self.aclose()

    async def aclose(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        for driver in self._drivers.values():
            await driver.aclose()
        await self.breakers.aclose()
        await self.latency.aclose()

    def models_for(self, workspace: Workspace) -> list[ModelGroup]:
        return [g for g in self.config.models if g.name in workspace.models]

    async def complete(self, caller: Caller, call: Call, request_id: str) -> Completion:
        """Serve a buffered request, or raise :class:`GatewayError` (already recorded)."""
        return await _Run(self, caller, call, request_id).complete()

    async def stream(self, caller: Caller, call: Call, request_id: str) -> StreamingCompletion:
        """Route a streamed request up to its first content chunk; then the body follows."""
        return await _Run(self, caller, call, request_id).stream()

    def _keep(self, coroutine: Any) -> None:
        # Work that must finish even if the client's task is cancelled (recording the end
        # of a stream the client walked away from): its own task, awaited at shutdown.
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_failure)

    async def _record_transitions(self, transitions: list[Transition], request_id: str) -> None:
        if not transitions:
            return
        generation, settings_for = self.config.generation, self.breakers.settings_for
        events = [
            breaker_transitioned(t, settings_for(t.key), generation, request_id)
            for t in transitions
        ]
        await self.store.append("breaker", ANY_VERSION, events)


class _Run:
    """One request's walk through contract §4's path."""

    def __init__(
        self,
        gateway: Gateway,
        caller: Caller,
        call: Call,
        request_id: str,
    ) -> None:
        self.gw = gateway
        self.caller = caller
        self.call = call
        self.request_id = request_id
        config = gateway.config
        group = config.model_group(call.model_group)
        assert group is not None, "the app resolves the model group before routing"
        self.group = group
        self.requirements = requirements = call.requirements
        self.defaults = config.policy_for(group.name)
        deadline_ms = self.defaults.deadline_ms
        if requirements.deadline_ms is not None:
            deadline_ms = min(deadline_ms, requirements.deadline_ms)  # the caller only narrows
        self.started = time.monotonic()
        self.deadline = self.started + deadline_ms / 1000
        self.context = RouteContext()
        self.sequence = 0
        self.attempt_count = 0
        self.tally = Tally()
        self.denied: set[BreakerKey] = set()
        self.budget = RequestBudget(
            gateway.store,
            request_id=request_id,
            workspace=caller.workspace,
            key_id=caller.key_id,
            key_budget=caller.key_budget,
            model_group=group.name,
            request_limit=requirements.max_cost_usd,
            owner=gateway.instance_id,
        )
        self.budget_denials = 0
        self._pending_effects: list[Effect] = []
        self.open: dict[str, _Attempt] = {}  # started, their end not yet recorded
        self._demands_shape = not call.stream and demands_a_shape(call.body)
        self._places = tuple((m.endpoint, m.model) for m in group.mappings)
        self._targets = group_targets(group)
        p95 = gateway.latencies.p95(group.name, call.stream) if hedge_p95(self.defaults) else None
        self.walk = Walk(policy=walk_policy(self.defaults, self.requirements, self._targets, p95))
        self._can_resume = any(target.resume != "none" for target in self._targets)
        # What the attempts' tasks and the hedge timer (None) report, in order.
        self._happenings = _Mailbox()
        self._hedge_timer: asyncio.TimerHandle | None = None
        self._routed: _Route | None = None  # the route the walk's next start takes
        self._routed_slot: str | None = None  # the endpoint slot taken for it
        self._admitted_as = "closed"  # the breakers' admission of it
        self.saturated: set[str] = set()  # endpoints whose slot this request was refused
        self._limits = {
            m.endpoint: limit
            for m in group.mappings
            if (endpoint := config.endpoint(m.endpoint)) is not None
            and (limit := endpoint.max_in_flight) is not None
        }
        self._candidates: tuple[ev.Candidate, ...] = ()  # the last evaluation's
        self._failures: dict[str, _Attempt] = {}  # failed attempts, for their decisions
        self._budget_refusal = ""
        # The committed stream as the client has it: its text so far (for a resume),
        # whether that can be continued, and the id and model its chunks carry.
        self._delivered: list[str] = []
        self._resumable = True
        self._chunk_id: str | None = None
        self._response_model: str | None = None
        self._writer: Callable[[bytes], bool] | None = None  # see StreamingCompletion
        self.ended = False  # RequestCompleted or RequestFailed is recorded (or on its way)
        self._stream_id = f"request-{request_id}"
        self._version = NO_STREAM
        self._unsure: _Unsure | None = None  # an append whose commit answer was lost
        self._requires: dict[str, int] | None = None  # what the first append requires
        if caller.key_version is not None:
            self._requires = {key_stream(caller.key_id): caller.key_version}
        self._metadata = {"config_generation": config.generation}
        self._pending: list[ev.Event] = [
            request_received(request_id, caller, call, config.generation)
        ]

    # --- the ledger ---

    def _record(self, step: StepRecord) -> None:
        """Queue a budget step: its events and book effects go out in the next append."""
        self._pending.extend(step.events)
        self._pending_effects.extend(step.effects)

    async def _flush(self, *more: ev.Event, step: StepRecord | None = None) -> None:
        submitted = await self._submit(*more, step=step)
        if submitted is not None:
            await self._committed(submitted)

    async def _submit(self, *more: ev.Event, step: StepRecord | None = None) -> _Submitted | None:
        """Send what is queued (and ``more``) to the ledger; await ``_committed`` on what
        this returns (None: nothing to send). Work between the two overlaps the commit."""
        if self._unsure is not None:
            await self._resolve_unsure()  # an earlier append's answer was lost
        pending, effects = self._pending, self._pending_effects
        events = [*pending, *(step.events if step else ()), *more]
        all_effects = [*effects, *(step.effects if step else ())]
        self._pending, self._pending_effects = [], []
        if not events:
            return None
        # This run is the stream's only writer, so the next version is known before the
        # append returns; a cancelled caller's append still commits (see EventStore.append),
        # and whatever is recorded after it must follow it.
        expected, self._version = self._version, self._version + len(events)
        try:
            future = self.gw.store.submit(
                self._stream_id,
                expected,
                events,
                metadata=self._metadata,
                effects=all_effects,
                requires=self._requires,
            )
        except BaseException:
            self._version = expected
            self._pending, self._pending_effects = pending, effects
            raise
        return _Submitted(future, expected, pending, effects, tuple(events), tuple(all_effects))

    async def _committed(self, submitted: _Submitted) -> None:
        try:
            await submitted.future
            self._requires = None
        except WrongExpectedVersion as refusal:
            if self._requires is None or refusal.stream_id not in self._requires:
                raise
            self.ended = True  # nothing of this request is on the ledger, nor will be
            raise KeyMoved(str(refusal)) from None
        except (BudgetDenied, HoldStateError, LedgerUnavailable) as error:
            # Refused by the books, or the database is down: taken as not written, and what
            # was queued stays queued (before anything queued since). When the database
            # failed, the commit may have happened all the same (its answer lost): the next
            # append finds out first.
            self._version = submitted.version
            self._pending = [*submitted.pending, *self._pending]
            self._pending_effects = [*submitted.pending_effects, *self._pending_effects]
            if isinstance(error, LedgerUnavailable):
                self._unsure = _Unsure(submitted.version, submitted.events, submitted.effects)
            raise

    async def _resolve_unsure(self) -> None:
        """An earlier append failed with the ledger unavailable: did it commit after all?

        This run is its stream's only writer, so anything past the version it expected is
        that append. If it committed, its events are not written again, and an attempt it
        started is finished as never run (``_start`` made no upstream call without an
        answer) with its reservation released."""
        unsure = self._unsure
        assert unsure is not None
        recorded = await self.gw.store.read_stream(self._stream_id, unsure.version)
        self._unsure = None
        if not recorded:
            return  # it did not commit: carry on as if it never happened
        self._requires = None  # it was accepted: what it required held
        if len(recorded) != len(unsure.events):
            raise RuntimeError(
                f"stream {self._stream_id} has {len(recorded)} events past version "
                f"{unsure.version}, not the {len(unsure.events)} of the unanswered append"
            )
        self._version = unsure.version + len(recorded)
        written = {id(e) for e in unsure.events}
        resolved = {id(e) for e in unsure.effects}
        self._pending = [e for e in self._pending if id(e) not in written]
        self._pending_effects = [e for e in self._pending_effects if id(e) not in resolved]
        for effect in unsure.effects:
            if isinstance(effect, Reserve) and not self.budget.has_hold(effect.hold.attempt_id):
                hold = effect.hold
                self.budget.adopt(hold)
                end = AttemptEnd(
                    "failed", ev.Evidence.NOT_STARTED, error_code=ErrorCode.LEDGER_UNAVAILABLE
                )
                self._pending.append(attempt_finished(self.request_id, hold.attempt_id, end, 0))
                self._record(self.budget.release(hold.attempt_id, "not_started"))

    async def _flush_patiently(self, *more: ev.Event) -> None:
        """The end of an abandoned request, retried while the ledger is unreachable (its
        hold stays counted meanwhile, and crash recovery is the last resort)."""
        for delay in (0.5, 1, 2, 4, 8, 16):
            try:
                await self._flush(*more)
                return
            except LedgerUnavailable:
                await asyncio.sleep(delay)
        await self._flush(*more)

    def _took(self, attempt: _Attempt) -> int:
        """The attempt's duration so far, in ms."""
        return round((time.monotonic() - attempt.started_at) * 1000)

    def _remaining_ms(self) -> int:
        return max(0, int((self.deadline - time.monotonic()) * 1000))

    def _elapsed_ms(self) -> int:
        return round((time.monotonic() - self.started) * 1000)

    # --- the two shapes of a request ---

    async def complete(self) -> Completion:
        return await self._ending_recorded(self._complete())

    async def stream(self) -> StreamingCompletion:
        return await self._ending_recorded(self._stream())

    async def _ending_recorded(self, work: Coroutine[Any, Any, _T]) -> _T:
        """Run ``work``; however it ends, the request's end is on the ledger."""
        try:
            return await work
        except asyncio.CancelledError:
            self._record_abandoned(canceled=True)
            raise
        except (GatewayError, KeyMoved):
            raise  # already recorded, or nothing to record
        except LedgerUnavailable:
            self._record_abandoned(canceled=False, error=ledger_unavailable())
            raise
        except Exception:
            self._record_abandoned(canceled=False)
            raise

    def _record_abandoned(self, *, canceled: bool, error: GatewayError | None = None) -> None:
        """The client went away (``canceled``) or the gateway itself failed before an
        answer: record how the request ended, in a task of its own that the cancellation of
        this one does not reach. A hold in flight stays counted as unknown usage."""
        if self.ended:
            return
        self.ended = True
        self._stop_hedge_timer()
        classification = _canceled_class(ev.Evidence.UNKNOWN)
        for attempt in self._take_open():
            self._discard(attempt)
            if canceled:
                self._pending.append(self._attempt_finished(attempt, classification, None))
            else:
                end = AttemptEnd(
                    "failed",
                    ev.Evidence.UNKNOWN,
                    error_code="gateway_error",
                    stream_committed=attempt.stream_committed,
                    response_bytes=attempt.response_bytes(),
                )
                self._pending.append(
                    attempt_finished(self.request_id, attempt.attempt_id, end, self._took(attempt))
                )
            if self.budget.has_hold(attempt.attempt_id):
                cause = "client_canceled" if canceled else "gateway_error"
                self._record(self.budget.hold_unknown(attempt.attempt_id, cause))
            if canceled:
                decision = Decision(action="stop", reason="client_canceled")
                self._pending.append(self._failover_decided(attempt, classification, decision))
        if canceled:
            error = client_canceled()
        elif error is None:
            error = internal_error()
        self.gw._keep(self._flush_patiently(self._request_failed(error)))

    async def _complete(self) -> Completion:
        attempt = await self._drive(Begin())
        route, result = attempt.route, attempt.result
        assert result is not None, "an answered attempt of a buffered request has its result"
        usage, cost = self._settlement(route, result.usage)
        await self._succeeded(
            attempt,
            usage=usage,
            cost=cost,
            finish_reason=result.finish_reason,
            response_id=result.response_id,
            response_model=_optional_str(result.response.get("model")),
            upstream_request_id=result.upstream_request_id,
            http_status=result.status,
            response_bytes=result.response_bytes,
        )
        return Completion(
            self.request_id, result.response, route.choice.endpoint, self.attempt_count, cost
        )

    async def _stream(self) -> StreamingCompletion:
        attempt = await self._drive(Begin())  # returns once the stream is committed
        return StreamingCompletion(
            self.request_id,
            attempt.route.choice.endpoint,
            self.attempt_count,
            self._stream_body(attempt),
            self._write_directly,
        )

    def _write_directly(self, writer: Callable[[bytes], bool]) -> None:
        self._writer = writer

    def _deliver(self, batch: list[dict[str, Any]], raw: bytes) -> bool:
        """A tapped read (DriverStream.tap) of a stream relayed as the upstream's bytes:
        written to the client now, unless it is not to go out as it came (a usage chunk
        the client did not ask for) or the writer cannot take it now; then the relay's
        task gets it, in order."""
        writer = self._writer
        if writer is None:
            return False
        if not self.call.include_usage:
            for chunk in batch:
                if _is_usage_chunk(chunk):
                    return False
        if not writer(raw):
            return False
        self._note_delivered(batch)
        return True

    # --- the driver: the walk (router.request.walk) decides, this executes and records ---

    async def _drive(self, happening: Happening) -> _Attempt:
        """Tell the walk ``happening`` and carry out what it asks, one action at a time,
        until it hands an attempt to the client (a committed stream, an answer, a resumed
        stream's continuation: returned) or ends the request (its error, recorded, raised)."""
        queue: deque[Happening] = deque([happening])
        while True:
            if not queue:
                queue.append(await self._next_happening())
            step = advance(self.walk, queue.popleft(), self.gw._rng)
            self.walk = step.walk
            for action in step.actions:
                match action:
                    case Route():
                        queue.append(await self._route(action))
                    case Start():
                        queue.append(await self._start(action))
                    case Run(attempt_id=attempt_id):
                        self._launch(self.open[attempt_id])
                    case ArmHedge(after_ms=after_ms):
                        self._arm_hedge(after_ms)
                    case Wait(ms=ms):
                        await asyncio.sleep(ms / 1000)
                    case Decided(attempt_id=attempt_id, decision=decision):
                        self._decided(attempt_id, decision)
                    case Cancel(attempt_id=attempt_id):
                        await self._cancel(attempt_id)
                    case Commit(attempt_id=attempt_id):
                        self._stop_hedge_timer()
                        attempt = self.open[attempt_id]
                        await self._commit(attempt)
                        return attempt
                    case Deliver(attempt_id=attempt_id):
                        self._stop_hedge_timer()
                        return self.open[attempt_id]
                    case Fail():
                        self._stop_hedge_timer()
                        raise await self._fail(self._walk_error(action), **self._failed_stream())

    async def _next_happening(self) -> Happening:
        """What the running attempts (or the hedge timer) did next."""
        while True:
            attempt = await self._happenings.get()
            if attempt is None:
                return HedgeDue()
            if attempt.attempt_id not in self.open:
                continue  # a way cancelled after it had finished
            if attempt.error is not None:
                raise attempt.error
            if attempt.classification is None:
                if attempt.kind != "resume":
                    waited = round((time.monotonic() - attempt.started_at) * 1000)
                    self.gw.latencies.add(self.group.name, self.call.stream, waited)
                    if self.group.strategy == "least_latency":
                        mapping = attempt.route.mapping
                        await self.gw.latency.observe((mapping.endpoint, mapping.model), waited)
                answered = not self.call.stream
                return Answered(attempt.attempt_id) if answered else Content(attempt.attempt_id)
            return await self._attempt_failed(attempt)

    def _launch(self, attempt: _Attempt) -> None:
        attempt.task = asyncio.create_task(self._run_attempt(attempt))

    async def _run_attempt(self, attempt: _Attempt) -> None:
        """One attempt, in a task of its own, up to its answer (buffered) or its first
        content (streams); then the driver hears of it."""
        try:
            async with asyncio.timeout_at(_loop_time(self.deadline)):
                if self.call.stream:
                    await self._open_stream(attempt)
                else:
                    result = await attempt.route.driver.complete(self._call(attempt))
                    attempt.result = result
                    if self._demands_shape:
                        self._check_output(attempt, result)
        except UpstreamFailure as failure:
            attempt.classification, attempt.failure = failure.classification, failure
        except _SeamBroken:
            attempt.classification, attempt.error_code = _SEAM_BROKEN, "resume_seam_unverified"
        except TimeoutError:
            attempt.classification = _deadline_class()
        except Exception as error:  # a bug or the ledger: the request's own task raises it
            attempt.error = error
        self._happenings.put(attempt)

    async def _open_stream(self, attempt: _Attempt) -> None:
        upstream = await attempt.route.driver.stream(self._call(attempt))
        attempt.call = None  # sent: what is held for the stream's life is kept small
        held_raw = None
        try:
            batches = upstream.batches()
            if attempt.seam is None:
                held, held_raw = await _first_content(batches, upstream)
            else:
                held, _ = await _first_content(self._continuation(attempt, batches), None)
                if attempt.seam.state != "joined" and not attempt.seam.end():
                    raise _SeamBroken
        except BaseException:
            await upstream.aclose()
            raise
        attempt.upstream, attempt.batches, attempt.held = upstream, batches, held
        attempt.held_raw = held_raw

    async def _continuation(
        self, attempt: _Attempt, batches: AsyncIterator[list[dict[str, Any]]]
    ) -> AsyncIterator[list[dict[str, Any]]]:
        """A resume's chunks as the client's stream goes on: what the client already has
        stripped (router.request.resume.Seam), no second role preamble, the stream's own id."""
        seam = attempt.seam
        assert seam is not None
        async for batch in batches:
            joined = [c for c in (_continued(chunk, seam, self._chunk_id) for chunk in batch) if c]
            if seam.state == "broken":
                raise _SeamBroken
            if joined:
                yield joined

    def _check_output(self, attempt: _Attempt, result: DriverResult) -> None:
        """Hold a buffered answer to the shape its request demanded (contract §5 "Output
        validation"): one that breaks it fails as ``invalid_output`` for the walk to fail
        over, or, with ``on_invalid_output: return``, is answered as it is, recorded so."""
        attempt.invalid_output = output_violation(self.call.body, result.response)
        if attempt.invalid_output is not None and self.defaults.on_invalid_output == "failover":
            attempt.classification = INVALID_OUTPUT

    def _arm_hedge(self, after_ms: int) -> None:
        self._stop_hedge_timer()
        loop = asyncio.get_running_loop()
        self._hedge_timer = loop.call_later(after_ms / 1000, self._happenings.put, None)

    def _stop_hedge_timer(self) -> None:
        if self._hedge_timer is not None:
            self._hedge_timer.cancel()
            self._hedge_timer = None

    def _take_open(self) -> list[_Attempt]:
        return [self._close(attempt_id) for attempt_id in list(self.open)]

    def _close(self, attempt_id: str) -> _Attempt:
        """The attempt's end is being recorded: it is no longer open, and gives its endpoint
        slot back (``max_in_flight``)."""
        attempt = self.open.pop(attempt_id)
        if attempt.slot is not None:
            self._give_back(attempt.route.choice.endpoint, attempt.slot)
            attempt.slot = None
        return attempt

    def _give_back_routed(self, route: _Route) -> None:
        """A start that did not happen: the slot its route took goes back."""
        if self._routed_slot is not None:
            self._give_back(route.choice.endpoint, self._routed_slot)
            self._routed_slot = None

    def _give_back(self, endpoint: str, slot: str) -> None:
        self.gw._keep(self.gw.slots.give_back(endpoint, slot))

    def _discard(self, attempt: _Attempt) -> None:
        """Stop an attempt's task and let go of its upstream connection."""
        if attempt.task is not None and not attempt.task.done():
            attempt.task.cancel()
        if attempt.upstream is not None:
            self.gw._keep(attempt.upstream.aclose())

    async def _cancel(self, attempt_id: str) -> None:
        """A way that lost the race: its usage is settled if it answered in full, else held
        unknown (contract §5 "Hedging")."""
        attempt = self._close(attempt_id)
        self._discard(attempt)
        result = attempt.result
        usage = cost = None
        if result is not None:
            usage, cost = self._settlement(attempt.route, result.usage)
        end = AttemptEnd(
            "failed",
            ev.Evidence.UNKNOWN if result is None else ev.Evidence.STARTED,
            error_code=ev.HEDGE_LOST,
            usage=usage,
            response_bytes=attempt.response_bytes(),
        )
        self._pending.append(
            attempt_finished(self.request_id, attempt_id, end, self._took(attempt))
        )
        if usage is not None and cost is not None:
            self._record(self.budget.settle(attempt_id, cost, usage))
        else:
            self._record(self.budget.hold_unknown(attempt_id, ev.HEDGE_LOST))

    async def _commit(self, attempt: _Attempt) -> None:
        """The ledger learns that the stream is the client's before the client's first byte
        (its headers go out once this returns): a gateway that dies from here on leaves a
        partial failure, and crash recovery can tell (ledger.books.recovery)."""
        upstream = attempt.upstream
        assert upstream is not None
        try:
            await self._flush(
                stream_committed(
                    self.request_id,
                    attempt.attempt_id,
                    attempt.route.choice.endpoint,
                    upstream.time_to_first_chunk_ms,
                )
            )
        except LedgerUnavailable:
            await upstream.aclose()
            self._not_committed(attempt, upstream)
            raise
        except BaseException:
            await upstream.aclose()
            raise
        attempt.stream_committed = True

    def _not_committed(self, attempt: _Attempt, upstream: DriverStream) -> None:
        """The stream's commit could not be recorded (the ledger is unavailable): the client
        gets the 503, nothing of the stream. The upstream did start, so the attempt's hold
        stays counted as unknown usage; the end is recorded once the ledger is back."""
        self._close(attempt.attempt_id)
        self.ended = True
        end = AttemptEnd(
            "failed",
            ev.Evidence.STARTED,
            error_code=ErrorCode.LEDGER_UNAVAILABLE,
            time_to_first_chunk_ms=upstream.time_to_first_chunk_ms,
            response_bytes=upstream.response_bytes,
        )
        self._pending.append(
            attempt_finished(self.request_id, attempt.attempt_id, end, self._took(attempt))
        )
        self._record(self.budget.hold_unknown(attempt.attempt_id, "ledger_unavailable"))
        self.gw._keep(self._flush_patiently(self._request_failed(ledger_unavailable())))

    async def _stream_body(self, attempt: _Attempt) -> AsyncGenerator[bytes, None]:
        """The client's bytes: a read's chunks go out together, as one piece. The read that
        ended the upstream's stream (its finish chunk, usage and end) goes out with the
        gateway's own end, once the completion is recorded, as a buffered answer does: one
        piece and one write fewer per stream. A stream that breaks is resumed where the walk
        says so (router.request.walk): the continuation's chunks follow on the same stream."""
        finished = False
        last = b""
        try:
            while True:
                upstream, batches = attempt.upstream, attempt.batches
                assert upstream is not None and batches is not None
                # A resume's chunks are rewritten (router.request.resume); the others go out as the
                # upstream's bytes where it has them (DriverStream.raw) and nothing is
                # dropped from them: they were parsed only for what the ledger and a resume
                # need (_note_delivered).
                passed = attempt.seam is None
                if not passed:
                    batches = self._continuation(attempt, batches)
                try:
                    batch: list[dict[str, Any]] | None = attempt.held
                    raw = attempt.held_raw
                    attempt.held, attempt.held_raw = [], None
                    while batch is not None:
                        piece = self._piece(batch, raw)
                        # The next read is what a stream waits for most of its life: the
                        # chunks and bytes of this one are not held meanwhile.
                        batch = raw = None
                        if piece and upstream.ended:
                            last = piece
                        elif piece:
                            yield piece
                        del piece
                        if passed and self._writer is not None:
                            upstream.tap(self._deliver)  # until a read it cannot take
                        batch = await anext(batches, None)
                        raw = upstream.raw if passed else None
                    if attempt.seam is not None and not attempt.seam.end():
                        raise _SeamBroken
                except (UpstreamFailure, _SeamBroken) as failure:
                    if isinstance(failure, UpstreamFailure):
                        attempt.classification, attempt.failure = failure.classification, failure
                    else:
                        attempt.classification = _SEAM_BROKEN
                        attempt.error_code = "resume_seam_unverified"
                    await upstream.aclose()
                    try:
                        attempt = await self._drive(await self._attempt_failed(attempt))
                    except GatewayError as error:
                        finished = True
                        yield last + encode_json([{"error": _in_band(error, self.request_id)}])
                        return
                    continue
                break
            usage, cost = self._settlement(attempt.route, upstream.usage)
            await self._succeeded(
                attempt,
                usage=usage,
                cost=cost,
                finish_reason=upstream.finish_reason,
                response_id=upstream.response_id,
                response_model=self._response_model,
                upstream_request_id=upstream.upstream_request_id,
                http_status=200,
                time_to_first_chunk_ms=upstream.time_to_first_chunk_ms,
                invalid_events=upstream.invalid_events,
                response_bytes=upstream.response_bytes,
            )
            finished = True
            yield last + DONE_FRAME
        finally:
            if not finished:
                # The client went away (this task is being cancelled): record it anyway, in
                # a task of its own that the cancellation does not reach.
                self.gw._keep(self._client_left(attempt))
            if attempt.upstream is not None:
                await attempt.upstream.aclose()

    def _piece(self, batch: list[dict[str, Any]], raw: bytes | None) -> bytes:
        """A read's chunks as the client's bytes (``raw``, the upstream's, if given and
        nothing is dropped), without a usage chunk the client did not ask for; b"" if
        nothing is left."""
        self._note_delivered(batch)
        if not self.call.include_usage:
            kept = [chunk for chunk in batch if not _is_usage_chunk(chunk)]
            if len(kept) != len(batch):
                batch, raw = kept, None
        if not batch:
            return b""
        return raw if raw is not None else encode_json(batch)

    def _note_delivered(self, batch: list[dict[str, Any]]) -> None:
        """Keep the text the client has, for a resume; anything but the text of one choice
        (a tool call, a refusal, audio, a second choice) cannot be continued. A group none
        of whose mappings can resume keeps only the stream's id and model."""
        for chunk in batch:
            if self._chunk_id is None and isinstance(chunk.get("id"), str):
                self._chunk_id = chunk["id"]
            if self._response_model is None and isinstance(chunk.get("model"), str):
                self._response_model = chunk["model"]
            if not self._can_resume:
                continue
            for choice in chunk.get("choices") or ():
                if not isinstance(choice, dict):
                    continue
                delta = choice.get("delta")
                if choice.get("index", 0) != 0:
                    self._resumable = False
                if not isinstance(delta, dict):
                    continue
                content = delta.get("content")
                if isinstance(content, str):
                    self._delivered.append(content)
                for key in _OTHER_CONTENT_KEYS:
                    if delta.get(key):
                        self._resumable = False
                        break

    async def _attempt_failed(self, attempt: _Attempt) -> Failed:
        """Record a failed attempt — its end, its hold's outcome, its breakers — and say so
        to the walk."""
        classification, failure = attempt.classification, attempt.failure
        assert classification is not None
        self._close(attempt.attempt_id)
        upstream = attempt.upstream
        invalid = upstream.invalid_events if upstream is not None else 0
        self._pending.append(
            self._attempt_finished(attempt, classification, failure, invalid_events=invalid)
        )
        self._record(self._hold_outcome(attempt, classification))
        if classification.disables_endpoint and await self._disable(attempt, failure):
            pass  # disabled: no breaker of its endpoint counts a refused key
        elif classification is not _SEAM_BROKEN:
            first = upstream.time_to_first_chunk_ms if upstream is not None else None
            await self._report_breakers(attempt.route, classification, _latency_ms(attempt, first))
        status = failure.outcome.http_status if failure else None
        if status is None and attempt.stream_committed:
            status = 200
        self.tally.failed(
            AttemptSummary(attempt.route.choice.endpoint, status, classification.failure_class),
            classification,
        )
        self._failures[attempt.attempt_id] = attempt
        delivered = "".join(self._delivered)
        return Failed(
            attempt.attempt_id,
            classification,
            self._remaining_ms(),
            delivered_chars=len(delivered),
            resumable=self._resumable and classification is not _SEAM_BROKEN,
        )

    async def _disable(self, attempt: _Attempt, failure: UpstreamFailure | None) -> bool:
        outcome = failure.outcome if failure is not None else None
        return await self.gw.disabled.disable(
            attempt.route.choice.endpoint,
            http_status=outcome.http_status if outcome else None,
            error_code=(outcome.error_code or outcome.error_type) if outcome else None,
            request_id=self.request_id,
            attempt_id=attempt.attempt_id,
        )

    def _decided(self, attempt_id: str, decision: Decision) -> None:
        attempt = self._failures[attempt_id]
        assert attempt.classification is not None
        self._pending.append(self._failover_decided(attempt, attempt.classification, decision))

    def _walk_error(self, fail: Fail) -> GatewayError:
        """The error a request the walk ended is answered with."""
        failed = None
        if fail.attempt_id is not None:
            attempt = self._failures[fail.attempt_id]
            assert attempt.classification is not None
            failed = (attempt.classification, attempt.failure)
        return final_error(
            fail,
            committed=self.walk.committed,
            tally=self.tally,
            candidates=self._candidates,
            group=self.group.name,
            budget_refusal=self._budget_refusal,
            failed=failed,
        )

    def _failed_stream(self) -> dict[str, Any]:
        """The RequestFailed fields of a committed stream that ended in an error."""
        if not self.walk.committed:
            return {}
        endpoint = self._failures[next(reversed(self._failures))].route.choice.endpoint
        return {"endpoint": endpoint, "stream_started": True}

    async def _client_left(self, attempt: _Attempt) -> None:
        """The client closed a committed stream: a partial failure, never a success."""
        if self.ended:  # the client left while the success was being recorded
            return
        self.ended = True
        classification = _canceled_class()
        for other in self._take_open():
            self._discard(other)
            self._pending.append(self._attempt_finished(other, classification, None))
            if self.budget.has_hold(other.attempt_id):
                self._record(self._hold_outcome(other, classification))
        decision = Decision(action="stop", reason="stream_committed")
        self.tally.summaries.append(
            AttemptSummary(attempt.route.choice.endpoint, 200, classification.failure_class)
        )
        error = client_canceled("the client closed the stream")
        await self._flush(
            self._failover_decided(attempt, classification, decision),
            self._request_failed(
                error, endpoint=attempt.route.choice.endpoint, stream_started=True
            ),
        )

    # --- steps of the path ---

    async def _route(self, action: Route) -> Routed | Unroutable:
        """Find the mapping for the walk's next attempt: a retry or a resume asks only the
        breakers of the targets it names; any other purpose evaluates every mapping and
        chooses one (contract §4)."""
        if action.only is not None:
            disabled = await self.gw.disabled.current()
            for target in action.only:
                mapping = self.group.mappings[target.mapping_index]
                if target.endpoint in disabled:
                    continue
                if await self._acquire(target.endpoint, mapping):
                    self._routed = self._route_to(target, action.purpose)
                    return Routed(target)
            return Unroutable()
        config = self.gw.config
        self.context = action.context
        keys = [BreakerKey.endpoint(m.endpoint) for m in self.group.mappings] + [
            BreakerKey.mapping(m.endpoint, m.model) for m in self.group.mappings
        ]
        while True:
            if self._pending_effects:
                # A failed attempt's hold was just released or kept: the balances this
                # evaluation reads must include that.
                await self._flush()
            breaker_open = self._breaker_lookup(await self.gw.breakers.blocked(keys))
            saturated = await self._saturation_lookup()
            latencies = None
            if self.group.strategy == "least_latency":
                latencies = await self.gw.latency.read(self._places)
            disabled = await self.gw.disabled.current()
            # Priced as at this attempt's start: its reservation and its settlement use the
            # price in force now (contract §2, price history), whenever it ends.
            group = self.group.priced_at(datetime.now(UTC))
            candidates = evaluate(
                config,
                self.caller.workspace,
                group,
                self.requirements,
                action.context,
                breaker_open=breaker_open,
                over_budget=await self.budget.over_budget_check(),
                latencies=latencies,
                saturated=saturated,
                credentials_disabled=functools.partial(disabled_detail, disabled),
            )
            choice = select(candidates, self.gw._rr, self.caller.workspace.id, group)
            self.sequence += 1
            self._pending.append(
                route_evaluated(
                    self.request_id,
                    self.sequence,
                    candidates,
                    action.context,
                    choice,
                    group.strategy,
                )
            )
            if choice is None:
                over = [c for c in candidates if c.reason_code is ev.ReasonCode.OVER_BUDGET]
                if over and action.purpose != "hedge":
                    self._pending.append(self.budget.denied_candidate(over[0]))
                self._candidates = candidates
                return Unroutable()
            mapping = group.mappings[choice.mapping_index]
            if await self._acquire(choice.endpoint, mapping):
                driver = self.gw._drivers[choice.endpoint]
                endpoint = config.endpoint(choice.endpoint)
                assert endpoint is not None, "evaluate found the mapping's endpoint"
                worst = candidates[choice.mapping_index].worst_case_usd or Decimal(0)
                self._routed = _Route(choice, mapping, driver, endpoint.driver, "first", worst)
                return Routed(self._targets[choice.mapping_index])

    async def _saturation_lookup(self) -> Callable[[str], str | None] | None:
        """Which of the group's endpoints have their ``max_in_flight`` attempts in flight (a
        read; the slot is taken atomically at admission)."""
        if not self._limits:
            return None
        in_use = await self.gw.slots.in_use(list(self._limits))

        def saturated(endpoint_id: str) -> str | None:
            limit = self._limits.get(endpoint_id)
            if limit is None:
                return None
            taken = in_use.get(endpoint_id, 0)
            if endpoint_id not in self.saturated and taken < limit:
                return None
            return f"{max(taken, limit)} of {limit} in flight"

        return saturated

    async def _acquire(self, endpoint_id: str, mapping: ModelMapping) -> bool:
        """Take a slot of the endpoint (its ``max_in_flight``), then its breakers' admission;
        False (nothing kept) if either refuses: evaluate again with it counted as such."""
        limit = self._limits.get(endpoint_id)
        slot = None
        if limit is not None:
            slot = new_id("slot")
            if not await self.gw.slots.take(endpoint_id, slot, limit):
                self.saturated.add(endpoint_id)
                return False
        if not await self._admitted(endpoint_id, mapping):
            if slot is not None:
                self._give_back(endpoint_id, slot)
            return False
        self._routed_slot = slot
        return True

    def _route_to(self, target: Target, purpose: Purpose) -> _Route:
        """The route of a retry (the failed attempt's own) or a resume (priced now, with the
        delivered text counted in its input: it is sent back as the partial answer)."""
        if purpose == "retry":
            failed = next(
                a.route
                for a in reversed(self._failures.values())
                if a.route.choice.mapping_index == target.mapping_index
            )
            return failed
        group = self.group.priced_at(datetime.now(UTC))
        mapping = group.mappings[target.mapping_index]
        endpoint = self.gw.config.endpoint(target.endpoint)
        assert endpoint is not None
        requirements = self.requirements.model_copy(
            update={
                "estimated_input_tokens": self.requirements.estimated_input_tokens
                + len("".join(self._delivered).encode())
            }
        )
        worst = worst_case_cost(mapping, requirements, endpoint.driver)
        choice = ev.RouteChoice(
            endpoint=target.endpoint,
            model=mapping.model,
            mapping_index=target.mapping_index,
            tier=mapping.tier,
            weight=mapping.weight,
            selection_position=0,
        )
        driver = self.gw._drivers[target.endpoint]
        return _Route(choice, mapping, driver, endpoint.driver, "first", worst)

    def _breaker_lookup(
        self, blocked: Mapping[BreakerKey, bool]
    ) -> Callable[[str, ModelMapping], str | None]:
        def breaker_open(endpoint_id: str, mapping: ModelMapping) -> str | None:
            endpoint_key = BreakerKey.endpoint(endpoint_id)
            if blocked.get(endpoint_key) or endpoint_key in self.denied:
                return "endpoint"
            mapping_key = BreakerKey.mapping(endpoint_id, mapping.model)
            if blocked.get(mapping_key) or mapping_key in self.denied:
                return "mapping"
            return None

        return breaker_open

    async def _admitted(self, endpoint_id: str, mapping: ModelMapping) -> bool:
        # blocked() was a read; the half-open probe is taken atomically here, and a lost
        # race for it sends us back to evaluation with that breaker counted as open.
        probes: list[str] = []
        for key in (
            BreakerKey.endpoint(endpoint_id),
            BreakerKey.mapping(endpoint_id, mapping.model),
        ):
            admission, transitions = await self.gw.breakers.admit(key)
            await self.gw._record_transitions(transitions, self.request_id)
            if admission is Admission.DENIED:
                self.denied.add(key)
                return False
            if admission is Admission.PROBE:
                probes.append(key.scope)
        # What the attempt was admitted under, for its start: closed, or the half-open probe.
        self._admitted_as = "probe:" + "+".join(probes) if probes else "closed"
        return True

    async def _start(self, action: Start) -> Started | BudgetRaced:
        """Reserve the attempt's worst case and record its start; BudgetRaced if the books
        refused the reservation (another request got there first)."""
        assert self._routed is not None, "a start follows its route"
        route = evolve(self._routed, cause=action.cause)
        attempt_id = new_id("att")
        endpoint = self.gw.config.endpoint(route.choice.endpoint)
        assert endpoint is not None
        reservation = self.budget.reserve(
            attempt_id, route.choice.endpoint, route.mapping.model, route.worst_case_usd
        )
        started = attempt_started(
            self.request_id,
            attempt_id,
            self.attempt_count + 1,
            route.cause,
            route.choice,
            route.mapping.model,
            endpoint.driver,
            reservation.events[0].reservation_id,  # type: ignore[attr-defined]
            _server_address(endpoint.base_url),
            self.call.stream,
            action.kind,
            action.resumed_from,
            action.delivered_chars,
            action.hedge_of,
            self._admitted_as,
        )
        seam = None
        if action.kind == "resume":
            seam = Seam("".join(self._delivered))
        call = None
        try:
            submitted = await self._submit(started, step=reservation)
            assert submitted is not None
            # While the start commits, the upstream request is built, to be sent once the
            # start is durable. One that cannot be built fails where the attempt runs.
            await _let_the_appender_send()
            with contextlib.suppress(Exception):
                call = self._prepare(route, attempt_id, seam)
            await self._committed(submitted)
        except LedgerUnavailable:
            self.budget.forget(attempt_id)  # no reservation, so no upstream call
            self._give_back_routed(route)
            raise
        except BudgetDenied as refusal:
            self.budget.forget(attempt_id)
            self._give_back_routed(route)
            self._pending.append(
                self.budget.denied(refusal, route.choice.endpoint, route.mapping.model)
            )
            self._budget_refusal = str(refusal)
            return BudgetRaced()
        self.attempt_count += 1
        attempt = _Attempt(route, attempt_id, time.monotonic(), call, kind=action.kind, seam=seam)
        attempt.stream_committed = action.kind == "resume"  # its text goes straight out
        attempt.slot, self._routed_slot = self._routed_slot, None
        self.open[attempt_id] = attempt
        return Started(attempt_id, action.target, action.kind)

    def _chat_request(self, route: _Route, seam: Seam | None = None) -> ChatRequest:
        max_tokens = self.call.max_tokens
        if max_tokens is None and route.driver.requires_max_tokens:
            # The bound the worst case reserved for, not a driver's default.
            max_tokens = route.mapping.max_output_tokens
        body: Mapping[str, Any] = self.call.body
        if seam is not None:
            body = continuation_body(body, route.mapping.resume, seam.delivered)
        return ChatRequest(
            body=body,
            upstream_model=route.mapping.model,
            max_tokens=max_tokens,
            stream=self.call.stream,
        )

    def _prepare(self, route: _Route, attempt_id: str, seam: Seam | None = None) -> PreparedCall:
        return route.driver.prepare(
            self._chat_request(route, seam), self._binding(route, attempt_id)
        )

    def _call(self, attempt: _Attempt) -> PreparedCall:
        """The attempt's upstream call: the one built while its start committed, else built
        now (raising what building raises)."""
        return attempt.call or self._prepare(attempt.route, attempt.attempt_id, attempt.seam)

    def _binding(self, route: _Route, attempt_id: str) -> AttemptBinding:
        """The attempt's endpoint and timeouts, as of its start (the request's deadline
        bounds the attempt all the same: ``_run_attempt``)."""
        endpoint = self.gw.config.endpoint(route.choice.endpoint)
        assert endpoint is not None
        remaining_s = max(0.001, self.deadline - time.monotonic())
        defaults = self.defaults
        # contract §8: the upstream joins the request's trace (the caller's, if it sent one) as a
        # child of this attempt's span, whose id otel/ derives from the attempt id.
        trace = self.call.trace
        trace_id = request_trace_id(self.request_id, trace.trace_id if trace else None)
        return AttemptBinding(
            endpoint=endpoint,
            upstream_model=route.mapping.model,
            attempt_id=attempt_id,
            timeouts=AttemptTimeouts(
                attempt_timeout_s=min(defaults.attempt_timeout_ms / 1000, remaining_s),
                first_token_timeout_s=min(defaults.first_token_timeout_ms / 1000, remaining_s),
                stream_idle_timeout_s=defaults.stream_idle_timeout_ms / 1000,
            ),
            traceparent=upstream_traceparent(trace_id, attempt_span_id(attempt_id)),
            tracestate=trace.tracestate if trace else None,
        )

    def _settlement(
        self, route: _Route, reported: ev.Usage | None
    ) -> tuple[ev.Usage | None, Decimal | None]:
        """What the attempt is billed for (the usage the upstream reported, plus what it
        bills without reporting) and its cost, dimension by dimension at the mapping's
        rates (contract §6); (None, None) when the upstream did not say."""
        if reported is None:
            return None, None
        usage = billed_usage(reported, self.requirements, route.driver_name)
        return usage, usage_cost(usage, settlement_rates(route.mapping))

    async def _succeeded(
        self,
        attempt: _Attempt,
        *,
        usage: ev.Usage | None,
        cost: Decimal | None,
        finish_reason: str | None,
        response_id: str | None,
        response_model: str | None,
        upstream_request_id: str | None,
        http_status: int,
        time_to_first_chunk_ms: int | None = None,
        invalid_events: int = 0,
        response_bytes: int = 0,
    ) -> None:
        route = attempt.route
        self._close(attempt.attempt_id)
        self.ended = True
        self.tally.summaries.append(AttemptSummary(route.choice.endpoint, http_status, None))
        end = AttemptEnd(
            "succeeded",
            ev.Evidence.STARTED,
            http_status=http_status,
            usage=usage,
            upstream_request_id=upstream_request_id,
            response_id=response_id,
            response_model=response_model,
            finish_reason=finish_reason,
            time_to_first_chunk_ms=time_to_first_chunk_ms,
            stream_committed=attempt.stream_committed,
            invalid_events=invalid_events,
            invalid_output=attempt.invalid_output,
            response_bytes=response_bytes,
        )
        self._pending.append(
            attempt_finished(self.request_id, attempt.attempt_id, end, self._took(attempt))
        )
        if usage is not None and cost is not None:
            self._record(self.budget.settle(attempt.attempt_id, cost, usage))
        else:  # the upstream answered but did not say what it used
            self._record(self.budget.hold_unknown(attempt.attempt_id, "usage_not_reported"))
        completed = request_completed(
            self.request_id,
            route.choice.endpoint,
            route.mapping.model,
            self.attempt_count,
            usage,
            cost,
            finish_reason,
            self._elapsed_ms(),
        )
        try:
            submitted = await self._submit(completed)
            assert submitted is not None
            try:
                # While it commits, the breakers hear of the success: the upstream answered,
                # whatever the ledger says next.
                await _let_the_appender_send()
                await self._report_breakers(
                    route, None, _latency_ms(attempt, time_to_first_chunk_ms)
                )
            finally:
                await self._committed(submitted)
        except LedgerUnavailable:
            # The answer cannot be acknowledged unrecorded, so the client gets a 503; the
            # attempt and its cost are still recorded once the ledger is back.
            self.gw._keep(self._flush_patiently(self._request_failed(ledger_unavailable())))
            raise

    def _attempt_finished(
        self,
        attempt: _Attempt,
        classification: Classification,
        failure: UpstreamFailure | None,
        *,
        invalid_events: int = 0,
    ) -> ev.AttemptFinished:
        result = attempt.result  # an answer that failed its request's output validation
        end = failed_end(
            classification,
            failure,
            result,
            attempt.upstream,  # a stream, broken after its first content
            usage=self._settlement(attempt.route, result.usage)[0] if result else None,
            response_model=self._response_model,
            stream_committed=attempt.stream_committed,
            invalid_events=invalid_events,
            invalid_output=attempt.invalid_output,
            response_bytes=attempt.response_bytes(),
        )
        return attempt_finished(self.request_id, attempt.attempt_id, end, self._took(attempt))

    def _hold_outcome(self, attempt: _Attempt, classification: Classification) -> StepRecord:
        """A failed attempt's hold: released if the upstream never started, otherwise kept
        as an unknown-usage settlement (contract §6) — a failover must fit in what is left."""
        if classification.evidence is ev.Evidence.NOT_STARTED:
            return self.budget.release(attempt.attempt_id, "not_started")
        if attempt.result is not None:  # it answered (invalid_output), and said what it used
            usage, cost = self._settlement(attempt.route, attempt.result.usage)
            if usage is not None and cost is not None:
                return self.budget.settle(attempt.attempt_id, cost, usage)
        cause = "broken_stream" if attempt.stream_committed else classification.failure_class
        return self.budget.hold_unknown(attempt.attempt_id, cause)

    def _failover_decided(
        self, attempt: _Attempt, classification: Classification, decision: Decision
    ) -> ev.FailoverDecided:
        return failover_decided(
            self.request_id,
            attempt.attempt_id,
            classification,
            decision,
            attempts_left=self.defaults.max_attempts - self.attempt_count,
            deadline_left_ms=self._remaining_ms(),
        )

    # --- endings ---

    async def _fail(
        self, error: GatewayError, *, endpoint: str | None = None, stream_started: bool = False
    ) -> GatewayError:
        """Record the request's failure; returns the error for the caller to raise."""
        error.with_attempts(tuple(self.tally.summaries))
        self.ended = True
        failed = self._request_failed(error, endpoint=endpoint, stream_started=stream_started)
        try:
            await self._flush(failed)
        except LedgerUnavailable:
            self.gw._keep(self._flush_patiently(failed))
            raise
        return error

    def _request_failed(
        self, error: GatewayError, *, endpoint: str | None = None, stream_started: bool = False
    ) -> ev.RequestFailed:
        return request_failed(
            self.request_id,
            error,
            self.attempt_count,
            self._elapsed_ms(),
            endpoint=endpoint,
            stream_started=stream_started,
        )

    async def _report_breakers(
        self, route: _Route, classification: Classification | None, latency_ms: int
    ) -> None:
        """Tell the breakers an attempt's outcome (None: a success) and its latency, which
        makes a call slow under a rolling policy (contract §5)."""
        endpoint_key = BreakerKey.endpoint(route.choice.endpoint)
        mapping_key = BreakerKey.mapping(route.choice.endpoint, route.mapping.model)
        transitions: list[Transition] = []
        breakers = self.gw.breakers
        if classification is None:
            transitions += await breakers.record_success(endpoint_key, duration_ms=latency_ms)
            transitions += await breakers.record_success(mapping_key, duration_ms=latency_ms)
        elif classification.breaker_scope is not None:
            key = endpoint_key if classification.breaker_scope == "endpoint" else mapping_key
            transitions += await breakers.record_failure(
                key,
                classification.failure_class.value,
                opens_at_once=classification.breaker_opens_at_once,
                retry_after_ms=classification.retry_after_ms,
                duration_ms=latency_ms,
            )
        await self.gw._record_transitions(transitions, self.request_id)


class _Mailbox:
    """What a run's attempts and its hedge timer report, in order, to the one task that
    drives it: an ``asyncio.Queue`` without its unbounded-capacity machinery (a run holds
    one for its whole life, and a long stream's memory is mostly what it holds)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[_Attempt | None] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: _Attempt | None) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> _Attempt | None:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


# --- small pure helpers ---


async def _let_the_appender_send() -> None:
    """One turn of the loop, after a submit: the appender, woken by it, takes the batch and
    sends it to the database before this task goes on, so that what the task does next
    overlaps the commit instead of delaying it."""
    await asyncio.sleep(0)


async def _first_content(
    batches: AsyncIterator[list[dict[str, Any]]], upstream: DriverStream | None
) -> tuple[list[dict[str, Any]], bytes | None]:
    """Pull chunks until one carries content (contract §5); return all pulled so far, and
    (given the upstream whose batches they are) the same as its bytes, if it has them all."""
    held: list[dict[str, Any]] = []
    raw: list[bytes] | None = [] if upstream is not None else None
    async for batch in batches:
        held += batch
        if raw is not None:
            piece = upstream.raw if upstream is not None else None
            raw = None if piece is None else [*raw, piece]
        if any(_has_content(chunk) for chunk in batch):
            break
    return held, None if raw is None else b"".join(raw)


def _has_content(chunk: Mapping[str, Any]) -> bool:
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("finish_reason"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and any(delta.get(key) for key in _CONTENT_KEYS):
            return True
    return False


# What in a delta is content the client must see (text, a tool call, a refusal, spoken
# audio, the legacy function call): the first of these commits the stream.
_CONTENT_KEYS: Final = ("content", "tool_calls", "refusal", "audio", "function_call")
_OTHER_CONTENT_KEYS: Final = _CONTENT_KEYS[1:]  # what a resume cannot continue


def _is_usage_chunk(chunk: Mapping[str, Any]) -> bool:
    # The final usage chunk the gateway asked for on its own account (choices == []).
    return chunk.get("choices") == [] and chunk.get("usage") is not None


def _deadline_class() -> Classification:
    return _DEADLINE


# A resume whose continuation cannot be joined to what the client has: the upstream did
# answer (its usage is held unknown), and nothing more can be done for the stream.
_SEAM_BROKEN: Final = Classification(
    failure_class=ev.FailureClass.UPSTREAM_UNAVAILABLE,
    evidence=ev.Evidence.STARTED,
    breaker_scope=None,
    breaker_opens_at_once=False,
    may_fail_over="no",
)


def _continued(chunk: dict[str, Any], seam: Seam, chunk_id: str | None) -> dict[str, Any] | None:
    """A continuation's chunk as the client's stream goes on (None: nothing left of it)."""
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices:
        return _with_id(chunk, chunk_id)  # the usage chunk
    choice = choices[0]
    if not isinstance(choice, dict) or not isinstance(choice.get("delta"), dict):
        return _with_id(chunk, chunk_id)
    delta = {k: v for k, v in choice["delta"].items() if k != "role"}
    content = delta.get("content")
    if isinstance(content, str):
        delta["content"] = seam.feed(content)
        if not delta["content"]:
            del delta["content"]
    if not delta and not choice.get("finish_reason") and chunk.get("usage") is None:
        return None
    return _with_id({**chunk, "choices": [{**choice, "delta": delta}, *choices[1:]]}, chunk_id)


def _with_id(chunk: dict[str, Any], chunk_id: str | None) -> dict[str, Any]:
    if chunk_id is None or "id" not in chunk:
        return chunk
    return {**chunk, "id": chunk_id}


def _in_band(error: GatewayError, request_id: str) -> dict[str, Any]:
    """The final SSE error event's ``error`` member."""
    return {
        "code": error.code,
        "message": error.message,
        "type": error.error_type,
        "request_id": request_id,
    }


def _canceled_class(evidence: ev.Evidence = ev.Evidence.STARTED) -> Classification:
    return Classification(
        failure_class=ev.FailureClass.CLIENT_CANCELED,
        evidence=evidence,
        breaker_scope=None,
        breaker_opens_at_once=False,
        may_fail_over="no",
    )


def _loop_time(deadline: float) -> float:
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())


@functools.lru_cache(maxsize=256)
def _server_address(base_url: str) -> tuple[str | None, int]:
    """OpenTelemetry's ``server.address`` and ``server.port`` for an endpoint (cached: the
    same few URLs, parsed on every attempt's start)."""
    parts = urlsplit(base_url)
    if parts.port is not None:
        return parts.hostname, parts.port
    return parts.hostname, 443 if parts.scheme == "https" else 80


def _optional_str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("recording the end of a request failed", exc_info=task.exception())


def _latency_ms(attempt: _Attempt, time_to_first_chunk_ms: int | None) -> int:
    """What makes a call slow for the breakers: a stream's time to its first chunk; a
    buffered call's (or a stream's that never had one) time until it ended."""
    if time_to_first_chunk_ms is not None:
        return time_to_first_chunk_ms
    return round((time.monotonic() - attempt.started_at) * 1000)
