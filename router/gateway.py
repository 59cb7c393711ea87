"""The request path: evaluate → select → attempt → decide, with every step on the ledger.

:class:`Gateway` owns what lives as long as a config generation: the config, one driver
per endpoint, the breaker board, the weighted round-robin state. Each request is one
:class:`_Run`, which walks contract §4's path using the pure decisions of
:mod:`router.routing` and records each fact in the request's stream (``request-<id>``).

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
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Final, Literal, TypeVar
from urllib.parse import urlsplit

from ledger import events as ev
from ledger.accounting import BudgetDenied, Effect, HoldStateError, Reserve, usage_cost
from ledger.apikeys import key_stream
from ledger.store import (
    ANY_VERSION,
    NO_STREAM,
    EventStore,
    LedgerUnavailable,
    RecordedEvent,
    WrongExpectedVersion,
)
from otel.ids import attempt_span_id, request_trace_id, upstream_traceparent
from router.breakers import Admission, BreakerBoard, BreakerKey, Transition
from router.budgets import RequestBudget, StepRecord
from router.chat import ChatCall, HeaderNarrowing
from router.classify import Classification
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
from router.errors import (
    AttemptSummary,
    ErrorCode,
    GatewayError,
    budget_exceeded,
    client_canceled,
    deadline_exceeded,
    error_for_failure,
    internal_error,
    ledger_unavailable,
    no_eligible_route,
    stream_broken,
    upstream_unavailable,
)
from router.ids import new_id
from router.routing import (
    AttemptOutcome,
    Decision,
    RouteContext,
    WeightedRoundRobin,
    decide,
    evaluate,
    next_context,
    select,
)
from router.sse import DONE_FRAME, encode_json
from router.worst_case import billed_usage, settlement_rates

__all__ = ["Caller", "Completion", "Gateway", "KeyMoved", "StreamingCompletion"]

log = logging.getLogger("waybill.gateway")

_T = TypeVar("_T")

_MAX_BUDGET_RACES: Final = 5  # reservations lost to concurrent requests before giving up

_DEADLINE: Final = Classification(
    failure_class=ev.FailureClass.DEADLINE_EXCEEDED,
    evidence=ev.Evidence.UNKNOWN,
    breaker_scope=None,
    breaker_opens_at_once=False,
    may_fail_over="no",
)


@dataclass(frozen=True, slots=True)
class Caller:
    """The authenticated key behind a request."""

    key_id: str
    workspace: Workspace
    role: str
    key_budget: tuple[Decimal, Literal["day", "month", "total"]] | None = None  # own budget
    key_version: int | None = None
    """The key's ledger stream's version when it was read unrevoked: the request's first
    append requires the stream still there (None: requires nothing)."""


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


@dataclass(frozen=True, slots=True)
class _Route:
    """One attempt's binding: chosen at selection, never redirected by a config reload."""

    choice: ev.RouteChoice
    mapping: ModelMapping
    driver: Driver
    driver_name: DriverName  # the endpoint's `driver`: what it sends on, so may be billed
    cause: Literal["first", "retry", "failover"]
    worst_case_usd: Decimal


@dataclass(slots=True)
class _Attempt:
    route: _Route
    attempt_id: str
    started_at: float
    call: PreparedCall | None  # built while its start committed (None: build it to send)
    stream_committed: bool = False


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


@dataclass(slots=True)
class _Tally:
    """What the run has seen so far, for the final answer."""

    summaries: list[AttemptSummary] = field(default_factory=list)
    classes: list[ev.FailureClass] = field(default_factory=list)
    retry_after_ms: int | None = None
    retries: dict[str, int] = field(default_factory=dict)  # endpoint -> same-endpoint retries


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
    ) -> None:
        self.config = config
        self.store = store
        self.breakers = breakers
        self.instance_id = instance_id or new_id("gw")  # owner of the holds it takes
        self._drivers = dict(drivers) if drivers else {}
        for endpoint in config.endpoints:
            if endpoint.id not in self._drivers:
                self._drivers[endpoint.id] = driver_for(endpoint.driver)
        self._rr = WeightedRoundRobin()
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

    def models_for(self, workspace: Workspace) -> list[ModelGroup]:
        return [g for g in self.config.models if g.name in workspace.models]

    async def complete(
        self, caller: Caller, call: ChatCall, headers: HeaderNarrowing, request_id: str
    ) -> Completion:
        """Serve a buffered request, or raise :class:`GatewayError` (already recorded)."""
        return await _Run(self, caller, call, headers, request_id).complete()

    async def stream(
        self, caller: Caller, call: ChatCall, headers: HeaderNarrowing, request_id: str
    ) -> StreamingCompletion:
        """Route a streamed request up to its first content chunk; then the body follows."""
        return await _Run(self, caller, call, headers, request_id).stream()

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
        events = [
            ev.BreakerTransitioned(
                scope=t.key.scope,
                target=t.key.target,
                from_state=t.from_state,
                to_state=t.to_state,
                failure_class=ev.FailureClass(t.failure_class) if t.failure_class else None,
                consecutive_failures=t.consecutive_failures,
                cooldown_ms=t.cooldown_ms,
                config_generation=self.config.generation,
                request_id=request_id,
            )
            for t in transitions
        ]
        await self.store.append("breaker", ANY_VERSION, events)


class _Run:
    """One request's walk through contract §4's path."""

    def __init__(
        self,
        gateway: Gateway,
        caller: Caller,
        call: ChatCall,
        headers: HeaderNarrowing,
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
        self.requirements = call.requirements(caller.workspace, headers)
        self.defaults = config.policy_for(group.name)
        deadline_ms = self.defaults.deadline_ms
        if headers.deadline_ms is not None:
            deadline_ms = min(deadline_ms, headers.deadline_ms)  # a header may only narrow
        self.started = time.monotonic()
        self.deadline = self.started + deadline_ms / 1000
        self.context = RouteContext()
        self.sequence = 0
        self.attempt_count = 0
        self.tally = _Tally()
        self.denied: set[BreakerKey] = set()
        self.budget = RequestBudget(
            gateway.store,
            request_id=request_id,
            workspace=caller.workspace,
            key_id=caller.key_id,
            key_budget=caller.key_budget,
            model_group=group.name,
            request_limit=headers.max_cost_usd,
            owner=gateway.instance_id,
        )
        self.budget_denials = 0
        self._pending_effects: list[Effect] = []
        self.in_flight: _Attempt | None = None  # started, not yet finished
        self.ended = False  # RequestCompleted or RequestFailed is recorded (or on its way)
        self._stream_id = f"request-{request_id}"
        self._version = NO_STREAM
        self._unsure: _Unsure | None = None  # an append whose commit answer was lost
        self._requires: dict[str, int] | None = None  # what the first append requires
        if caller.key_version is not None:
            self._requires = {key_stream(caller.key_id): caller.key_version}
        self._metadata = {"config_generation": config.generation}
        caller_trace = _parse_traceparent(headers.traceparent)
        self.caller_trace_id = caller_trace[0] if caller_trace else None
        # W3C: a tracestate goes with the traceparent it came with, never alone.
        self.caller_tracestate = headers.tracestate if caller_trace else None
        self._pending: list[ev.Event] = [
            ev.RequestReceived(
                request_id=request_id,
                workspace=caller.workspace.id,
                key_id=caller.key_id,
                model_group=group.name,
                requirements=self.requirements,
                config_generation=config.generation,
                prompt_sha256=call.prompt_sha256,
                prompt_bytes=call.prompt_bytes,
                message_count=call.message_count,
                idempotency_key_sha256=None,
                trace_id=caller_trace[0] if caller_trace else None,
                parent_span_id=caller_trace[1] if caller_trace else None,
            )
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
                self._pending.append(
                    ev.AttemptFinished(
                        request_id=self.request_id,
                        attempt_id=hold.attempt_id,
                        status="failed",
                        evidence=ev.Evidence.NOT_STARTED,
                        error_code=ErrorCode.LEDGER_UNAVAILABLE,
                        duration_ms=0,
                    )
                )
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
        attempt, self.in_flight = self.in_flight, None
        if attempt is not None:
            if canceled:
                classification = _canceled_class(ev.Evidence.UNKNOWN)
                self._pending.append(self._attempt_finished(attempt, classification, None))
            else:
                self._pending.append(
                    ev.AttemptFinished(
                        request_id=self.request_id,
                        attempt_id=attempt.attempt_id,
                        status="failed",
                        evidence=ev.Evidence.UNKNOWN,
                        error_code="gateway_error",
                        duration_ms=round((time.monotonic() - attempt.started_at) * 1000),
                        stream_committed=attempt.stream_committed,
                    )
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

    async def _until_answered(
        self, attempt_once: Callable[[_Route, _Attempt], Awaitable[_T]]
    ) -> tuple[_Route, _Attempt, _T]:
        """contract §4's loop: route, start an attempt, run it within the deadline; on a failure
        decide, then retry the route, fail over, or stop (``_failed`` raises the final
        error). Returns the attempt that answered and what it returned."""
        route: _Route | None = None
        while True:
            route = route or await self._next_route()
            attempt = await self._start(route)
            if attempt is None:
                route = None
                continue
            try:
                async with asyncio.timeout_at(_loop_time(self.deadline)):
                    return route, attempt, await attempt_once(route, attempt)
            except UpstreamFailure as failure:
                route = await self._failed(attempt, failure.classification, failure)
            except TimeoutError:
                route = await self._failed(attempt, _deadline_class(), None)

    async def _complete(self) -> Completion:
        async def call(route: _Route, attempt: _Attempt) -> DriverResult:
            return await route.driver.complete(self._call(attempt))

        route, attempt, result = await self._until_answered(call)
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
        )
        return Completion(
            self.request_id, result.response, route.choice.endpoint, self.attempt_count, cost
        )

    async def _stream(self) -> StreamingCompletion:
        async def open_until_content(
            route: _Route, attempt: _Attempt
        ) -> tuple[DriverStream, AsyncIterator[list[dict[str, Any]]], list[dict[str, Any]]]:
            upstream = await route.driver.stream(self._call(attempt))
            try:
                batches = upstream.batches()
                return upstream, batches, await _first_content(batches)
            except BaseException:
                await upstream.aclose()
                raise

        route, attempt, (upstream, batches, held) = await self._until_answered(open_until_content)
        try:
            # The ledger learns that the stream is the client's before the client's first
            # byte (its headers go out once this returns): a gateway that dies from here on
            # leaves a partial failure, and crash recovery can tell (ledger.recovery).
            await self._flush(
                ev.StreamCommitted(
                    request_id=self.request_id,
                    attempt_id=attempt.attempt_id,
                    endpoint=route.choice.endpoint,
                    time_to_first_chunk_ms=upstream.time_to_first_chunk_ms,
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
        return StreamingCompletion(
            self.request_id,
            route.choice.endpoint,
            self.attempt_count,
            self._stream_body(attempt, upstream, batches, held),
        )

    def _not_committed(self, attempt: _Attempt, upstream: DriverStream) -> None:
        """The stream's commit could not be recorded (the ledger is unavailable): the client
        gets the 503, nothing of the stream. The upstream did start, so the attempt's hold
        stays counted as unknown usage; the end is recorded once the ledger is back."""
        self.in_flight, self.ended = None, True
        self._pending.append(
            ev.AttemptFinished(
                request_id=self.request_id,
                attempt_id=attempt.attempt_id,
                status="failed",
                evidence=ev.Evidence.STARTED,
                error_code=ErrorCode.LEDGER_UNAVAILABLE,
                duration_ms=round((time.monotonic() - attempt.started_at) * 1000),
                time_to_first_chunk_ms=upstream.time_to_first_chunk_ms,
            )
        )
        self._record(self.budget.hold_unknown(attempt.attempt_id, "ledger_unavailable"))
        self.gw._keep(self._flush_patiently(self._request_failed(ledger_unavailable())))

    async def _stream_body(
        self,
        attempt: _Attempt,
        upstream: DriverStream,
        batches: AsyncIterator[list[dict[str, Any]]],
        held: list[dict[str, Any]],
    ) -> AsyncGenerator[bytes, None]:
        """The client's bytes: a read's chunks go out together, as one piece. The read that
        ended the upstream's stream (its finish chunk, usage and end) goes out with the
        gateway's own end, once the completion is recorded, as a buffered answer does: one
        piece and one write fewer per stream."""
        include_usage = self.call.include_usage
        finished = False
        last = b""
        try:
            batch: list[dict[str, Any]] | None = held
            while batch is not None:
                if not include_usage:
                    batch = [chunk for chunk in batch if not _is_usage_chunk(chunk)]
                if batch:
                    if upstream.ended:
                        last = encode_json(batch)
                    else:
                        yield encode_json(batch)
                batch = await anext(batches, None)
            usage, cost = self._settlement(attempt.route, upstream.usage)
            await self._succeeded(
                attempt,
                usage=usage,
                cost=cost,
                finish_reason=upstream.finish_reason,
                response_id=upstream.response_id,
                response_model=None,
                upstream_request_id=upstream.upstream_request_id,
                http_status=200,
                time_to_first_chunk_ms=upstream.time_to_first_chunk_ms,
                invalid_events=upstream.invalid_events,
            )
            finished = True
            yield last + DONE_FRAME
        except UpstreamFailure as failure:
            finished = True
            error = await self._broken_stream(attempt, failure.classification, failure, upstream)
            detail = {
                "code": error.code,
                "message": error.message,
                "type": error.error_type,
                "request_id": self.request_id,
            }
            yield last + encode_json([{"error": detail}])
        finally:
            if not finished:
                # The client went away (this task is being cancelled): record it anyway, in
                # a task of its own that the cancellation does not reach.
                self.gw._keep(self._broken_stream(attempt, _canceled_class(), None, upstream))
            await upstream.aclose()

    # --- steps of the path ---

    async def _next_route(self) -> _Route:
        """Evaluate every mapping, choose one and bind the attempt to it (contract §4)."""
        config = self.gw.config
        keys = [BreakerKey.endpoint(m.endpoint) for m in self.group.mappings] + [
            BreakerKey.mapping(m.endpoint, m.model) for m in self.group.mappings
        ]
        while True:
            if self._pending_effects:
                # A failed attempt's hold was just released or kept: the balances this
                # evaluation reads must include that.
                await self._flush()
            breaker_open = self._breaker_lookup(await self.gw.breakers.blocked(keys))
            # Priced as at this attempt's start: its reservation and its settlement use the
            # price in force now (contract §2, price history), whenever it ends.
            group = self.group.priced_at(datetime.now(UTC))
            candidates = evaluate(
                config,
                self.caller.workspace,
                group,
                self.requirements,
                self.context,
                breaker_open=breaker_open,
                over_budget=await self.budget.over_budget_check(),
            )
            choice = select(candidates, self.gw._rr, self.caller.workspace.id, group)
            self.sequence += 1
            self._pending.append(
                ev.RouteEvaluated(
                    request_id=self.request_id,
                    sequence=self.sequence,
                    candidates=candidates,
                    tried_endpoints=tuple(sorted(self.context.tried_endpoints)),
                    chosen=choice,
                )
            )
            if choice is None:
                over = [c for c in candidates if c.reason_code is ev.ReasonCode.OVER_BUDGET]
                if over:
                    self._pending.append(self.budget.denied_candidate(over[0]))
                raise await self._fail(self._no_route_error(candidates))
            mapping = group.mappings[choice.mapping_index]
            if await self._admitted(choice.endpoint, mapping):
                driver = self.gw._drivers[choice.endpoint]
                endpoint = config.endpoint(choice.endpoint)
                assert endpoint is not None, "evaluate found the mapping's endpoint"
                worst = candidates[choice.mapping_index].worst_case_usd or Decimal(0)
                cause: Literal["first", "failover"] = (
                    "first" if self.attempt_count == 0 else "failover"
                )
                return _Route(choice, mapping, driver, endpoint.driver, cause, worst)

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
        for key in (
            BreakerKey.endpoint(endpoint_id),
            BreakerKey.mapping(endpoint_id, mapping.model),
        ):
            admission, transitions = await self.gw.breakers.admit(key)
            await self.gw._record_transitions(transitions, self.request_id)
            if admission is Admission.DENIED:
                self.denied.add(key)
                return False
        return True

    async def _start(self, route: _Route) -> _Attempt | None:
        """Reserve the attempt's worst case and record its start; None if the books refused
        the reservation (another request got there first): evaluate again."""
        attempt_id = new_id("att")
        endpoint = self.gw.config.endpoint(route.choice.endpoint)
        assert endpoint is not None
        host, port = _server_address(endpoint.base_url)
        reservation = self.budget.reserve(
            attempt_id, route.choice.endpoint, route.mapping.model, route.worst_case_usd
        )
        started = ev.AttemptStarted(
            request_id=self.request_id,
            attempt_id=attempt_id,
            attempt_number=self.attempt_count + 1,
            cause=route.cause,
            endpoint=route.choice.endpoint,
            driver=endpoint.driver,
            model=route.mapping.model,
            tier=route.choice.tier,
            weight=route.choice.weight,
            reservation_id=reservation.events[0].reservation_id,  # type: ignore[attr-defined]
            server_address=host,
            server_port=port,
            stream=self.call.stream,
        )
        call = None
        try:
            submitted = await self._submit(started, step=reservation)
            assert submitted is not None
            # While the start commits, the upstream request is built, to be sent once the
            # start is durable. One that cannot be built fails where the attempt runs.
            await _let_the_appender_send()
            with contextlib.suppress(Exception):
                call = self._prepare(route, attempt_id)
            await self._committed(submitted)
        except LedgerUnavailable:
            self.budget.forget(attempt_id)  # no reservation, so no upstream call
            raise
        except BudgetDenied as refusal:
            self.budget.forget(attempt_id)
            self._pending.append(
                self.budget.denied(refusal, route.choice.endpoint, route.mapping.model)
            )
            self.budget_denials += 1
            if self.budget_denials > _MAX_BUDGET_RACES:
                raise await self._fail(budget_exceeded(str(refusal))) from None
            return None
        self.attempt_count += 1
        attempt = _Attempt(route, attempt_id, time.monotonic(), call)
        self.in_flight = attempt
        return attempt

    def _chat_request(self, route: _Route) -> ChatRequest:
        max_tokens = self.call.max_tokens
        if max_tokens is None and route.driver.requires_max_tokens:
            # The bound the worst case reserved for, not a driver's default.
            max_tokens = route.mapping.max_output_tokens
        return ChatRequest(
            body=self.call.body,
            upstream_model=route.mapping.model,
            max_tokens=max_tokens,
            stream=self.call.stream,
        )

    def _prepare(self, route: _Route, attempt_id: str) -> PreparedCall:
        return route.driver.prepare(self._chat_request(route), self._binding(route, attempt_id))

    def _call(self, attempt: _Attempt) -> PreparedCall:
        """The attempt's upstream call: the one built while its start committed, else built
        now (raising what building raises)."""
        return attempt.call or self._prepare(attempt.route, attempt.attempt_id)

    def _binding(self, route: _Route, attempt_id: str) -> AttemptBinding:
        """The attempt's endpoint and timeouts, as of its start (the request's deadline
        bounds the attempt all the same: ``_until_answered``)."""
        endpoint = self.gw.config.endpoint(route.choice.endpoint)
        assert endpoint is not None
        remaining_s = max(0.001, self.deadline - time.monotonic())
        defaults = self.defaults
        # contract §8: the upstream joins the request's trace (the caller's, if it sent one) as a
        # child of this attempt's span, whose id otel/ derives from the attempt id.
        trace_id = request_trace_id(self.request_id, self.caller_trace_id)
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
            tracestate=self.caller_tracestate,
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
    ) -> None:
        route = attempt.route
        self.in_flight, self.ended = None, True
        duration = round((time.monotonic() - attempt.started_at) * 1000)
        self.tally.summaries.append(AttemptSummary(route.choice.endpoint, http_status, None))
        self._pending.append(
            ev.AttemptFinished(
                request_id=self.request_id,
                attempt_id=attempt.attempt_id,
                status="succeeded",
                evidence=ev.Evidence.STARTED,
                http_status=http_status,
                usage=usage,
                upstream_request_id=upstream_request_id,
                response_id=response_id,
                response_model=response_model,
                finish_reason=finish_reason,
                duration_ms=duration,
                time_to_first_chunk_ms=time_to_first_chunk_ms,
                stream_committed=attempt.stream_committed,
                invalid_events=invalid_events,
            )
        )
        if usage is not None and cost is not None:
            self._record(self.budget.settle(attempt.attempt_id, cost, usage))
        else:  # the upstream answered but did not say what it used
            self._record(self.budget.hold_unknown(attempt.attempt_id, "usage_not_reported"))
        completed = ev.RequestCompleted(
            request_id=self.request_id,
            endpoint=route.choice.endpoint,
            model=route.mapping.model,
            attempts=self.attempt_count,
            usage=usage,
            cost_usd=cost,
            finish_reason=finish_reason,
            duration_ms=self._elapsed_ms(),
        )
        try:
            submitted = await self._submit(completed)
            assert submitted is not None
            try:
                # While it commits, the breakers hear of the success: the upstream answered,
                # whatever the ledger says next.
                await _let_the_appender_send()
                await self._report_breakers(route, None)
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
        outcome = failure.outcome if failure is not None else None
        return ev.AttemptFinished(
            request_id=self.request_id,
            attempt_id=attempt.attempt_id,
            status="failed",
            failure_class=classification.failure_class,
            evidence=classification.evidence,
            http_status=outcome.http_status if outcome else None,
            error_code=(outcome.error_code or outcome.error_type) if outcome else None,
            upstream_request_id=failure.upstream_request_id if failure else None,
            retry_after_ms=classification.retry_after_ms,
            duration_ms=round((time.monotonic() - attempt.started_at) * 1000),
            stream_committed=attempt.stream_committed,
            invalid_events=invalid_events,
        )

    async def _failed(
        self, attempt: _Attempt, classification: Classification, failure: UpstreamFailure | None
    ) -> _Route | None:
        """Record a failed attempt and decide: the route to retry, None to re-evaluate for a
        failover, or raise the final (recorded) error."""
        route = attempt.route
        endpoint_id = route.choice.endpoint
        self.in_flight = None
        self._pending.append(self._attempt_finished(attempt, classification, failure))
        self._record(self._hold_outcome(attempt, classification))
        await self._report_breakers(route, classification)
        status = failure.outcome.http_status if failure else None
        self.tally.summaries.append(
            AttemptSummary(endpoint_id, status, classification.failure_class.value)
        )
        self.tally.classes.append(classification.failure_class)
        if classification.retry_after_ms is not None:
            self.tally.retry_after_ms = classification.retry_after_ms
        retries = self.tally.retries.get(endpoint_id, 0)
        decision = decide(
            AttemptOutcome(
                classification=classification,
                attempts_made=self.attempt_count,
                retries_on_endpoint=retries,
                remaining_ms=self._remaining_ms(),
                allow_failover=self.requirements.allow_failover,
                stream_committed=attempt.stream_committed,
                allow_unknown_execution=self.requirements.allow_unknown_execution,
                server_side_effects=self.requirements.server_side_effects,
            ),
            self.defaults,
            self.gw._rng,
        )
        self._pending.append(self._failover_decided(attempt, classification, decision))
        if decision.action == "stop":
            raise await self._fail(self._final_error(classification, failure, decision))
        self.context = next_context(
            self.context, decision.action, endpoint_id, route.mapping, classification.failure_class
        )
        if decision.action == "retry":
            self.tally.retries[endpoint_id] = retries + 1
            if decision.backoff_ms:
                await asyncio.sleep(decision.backoff_ms / 1000)
            if await self._admitted(endpoint_id, route.mapping):
                return replace(route, cause="retry")
        return None

    def _hold_outcome(self, attempt: _Attempt, classification: Classification) -> StepRecord:
        """A failed attempt's hold: released if the upstream never started, otherwise kept
        as an unknown-usage settlement (contract §6) — a failover must fit in what is left."""
        if classification.evidence is ev.Evidence.NOT_STARTED:
            return self.budget.release(attempt.attempt_id, "not_started")
        cause = "broken_stream" if attempt.stream_committed else classification.failure_class
        return self.budget.hold_unknown(attempt.attempt_id, cause)

    def _failover_decided(
        self, attempt: _Attempt, classification: Classification, decision: Decision
    ) -> ev.FailoverDecided:
        return ev.FailoverDecided(
            request_id=self.request_id,
            after_attempt_id=attempt.attempt_id,
            failure_class=classification.failure_class,
            evidence=classification.evidence,
            action=decision.action,
            allowed=decision.allowed,
            reason=decision.reason,
            backoff_ms=decision.backoff_ms,
            attempts_left=max(0, self.defaults.max_attempts - self.attempt_count),
            deadline_left_ms=self._remaining_ms(),
            policy=decision.policy,
        )

    async def _broken_stream(
        self,
        attempt: _Attempt,
        classification: Classification,
        failure: UpstreamFailure | None,
        upstream: DriverStream,
    ) -> GatewayError:
        """A committed stream that did not finish: a partial failure, never a success."""
        if classification.failure_class is ev.FailureClass.CLIENT_CANCELED:
            error = client_canceled("the client closed the stream")
        else:
            error = stream_broken(classification.failure_class)
        if self.ended:  # the client left while the success was being recorded
            return error
        self.in_flight, self.ended = None, True
        self.tally.summaries.append(
            AttemptSummary(attempt.route.choice.endpoint, 200, classification.failure_class.value)
        )
        self._pending.append(
            self._attempt_finished(
                attempt, classification, failure, invalid_events=upstream.invalid_events
            )
        )
        self._record(self._hold_outcome(attempt, classification))
        decision = Decision(action="stop", reason="stream_committed")
        await self._flush(
            self._failover_decided(attempt, classification, decision),
            self._request_failed(
                error, endpoint=attempt.route.choice.endpoint, stream_started=True
            ),
        )
        await self._report_breakers(attempt.route, classification)
        return error

    # --- endings ---

    async def _fail(self, error: GatewayError) -> GatewayError:
        """Record the request's failure; returns the error for the caller to raise."""
        error.with_attempts(tuple(self.tally.summaries))
        self.ended = True
        try:
            await self._flush(self._request_failed(error))
        except LedgerUnavailable:
            self.gw._keep(self._flush_patiently(self._request_failed(error)))
            raise
        return error

    def _request_failed(
        self, error: GatewayError, *, endpoint: str | None = None, stream_started: bool = False
    ) -> ev.RequestFailed:
        return ev.RequestFailed(
            request_id=self.request_id,
            http_status=error.status,
            error_code=error.code,
            error_type=error.error_type,
            message=error.message,
            attempts=self.attempt_count,
            endpoint=endpoint,
            stream_started=stream_started,
            duration_ms=self._elapsed_ms(),
        )

    def _final_error(
        self, classification: Classification, failure: UpstreamFailure | None, decision: Decision
    ) -> GatewayError:
        failure_class = classification.failure_class
        if failure_class is ev.FailureClass.DEADLINE_EXCEEDED or decision.reason == (
            "deadline_exceeded"
        ):
            return deadline_exceeded()
        return error_for_failure(
            failure_class,
            _failure_message(classification, failure, decision),
            retry_after_ms=classification.retry_after_ms,
        )

    def _no_route_error(self, candidates: tuple[ev.Candidate, ...]) -> GatewayError:
        reasons = {c.reason_code for c in candidates if not c.eligible}
        if ev.ReasonCode.OVER_BUDGET in reasons:
            return budget_exceeded(
                "no eligible route fits the remaining budget: "
                + _exclusions(candidates, ev.ReasonCode.OVER_BUDGET)
            )
        if self.tally.classes:
            # Attempts were made and nothing is left to fail over to: name the real cause.
            if all(c is ev.FailureClass.RATE_LIMITED for c in self.tally.classes):
                return error_for_failure(
                    ev.FailureClass.RATE_LIMITED,
                    "every eligible endpoint is rate-limited",
                    retry_after_ms=self.tally.retry_after_ms or 1000,
                )
            last = self.tally.classes[-1]
            return error_for_failure(last, f"no endpoint left to fail over to after {last}")
        if ev.ReasonCode.BREAKER_OPEN in reasons and reasons <= {
            ev.ReasonCode.BREAKER_OPEN,
            ev.ReasonCode.ALREADY_TRIED,
        }:
            return upstream_unavailable(
                "every candidate endpoint is cooling down after failures (breaker open)",
                retry_after_s=1,
            )
        return no_eligible_route(
            f"no endpoint of model group {self.group.name!r} can serve this request: "
            + _exclusions(candidates, None)
        )

    async def _report_breakers(self, route: _Route, classification: Classification | None) -> None:
        endpoint_key = BreakerKey.endpoint(route.choice.endpoint)
        mapping_key = BreakerKey.mapping(route.choice.endpoint, route.mapping.model)
        transitions: list[Transition] = []
        breakers = self.gw.breakers
        if classification is None:
            transitions += await breakers.record_success(endpoint_key)
            transitions += await breakers.record_success(mapping_key)
        elif classification.breaker_scope is not None:
            key = endpoint_key if classification.breaker_scope == "endpoint" else mapping_key
            transitions += await breakers.record_failure(
                key,
                classification.failure_class.value,
                opens_at_once=classification.breaker_opens_at_once,
                retry_after_ms=classification.retry_after_ms,
            )
        await self.gw._record_transitions(transitions, self.request_id)


# --- small pure helpers ---


async def _let_the_appender_send() -> None:
    """One turn of the loop, after a submit: the appender, woken by it, takes the batch and
    sends it to the database before this task goes on, so that what the task does next
    overlaps the commit instead of delaying it."""
    await asyncio.sleep(0)


async def _first_content(batches: AsyncIterator[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Pull chunks until one carries content (contract §5); return all pulled so far."""
    held: list[dict[str, Any]] = []
    async for batch in batches:
        held += batch
        if any(_has_content(chunk) for chunk in batch):
            break
    return held


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


def _is_usage_chunk(chunk: Mapping[str, Any]) -> bool:
    # The final usage chunk the gateway asked for on its own account (choices == []).
    return chunk.get("choices") == [] and chunk.get("usage") is not None


def _deadline_class() -> Classification:
    return _DEADLINE


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


def _parse_traceparent(traceparent: str | None) -> tuple[str, str] | None:
    """The caller's (trace id, parent span id) from a W3C ``traceparent``, if well formed."""
    if not traceparent:
        return None
    parts = traceparent.strip().lower().split("-")
    if len(parts) < 4 or len(parts[0]) != 2 or parts[0] == "ff":
        return None
    trace_id, span_id = parts[1], parts[2]
    hexdigits = set("0123456789abcdef")
    if len(trace_id) != 32 or len(span_id) != 16 or not set(trace_id + span_id) <= hexdigits:
        return None
    if trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    return trace_id, span_id


def _optional_str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("recording the end of a request failed", exc_info=task.exception())


def _failure_message(
    classification: Classification, failure: UpstreamFailure | None, decision: Decision
) -> str:
    what = f"upstream failed: {classification.failure_class} ({classification.evidence})"
    if failure is not None and failure.outcome.error_message:
        what += f": {failure.outcome.error_message}"
    return f"{what}; {decision.reason.replace('_', ' ')}"


def _exclusions(candidates: tuple[ev.Candidate, ...], only: ev.ReasonCode | None) -> str:
    parts = [
        f"{c.endpoint}/{c.model}: {c.reason_code}" + (f" ({c.detail})" if c.detail else "")
        for c in candidates
        if not c.eligible and (only is None or c.reason_code is only)
    ]
    return "; ".join(parts)
