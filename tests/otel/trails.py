"""Request trails as the ledger records them, with chosen commit times, for the span fold."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from ledger import events as ev
from ledger.events import encode_event
from ledger.store import RecordedEvent

T0 = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"


def at(ms: int) -> datetime:
    return T0 + timedelta(milliseconds=ms)


def recorded(
    batches: Sequence[tuple[int, Sequence[ev.Event]]], *, first_position: int = 1
) -> list[RecordedEvent]:
    """Events of one request stream, committed in batches at ``at(ms)``."""
    out: list[RecordedEvent] = []
    position = first_position
    for ms, events in batches:
        for event in events:
            request_id = getattr(event, "request_id", None) or "r"
            out.append(
                RecordedEvent(
                    position=position,
                    stream_id=f"request-{request_id}",
                    version=len(out) + 1,
                    type=type(event).type,
                    schema_version=type(event).schema_version,
                    data=encode_event(event),
                    metadata={},
                    recorded_at=at(ms),
                    hash="0" * 64,
                    payload=b"",
                )
            )
            position += 1
    return out


def received(request_id: str, *, traced: bool = False, stream: bool = False) -> ev.RequestReceived:
    return ev.RequestReceived(
        request_id=request_id,
        workspace="acme",
        key_id="k_1",
        model_group="chat-default",
        requirements=ev.Requirements(capabilities=("text",), stream=stream, max_output_tokens=64),
        config_generation="g1",
        prompt_sha256=hashlib.sha256(b"the prompt").hexdigest(),
        prompt_bytes=48,
        message_count=1,
        trace_id=CALLER_TRACE if traced else None,
        parent_span_id=CALLER_SPAN if traced else None,
    )


def candidate(
    endpoint: str, model: str, tier: int = 0, reason: ev.ReasonCode | None = None
) -> ev.Candidate:
    return ev.Candidate(
        endpoint=endpoint,
        model=model,
        mapping_index=0 if endpoint == "east" else 1,
        tier=tier,
        weight=3 if endpoint == "east" else 1,
        eligible=reason is None,
        reason_code=reason,
        detail="tools" if reason is ev.ReasonCode.MISSING_CAPABILITY else None,
    )


def evaluated(
    request_id: str, sequence: int, candidates: Sequence[ev.Candidate], chosen: str | None
) -> ev.RouteEvaluated:
    choice = next((c for c in candidates if c.endpoint == chosen), None)
    return ev.RouteEvaluated(
        request_id=request_id,
        sequence=sequence,
        candidates=tuple(candidates),
        tried_endpoints=("east",) if sequence > 1 else (),
        chosen=None
        if choice is None
        else ev.RouteChoice(
            endpoint=choice.endpoint,
            model=choice.model,
            mapping_index=choice.mapping_index,
            tier=choice.tier,
            weight=choice.weight,
            selection_position=sequence - 1,
        ),
    )


def started(
    request_id: str, n: int, endpoint: str, model: str, driver: str = "openai"
) -> ev.AttemptStarted:
    return ev.AttemptStarted(
        request_id=request_id,
        attempt_id=f"{request_id}-a{n}",
        attempt_number=n,
        cause="first" if n == 1 else "failover",
        endpoint=endpoint,
        driver=driver,
        model=model,
        tier=0 if endpoint == "east" else 1,
        weight=3 if endpoint == "east" else 1,
        server_address=f"{endpoint}.example.test",
        server_port=443,
        admitted_as="closed" if n == 1 else "probe:endpoint",
    )


USAGE = ev.Usage(input_tokens=12, output_tokens=30)


def failover_trail(request_id: str = "r_failover") -> list[RecordedEvent]:
    """east answers 502 (unknown evidence), the gateway fails over to west, which succeeds."""
    east = candidate("east", "gpt-4o-mini")
    west = candidate("west", "claude-3-5", tier=1)
    first = f"{request_id}-a1"
    second = f"{request_id}-a2"
    return recorded(
        [
            (
                0,
                [
                    received(request_id, traced=True),
                    evaluated(request_id, 1, [east, west], "east"),
                    ev.BudgetReserved(
                        request_id=request_id,
                        attempt_id=first,
                        reservation_id=f"{first}-r",
                        amount_usd=Decimal("0.0030"),
                        accounts=(),
                        endpoint="east",
                        model="gpt-4o-mini",
                    ),
                    started(request_id, 1, "east", "gpt-4o-mini"),
                ],
            ),
            (
                # east's failure is recorded with the next attempt, 300 ms later
                300,
                [
                    ev.AttemptFinished(
                        request_id=request_id,
                        attempt_id=first,
                        status="failed",
                        failure_class=ev.FailureClass.UPSTREAM_UNAVAILABLE,
                        evidence=ev.Evidence.UNKNOWN,
                        http_status=502,
                        error_code="server_error",
                        duration_ms=120,
                        response_bytes=87,
                    ),
                    ev.UnknownUsageOpened(
                        settlement_id=f"{first}-s",
                        request_id=request_id,
                        attempt_id=first,
                        reservation_id=f"{first}-r",
                        workspace="acme",
                        key_id="k_1",
                        endpoint="east",
                        model="gpt-4o-mini",
                        held_usd=Decimal("0.0030"),
                        cause="upstream_unavailable",
                    ),
                    ev.FailoverDecided(
                        request_id=request_id,
                        after_attempt_id=first,
                        failure_class=ev.FailureClass.UPSTREAM_UNAVAILABLE,
                        evidence=ev.Evidence.UNKNOWN,
                        action="failover",
                        allowed=True,
                        reason="unknown_execution_failover",
                    ),
                    evaluated(
                        request_id,
                        2,
                        [
                            candidate("east", "gpt-4o-mini", reason=ev.ReasonCode.ALREADY_TRIED),
                            west,
                        ],
                        "west",
                    ),
                    started(request_id, 2, "west", "claude-3-5", driver="anthropic"),
                ],
            ),
            (
                700,
                [
                    ev.AttemptFinished(
                        request_id=request_id,
                        attempt_id=second,
                        status="succeeded",
                        evidence=ev.Evidence.STARTED,
                        http_status=200,
                        usage=USAGE,
                        upstream_request_id="up-123",
                        response_id="msg_1",
                        response_model="claude-3-5-20241022",
                        finish_reason="stop",
                        duration_ms=380,
                        time_to_first_chunk_ms=95,
                        response_bytes=1024,
                    ),
                    ev.RequestCompleted(
                        request_id=request_id,
                        endpoint="west",
                        model="claude-3-5",
                        attempts=2,
                        usage=USAGE,
                        cost_usd=Decimal("0.000072"),
                        finish_reason="stop",
                        duration_ms=720,
                    ),
                    ev.BudgetSettled(
                        request_id=request_id,
                        attempt_id=second,
                        reservation_id=f"{second}-r",
                        reserved_usd=Decimal("0.0040"),
                        settled_usd=Decimal("0.000072"),
                        released_usd=Decimal("0.003928"),
                        usage=USAGE,
                    ),
                ],
            ),
            (
                # a reconciliation, days later: not part of the request's trace
                86_400_000,
                [
                    ev.UnknownUsageSettled(
                        settlement_id=f"{first}-s",
                        request_id=request_id,
                        attempt_id=first,
                        reservation_id=f"{first}-r",
                        held_usd=Decimal("0.0030"),
                        settled_usd=Decimal("0.0010"),
                        released_usd=Decimal("0.0020"),
                        source="reconciliation",
                        actor="k_admin",
                    ),
                ],
            ),
        ]
    )


def quota_trail(request_id: str = "r_quota") -> list[RecordedEvent]:
    """A 429 insufficient_quota: never fails over, the request fails."""
    attempt = f"{request_id}-a1"
    east = candidate("east", "gpt-4o-mini")
    return recorded(
        [
            (
                0,
                [
                    received(request_id),
                    evaluated(request_id, 1, [east], "east"),
                    started(request_id, 1, "east", "gpt-4o-mini"),
                ],
            ),
            (
                50,
                [
                    ev.AttemptFinished(
                        request_id=request_id,
                        attempt_id=attempt,
                        status="failed",
                        failure_class=ev.FailureClass.QUOTA_EXHAUSTED,
                        evidence=ev.Evidence.NOT_STARTED,
                        http_status=429,
                        error_code="insufficient_quota",
                        duration_ms=40,
                    ),
                    ev.FailoverDecided(
                        request_id=request_id,
                        after_attempt_id=attempt,
                        failure_class=ev.FailureClass.QUOTA_EXHAUSTED,
                        evidence=ev.Evidence.NOT_STARTED,
                        action="stop",
                        allowed=False,
                        reason="quota_exhausted_never_fails_over",
                    ),
                    ev.RequestFailed(
                        request_id=request_id,
                        http_status=502,
                        error_code="upstream_quota_exhausted",
                        error_type="upstream_error",
                        message="upstream failed: quota_exhausted (not_started)",
                        attempts=1,
                        duration_ms=52,
                    ),
                ],
            ),
        ]
    )


def no_route_trail(request_id: str = "r_noroute") -> list[RecordedEvent]:
    """Nothing eligible: no attempt, a 422."""
    candidates = [
        candidate("east", "gpt-4o-mini", reason=ev.ReasonCode.MISSING_CAPABILITY),
        candidate("west", "claude-3-5", tier=1, reason=ev.ReasonCode.REGION_NOT_ALLOWED),
    ]
    return recorded(
        [
            (
                0,
                [
                    received(request_id),
                    evaluated(request_id, 1, candidates, None),
                    ev.RequestFailed(
                        request_id=request_id,
                        http_status=422,
                        error_code="no_eligible_route",
                        error_type="invalid_request_error",
                        message="no endpoint can serve this request",
                        attempts=0,
                        duration_ms=3,
                    ),
                ],
            )
        ]
    )
