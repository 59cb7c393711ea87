"""The events a request records, each built in one place from plain values.

One builder per event type the request path writes (besides the budget's, which
:mod:`router.request.budget` builds): how a request was received, each evaluation, each
attempt's start and end, each decision after a failure, the stream's commit, the request's
completion or failure, and the breakers' transitions it caused. An attempt ends in many ways
(an answer, a failure, a lost hedge, a cancelled client, the ledger down): each is told as an
:class:`AttemptEnd`, and :func:`attempt_finished` is the one ``AttemptFinished`` they make.

The events of every request are built trusted (``Record.trusted``: not validated again) from
the typed values handed in here; those of the rarer paths (a failover's decision, a failed
request, a breaker's transition) are validated.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Literal

from ledger import events as ev
from ledger.support.frozen import direct_init
from router.adapters.breaker_policy import BreakerSettings, Figures, crossed
from router.adapters.breakers import Transition
from router.config import Defaults, Endpoint
from router.drivers import DriverResult, DriverStream, UpstreamFailure
from router.errors import GatewayError
from router.request.call import Call, Caller
from router.request.classify import Classification
from router.request.composer import Dispatch
from router.request.decision import Decision
from router.request.selection import RouteContext

__all__ = [
    "AttemptEnd",
    "answered_end",
    "attempt_finished",
    "attempt_started",
    "breaker_transitioned",
    "endpoint_timeouts",
    "failed_end",
    "failover_decided",
    "request_completed",
    "request_failed",
    "request_received",
    "route_evaluated",
    "stream_committed",
    "streamed_end",
]


@direct_init
@dataclass(frozen=True, slots=True)
class AttemptEnd:
    """How an attempt ended: its ``AttemptFinished`` but for the ids and the duration."""

    status: Literal["succeeded", "failed"]
    evidence: ev.Evidence
    failure_class: ev.FailureClass | None = None
    http_status: int | None = None
    error_code: str | None = None  # the upstream's, else the gateway's own
    usage: ev.Usage | None = None
    upstream_request_id: str | None = None
    response_id: str | None = None
    response_model: str | None = None
    finish_reason: str | None = None
    retry_after_ms: int | None = None
    time_to_first_chunk_ms: int | None = None
    stream_committed: bool = False
    invalid_events: int = 0
    invalid_output: str | None = None
    response_bytes: int = 0


def attempt_finished(
    request_id: str, attempt_id: str, end: AttemptEnd, duration_ms: int
) -> ev.AttemptFinished:
    return ev.AttemptFinished.trusted(
        request_id=request_id,
        attempt_id=attempt_id,
        status=end.status,
        failure_class=end.failure_class,
        evidence=end.evidence,
        http_status=end.http_status,
        # The gateway's own codes are a StrEnum: recorded as the plain str validation makes.
        error_code=None if end.error_code is None else str(end.error_code),
        usage=end.usage,
        upstream_request_id=end.upstream_request_id,
        response_id=end.response_id,
        response_model=end.response_model,
        finish_reason=end.finish_reason,
        retry_after_ms=end.retry_after_ms,
        duration_ms=duration_ms,
        time_to_first_chunk_ms=end.time_to_first_chunk_ms,
        stream_committed=end.stream_committed,
        invalid_events=end.invalid_events,
        invalid_output=end.invalid_output,
        response_bytes=end.response_bytes,
    )


def failed_end(
    classification: Classification,
    failure: UpstreamFailure | None,
    result: DriverResult | None,
    upstream: DriverStream | None,
    *,
    usage: ev.Usage | None,
    response_model: str | None,
    stream_committed: bool,
    invalid_events: int,
    invalid_output: str | None,
    response_bytes: int,
    error_code: str | None = None,
) -> AttemptEnd:
    """A failed attempt's end, from what it saw: the upstream's failure, or an answer that
    failed its request's output validation (``result``), or a stream broken after its first
    content (``upstream``); ``error_code``, the gateway's own where the upstream gave none
    (``resume_seam_unverified``, contract §5 "Resume")."""
    outcome = failure.outcome if failure is not None else None
    if outcome is not None:
        http_status = outcome.http_status
    else:
        http_status = result.status if result is not None else None
    if failure is not None:
        upstream_request_id = failure.upstream_request_id
    else:
        upstream_request_id = result.upstream_request_id if result is not None else None
    if result is not None:
        response_id = result.response_id
    else:
        response_id = upstream.response_id if upstream is not None else None
    return AttemptEnd(
        status="failed",
        evidence=classification.evidence,
        failure_class=classification.failure_class,
        http_status=http_status,
        error_code=(outcome.error_code or outcome.error_type) if outcome else error_code,
        usage=usage,
        upstream_request_id=upstream_request_id,
        response_id=response_id,
        response_model=response_model if stream_committed else None,
        retry_after_ms=classification.retry_after_ms,
        time_to_first_chunk_ms=upstream.time_to_first_chunk_ms if upstream else None,
        stream_committed=stream_committed,
        invalid_events=invalid_events,
        invalid_output=invalid_output,
        response_bytes=response_bytes,
    )


def answered_end(
    result: DriverResult,
    usage: ev.Usage | None,
    stream_committed: bool,
    invalid_output: str | None,
) -> AttemptEnd:
    """A buffered answer's end (``usage``: as billed, :func:`worst_case.settlement`)."""
    model = result.response.get("model")
    return AttemptEnd(
        "succeeded",
        ev.Evidence.STARTED,
        http_status=result.status,
        usage=usage,
        upstream_request_id=result.upstream_request_id,
        response_id=result.response_id,
        response_model=model if isinstance(model, str) else None,
        finish_reason=result.finish_reason,
        stream_committed=stream_committed,
        invalid_output=invalid_output,
        response_bytes=result.response_bytes,
    )


def streamed_end(
    upstream: DriverStream,
    usage: ev.Usage | None,
    response_model: str | None,
    stream_committed: bool,
    invalid_output: str | None,
) -> AttemptEnd:
    """A stream's end, once the upstream ended it (``response_model``: as its chunks said)."""
    return AttemptEnd(
        "succeeded",
        ev.Evidence.STARTED,
        http_status=200,
        usage=usage,
        upstream_request_id=upstream.upstream_request_id,
        response_id=upstream.response_id,
        response_model=response_model,
        finish_reason=upstream.finish_reason,
        time_to_first_chunk_ms=upstream.time_to_first_chunk_ms,
        stream_committed=stream_committed,
        invalid_events=upstream.invalid_events,
        invalid_output=invalid_output,
        response_bytes=upstream.response_bytes,
    )


def request_received(
    request_id: str, caller: Caller, call: Call, generation: str
) -> ev.RequestReceived:
    trace = call.trace
    return ev.RequestReceived.trusted(
        request_id=request_id,
        workspace=caller.workspace.id,
        key_id=caller.key_id,
        model_group=call.model_group,
        requirements=call.requirements,
        config_generation=generation,
        prompt_sha256=call.prompt_sha256,
        prompt_bytes=call.prompt_bytes,
        message_count=call.message_count,
        idempotency_key_sha256=None,
        trace_id=trace.trace_id if trace else None,
        parent_span_id=trace.parent_span_id if trace else None,
        api=call.api,
    )


def route_evaluated(
    request_id: str,
    sequence: int,
    candidates: tuple[ev.Candidate, ...],
    context: RouteContext,
    chosen: ev.RouteChoice | None,
    strategy: Literal["weighted", "least_latency", "least_cost"],
    group_path: tuple[str, ...] = (),
) -> ev.RouteEvaluated:
    return ev.RouteEvaluated.trusted(
        request_id=request_id,
        sequence=sequence,
        candidates=candidates,
        tried_endpoints=tuple(sorted(context.tried_endpoints)),
        chosen=chosen,
        strategy=strategy,
        group_path=group_path,  # a composed group's level (contract §4 "Pools")
    )


def endpoint_timeouts(endpoint: Endpoint, policy: Defaults) -> ev.Timeouts | None:
    """The timeouts an attempt on ``endpoint`` runs under, when the endpoint's own
    ``timeouts:`` block is laid over the group's ``policy`` (else None: the policy's)."""
    if endpoint.timeouts is None:
        return None
    effective = endpoint.timeouts.over(policy)
    return ev.Timeouts(
        attempt_timeout_ms=effective.attempt_timeout_ms,
        first_token_timeout_ms=effective.first_token_timeout_ms,
        stream_idle_timeout_ms=effective.stream_idle_timeout_ms,
    )


def attempt_started(
    request_id: str,
    attempt_id: str,
    number: int,
    cause: Literal["first", "retry", "failover", "hedge"],
    choice: ev.RouteChoice,
    model: str,
    driver: Literal["openai", "anthropic"],
    reservation_id: str,
    server: tuple[str | None, int],
    stream: bool,
    kind: Literal["call", "resume", "hedge"],
    resumed_from: str | None,
    delivered_chars: int | None,
    hedge_of: str | None,
    admitted_as: str,
    dispatch: Dispatch | None = None,
    group_path: tuple[str, ...] = (),
    timeouts: ev.Timeouts | None = None,
) -> ev.AttemptStarted:
    return ev.AttemptStarted.trusted(
        request_id=request_id,
        attempt_id=attempt_id,
        attempt_number=number,
        cause=cause,
        endpoint=choice.endpoint,
        driver=driver,
        model=model,
        tier=choice.tier,
        weight=choice.weight,
        reservation_id=reservation_id,
        server_address=server[0],
        server_port=server[1],
        stream=stream,
        kind=kind,
        resumed_from=resumed_from,
        delivered_chars=delivered_chars,
        hedge_of=hedge_of,
        admitted_as=admitted_as,
        # A composed group's attempt (contract §4 "Pools"): its directive, pool and path.
        dispatch=dispatch.directive if dispatch else None,
        pool=dispatch.pool if dispatch else None,
        group_path=group_path,
        preferred_endpoint=dispatch.preferred if dispatch else None,
        timeouts=timeouts,
    )


def stream_committed(
    request_id: str, attempt_id: str, endpoint: str, time_to_first_chunk_ms: int | None
) -> ev.StreamCommitted:
    return ev.StreamCommitted.trusted(
        request_id=request_id,
        attempt_id=attempt_id,
        endpoint=endpoint,
        time_to_first_chunk_ms=time_to_first_chunk_ms,
    )


def failover_decided(
    request_id: str,
    attempt_id: str,
    classification: Classification,
    decision: Decision,
    *,
    attempts_left: int,
    deadline_left_ms: int,
) -> ev.FailoverDecided:
    return ev.FailoverDecided(
        request_id=request_id,
        after_attempt_id=attempt_id,
        failure_class=classification.failure_class,
        evidence=classification.evidence,
        action=decision.action,
        allowed=decision.allowed,
        reason=decision.reason,
        backoff_ms=decision.backoff_ms,
        attempts_left=max(0, attempts_left),
        deadline_left_ms=deadline_left_ms,
        policy=decision.policy,
    )


def request_completed(
    request_id: str,
    endpoint: str,
    model: str,
    attempts: int,
    usage: ev.Usage | None,
    cost: Decimal | None,
    finish_reason: str | None,
    duration_ms: int,
) -> ev.RequestCompleted:
    return ev.RequestCompleted.trusted(
        request_id=request_id,
        endpoint=endpoint,
        model=model,
        attempts=attempts,
        usage=usage,
        cost_usd=cost,
        finish_reason=finish_reason,
        duration_ms=duration_ms,
    )


def request_failed(
    request_id: str,
    error: GatewayError,
    attempts: int,
    duration_ms: int,
    *,
    endpoint: str | None = None,
    stream_started: bool = False,
) -> ev.RequestFailed:
    return ev.RequestFailed(
        request_id=request_id,
        http_status=error.status,
        error_code=error.code,
        error_type=error.error_type,
        message=error.message,
        attempts=attempts,
        endpoint=endpoint,
        stream_started=stream_started,
        duration_ms=duration_ms,
    )


def breaker_transitioned(
    transition: Transition, settings: BreakerSettings, generation: str, request_id: str
) -> ev.BreakerTransitioned:
    t = transition
    return ev.BreakerTransitioned(
        scope=t.key.scope,
        target=t.key.target,
        from_state=t.from_state,
        to_state=t.to_state,
        failure_class=ev.FailureClass(t.failure_class) if t.failure_class else None,
        consecutive_failures=t.consecutive_failures,
        cooldown_ms=t.cooldown_ms,
        config_generation=generation,
        request_id=request_id,
        policy=settings.policy,
        reason=t.reason,
        duration_ms=t.duration_ms,
        **_window_figures(t.figures),
        **crossed(t.reason, settings),
    )


def _window_figures(figures: Figures | None) -> dict[str, Any]:
    """A rolling window's figures as ``BreakerTransitioned`` fields (none: absent)."""
    if figures is None:
        return {}
    return {
        "calls": figures.calls,
        "failed_calls": figures.failed,
        "slow_calls": figures.slow,
        "failure_rate": figures.failure_rate(),
        "slow_call_rate": figures.slow_call_rate(),
    }
