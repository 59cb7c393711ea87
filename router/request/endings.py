"""How one request's attempts and the request itself end, written to its journal as they
happen: each attempt's ``AttemptFinished`` and its hold's outcome (released, settled or held
as unknown usage, contract §6), each decision after a failure, and the request's own end
(``RequestCompleted`` or ``RequestFailed``) — also when the client went away or the ledger
could not take it, in a task of its own that retries.

:class:`Endings` keeps what the final answer needs (:class:`router.request.final_error.Tally`)
and whether the request's end is recorded (or on its way).
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from ledger import events as ev
from ledger.store import LedgerUnavailable
from router.drivers import DriverStream, UpstreamFailure
from router.errors import (
    AttemptSummary,
    ErrorCode,
    GatewayError,
    client_canceled,
    internal_error,
    ledger_unavailable,
)
from router.request.attempt import Attempt, AttemptRoute
from router.request.budget import StepRecord
from router.request.classify import Classification
from router.request.decision import Decision
from router.request.final_error import Tally
from router.request.ports import Budget, Journal, Ports
from router.request.records import (
    AttemptEnd,
    attempt_finished,
    failed_end,
    failover_decided,
    request_completed,
    request_failed,
)
from router.request.relay import StreamRelay
from router.request.worst_case import settlement

__all__ = ["Endings", "canceled_class"]


class Endings:
    """One request's endings, recorded."""

    __slots__ = (
        "_budget",
        "_clock",
        "_deadline",
        "_journal",
        "_keep",
        "_max_attempts",
        "_relay",
        "_request_id",
        "_requirements",
        "_started",
        "ended",
        "tally",
    )

    def __init__(
        self,
        ports: Ports,
        request_id: str,
        requirements: ev.Requirements,
        *,
        max_attempts: int,
        started: float,
        deadline: float,
        budget: Budget,
        journal: Journal[Any],
        relay: StreamRelay,
    ) -> None:
        """``started``, ``deadline``: the request's, on the clock's ``monotonic``."""
        self._clock = ports.clock
        self._keep = ports.keep
        self._request_id = request_id
        self._requirements = requirements
        self._max_attempts = max_attempts
        self._started = started
        self._deadline = deadline
        self._budget = budget
        self._journal = journal
        self._relay = relay  # what the client has of the stream: its model, for the record
        self.tally = Tally()
        self.ended = False  # RequestCompleted or RequestFailed is recorded (or on its way)

    # --- an attempt's end ---

    def attempt_failed(
        self, attempt: Attempt, classification: Classification, *, invalid_events: int = 0
    ) -> None:
        """A failed attempt's end and its hold's outcome."""
        failed = self._failed(attempt, classification, attempt.failure, invalid_events)
        self._journal.queue(failed)
        self._journal.record(self.hold_outcome(attempt, classification))

    def way_lost(self, attempt: Attempt) -> None:
        """A way that lost the race: its usage is settled if it answered in full, else held
        unknown (contract §5 "Hedging")."""
        result = attempt.result
        usage = cost = None
        if result is not None:
            usage, cost = self.settlement(attempt.route, result.usage)
        end = AttemptEnd(
            "failed",
            ev.Evidence.UNKNOWN if result is None else ev.Evidence.STARTED,
            error_code=ev.HEDGE_LOST,
            usage=usage,
            response_bytes=attempt.response_bytes(),
        )
        self._finished(attempt, end)
        if usage is not None and cost is not None:
            self._journal.record(self._budget.settle(attempt.attempt_id, cost, usage))
        else:
            self._journal.record(self._budget.hold_unknown(attempt.attempt_id, ev.HEDGE_LOST))

    def decided(
        self, attempt: Attempt, classification: Classification, decision: Decision, attempts: int
    ) -> ev.FailoverDecided:
        """The decision taken after ``attempt`` failed, ``attempts`` having been made."""
        return failover_decided(
            self._request_id,
            attempt.attempt_id,
            classification,
            decision,
            attempts_left=self._max_attempts - attempts,
            deadline_left_ms=self.remaining_ms(),
        )

    def hold_outcome(self, attempt: Attempt, classification: Classification) -> StepRecord:
        """A failed attempt's hold: released if the upstream never started, otherwise kept
        as an unknown-usage settlement (contract §6) — a failover must fit in what is left."""
        if classification.evidence is ev.Evidence.NOT_STARTED:
            return self._budget.release(attempt.attempt_id, "not_started")
        if attempt.result is not None:  # it answered (invalid_output), and said what it used
            usage, cost = self.settlement(attempt.route, attempt.result.usage)
            if usage is not None and cost is not None:
                return self._budget.settle(attempt.attempt_id, cost, usage)
        cause = "broken_stream" if attempt.stream_committed else classification.failure_class
        return self._budget.hold_unknown(attempt.attempt_id, cause)

    def settlement(
        self, route: AttemptRoute, reported: ev.Usage | None
    ) -> tuple[ev.Usage | None, Decimal | None]:
        """What an attempt on ``route`` is billed for, and its cost (None: not reported)."""
        return settlement(reported, route.mapping, self._requirements, route.driver_name)

    # --- the request's end ---

    def succeeded(
        self, attempt: Attempt, end: AttemptEnd, cost: Decimal | None, attempts: int
    ) -> ev.RequestCompleted:
        """The answered attempt's end and its settlement, queued; the ``RequestCompleted``
        to append with them."""
        self.ended = True
        endpoint = attempt.route.choice.endpoint
        self.tally.summaries.append(AttemptSummary(endpoint, end.http_status, None))
        self._finished(attempt, end)
        usage = end.usage
        if usage is not None and cost is not None:
            self._journal.record(self._budget.settle(attempt.attempt_id, cost, usage))
        else:  # the upstream answered but did not say what it used
            self._journal.record(
                self._budget.hold_unknown(attempt.attempt_id, "usage_not_reported")
            )
        return request_completed(
            self._request_id,
            endpoint,
            attempt.route.mapping.model,
            attempts,
            usage,
            cost,
            end.finish_reason,
            self.elapsed_ms(),
        )

    async def fail(
        self,
        error: GatewayError,
        attempts: int,
        *,
        endpoint: str | None = None,
        stream_started: bool = False,
    ) -> GatewayError:
        """Record the request's failure; returns the error for the caller to raise."""
        error.with_attempts(tuple(self.tally.summaries))
        self.ended = True
        failed = self.request_failed(
            error, attempts, endpoint=endpoint, stream_started=stream_started
        )
        try:
            await self._journal.flush(failed)
        except LedgerUnavailable:
            self._keep(self._journal.flush_patiently(failed))
            raise
        return error

    def unrecorded(self, attempts: int, *, streamed_from: str | None = None) -> None:
        """The ledger could not take the request's end: the client gets the 503 (a stream
        ``streamed_from`` an endpoint, its in-band error), and the end is recorded, a
        failure, once the ledger is back."""
        failed = self.request_failed(
            ledger_unavailable(),
            attempts,
            endpoint=streamed_from,
            stream_started=streamed_from is not None,
        )
        self._keep(self._journal.flush_patiently(failed))

    def not_committed(self, attempt: Attempt, upstream: DriverStream, attempts: int) -> None:
        """The stream's commit could not be recorded (the ledger is unavailable): the client
        gets the 503, nothing of the stream. The upstream did start, so the attempt's hold
        stays counted as unknown usage; the end is recorded once the ledger is back."""
        self.ended = True
        end = AttemptEnd(
            "failed",
            ev.Evidence.STARTED,
            error_code=ErrorCode.LEDGER_UNAVAILABLE,
            time_to_first_chunk_ms=upstream.time_to_first_chunk_ms,
            response_bytes=upstream.response_bytes,
        )
        self._finished(attempt, end)
        self._journal.record(self._budget.hold_unknown(attempt.attempt_id, "ledger_unavailable"))
        self.unrecorded(attempts)

    def abandoned(
        self,
        running: list[Attempt],
        attempts: int,
        *,
        canceled: bool,
        error: GatewayError | None = None,
    ) -> None:
        """The client went away (``canceled``) or the gateway itself failed before an
        answer, ``running`` in flight: record how the request ended, in a task of its own
        that the cancellation of the request's does not reach. A hold in flight stays
        counted as unknown usage."""
        self.ended = True
        classification = canceled_class(ev.Evidence.UNKNOWN)
        budget, journal = self._budget, self._journal
        for attempt in running:
            if canceled:
                journal.queue(self._failed(attempt, classification, None, 0))
            else:
                end = AttemptEnd(
                    "failed",
                    ev.Evidence.UNKNOWN,
                    error_code="gateway_error",
                    stream_committed=attempt.stream_committed,
                    response_bytes=attempt.response_bytes(),
                )
                self._finished(attempt, end)
            if budget.has_hold(attempt.attempt_id):
                cause = "client_canceled" if canceled else "gateway_error"
                journal.record(budget.hold_unknown(attempt.attempt_id, cause))
            if canceled:
                decision = Decision(action="stop", reason="client_canceled")
                journal.queue(self.decided(attempt, classification, decision, attempts))
        if canceled:
            error = client_canceled()
        elif error is None:
            error = internal_error()
        self._keep(journal.flush_patiently(self.request_failed(error, attempts)))

    async def client_left(self, attempt: Attempt, others: list[Attempt], attempts: int) -> None:
        """The client closed the stream ``attempt`` carried (``others`` were still running):
        a partial failure, never a success."""
        self.ended = True
        classification = canceled_class()
        journal = self._journal
        for other in others:
            journal.queue(self._failed(other, classification, None, 0))
            if self._budget.has_hold(other.attempt_id):
                journal.record(self.hold_outcome(other, classification))
        decision = Decision(action="stop", reason="stream_committed")
        endpoint = attempt.route.choice.endpoint
        self.tally.summaries.append(AttemptSummary(endpoint, 200, classification.failure_class))
        error = client_canceled("the client closed the stream")
        await journal.flush(
            self.decided(attempt, classification, decision, attempts),
            self.request_failed(error, attempts, endpoint=endpoint, stream_started=True),
        )

    def request_failed(
        self,
        error: GatewayError,
        attempts: int,
        *,
        endpoint: str | None = None,
        stream_started: bool = False,
    ) -> ev.RequestFailed:
        return request_failed(
            self._request_id,
            error,
            attempts,
            self.elapsed_ms(),
            endpoint=endpoint,
            stream_started=stream_started,
        )

    # --- time ---

    def took(self, attempt: Attempt) -> int:
        """The attempt's duration so far, in ms."""
        return round((self._clock.monotonic() - attempt.started_at) * 1000)

    def remaining_ms(self) -> int:
        """Of the request's deadline."""
        return max(0, int((self._deadline - self._clock.monotonic()) * 1000))

    def elapsed_ms(self) -> int:
        return round((self._clock.monotonic() - self._started) * 1000)

    # --- helpers ---

    def _finished(self, attempt: Attempt, end: AttemptEnd) -> None:
        self._journal.queue(
            attempt_finished(self._request_id, attempt.attempt_id, end, self.took(attempt))
        )

    def _failed(
        self,
        attempt: Attempt,
        classification: Classification,
        failure: UpstreamFailure | None,
        invalid_events: int,
    ) -> ev.AttemptFinished:
        """The end of a failed attempt (of ``failure``; None: the request ended it)."""
        result = attempt.result  # an answer that failed its request's output validation
        end = failed_end(
            classification,
            failure,
            result,
            attempt.upstream,  # a stream, broken after its first content
            usage=self.settlement(attempt.route, result.usage)[0] if result else None,
            response_model=self._relay.response_model,
            stream_committed=attempt.stream_committed,
            invalid_events=invalid_events,
            invalid_output=attempt.invalid_output,
            response_bytes=attempt.response_bytes(),
            error_code=attempt.error_code,
        )
        return attempt_finished(self._request_id, attempt.attempt_id, end, self.took(attempt))


def canceled_class(evidence: ev.Evidence = ev.Evidence.STARTED) -> Classification:
    """An attempt the client's leaving ended."""
    return Classification(
        failure_class=ev.FailureClass.CLIENT_CANCELED,
        evidence=evidence,
        breaker_scope=None,
        breaker_opens_at_once=False,
        may_fail_over="no",
    )
