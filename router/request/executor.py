"""The executor: one request's walk (:mod:`router.request.walk`) carried out, every fact
recorded in the request's journal.

The walk decides; the executor tells it what happened and does what it asks, one action at a
time, through the ports (:mod:`router.request.ports`): ``Route`` (:mod:`router.request.routing`),
``Start`` (reserve and record the start), ``Run`` (send the attempt upstream in a task of its
own, which reports to the request's mailbox), ``ArmHedge``, ``Wait``, ``Decided``, ``Cancel``,
``Commit``, ``Deliver`` and ``Fail``. Events are built by :mod:`router.request.records`, the
final error chosen by :mod:`router.request.final_error`, a stream relayed by
:mod:`router.request.relay`.

Durability: the events of a request are appended in two group-committed batches per
attempt — before the upstream call (``RequestReceived``, ``RouteEvaluated``,
``AttemptStarted``, and the previous attempt's outcome) and before the answer is given
(``AttemptFinished``, ``RequestCompleted``/``RequestFailed``) — so an upstream is never
called for an attempt the ledger does not know, and an answered request is never missing.
A stream's ``StreamCommitted`` is durable before the client's first byte; from there the
endpoint is fixed, and a later failure is a partial failure (contract §5).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import deque
from collections.abc import Coroutine
from decimal import Decimal
from typing import Any, TypeVar

from ledger.books.accounting import BudgetDenied
from ledger.events import FailureClass
from ledger.store import LedgerUnavailable
from ledger.support.frozen import evolve
from router.drivers import UpstreamFailure
from router.errors import (
    AttemptSummary,
    GatewayError,
    composition_error,
    ledger_unavailable,
)
from router.request.admission import (
    RateAdmission,
    limits_of,
    rate_limit_exceeded,
    refused,
    worst_case_tokens,
)
from router.request.attempt import Attempt, AttemptRoute
from router.request.call import Call, Caller, Completion, StreamingCompletion
from router.request.classify import BreakerScope, Classification
from router.request.composed import routing_for
from router.request.composer import CompositionError
from router.request.endings import Endings
from router.request.final_error import final_error
from router.request.journal import KeyMoved
from router.request.moves import (
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
    Route,
    Routed,
    Run,
    Start,
    Started,
    Unroutable,
    Wait,
)
from router.request.policy import hedge_p95, walk_policy
from router.request.ports import Budget, Journal, Ports, Timer
from router.request.records import (
    AttemptEnd,
    answered_end,
    attempt_started,
    endpoint_timeouts,
    request_received,
    stream_committed,
    streamed_end,
)
from router.request.relay import SEAM_BROKEN, StreamRelay
from router.request.resume import Seam, can_continue
from router.request.routing import GroupPlan
from router.request.runner import AttemptRunner
from router.request.scope import endpoint_scope
from router.request.upstream_call import server_address
from router.request.walk import (
    Walk,
    advance,
)
from router.support.ids import new_id

__all__ = ["Executor"]

_T = TypeVar("_T")


class Executor:
    """One request's walk through contract §4's path."""

    def __init__(
        self,
        ports: Ports,
        plan: GroupPlan,
        caller: Caller,
        call: Call,
        request_id: str,
        *,
        budget: Budget,
        journal: Journal[Any],
    ) -> None:
        self.ports = ports
        self.plan = plan
        self.caller = caller
        self.call = call
        self.request_id = request_id
        self.budget = budget
        self.journal = journal
        self.group = group = plan.group
        self.defaults = defaults = plan.defaults
        requirements = call.requirements
        deadline_ms = defaults.deadline_ms
        if requirements.deadline_ms is not None:
            deadline_ms = min(deadline_ms, requirements.deadline_ms)  # the caller only narrows
        started = ports.clock.monotonic()
        self.deadline = started + deadline_ms / 1000
        p95 = ports.first_answers.p95(group.name, call.stream) if hedge_p95(defaults) else None
        scope = endpoint_scope(ports.config, group, requirements)
        policy = walk_policy(
            defaults, requirements, plan.targets, p95, plan.pool_policies, scope=scope
        )
        self.walk = Walk(policy=policy)
        self.open: dict[str, Attempt] = {}  # started, their end not yet recorded
        self.failures: dict[str, Attempt] = {}  # failed attempts, for their decisions
        self.routing = routing_for(
            ports,
            plan,
            caller.workspace,
            requirements,
            request_id,
            budget,
            journal,
            deadline=self.deadline,
        )
        self.relay = relay = StreamRelay(
            self, include_usage=call.include_usage, can_resume=plan.can_resume
        )
        self.endings = Endings(
            ports,
            request_id,
            requirements,
            max_attempts=defaults.max_attempts,
            started=started,
            deadline=self.deadline,
            budget=budget,
            journal=journal,
            relay=relay,
        )
        self.runner = AttemptRunner(
            ports, call, defaults, deadline=self.deadline, request_id=request_id, relay=relay
        )
        self._hedge_timer: Timer | None = None
        self._budget_refusal = ""  # the books' last refusal of a reservation
        self._rate: RateAdmission | None = None  # counted against rate limits
        journal.queue(request_received(request_id, caller, call, ports.config.generation))

    # --- the two shapes of a request ---

    async def complete(self) -> Completion:
        return await self._ending_recorded(self._complete())

    async def stream(self) -> StreamingCompletion:
        return await self._ending_recorded(self._stream())

    async def _ending_recorded(self, work: Coroutine[Any, Any, _T]) -> _T:
        """Run ``work``; however it ends, the request's end is on the ledger (and a request
        that started no attempt gives back the tokens it counted against rate limits)."""
        try:
            return await self._recorded(work)
        except BaseException:
            if self.walk.attempts == 0 and self._rate is not None:  # nothing used
                self.ports.keep(self._rate_settled(0))
            raise

    async def _recorded(self, work: Coroutine[Any, Any, _T]) -> _T:
        try:
            return await work
        except asyncio.CancelledError:
            self._record_abandoned(canceled=True)
            raise
        except GatewayError:
            raise  # already recorded
        except KeyMoved:
            self.endings.ended = True  # nothing of this request is on the ledger, nor will be
            raise
        except LedgerUnavailable:
            self._record_abandoned(canceled=False, error=ledger_unavailable())
            raise
        except Exception:
            self._record_abandoned(canceled=False)
            raise

    async def _admit(self) -> None:
        """Count the request against its key's and workspace's rate limits, or end it (429
        ``rate_limited``, recorded) before anything is routed, reserved or called."""
        counters, limits = self.ports.rate_counters, limits_of(self.caller)
        if counters is None or not limits:
            return
        tokens = worst_case_tokens(self.ports.config, self.group, self.call.requirements)
        now = self.ports.clock.now().timestamp()
        window, refusal = await counters.take(limits, tokens, now)
        if refusal is not None:
            self.journal.queue(rate_limit_exceeded(self.request_id, refusal, tokens))
            raise await self.endings.fail(refused(refusal), self.walk.attempts)
        self._rate = RateAdmission(counters, [x.subject for x in limits], window, tokens)

    async def _rate_settled(self, used_tokens: int | None) -> None:
        """Correct the tokens counted at admission to what the request used (None: keep the
        worst case — a failed attempt may have used tokens nobody reported)."""
        rate, self._rate = self._rate, None
        if rate is not None and used_tokens is not None:
            await rate.settled(used_tokens)

    async def _complete(self) -> Completion:
        await self._admit()
        attempt = await self._drive(Begin())
        route, result = attempt.route, attempt.result
        assert result is not None, "an answered attempt of a buffered request has its result"
        usage, cost = self.endings.settlement(route, result.usage)
        end = answered_end(result, usage, attempt.stream_committed, attempt.invalid_output)
        await self._succeeded(attempt, end, cost)
        return Completion(
            self.request_id, result.response, route.choice.endpoint, self.walk.attempts, cost
        )

    async def _stream(self) -> StreamingCompletion:
        await self._admit()
        attempt = await self._drive(Begin())  # returns once the stream is committed
        relay = self.relay
        return StreamingCompletion(
            self.request_id,
            attempt.route.choice.endpoint,
            self.walk.attempts,
            relay.body(attempt),
            relay.write_directly,
        )

    # --- the walk decides, this carries it out ---

    async def _drive(self, happening: Happening) -> Attempt:
        """Tell the walk ``happening`` and carry out what it asks, one action at a time,
        until it hands an attempt to the client (a committed stream, an answer, a resumed
        stream's continuation: returned) or ends the request (its error, recorded, raised)."""
        queue: deque[Happening] = deque([happening])
        while True:
            if not queue:
                queue.append(await self._next_happening())
            step = advance(self.walk, queue.popleft(), self.ports.rng)
            self.walk = step.walk
            for action in step.actions:
                match action:
                    case Route():
                        queue.append(await self._route(action))
                    case Start():
                        queue.append(await self._start(action))
                    case Run(attempt_id=attempt_id):
                        self.runner.start(self.open[attempt_id])
                    case ArmHedge(after_ms=after_ms):
                        self._stop_hedge_timer()
                        self._hedge_timer = self.ports.clock.call_later(
                            after_ms / 1000, self.runner.mailbox.hedge_due
                        )
                    case Wait(ms=ms):
                        await self.ports.clock.sleep(ms / 1000)
                    case Decided(attempt_id=attempt_id, decision=decision):
                        attempt = self.failures[attempt_id]
                        assert attempt.classification is not None
                        decided = self.endings.decided(
                            attempt, attempt.classification, decision, self.walk.attempts
                        )
                        self.journal.queue(decided)
                    case Cancel(attempt_id=attempt_id):
                        self._cancel(attempt_id)
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
                        error = self._final_error(action)
                        raise await self.endings.fail(
                            error, self.walk.attempts, **self._failed_stream()
                        )

    async def _next_happening(self) -> Happening:
        """What the running attempts (or the hedge timer) did next."""
        while True:
            attempt = await self.runner.mailbox.get()
            if attempt is None:
                return HedgeDue()
            if attempt.attempt_id not in self.open:
                continue  # a way cancelled after it had finished
            if attempt.error is not None:
                raise attempt.error
            if attempt.classification is None:
                if attempt.kind != "resume":
                    waited = self.endings.took(attempt)
                    mapping = attempt.route.mapping
                    place = (mapping.endpoint, mapping.model)
                    self.ports.first_answers.add(self.group.name, self.call.stream, waited, place)
                    if self.plan.observes_latency:
                        await self.ports.latency.observe(place, waited)
                answered = not self.call.stream
                return Answered(attempt.attempt_id) if answered else Content(attempt.attempt_id)
            return await self._attempt_failed(attempt)

    async def _route(self, action: Route) -> Routed | Unroutable:
        """Find the mapping for the walk's next attempt, or end the request with a
        composition error (contract §4 "Pools"): found before any upstream I/O, it is never
        failed over and never counted against an upstream."""
        try:
            return await self._find_route(action)
        except CompositionError as broken:
            error = composition_error(broken.rule, broken.detail)
            if self.open:  # a hedge's route: the way running ends with the request
                self._record_abandoned(canceled=False, error=error)
                raise error from None
            self._stop_hedge_timer()
            raise await self.endings.fail(
                error, self.walk.attempts, **self._failed_stream()
            ) from None

    async def _find_route(self, action: Route) -> Routed | Unroutable:
        """A retry or a resume asks only the breakers of the targets it names; any other
        purpose evaluates every mapping and chooses one (contract §4)."""
        if action.only is None:
            return await self.routing.choose(action)
        target = await self.routing.admit_one_of(action.only)
        if target is None:
            return Unroutable(self.routing.refused)
        if action.purpose == "retry":  # the failed attempt's own route
            self.routing.routed = next(
                a.route
                for a in reversed(self.failures.values())
                if a.route.choice.mapping_index == target.mapping_index
            )
        else:
            delivered = len(self.relay.delivered().encode())
            self.routing.routed = self.routing.priced(target, delivered)
        return Routed(target)

    async def _start(self, action: Start) -> Started | BudgetRaced:
        """Reserve the attempt's worst case and record its start; BudgetRaced if the books
        refused the reservation (another request got there first)."""
        routing, journal = self.routing, self.journal
        assert routing.routed is not None, "a start follows its route"
        route = routing.routed
        if route.cause != action.cause:  # a first attempt's route is bound as it was found
            route = evolve(route, cause=action.cause)
        attempt_id = new_id("att")
        endpoint = self.ports.config.endpoint(route.choice.endpoint)
        assert endpoint is not None
        reservation = self.budget.reserve(
            attempt_id, route.choice.endpoint, route.mapping.model, route.worst_case_usd
        )
        started = attempt_started(
            self.request_id,
            attempt_id,
            self.walk.attempts + 1,
            route.cause,
            route.choice,
            route.mapping.model,
            endpoint.driver,
            reservation.events[0].reservation_id,  # type: ignore[attr-defined]
            server_address(endpoint.base_url),
            self.call.stream,
            action.kind,
            action.resumed_from,
            action.delivered_chars,
            action.hedge_of,
            routing.admitted_as,
            route.dispatch,
            self._group_path(route),
            endpoint_timeouts(endpoint, self.defaults),
        )
        seam = Seam(self.relay.delivered()) if action.kind == "resume" else None
        call = None
        try:
            submitted = await journal.submit(started, step=reservation)
            assert submitted is not None
            # While the start commits, the upstream request is built, to be sent once the
            # start is durable. One that cannot be built fails where the attempt runs.
            await _let_the_appender_send()
            with contextlib.suppress(Exception):
                call = self.runner.prepare(route, attempt_id, seam)
            await journal.committed(submitted)
        except LedgerUnavailable:
            self.budget.forget(attempt_id)  # no reservation, so no upstream call
            routing.give_back_routed(route)
            raise
        except BudgetDenied as refusal:
            self.budget.forget(attempt_id)
            routing.give_back_routed(route)
            await self.ports.breakers.release_probes(routing.probes)
            journal.queue(self.budget.denied(refusal, route.choice.endpoint, route.mapping.model))
            self._budget_refusal = str(refusal)
            return BudgetRaced()
        started_at = self.ports.clock.monotonic()
        attempt = Attempt(route, attempt_id, started_at, call, kind=action.kind, seam=seam)
        attempt.stream_committed = action.kind == "resume"  # its text goes straight out
        attempt.slot = routing.take_slot()
        attempt.probes, routing.probes = routing.probes, ()
        self.open[attempt_id] = attempt
        return Started(attempt_id, action.target, action.kind)

    def _group_path(self, route: AttemptRoute) -> tuple[str, ...]:
        composition = self.plan.composition
        if composition is None or route.dispatch is None:
            return ()
        return composition.path(route.dispatch.pool)

    def _stop_hedge_timer(self) -> None:
        if self._hedge_timer is not None:
            self._hedge_timer.cancel()
            self._hedge_timer = None

    def _close(self, attempt_id: str) -> Attempt:
        """The attempt's end is being recorded: it is no longer open, and gives its endpoint
        slot back (``max_in_flight``)."""
        attempt = self.open.pop(attempt_id)
        if attempt.slot is not None:
            self.routing.give_back(attempt.route.choice.endpoint, attempt.slot)
            attempt.slot = None
        return attempt

    def _close_all(self) -> list[Attempt]:
        """Every attempt still open, closed and stopped: the request ends with them."""
        running = [self._close(attempt_id) for attempt_id in list(self.open)]
        for attempt in running:
            self._discard(attempt)
            self.ports.keep(self._release_probes(attempt))
        return running

    def _discard(self, attempt: Attempt) -> None:
        """Stop an attempt's task and let go of its upstream connection."""
        if attempt.task is not None and not attempt.task.done():
            attempt.task.cancel()
        if attempt.upstream is not None:
            self.ports.keep(attempt.upstream.aclose())

    def _cancel(self, attempt_id: str) -> None:
        """A way that lost the race (contract §5 "Hedging")."""
        attempt = self._close(attempt_id)
        self._discard(attempt)
        self.ports.keep(self._release_probes(attempt))
        self.endings.way_lost(attempt)

    async def _commit(self, attempt: Attempt) -> None:
        """The ledger learns that the stream is the client's before the client's first byte
        (its headers go out once this returns): a gateway that dies from here on leaves a
        partial failure, and crash recovery can tell (ledger.books.recovery)."""
        upstream = attempt.upstream
        assert upstream is not None
        committed = stream_committed(
            self.request_id,
            attempt.attempt_id,
            attempt.route.choice.endpoint,
            upstream.time_to_first_chunk_ms,
        )
        try:
            await self.journal.flush(committed)
        except LedgerUnavailable:
            await upstream.aclose()
            self._close(attempt.attempt_id)
            self.ports.keep(self._release_probes(attempt))
            self.endings.not_committed(attempt, upstream, self.walk.attempts)
            raise
        except BaseException:
            await upstream.aclose()
            raise
        attempt.stream_committed = True

    # --- what the stream relay asks (router.request.relay.StreamOwner) ---

    async def resume(self, broken: Attempt) -> Attempt:
        return await self._drive(await self._attempt_failed(broken))

    async def finished(self, attempt: Attempt) -> None:
        upstream = attempt.upstream
        assert upstream is not None
        usage, cost = self.endings.settlement(attempt.route, upstream.usage)
        model = self.relay.response_model
        end = streamed_end(upstream, usage, model, attempt.stream_committed, attempt.invalid_output)
        await self._succeeded(attempt, end, cost)

    def left(self, attempt: Attempt) -> None:
        self.ports.keep(self._client_left(attempt))

    # --- failures and endings ---

    async def _attempt_failed(self, attempt: Attempt) -> Failed:
        """Record a failed attempt — its end, its hold's outcome, its breakers — and say so
        to the walk."""
        classification, failure = attempt.classification, attempt.failure
        assert classification is not None
        self._close(attempt.attempt_id)
        upstream = attempt.upstream
        invalid = upstream.invalid_events if upstream is not None else 0
        self.endings.attempt_failed(attempt, classification, invalid_events=invalid)
        opened: BreakerScope | None = None
        if classification.disables_endpoint and await self._disable(attempt, failure):
            pass  # disabled: no breaker of its endpoint counts a refused key
        elif classification is not SEAM_BROKEN:
            first = upstream.time_to_first_chunk_ms if upstream is not None else None
            opened = await self._report_breakers(
                attempt, classification, self._latency_ms(attempt, first)
            )
        await self._release_probes(attempt)
        status = failure.outcome.http_status if failure else None
        if status is None and attempt.stream_committed:
            status = 200
        self.endings.tally.failed(
            AttemptSummary(attempt.route.choice.endpoint, status, classification.failure_class),
            classification,
        )
        self.failures[attempt.attempt_id] = attempt
        relay = self.relay
        return Failed(
            attempt.attempt_id,
            classification,
            self.endings.remaining_ms(),
            delivered_chars=len(relay.delivered()),
            resumable=relay.resumable
            and classification is not SEAM_BROKEN
            and can_continue(self.call.native),
            breaker_opened=opened,
        )

    async def _disable(self, attempt: Attempt, failure: UpstreamFailure | None) -> bool:
        outcome = failure.outcome if failure is not None else None
        return await self.ports.disabled.disable(
            attempt.route.choice.endpoint,
            http_status=outcome.http_status if outcome else None,
            error_code=(outcome.error_code or outcome.error_type) if outcome else None,
            request_id=self.request_id,
            attempt_id=attempt.attempt_id,
        )

    def _final_error(self, fail: Fail) -> GatewayError:
        """The error a request the walk ended is answered with."""
        failed = None
        if fail.attempt_id is not None:
            attempt = self.failures[fail.attempt_id]
            assert attempt.classification is not None
            failed = (attempt.classification, attempt.failure)
        return final_error(
            fail,
            committed=self.walk.committed,
            tally=self.endings.tally,
            candidates=self.routing.candidates,
            group=self.group.name,
            budget_refusal=self._budget_refusal,
            failed=failed,
            probe_in_ms=self.routing.probe_in_ms,
        )

    def _failed_stream(self) -> dict[str, Any]:
        """The RequestFailed fields of a committed stream that ended in an error."""
        if not self.walk.committed:
            return {}
        endpoint = self.failures[next(reversed(self.failures))].route.choice.endpoint
        return {"endpoint": endpoint, "stream_started": True}

    async def _succeeded(self, attempt: Attempt, end: AttemptEnd, cost: Decimal | None) -> None:
        self._close(attempt.attempt_id)
        completed = self.endings.succeeded(attempt, end, cost, self.walk.attempts)
        usage = end.usage
        # Before the answer goes out, so that the caller's next request sees the correction.
        await self._rate_settled(usage.input_tokens + usage.output_tokens if usage else None)
        journal = self.journal
        try:
            submitted = await journal.submit(completed)
            assert submitted is not None
            try:
                # While it commits, the breakers hear of the success: the upstream answered,
                # whatever the ledger says next.
                await _let_the_appender_send()
                latency = self._latency_ms(attempt, end.time_to_first_chunk_ms)
                await self._report_breakers(attempt, None, latency)
            finally:
                await journal.committed(submitted)
        except LedgerUnavailable:
            # The answer cannot be acknowledged unrecorded, so the client gets a 503; the
            # attempt and its cost are still recorded once the ledger is back.
            streamed_from = attempt.route.choice.endpoint if attempt.stream_committed else None
            self.endings.unrecorded(self.walk.attempts, streamed_from=streamed_from)
            raise

    def _record_abandoned(self, *, canceled: bool, error: GatewayError | None = None) -> None:
        """The client went away (``canceled``) or the gateway itself failed before an
        answer: the request's end is recorded, in a task of its own."""
        if self.endings.ended:
            return
        self._stop_hedge_timer()
        running = self._close_all()
        self.endings.abandoned(running, self.walk.attempts, canceled=canceled, error=error)

    async def _client_left(self, attempt: Attempt) -> None:
        """The client closed a committed stream: a partial failure, never a success."""
        if self.endings.ended:  # the client left while the success was being recorded
            return
        others = self._close_all()
        await self.endings.client_left(attempt, others, self.walk.attempts)

    async def _report_breakers(
        self, attempt: Attempt, classification: Classification | None, latency_ms: int
    ) -> BreakerScope | None:
        """Tell the breakers an attempt's outcome (None: a success) and its latency, which
        makes a call slow under a rolling policy (contract §5); the scope whose breaker that
        opened (or re-opened), if any, for the walk not to plan what it would refuse."""
        index, plan = attempt.route.choice.mapping_index, self.plan
        endpoint_key, mapping_key = plan.endpoint_keys[index], plan.mapping_keys[index]
        if classification is None:
            attempt.probes = ()  # both judged
            await self.ports.breakers.succeeded(
                (endpoint_key, mapping_key), latency_ms, self.request_id
            )
            return None
        scope = classification.breaker_scope
        if scope is None:
            return None
        key = endpoint_key if scope == "endpoint" else mapping_key
        attempt.probes = tuple(k for k in attempt.probes if k != key)  # judged
        if (
            classification.failure_class is FailureClass.QUOTA_EXHAUSTED
            and plan.defaults.on_quota_exhausted == "failover"
        ):
            # An approved quota failover leaves the account at once: its endpoint's breaker
            # opens now, and its cool-down is how long the endpoint stays excluded.
            classification = dataclasses.replace(classification, breaker_opens_at_once=True)
        failed = self.ports.breakers.failed
        workspace = self.caller.workspace.id
        opened = await failed(key, classification, latency_ms, self.request_id, workspace)
        return scope if opened else None

    async def _release_probes(self, attempt: Attempt) -> None:
        """However an attempt ends, a probe lease it holds and no verdict judged goes back
        (contract §5: a probe always ends), never left to run out while every tenant waits."""
        if attempt.probes:
            probes, attempt.probes = attempt.probes, ()
            await self.ports.breakers.release_probes(probes)

    # --- time ---

    def _latency_ms(self, attempt: Attempt, time_to_first_chunk_ms: int | None) -> int:
        """What makes a call slow for the breakers: a stream's time to its first chunk; a
        buffered call's (or a stream's that never had one) time until it ended."""
        if time_to_first_chunk_ms is not None:
            return time_to_first_chunk_ms
        return self.endings.took(attempt)


async def _let_the_appender_send() -> None:
    """One turn of the loop, after a submit: the appender, woken by it, takes the batch and
    sends it to the database before this task goes on, so that what the task does next
    overlaps the commit instead of delaying it."""
    await asyncio.sleep(0)
