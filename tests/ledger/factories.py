"""Realistic event trails for ledger tests (no gateway needed)."""

from __future__ import annotations

import hashlib
from decimal import Decimal

from ledger import events as ev


def received(request_id: str, workspace: str = "acme", key_id: str = "k_1") -> ev.RequestReceived:
    return ev.RequestReceived(
        request_id=request_id,
        workspace=workspace,
        key_id=key_id,
        model_group="chat-default",
        requirements=ev.Requirements(capabilities=("text",), estimated_input_tokens=12),
        config_generation="g1",
        prompt_sha256=hashlib.sha256(request_id.encode()).hexdigest(),
        prompt_bytes=48,
        message_count=1,
    )


def _candidates() -> tuple[ev.Candidate, ...]:
    return (
        ev.Candidate(
            endpoint="east",
            model="gpt-4o-mini",
            mapping_index=0,
            tier=0,
            weight=3,
            eligible=True,
            worst_case_usd=Decimal("0.0030"),
        ),
        ev.Candidate(
            endpoint="eu",
            model="claude",
            mapping_index=1,
            tier=1,
            weight=1,
            eligible=False,
            reason_code=ev.ReasonCode.MISSING_CAPABILITY,
            detail="tools",
        ),
    )


def succeeded_trail(request_id: str, cost: str = "0.0012") -> list[ev.Event]:
    attempt = f"{request_id}-a1"
    usage = ev.Usage(input_tokens=12, output_tokens=30)
    return [
        received(request_id),
        ev.RouteEvaluated(
            request_id=request_id,
            sequence=1,
            candidates=_candidates(),
            chosen=ev.RouteChoice(
                endpoint="east",
                model="gpt-4o-mini",
                mapping_index=0,
                tier=0,
                weight=3,
                selection_position=0,
            ),
        ),
        ev.BudgetReserved(
            request_id=request_id,
            attempt_id=attempt,
            reservation_id=f"{attempt}-r",
            amount_usd=Decimal("0.0030"),
            endpoint="east",
            model="gpt-4o-mini",
            accounts=(
                ev.AccountRef(
                    account_id="workspace:acme", kind="workspace", limit_usd=Decimal(100)
                ),
            ),
        ),
        ev.AttemptStarted(
            request_id=request_id,
            attempt_id=attempt,
            attempt_number=1,
            cause="first",
            endpoint="east",
            driver="openai",
            model="gpt-4o-mini",
            tier=0,
            weight=3,
        ),
        ev.AttemptFinished(
            request_id=request_id,
            attempt_id=attempt,
            status="succeeded",
            evidence=ev.Evidence.STARTED,
            http_status=200,
            usage=usage,
            duration_ms=40,
        ),
        ev.BudgetSettled(
            request_id=request_id,
            attempt_id=attempt,
            reservation_id=f"{attempt}-r",
            reserved_usd=Decimal("0.0030"),
            settled_usd=Decimal(cost),
            released_usd=Decimal("0.0030") - Decimal(cost),
            usage=usage,
        ),
        ev.RequestCompleted(
            request_id=request_id,
            endpoint="east",
            model="gpt-4o-mini",
            attempts=1,
            usage=usage,
            cost_usd=Decimal(cost),
            duration_ms=45,
        ),
    ]


def unknown_then_failed_trail(request_id: str) -> list[ev.Event]:
    attempt = f"{request_id}-a1"
    return [
        received(request_id),
        ev.BudgetReserved(
            request_id=request_id,
            attempt_id=attempt,
            reservation_id=f"{attempt}-r",
            amount_usd=Decimal("0.0050"),
            endpoint="east",
            model="gpt-4o-mini",
            accounts=(ev.AccountRef(account_id="key:k_1", kind="key", limit_usd=Decimal(10)),),
        ),
        ev.AttemptStarted(
            request_id=request_id,
            attempt_id=attempt,
            attempt_number=1,
            cause="first",
            endpoint="east",
            driver="openai",
            model="gpt-4o-mini",
            tier=0,
            weight=3,
        ),
        ev.AttemptFinished(
            request_id=request_id,
            attempt_id=attempt,
            status="failed",
            failure_class=ev.FailureClass.UPSTREAM_UNAVAILABLE,
            evidence=ev.Evidence.UNKNOWN,
            http_status=502,
            duration_ms=10,
        ),
        ev.UnknownUsageOpened(
            settlement_id=f"{attempt}-s",
            request_id=request_id,
            attempt_id=attempt,
            reservation_id=f"{attempt}-r",
            workspace="acme",
            key_id="k_1",
            endpoint="east",
            model="gpt-4o-mini",
            held_usd=Decimal("0.0050"),
            cause="upstream_unavailable",
        ),
        ev.FailoverDecided(
            request_id=request_id,
            after_attempt_id=attempt,
            failure_class=ev.FailureClass.UPSTREAM_UNAVAILABLE,
            evidence=ev.Evidence.UNKNOWN,
            action="stop",
            allowed=False,
            reason="on_unknown_execution_stop",
        ),
        ev.RequestFailed(
            request_id=request_id,
            http_status=503,
            error_code="upstream_unavailable",
            error_type="upstream_error",
            message="all candidates failed",
            attempts=1,
            duration_ms=12,
        ),
    ]


def key_created(key_id: str = "k_1") -> ev.KeyCreated:
    return ev.KeyCreated(
        key_id=key_id,
        workspace="acme",
        role="client",
        secret_sha256=hashlib.sha256(key_id.encode()).hexdigest(),
    )
