"""The explanation's ``decision_path`` and ``budget_checks``: each event as one step.

:func:`step` words every event of a request as one readable step; :func:`budget_check`
gives each budget event's figures (:data:`BUDGET_TYPES` are the events it covers).
"""

from __future__ import annotations

from typing import Any, Final

from ledger import events as ev
from ledger.store import RecordedEvent
from ledger.types import money_str
from ledger.views.explain_trail import Trail
from ledger.views.explain_words import (
    by_strategy,
    candidate_name,
    dispatch_text,
    failure_name,
    level_text,
    reason_text,
    reason_words,
    weight_text,
)

__all__ = ["BUDGET_TYPES", "budget_check", "step"]

BUDGET_TYPES: Final = frozenset(
    {
        ev.BudgetReserved.type,
        ev.BudgetReservationDenied.type,
        ev.BudgetSettled.type,
        ev.BudgetReleased.type,
        ev.UnknownUsageOpened.type,
        ev.UnknownUsageSettled.type,
        ev.BudgetOverrun.type,
    }
)


def step(trail: Trail, recorded: RecordedEvent, event: ev.Event) -> dict[str, Any]:
    return {
        "position": recorded.position,
        "recorded_at": recorded.recorded_at.isoformat(),
        "event": event.type,
        "text": _step_text(trail, event),
    }


def _step_text(trail: Trail, event: ev.Event) -> str:
    match event:
        case ev.RequestReceived():
            r = event.requirements
            needs = ", ".join(r.capabilities) or "nothing special"
            return (
                f"received through {event.api} for model group {event.model_group} from key "
                f"{event.key_id} of workspace {event.workspace}: needs {needs}; "
                f"data class {r.data_class}"
                + (f"; regions {', '.join(r.regions)}" if r.regions is not None else "")
                + _endpoint_scope_text(r)
                + ("" if r.allow_failover else "; failover forbidden by the caller")
                + ("; failover granted by the caller" if r.failover_granted else "")
                + (
                    "; asks the provider for server-side effects, so it is strict"
                    if r.server_side_effects
                    else ""
                )
                + (
                    "; the caller allows running it again after an attempt that may have run"
                    if r.allow_unknown_execution
                    else ""
                )
                + f"; billable: {_billable(r)}"
                + f"; config generation {event.config_generation}"
            )
        case ev.RouteEvaluated():
            eligible = sum(c.eligible for c in event.candidates)
            text = (
                f"evaluation {event.sequence}{level_text(event)}: {eligible} of "
                f"{len(event.candidates)} candidates eligible"
            )
            excluded = [
                f"{candidate_name(c)}: {reason_text(c.reason_code, c.detail)}"
                for c in event.candidates
                if not c.eligible
            ]
            if excluded:
                text += f" (excluded {'; '.join(excluded)})"
            if event.chosen is None:
                return text + "; nothing eligible left"
            ch = event.chosen
            ranked = [c for c in event.candidates if c.mapping_index == ch.mapping_index]
            effective = ranked[0].effective_weight if ranked else None
            if ch.preferred:
                return (
                    f"{text}; chose {ch.endpoint}/{ch.model} on tier {ch.tier}, the caller's "
                    "preferred endpoint (X-Waybill-Prefer-Endpoint)"
                )
            return (
                f"{text}; chose {ch.endpoint}/{ch.model} on tier {ch.tier} "
                f"({by_strategy(event)}{weight_text(ch.weight, effective)}, round-robin position "
                f"{ch.selection_position})"
            )
        case ev.BudgetReserved():
            accounts = ", ".join(a.account_id for a in event.accounts) or "no budget account"
            return (
                f"reserved ${money_str(event.amount_usd)} for {trail.number(event.attempt_id)} "
                f"on {event.endpoint}/{event.model} against {accounts}"
            )
        case ev.BudgetReservationDenied():
            return (
                f"reservation of ${money_str(event.amount_usd)} on {event.endpoint}/"
                f"{event.model} denied: {event.account_kind} account {event.account_id} has "
                f"${money_str(event.available_usd)} of ${money_str(event.limit_usd)} left"
            )
        case ev.AttemptStarted():
            started = (
                f"attempt {event.attempt_number} ({event.cause}) started on "
                f"{event.endpoint}/{event.model}, tier {event.tier}"
            )
            started += dispatch_text(event)
            if event.admitted_as is not None and event.admitted_as.startswith("probe"):
                scope = event.admitted_as.removeprefix("probe:").replace("+", " and ")
                started += f", as the half-open {scope} breaker's one probe"
            if event.timeouts is not None:
                t = event.timeouts
                started += (
                    f", under its endpoint's timeouts (attempt {t.attempt_timeout_ms} ms, first "
                    f"token {t.first_token_timeout_ms} ms, stream idle "
                    f"{t.stream_idle_timeout_ms} ms)"
                )
            if event.kind == "resume" and event.resumed_from is not None:
                started += (
                    f": a resume of {trail.number(event.resumed_from)}, continuing the "
                    f"{event.delivered_chars} characters the client already had"
                )
            elif event.kind == "hedge" and event.hedge_of is not None:
                started += (
                    f": a hedge beside {trail.number(event.hedge_of)}, which had not "
                    "answered yet; the first to answer wins"
                )
            return started
        case ev.StreamCommitted():
            first = (
                f", {event.time_to_first_chunk_ms} ms to its first chunk"
                if event.time_to_first_chunk_ms is not None
                else ""
            )
            return (
                f"{trail.number(event.attempt_id)} committed its stream to the client on "
                f"{event.endpoint}{first}: no failover from here"
            )
        case ev.AttemptFinished():
            where = trail.number(event.attempt_id)
            if event.status == "succeeded":
                usage = (
                    f", usage {event.usage.input_tokens} in / {event.usage.output_tokens} out"
                    if event.usage
                    else ", usage not reported"
                )
                return f"{where} succeeded: {event.http_status} in {event.duration_ms} ms{usage}"
            status = f"{event.http_status} " if event.http_status else ""
            cls = failure_name(event)
            return (
                f"{where} failed: {status}{cls}, evidence {event.evidence.value}, "
                f"{event.duration_ms} ms"
            )
        case ev.FailoverDecided():
            where = trail.number(event.after_attempt_id)
            verdict = "allowed" if event.allowed else "not allowed"
            wait = f" after {event.backoff_ms} ms" if event.backoff_ms else ""
            return (
                f"after {where} ({event.failure_class.value}, {event.evidence.value}): "
                f"{event.action}{wait}, {verdict}: {reason_words(event.reason)}"
            )
        case ev.BudgetSettled():
            return (
                f"settled ${money_str(event.settled_usd)} of ${money_str(event.reserved_usd)} "
                f"reserved for {trail.number(event.attempt_id)}, released "
                f"${money_str(event.released_usd)}"
            )
        case ev.BudgetReleased():
            return (
                f"released ${money_str(event.released_usd)} reserved for "
                f"{trail.number(event.attempt_id)}: {event.reason}"
            )
        case ev.UnknownUsageOpened():
            return (
                f"held ${money_str(event.held_usd)} of {trail.number(event.attempt_id)} as "
                f"unknown usage (settlement {event.settlement_id}): {event.cause}"
            )
        case ev.UnknownUsageSettled():
            by = (
                f"reconciliation {event.reconciliation_id}"
                if event.source == "reconciliation"
                else f"operator {event.actor}"
            )
            why = f": {event.reason}" if event.reason else ""
            return (
                f"unknown usage {event.settlement_id} settled by {by}: "
                f"${money_str(event.settled_usd)} settled, ${money_str(event.released_usd)} "
                f"released{why}"
            )
        case ev.BudgetOverrun():
            return (
                f"overrun: {trail.number(event.attempt_id)} settled "
                f"${money_str(event.actual_usd)} against a reservation of "
                f"${money_str(event.held_usd)}, ${money_str(event.excess_usd)} beyond it "
                f"({event.cause}); counted on {', '.join(event.accounts) or 'no budget account'}"
            )
        case ev.PeriodAdjusted():
            return (
                f"{event.period} was closed: the change to {trail.number(event.attempt_id)} "
                f"is an adjustment recorded in {event.in_period} (settled "
                f"{money_str(event.settled_usd)}, held unknown "
                f"{money_str(event.held_unknown_usd)}, overrun {money_str(event.overrun_usd)})"
            )
        case ev.RequestCompleted():
            cost = f", cost ${money_str(event.cost_usd)}" if event.cost_usd is not None else ""
            return (
                f"completed: served by {event.endpoint}/{event.model} after {event.attempts} "
                f"attempt(s){cost}, {event.duration_ms} ms"
            )
        case ev.RequestFailed():
            kind = "partial failure" if event.stream_started else "failed"
            return (
                f"{kind}: {event.http_status} {event.error_code} after {event.attempts} "
                f"attempt(s), {event.duration_ms} ms: {event.message}"
            )
    return event.type


def _endpoint_scope_text(r: ev.Requirements) -> str:
    """The caller's endpoint scope and target, as RequestReceived recorded them."""
    text = ""
    if r.key_endpoints is not None:
        text += f"; the key's endpoint scope {', '.join(r.key_endpoints)}"
    if r.endpoints is not None:
        text += f"; endpoints narrowed to {', '.join(r.endpoints)}"
    if r.require_endpoint is not None:
        text += f"; pinned to endpoint {r.require_endpoint}: no other is ever tried"
    if r.prefer_endpoint is not None:
        text += f"; prefers endpoint {r.prefer_endpoint}"
    return text


def _billable(r: ev.Requirements) -> str:
    """What the request may be billed for: the facts its worst case is made of."""
    output = "the mapping's max" if r.max_output_tokens is None else f"{r.max_output_tokens}"
    each = " each" if r.choices > 1 else ""
    facts = [f"up to {r.estimated_input_tokens} input tokens of text"]
    facts += [
        f"{count} {kind} part{'s' if count > 1 else ''}"
        for count, kind in (
            (r.image_inputs, "image"),
            (r.audio_inputs, "audio"),
            (r.file_inputs, "file"),
        )
        if count
    ]
    facts.append(
        f"{r.choices} choice{'s' if r.choices > 1 else ''} of up to {output} output tokens{each}"
    )
    if r.prediction_tokens:
        facts.append(f"a prediction of up to {r.prediction_tokens} tokens per choice")
    if r.audio_output:
        facts.append("audio output")
    if r.web_search:
        facts.append("web search")
    if r.unknown_inputs:
        facts.append(f"content parts no price covers ({', '.join(r.unknown_inputs)})")
    return ", ".join(facts)


def budget_check(recorded: RecordedEvent, event: ev.Event) -> dict[str, Any]:
    check: dict[str, Any] = {"position": recorded.position, "event": event.type}
    match event:
        case ev.BudgetReserved():
            check.update(
                check="reserved",
                attempt_id=event.attempt_id,
                reservation_id=event.reservation_id,
                endpoint=event.endpoint,
                model=event.model,
                amount_usd=money_str(event.amount_usd),
                accounts=[a.model_dump(mode="json") for a in event.accounts],
            )
        case ev.BudgetReservationDenied():
            check.update(
                check="denied",
                endpoint=event.endpoint,
                model=event.model,
                amount_usd=money_str(event.amount_usd),
                account_id=event.account_id,
                account_kind=event.account_kind,
                limit_usd=money_str(event.limit_usd),
                available_usd=money_str(event.available_usd),
            )
        case ev.BudgetSettled():
            check.update(
                check="settled",
                attempt_id=event.attempt_id,
                reservation_id=event.reservation_id,
                reserved_usd=money_str(event.reserved_usd),
                settled_usd=money_str(event.settled_usd),
                released_usd=money_str(event.released_usd),
            )
        case ev.BudgetReleased():
            check.update(
                check="released",
                attempt_id=event.attempt_id,
                reservation_id=event.reservation_id,
                released_usd=money_str(event.released_usd),
                reason=event.reason,
            )
        case ev.UnknownUsageOpened():
            check.update(
                check="unknown_usage_opened",
                attempt_id=event.attempt_id,
                reservation_id=event.reservation_id,
                settlement_id=event.settlement_id,
                held_usd=money_str(event.held_usd),
                cause=event.cause,
            )
        case ev.UnknownUsageSettled():
            check.update(
                check="unknown_usage_settled",
                attempt_id=event.attempt_id,
                reservation_id=event.reservation_id,
                settlement_id=event.settlement_id,
                held_usd=money_str(event.held_usd),
                settled_usd=money_str(event.settled_usd),
                released_usd=money_str(event.released_usd),
                source=event.source,
                actor=event.actor,
            )
            if event.bucket is not None:  # settled from a provider report's bucket
                check.update(reconciliation_id=event.reconciliation_id, bucket=event.bucket)
        case ev.BudgetOverrun():
            check.update(
                check="overrun",
                attempt_id=event.attempt_id,
                reservation_id=event.reservation_id,
                held_usd=money_str(event.held_usd),
                actual_usd=money_str(event.actual_usd),
                excess_usd=money_str(event.excess_usd),
                accounts=list(event.accounts),
                cause=event.cause,
            )
    return check
