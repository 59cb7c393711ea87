"""A request's spans, folded from its ledger events: pure, no I/O, no OpenTelemetry SDK.

One request gives one ``SERVER`` span ``chat {model group}`` (child of the caller's span
when the request came with a ``traceparent``) and one ``CLIENT`` child span per upstream
attempt, ``chat {upstream model}`` (contract §8). Route evaluations, excluded candidates,
failover decisions and budget denials are span events on the request span, each at the
instant the ledger recorded it.

Only the request's stream up to the commit of its terminal event (``RequestCompleted`` or
``RequestFailed``) is folded: the spans depend on nothing that happens later, so the live
exporter and a re-export years later produce the same spans with the same ids.

Times: the ledger's ``recorded_at`` is when an event was committed, and the gateway commits
a request's events in batches (before each upstream call, and before answering). So:

- an attempt starts when its ``AttemptStarted`` was committed (right before the upstream
  call) and ends ``duration_ms`` later, never after its ``AttemptFinished`` was committed
  (which, for a retry with back-off, is only after the back-off);
- the request ends when its terminal event was committed and starts ``duration_ms`` before
  (the gateway measures that from the request's arrival), never after ``RequestReceived``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Literal

from ledger import events as ev
from ledger.store import RecordedEvent
from otel import semconv as sc
from otel.ids import (
    attempt_span_id,
    is_valid_span_id,
    pseudonymous_tenant,
    request_span_id,
    request_trace_id,
)

__all__ = [
    "TERMINAL_TYPES",
    "AttributeValue",
    "SpanData",
    "SpanEvent",
    "request_spans",
]

TERMINAL_TYPES = frozenset({ev.RequestCompleted.type, ev.RequestFailed.type})

AttributeValue = str | bool | int | float | tuple[str, ...]
Attributes = Mapping[str, AttributeValue]


@dataclass(frozen=True, slots=True)
class SpanEvent:
    name: str
    time: datetime
    attributes: Attributes


@dataclass(frozen=True, slots=True)
class SpanData:
    """One finished span, with everything an exporter needs and nothing else."""

    name: str
    kind: Literal["server", "client"]
    trace_id: str
    span_id: str
    parent_span_id: str | None
    remote_parent: bool  # the parent is the caller's span, in another process
    start: datetime
    end: datetime
    attributes: Attributes
    events: tuple[SpanEvent, ...] = ()
    error: str | None = None  # status ERROR with this description; None: status unset


@dataclass(slots=True)
class _Attempt:
    started: RecordedEvent
    event: ev.AttemptStarted
    finished: ev.AttemptFinished | None = None
    finished_at: datetime | None = None
    money: dict[str, Decimal] = field(default_factory=dict)  # reserved / settled / held


@dataclass(slots=True)
class _Fold:
    received: ev.RequestReceived
    received_at: datetime
    attempts: dict[str, _Attempt] = field(default_factory=dict)
    events: list[SpanEvent] = field(default_factory=list)
    # Budget amounts by attempt id: a reservation is made before its attempt starts.
    money: dict[str, dict[str, Decimal]] = field(default_factory=dict)

    def add_money(self, attempt_id: str, name: str, amount: Decimal) -> None:
        amounts = self.money.setdefault(attempt_id, {})
        amounts[name] = amounts.get(name, Decimal(0)) + amount


def request_spans(
    recorded: Sequence[RecordedEvent], *, tenant_key: bytes | None = None
) -> list[SpanData]:
    """The spans of one request, from its stream's events in order; ``[]`` while the request
    has no terminal event yet. The request span comes first, then one span per attempt.
    With a ``tenant_key`` the request span names its tenant by ``waybill.tenant`` (a
    pseudonym) instead of ``waybill.workspace``."""
    terminal_at = next((e.recorded_at for e in recorded if e.type in TERMINAL_TYPES), None)
    if terminal_at is None:
        return []
    fold: _Fold | None = None
    terminal: ev.RequestCompleted | ev.RequestFailed | None = None
    for item in recorded:
        if item.recorded_at > terminal_at:
            break  # committed after the request ended: not part of its trace
        event = item.event()
        if isinstance(event, ev.RequestReceived):
            fold = fold or _Fold(event, item.recorded_at)
        elif fold is not None:
            if isinstance(event, ev.RequestCompleted | ev.RequestFailed):
                terminal = terminal or event
            else:
                _fold_step(fold, item, event)
    if fold is None or terminal is None:
        return []
    return _build(fold, terminal, terminal_at, tenant_key)


def _fold_step(fold: _Fold, item: RecordedEvent, event: ev.Event) -> None:
    at = item.recorded_at
    match event:
        case ev.AttemptStarted():
            fold.attempts.setdefault(event.attempt_id, _Attempt(item, event))
        case ev.AttemptFinished():
            attempt = fold.attempts.get(event.attempt_id)
            if attempt is not None and attempt.finished is None:
                attempt.finished, attempt.finished_at = event, at
        case ev.BudgetReserved():
            fold.add_money(event.attempt_id, sc.WAYBILL_RESERVED_USD, event.amount_usd)
        case ev.BudgetSettled():
            fold.add_money(event.attempt_id, sc.WAYBILL_SETTLED_USD, event.settled_usd)
        case ev.UnknownUsageOpened():
            fold.add_money(event.attempt_id, sc.WAYBILL_HELD_UNKNOWN_USD, event.held_usd)
        case ev.RouteEvaluated():
            fold.events.extend(_route_events(event, at))
        case ev.FailoverDecided():
            fold.events.append(_failover_event(event, at))
        case ev.BudgetReservationDenied():
            fold.events.append(_denied_event(event, at))


def _build(
    fold: _Fold,
    terminal: ev.RequestCompleted | ev.RequestFailed,
    terminal_at: datetime,
    tenant_key: bytes | None,
) -> list[SpanData]:
    received = fold.received
    trace_id = request_trace_id(received.request_id, received.trace_id)
    caller_parent = received.parent_span_id
    has_caller = trace_id == (received.trace_id or "").lower() and is_valid_span_id(caller_parent)
    span_id = request_span_id(received.request_id)
    start = min(fold.received_at, terminal_at - timedelta(milliseconds=terminal.duration_ms))
    attempts = sorted(fold.attempts.values(), key=lambda a: a.event.attempt_number)
    for attempt in attempts:
        attempt.money = fold.money.get(attempt.event.attempt_id, {})
    operation = sc.operation_of(received.api)
    request = SpanData(
        name=sc.span_name(received.model_group, operation),
        kind="server",
        trace_id=trace_id,
        span_id=span_id,
        parent_span_id=caller_parent.lower() if has_caller and caller_parent else None,
        remote_parent=has_caller,
        start=start,
        end=terminal_at,
        attributes=_request_attributes(received, terminal, attempts, tenant_key),
        events=tuple(fold.events),
        error=terminal.error_code if isinstance(terminal, ev.RequestFailed) else None,
    )
    children = [
        _attempt_span(attempt, trace_id, span_id, start, terminal_at, operation)
        for attempt in attempts
    ]
    return [request, *children]


def _attempt_span(
    attempt: _Attempt,
    trace_id: str,
    parent: str,
    request_start: datetime,
    request_end: datetime,
    operation: str,
) -> SpanData:
    started, finished = attempt.event, attempt.finished
    start = max(attempt.started.recorded_at, request_start)
    error: str | None
    if finished is None or attempt.finished_at is None:
        end, error = request_end, "unfinished"  # the gateway stopped mid-attempt
    else:
        by_duration = start + timedelta(milliseconds=finished.duration_ms)
        end = max(start, min(attempt.finished_at, by_duration))
        error = None
        if finished.status == "failed":
            error = finished.failure_class.value if finished.failure_class else "failed"
    return SpanData(
        name=sc.span_name(started.model, operation),
        kind="client",
        trace_id=trace_id,
        span_id=attempt_span_id(started.attempt_id),
        parent_span_id=parent,
        remote_parent=False,
        start=start,
        end=min(end, request_end),
        attributes=_attempt_attributes(attempt, operation),
        error=error,
    )


# --- attributes ---


def _provider(driver: str) -> str:
    return sc.PROVIDER_BY_DRIVER.get(driver, driver)


def _money(value: Decimal) -> str:
    return format(value, "f")


def _usage(attributes: dict[str, AttributeValue], usage: ev.Usage | None) -> None:
    if usage is None:
        return
    attributes[sc.GEN_AI_USAGE_INPUT_TOKENS] = usage.input_tokens
    attributes[sc.GEN_AI_USAGE_OUTPUT_TOKENS] = usage.output_tokens
    if usage.cached_input_tokens:
        attributes[sc.WAYBILL_CACHED_INPUT_TOKENS] = usage.cached_input_tokens
    if usage.cache_write_input_tokens:
        attributes[sc.WAYBILL_CACHE_WRITE_INPUT_TOKENS] = usage.cache_write_input_tokens
    if usage.cache_write_1h_input_tokens:
        attributes[sc.WAYBILL_CACHE_WRITE_1H_INPUT_TOKENS] = usage.cache_write_1h_input_tokens


def _costs(attributes: dict[str, AttributeValue], attempts: Sequence[_Attempt]) -> None:
    for name in (sc.WAYBILL_RESERVED_USD, sc.WAYBILL_SETTLED_USD, sc.WAYBILL_HELD_UNKNOWN_USD):
        known = [a.money[name] for a in attempts if name in a.money]
        if known:
            attributes[name] = _money(sum(known, Decimal(0)))


def _request_attributes(
    received: ev.RequestReceived,
    terminal: ev.RequestCompleted | ev.RequestFailed,
    attempts: Sequence[_Attempt],
    tenant_key: bytes | None,
) -> dict[str, AttributeValue]:
    requirements = received.requirements
    tenant = (
        (sc.WAYBILL_WORKSPACE, received.workspace)
        if tenant_key is None
        else (sc.WAYBILL_TENANT, pseudonymous_tenant(received.workspace, tenant_key))
    )
    attributes: dict[str, AttributeValue] = {
        sc.GEN_AI_OPERATION_NAME: sc.operation_of(received.api),
        sc.GEN_AI_REQUEST_MODEL: received.model_group,
        sc.GEN_AI_REQUEST_STREAM: requirements.stream,
        sc.WAYBILL_REQUEST_ID: received.request_id,
        tenant[0]: tenant[1],
        sc.WAYBILL_KEY_ID: received.key_id,
        sc.WAYBILL_MODEL_GROUP: received.model_group,
        sc.WAYBILL_CONFIG_GENERATION: received.config_generation,
        sc.WAYBILL_ATTEMPTS: terminal.attempts,
        sc.HTTP_RESPONSE_STATUS_CODE: terminal.http_status,
    }
    if requirements.max_output_tokens:  # 0: a request without output (embeddings)
        attributes[sc.GEN_AI_REQUEST_MAX_TOKENS] = requirements.max_output_tokens
    if requirements.choices != 1:
        attributes[sc.GEN_AI_REQUEST_CHOICE_COUNT] = requirements.choices
    last = attempts[-1] if attempts else None
    if last is not None:
        attributes[sc.GEN_AI_PROVIDER_NAME] = _provider(last.event.driver)
    if isinstance(terminal, ev.RequestCompleted):
        finished = last.finished if last is not None else None
        attributes[sc.WAYBILL_STATUS] = "succeeded"
        attributes[sc.WAYBILL_ENDPOINT] = terminal.endpoint
        attributes[sc.GEN_AI_RESPONSE_MODEL] = (
            finished.response_model if finished and finished.response_model else terminal.model
        )
        if finished is not None and finished.response_id:
            attributes[sc.GEN_AI_RESPONSE_ID] = finished.response_id
        if terminal.finish_reason:
            attributes[sc.GEN_AI_RESPONSE_FINISH_REASONS] = (terminal.finish_reason,)
        _usage(attributes, terminal.usage)
        if terminal.cost_usd is not None:
            attributes[sc.WAYBILL_COST_USD] = _money(terminal.cost_usd)
    else:
        attributes[sc.WAYBILL_STATUS] = "partial_failure" if terminal.stream_started else "failed"
        attributes[sc.ERROR_TYPE] = terminal.error_code
        attributes[sc.WAYBILL_ERROR_CODE] = terminal.error_code
        if terminal.endpoint:
            attributes[sc.WAYBILL_ENDPOINT] = terminal.endpoint
    _costs(attributes, attempts)
    return attributes


def _attempt_attributes(attempt: _Attempt, operation: str) -> dict[str, AttributeValue]:
    started, finished = attempt.event, attempt.finished
    attributes: dict[str, AttributeValue] = {
        sc.GEN_AI_OPERATION_NAME: operation,
        sc.GEN_AI_PROVIDER_NAME: _provider(started.driver),
        sc.GEN_AI_REQUEST_MODEL: started.model,
        sc.GEN_AI_REQUEST_STREAM: started.stream,
        sc.WAYBILL_REQUEST_ID: started.request_id,
        sc.WAYBILL_ATTEMPT_ID: started.attempt_id,
        sc.WAYBILL_ATTEMPT_NUMBER: started.attempt_number,
        sc.WAYBILL_ATTEMPT_CAUSE: started.cause,
        sc.WAYBILL_ATTEMPT_KIND: started.kind,
        sc.WAYBILL_ENDPOINT: started.endpoint,
        sc.WAYBILL_TIER: started.tier,
        sc.WAYBILL_WEIGHT: started.weight,
    }
    if started.admitted_as is not None:
        attributes[sc.WAYBILL_ATTEMPT_ADMITTED_AS] = started.admitted_as
    if started.server_address:
        attributes[sc.SERVER_ADDRESS] = started.server_address
    if started.server_port is not None:
        attributes[sc.SERVER_PORT] = started.server_port
    if finished is None:
        attributes[sc.ERROR_TYPE] = "unfinished"
    else:
        attributes[sc.WAYBILL_STATUS] = finished.status
        attributes[sc.WAYBILL_EVIDENCE] = finished.evidence.value
        attributes[sc.WAYBILL_STREAM_COMMITTED] = finished.stream_committed
        attributes[sc.WAYBILL_ATTEMPT_RESPONSE_BYTES] = finished.response_bytes
        if finished.time_to_first_chunk_ms is not None:
            attributes[sc.WAYBILL_ATTEMPT_TIME_TO_FIRST_CHUNK_MS] = finished.time_to_first_chunk_ms
        if finished.invalid_output is not None:
            attributes[sc.WAYBILL_ATTEMPT_INVALID_OUTPUT] = finished.invalid_output
        if finished.http_status is not None:
            attributes[sc.HTTP_RESPONSE_STATUS_CODE] = finished.http_status
        if finished.response_model:
            attributes[sc.GEN_AI_RESPONSE_MODEL] = finished.response_model
        if finished.response_id:
            attributes[sc.GEN_AI_RESPONSE_ID] = finished.response_id
        if finished.finish_reason:
            attributes[sc.GEN_AI_RESPONSE_FINISH_REASONS] = (finished.finish_reason,)
        if finished.upstream_request_id:
            attributes[sc.WAYBILL_UPSTREAM_REQUEST_ID] = finished.upstream_request_id
        if finished.error_code:
            attributes[sc.WAYBILL_ERROR_CODE] = finished.error_code
        _usage(attributes, finished.usage)
        if finished.failure_class is not None:
            attributes[sc.ERROR_TYPE] = finished.failure_class.value
            attributes[sc.WAYBILL_FAILURE_CLASS] = finished.failure_class.value
        elif finished.status == "failed":
            attributes[sc.ERROR_TYPE] = finished.error_code or "failed"
    _costs(attributes, [attempt])
    return attributes


# --- span events ---


def _route_events(event: ev.RouteEvaluated, at: datetime) -> list[SpanEvent]:
    summary: dict[str, AttributeValue] = {
        sc.WAYBILL_SEQUENCE: event.sequence,
        sc.WAYBILL_CANDIDATES: len(event.candidates),
        sc.WAYBILL_ELIGIBLE: sum(1 for c in event.candidates if c.eligible),
        sc.WAYBILL_TRIED_ENDPOINTS: tuple(event.tried_endpoints),
    }
    if event.chosen is not None:
        summary.update(
            {
                sc.WAYBILL_ENDPOINT: event.chosen.endpoint,
                sc.WAYBILL_MODEL: event.chosen.model,
                sc.WAYBILL_TIER: event.chosen.tier,
                sc.WAYBILL_WEIGHT: event.chosen.weight,
                sc.WAYBILL_SELECTION_POSITION: event.chosen.selection_position,
            }
        )
    events = [SpanEvent(sc.EVENT_ROUTE_EVALUATED, at, summary)]
    for candidate in event.candidates:
        if candidate.eligible:
            continue
        attributes: dict[str, AttributeValue] = {
            sc.WAYBILL_SEQUENCE: event.sequence,
            sc.WAYBILL_ENDPOINT: candidate.endpoint,
            sc.WAYBILL_MODEL: candidate.model,
            sc.WAYBILL_TIER: candidate.tier,
            sc.WAYBILL_WEIGHT: candidate.weight,
        }
        if candidate.reason_code is not None:
            attributes[sc.WAYBILL_REASON_CODE] = candidate.reason_code.value
        if candidate.detail:
            attributes[sc.WAYBILL_DETAIL] = candidate.detail
        events.append(SpanEvent(sc.EVENT_CANDIDATE_EXCLUDED, at, attributes))
    return events


def _failover_event(event: ev.FailoverDecided, at: datetime) -> SpanEvent:
    attributes: dict[str, AttributeValue] = {
        sc.WAYBILL_AFTER_ATTEMPT_ID: event.after_attempt_id,
        sc.WAYBILL_FAILURE_CLASS: event.failure_class.value,
        sc.WAYBILL_EVIDENCE: event.evidence.value,
        sc.WAYBILL_ACTION: event.action,
        sc.WAYBILL_ALLOWED: event.allowed,
        sc.WAYBILL_REASON: event.reason,
    }
    if event.backoff_ms is not None:
        attributes[sc.WAYBILL_BACKOFF_MS] = event.backoff_ms
    return SpanEvent(sc.EVENT_FAILOVER_DECIDED, at, attributes)


def _denied_event(event: ev.BudgetReservationDenied, at: datetime) -> SpanEvent:
    return SpanEvent(
        sc.EVENT_BUDGET_DENIED,
        at,
        {
            sc.WAYBILL_ENDPOINT: event.endpoint,
            sc.WAYBILL_MODEL: event.model,
            sc.WAYBILL_ACCOUNT_KIND: event.account_kind,
            sc.WAYBILL_ACCOUNT_ID: event.account_id,
            sc.WAYBILL_AMOUNT_USD: _money(event.amount_usd),
            sc.WAYBILL_AVAILABLE_USD: _money(event.available_usd),
        },
    )
