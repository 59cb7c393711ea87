"""Why did this request go there? The explanation of contract §3, built from a request's events.

Pure: :func:`explain` takes the recorded events of one request (its ``request-<id>``
stream) and returns plain JSON values; :func:`render_text` (:mod:`ledger.views.explain_text`,
re-exported here) turns that into what ``waybill explain`` and
``GET /v1/requests/{id}/explain?format=text`` print. Nothing here
reads a clock, the config or a read model, so a request's explanation is the same today,
after ``waybill replay`` and on any replica.

The explanation holds:

- ``summary``: one paragraph naming the route taken, each failed attempt with its HTTP
  status, failure class, evidence and the failover decision's reason, each mapping that was
  never chosen and why (its reason code), the money and the config generation;
- ``candidates``: every mapping of every route evaluation, eligible or its reason code,
  with the chosen one's round-robin position; in a composed group each evaluation's level
  (``group_path``: the composer's candidates are its pools, a pool's its mappings);
- ``attempts``: each attempt with its failure class, evidence, timings, reservation and its
  outcome, and the failover decision that followed it;
- ``decision_path``: every event of the request as one ordered, readable step;
- ``budget_checks``: the reservations, denials, settlements and releases, when recorded.

Money is a decimal string; codes are the contract's words, never paraphrased.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any, Final

from ledger import events as ev
from ledger.store import RecordedEvent
from ledger.types import money_str
from ledger.views.explain_text import render_text

__all__ = ["Explanation", "NotARequestTrail", "explain", "render_text"]

Explanation = dict[str, Any]
"""The JSON explanation: plain dicts, lists, strings, numbers, booleans and None."""

_ZERO: Final = Decimal(0)

_EVIDENCE_PHRASE: Final[Mapping[str, str]] = {
    ev.Evidence.NOT_STARTED: "before starting work",
    ev.Evidence.UNKNOWN: "with execution unknown",
    ev.Evidence.STARTED: "after starting work",
}

# The rules of contract §5 "Per on_unknown_execution" in plain words: whether an attempt that
# may have run is followed by another. Other decision reasons read plainly as their codes.
_RULE_WORDS: Final[Mapping[str, str]] = {
    "on_unknown_execution_stop": (
        "strict, as on_unknown_execution: stop says: a request whose attempt may have run "
        "is never run again"
    ),
    "server_side_effects_strict": (
        "strict, as every request asking the provider for server-side effects (server-side "
        "tools, web search) is: it is never run again once an attempt may have run"
    ),
    "unknown_execution_allowed_by_header": (
        "the caller's X-Waybill-Allow-Failover: unknown allowed running it again although "
        "the attempt may have run"
    ),
    "failover_not_granted": (
        "the model group fails over only on grant (failover: on_grant), and the request "
        "carried no X-Waybill-Allow-Failover: true"
    ),
}

_BUDGET_TYPES: Final = frozenset(
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


class NotARequestTrail(ValueError):
    """The events do not begin with a ``RequestReceived``: there is no request to explain."""


# --- gathering the trail -------------------------------------------------------------------


@dataclass
class _Money:
    """One attempt's reservation, as the budget events tell it."""

    reservation_id: str | None = None
    reserved: Decimal | None = None
    settled: Decimal = _ZERO
    released: Decimal = _ZERO
    held_unknown: Decimal = _ZERO
    overrun: Decimal = _ZERO  # settled beyond the reservation
    outcome: str | None = None  # held | settled | released | held_unknown | unknown_settled


@dataclass
class _Attempt:
    started: ev.AttemptStarted
    finished: ev.AttemptFinished | None = None
    decided: ev.FailoverDecided | None = None

    @property
    def name(self) -> str:
        return f"{self.started.endpoint}/{self.started.model}"

    @property
    def status(self) -> str:
        return "in_progress" if self.finished is None else self.finished.status


@dataclass
class _Trail:
    received: ev.RequestReceived
    steps: list[tuple[RecordedEvent, ev.Event]] = field(default_factory=list)
    evaluations: list[ev.RouteEvaluated] = field(default_factory=list)
    attempts: dict[str, _Attempt] = field(default_factory=dict)
    money: dict[str, _Money] = field(default_factory=dict)
    denials: list[ev.BudgetReservationDenied] = field(default_factory=list)
    end: ev.RequestCompleted | ev.RequestFailed | None = None
    ended_at: datetime | None = None

    @property
    def status(self) -> str:
        match self.end:
            case ev.RequestCompleted():
                return "succeeded"
            case ev.RequestFailed(stream_started=True):
                return "partial_failure"
            case ev.RequestFailed():
                return "failed"
        return "in_progress"

    @property
    def budgeted(self) -> bool:
        return bool(self.money) or bool(self.denials)

    def number(self, attempt_id: str) -> str:
        attempt = self.attempts.get(attempt_id)
        return f"attempt {attempt.started.attempt_number}" if attempt else f"attempt {attempt_id}"


def _gather(events: Sequence[RecordedEvent]) -> _Trail:
    ordered = sorted(events, key=lambda r: r.position)
    if not ordered or ordered[0].type != ev.RequestReceived.type:
        raise NotARequestTrail("a request's events begin with RequestReceived")
    first = ordered[0].event()
    assert isinstance(first, ev.RequestReceived)
    trail = _Trail(received=first)
    for recorded in ordered:
        event = recorded.event()
        if getattr(event, "request_id", first.request_id) != first.request_id:
            continue  # not this request's fact
        trail.steps.append((recorded, event))
        _fold(trail, recorded, event)
    return trail


def _fold(trail: _Trail, recorded: RecordedEvent, event: ev.Event) -> None:
    money = trail.money
    match event:
        case ev.RouteEvaluated():
            trail.evaluations.append(event)
        case ev.AttemptStarted():
            trail.attempts[event.attempt_id] = _Attempt(event)
        case ev.AttemptFinished():
            if event.attempt_id in trail.attempts:
                trail.attempts[event.attempt_id].finished = event
        case ev.FailoverDecided():
            if event.after_attempt_id in trail.attempts:
                trail.attempts[event.after_attempt_id].decided = event
        case ev.BudgetReserved():
            m = money.setdefault(event.attempt_id, _Money())
            m.reservation_id = event.reservation_id
            m.reserved = (m.reserved or _ZERO) + event.amount_usd
            m.outcome = "held"
        case ev.BudgetReservationDenied():
            trail.denials.append(event)
        case ev.BudgetSettled():
            m = money.setdefault(event.attempt_id, _Money())
            m.settled += event.settled_usd
            m.released += event.released_usd
            m.outcome = "settled"
        case ev.BudgetReleased():
            m = money.setdefault(event.attempt_id, _Money())
            m.released += event.released_usd
            m.outcome = "released"
        case ev.UnknownUsageOpened():
            m = money.setdefault(event.attempt_id, _Money())
            m.held_unknown += event.held_usd
            m.outcome = "held_unknown"
        case ev.UnknownUsageSettled():
            m = money.setdefault(event.attempt_id, _Money())
            m.held_unknown -= event.held_usd
            m.settled += event.settled_usd
            m.released += event.released_usd
            m.outcome = "unknown_settled"
        case ev.BudgetOverrun():
            money.setdefault(event.attempt_id, _Money()).overrun += event.excess_usd
        case ev.RequestCompleted() | ev.RequestFailed():
            trail.end = event
            trail.ended_at = recorded.recorded_at


# --- the explanation -----------------------------------------------------------------------


def explain(events: Sequence[RecordedEvent]) -> Explanation:
    """The explanation of the request whose recorded events these are (its whole stream)."""
    trail = _gather(events)
    received = trail.received
    end = trail.end
    totals = _totals(trail)
    return {
        "request_id": received.request_id,
        "workspace": received.workspace,
        "key_id": received.key_id,
        "model": received.model_group,
        "api": received.api,
        "status": trail.status,
        "http_status": end.http_status if end is not None else None,
        "error_code": end.error_code if isinstance(end, ev.RequestFailed) else None,
        "endpoint": _final_endpoint(trail),
        "config_generation": received.config_generation,
        "requirements": received.requirements.model_dump(mode="json"),
        "received_at": trail.steps[0][0].recorded_at.isoformat(),
        "completed_at": trail.ended_at.isoformat() if trail.ended_at else None,
        "duration_ms": end.duration_ms if end is not None else None,
        "cost_usd": _money(end.cost_usd) if isinstance(end, ev.RequestCompleted) else None,
        **totals,
        "summary": _summary(trail),
        "candidates": _candidates(trail),
        "attempts": [_attempt_json(trail, a) for a in trail.attempts.values()],
        "decision_path": [_step(trail, r, e) for r, e in trail.steps],
        "budget_checks": [_budget_check(r, e) for r, e in trail.steps if e.type in _BUDGET_TYPES],
    }


def _money(amount: Decimal | None) -> str | None:
    return None if amount is None else money_str(amount)


def _final_endpoint(trail: _Trail) -> str | None:
    end = trail.end
    if isinstance(end, ev.RequestCompleted | ev.RequestFailed):
        return end.endpoint
    return None


def _totals(trail: _Trail) -> dict[str, str | None]:
    if not trail.budgeted:
        return dict.fromkeys(
            ("reserved_usd", "settled_usd", "released_usd", "held_unknown_usd", "overrun_usd")
        )
    ms = trail.money.values()
    return {
        "reserved_usd": money_str(sum((m.reserved or _ZERO for m in ms), _ZERO)),
        "settled_usd": money_str(sum((m.settled for m in ms), _ZERO)),
        "released_usd": money_str(sum((m.released for m in ms), _ZERO)),
        "held_unknown_usd": money_str(sum((m.held_unknown for m in ms), _ZERO)),
        "overrun_usd": money_str(sum((m.overrun for m in ms), _ZERO)),
    }


def _by_strategy(evaluation: ev.RouteEvaluated) -> str:
    """The figures a least_cost or least_latency choice compared, in words ("" if weighted)."""
    chosen = evaluation.chosen
    if chosen is None or evaluation.strategy == "weighted":
        return ""
    rivals = [c for c in evaluation.candidates if c.eligible and c.tier == chosen.tier]
    if evaluation.strategy == "least_cost":
        figures = ", ".join(
            f"{c.endpoint}/{c.model} ${money_str(c.worst_case_usd)}"
            for c in rivals
            if c.worst_case_usd is not None
        )
        return f"least worst-case cost of {figures}; "
    figures = ", ".join(
        f"{c.endpoint}/{c.model} "
        + ("not measured yet" if c.latency_ms is None else f"{c.latency_ms} ms")
        for c in rivals
    )
    return f"least latency of {figures}; "


def _candidates(trail: _Trail) -> list[dict[str, Any]]:
    rows = []
    for evaluation in trail.evaluations:
        chosen = evaluation.chosen
        for c in evaluation.candidates:
            is_chosen = chosen is not None and chosen.mapping_index == c.mapping_index
            rows.append(
                {
                    "evaluation": evaluation.sequence,
                    # A composed group's level (contract §4 "Pools"); [] for a plain group.
                    "group_path": list(evaluation.group_path),
                    "pool": c.pool,
                    "mapping_index": c.mapping_index,
                    "endpoint": c.endpoint,
                    "model": c.model,
                    "tier": c.tier,
                    "weight": c.weight,
                    "eligible": c.eligible,
                    "reason_code": c.reason_code.value if c.reason_code else None,
                    "detail": c.detail,
                    "worst_case_usd": _money(c.worst_case_usd),
                    "latency_ms": c.latency_ms,
                    "strategy": evaluation.strategy,
                    "chosen": is_chosen,
                    "selection_position": chosen.selection_position
                    if chosen is not None and is_chosen
                    else None,
                    "preferred": chosen is not None and is_chosen and chosen.preferred,
                }
            )
    return rows


def _attempt_json(trail: _Trail, attempt: _Attempt) -> dict[str, Any]:
    s, f, d = attempt.started, attempt.finished, attempt.decided
    m = trail.money.get(s.attempt_id)
    return {
        "attempt_id": s.attempt_id,
        "attempt_number": s.attempt_number,
        "cause": s.cause,
        "kind": s.kind,
        "resumed_from": s.resumed_from,
        "delivered_chars": s.delivered_chars,
        "hedge_of": s.hedge_of,
        "admitted_as": s.admitted_as,
        "dispatch": s.dispatch,
        "pool": s.pool,
        "group_path": list(s.group_path),
        "preferred_endpoint": s.preferred_endpoint,
        # The endpoint's own timeouts laid over the group's policy; None: the policy's.
        "timeouts": s.timeouts.model_dump() if s.timeouts is not None else None,
        "endpoint": s.endpoint,
        "model": s.model,
        "tier": s.tier,
        "weight": s.weight,
        "driver": s.driver,
        "stream": s.stream,
        "status": attempt.status,
        "failure_class": f.failure_class.value if f and f.failure_class else None,
        "evidence": f.evidence.value if f else None,
        "http_status": f.http_status if f else None,
        "error_code": f.error_code if f else None,
        "retry_after_ms": f.retry_after_ms if f else None,
        "duration_ms": f.duration_ms if f else None,
        "time_to_first_chunk_ms": f.time_to_first_chunk_ms if f else None,
        "stream_committed": f.stream_committed if f else False,
        "invalid_events": f.invalid_events if f else 0,
        "usage": f.usage.model_dump(mode="json") if f and f.usage else None,
        "upstream_request_id": f.upstream_request_id if f else None,
        "reservation_id": (m.reservation_id if m else None) or s.reservation_id,
        "reserved_usd": _money(m.reserved) if m else None,
        "settled_usd": money_str(m.settled) if m else None,
        "released_usd": money_str(m.released) if m else None,
        "held_unknown_usd": money_str(m.held_unknown) if m else None,
        "overrun_usd": money_str(m.overrun) if m else None,
        "reservation": m.outcome if m else None,
        "failover": None
        if d is None
        else {
            "allowed": d.allowed,
            "action": d.action,
            "reason": d.reason,
            "backoff_ms": d.backoff_ms,
            "policy": d.policy,
        },
    }


# --- the summary ---------------------------------------------------------------------------


def _reason(code: ev.ReasonCode | None, detail: str | None) -> str:
    text = code.value if code else "ineligible"
    if not detail:
        return text
    return f"{text} {detail}" if " " not in detail else f"{text} ({detail})"


def _decision(d: ev.FailoverDecided | None) -> str:
    if d is None:
        return ""
    if d.action == "retry" and d.backoff_ms:
        return f" (retry in {d.backoff_ms} ms: {_reason_words(d.reason)})"
    return f" ({d.action}: {_reason_words(d.reason)})"


def _reason_words(reason: str) -> str:
    """A decision's reason code, with the rule behind it in plain words where it has one."""
    words = _RULE_WORDS.get(reason)
    return reason if words is None else f"{reason}, {words}"


def _failure_name(finished: ev.AttemptFinished) -> str:
    """A failed attempt's failure class, else its error code (``gateway_lost``: crash
    recovery ended it), else plain "failure"."""
    if finished.failure_class is not None:
        return finished.failure_class.value
    return finished.error_code or "failure"


def _failure(attempt: _Attempt) -> str:
    s, f = attempt.started, attempt.finished
    where = f"tier {s.tier}'s {attempt.name}"
    if f is None:
        return f"{where} (in flight)"
    cls = _failure_name(f)
    verb = f"answered {f.http_status} {cls}" if f.http_status else f"failed with {cls}"
    return f"{where} {verb} {_EVIDENCE_PHRASE[f.evidence]}{_decision(attempt.decided)}"


def _outcome(trail: _Trail) -> str:
    attempts = list(trail.attempts.values())
    end = trail.end
    head = f"Request {trail.received.request_id} (model group {trail.received.model_group})"
    last = attempts[-1] if attempts else None
    committed = (
        last
        if last is not None
        and (
            isinstance(end, ev.RequestCompleted)
            or (isinstance(end, ev.RequestFailed) and end.stream_started)
        )
        else None
    )
    earlier = [a for a in attempts if a is not committed and a.finished is not None]
    after = f" after {'; then '.join(_failure(a) for a in earlier)}" if earlier else ""
    nothing_left = bool(trail.evaluations) and trail.evaluations[-1].chosen is None
    if isinstance(end, ev.RequestCompleted):
        assert committed is not None
        where = f"{committed.name} on tier {committed.started.tier}"
        return f"{head} was served by {where}{after}"
    if isinstance(end, ev.RequestFailed) and committed is not None:
        f = committed.finished
        broke = (
            f"{_failure_name(f)} {_EVIDENCE_PHRASE[f.evidence]}"
            if f is not None
            else "no attempt outcome recorded"
        )
        return (
            f"{head} committed its stream to {committed.name} on tier "
            f"{committed.started.tier}{after}, and the stream broke after it started: {broke}; "
            f"recorded as a partial failure ({end.http_status} {end.error_code})"
        )
    if isinstance(end, ev.RequestFailed):
        text = f"{head} failed with {end.http_status} {end.error_code}"
        if earlier:
            text += after
        elif trail.denials:
            text += " before any attempt: the budget could not cover a reservation"
        elif nothing_left:
            text += " before any attempt: no candidate was eligible"
        else:
            text += " before any attempt"
        if earlier and nothing_left:
            text += "; then no eligible candidate was left"
        return text
    text = f"{head} is in progress{after}"
    if last is not None and last.finished is None:
        text += f"; attempt {last.started.attempt_number} on {last.name} is in flight"
    return text


def _not_chosen(trail: _Trail) -> list[str]:
    """Why each mapping that never carried an attempt did not (contract §4 reason codes)."""
    end, attempts = trail.end, list(trail.attempts.values())
    # A partial failure: once the stream was committed no other mapping could take it over
    # (contract §5 "Streaming"), so an eligible one left unused was not "never needed".
    broken_stream = (
        attempts[-1].name
        if attempts and isinstance(end, ev.RequestFailed) and end.stream_started
        else None
    )
    # A candidate is one per level: a composed group's evaluations index the composer's
    # members and each pool's mappings apart (contract §4 "Pools").
    chosen_indexes = {(e.group_path, e.chosen.mapping_index) for e in trail.evaluations if e.chosen}
    seen: dict[tuple[tuple[str, ...], int], list[tuple[ev.RouteEvaluated, ev.Candidate]]] = {}
    for evaluation in trail.evaluations:
        for c in evaluation.candidates:
            seen.setdefault((evaluation.group_path, c.mapping_index), []).append((evaluation, c))
    clauses = []
    for index in sorted(seen):
        if index in chosen_indexes:
            continue
        views = seen[index]
        c0 = views[0][1]
        name = _name(c0)
        if not any(c.eligible for _, c in views):
            reasons = list(dict.fromkeys(_reason(c.reason_code, c.detail) for _, c in views))
            clauses.append(f"{name} was never eligible: {', then '.join(reasons)}")
            continue
        preferred = [e.chosen for e, c in views if c.eligible and e.chosen and e.chosen.preferred]
        rivals = [e.chosen for e, c in views if c.eligible and e.chosen and e.chosen.tier == c.tier]
        if preferred:
            clauses.append(
                f"{name} on tier {c0.tier} was eligible but the caller preferred "
                f"{preferred[0].endpoint}/{preferred[0].model} (X-Waybill-Prefer-Endpoint)"
            )
        elif rivals:
            winner = rivals[0]
            how = {
                "weighted": "the weighted round-robin",
                "least_cost": "the least-cost strategy",
                "least_latency": "the least-latency strategy",
            }[next(e.strategy for e, c in views if c.eligible and e.chosen)]
            clauses.append(
                f"{name} was eligible on tier {c0.tier} (weight {c0.weight}) but {how} chose "
                f"{winner.endpoint}/{winner.model} (weight {winner.weight})"
            )
        elif broken_stream is not None:
            clauses.append(
                f"{name} on tier {c0.tier} was eligible but could not take over: the stream "
                f"was committed to {broken_stream}, and a committed stream is only resumed on "
                "its own model or ended"
            )
        else:
            clauses.append(f"{name} on tier {c0.tier} was eligible but never needed")
        for e, c in views:
            if not c.eligible and c.reason_code is not ev.ReasonCode.ALREADY_TRIED:
                clauses.append(
                    f"{name} was excluded from evaluation {e.sequence}: "
                    f"{_reason(c.reason_code, c.detail)}"
                )
    return clauses


def _name(c: ev.Candidate) -> str:
    """A candidate as the explanation names it: a composer's pool, or a mapping."""
    if c.pool is not None:
        return f"pool {c.pool}"
    return f"{c.endpoint}/{c.model}"


def _level(event: ev.RouteEvaluated) -> str:
    """Which level of a composed group an evaluation is ("" for a plain group's)."""
    path = event.group_path
    if not path:
        return ""
    if len(path) == 1:
        return f" of the members of composed group {path[0]}"
    return f" inside pool {path[-1]} ({' > '.join(path)})"


def _dispatch(event: ev.AttemptStarted) -> str:
    """How a composed group's attempt was dispatched to its pool ("" for a plain group's)."""
    if event.dispatch is None:
        return ""
    where = " > ".join(event.group_path)
    if event.dispatch == "delegate_pool":
        preferred = (
            f"; the composer preferred {event.preferred_endpoint}"
            if event.preferred_endpoint
            else ""
        )
        return f", delegated to pool {event.pool} ({where}), whose router chose it{preferred}"
    if event.pool is None:
        return f", executed exactly as a mapping of {where}"
    return f", executed exactly in pool {event.pool} ({where}) as the planned fallback"


def _money_clause(trail: _Trail) -> list[str]:
    clauses = []
    if trail.money:
        ms = list(trail.money.values())
        held = sum((m.held_unknown for m in ms), _ZERO)
        open_ = sum((m.reserved or _ZERO for m in ms if m.outcome == "held"), _ZERO)
        text = (
            f"cost ${money_str(sum((m.settled for m in ms), _ZERO))} settled, "
            f"${money_str(sum((m.released for m in ms), _ZERO))} released"
        )
        if held:
            text += f", ${money_str(held)} held as unknown usage"
        if open_:
            text += f", ${money_str(open_)} still reserved"
        overrun = sum((m.overrun for m in ms), _ZERO)
        if overrun:
            text += f", ${money_str(overrun)} of it beyond what was reserved (overrun)"
        clauses.append(text)
    else:
        end = trail.end
        if isinstance(end, ev.RequestCompleted) and end.cost_usd is not None:
            clauses.append(f"cost ${money_str(end.cost_usd)} from the reported usage")
        else:
            clauses.append("no cost recorded")
        unknown = [
            a.name
            for a in trail.attempts.values()
            if a.finished is not None
            and a.finished.usage is None
            and a.finished.evidence is not ev.Evidence.NOT_STARTED
        ]
        if unknown:
            clauses.append(f"usage unknown for the attempt on {', '.join(unknown)}")
    for denied in trail.denials:
        clauses.append(
            f"a reservation of ${money_str(denied.amount_usd)} on {denied.endpoint}/"
            f"{denied.model} was denied: {denied.account_kind} account {denied.account_id} "
            f"had ${money_str(denied.available_usd)} of ${money_str(denied.limit_usd)} left"
        )
    return clauses


def _summary(trail: _Trail) -> str:
    clauses = [
        _outcome(trail),
        *_resumes_and_hedges(trail),
        *_not_chosen(trail),
        *_money_clause(trail),
        f"config generation {trail.received.config_generation}",
    ]
    return "; ".join(clauses) + "."


def _resumes_and_hedges(trail: _Trail) -> list[str]:
    """The attempts that were not a plain retry or failover, in words."""
    started = [a.started for a in trail.attempts.values()]
    clauses = []
    resumes = [s for s in started if s.kind == "resume"]
    if resumes:
        times = "once" if len(resumes) == 1 else f"{len(resumes)} times"
        clauses.append(
            f"its stream broke and was resumed on the same upstream model {times}, the "
            "client's text sent back as the partial answer and only the continuation forwarded"
        )
    for hedge in (s for s in started if s.kind == "hedge" and s.hedge_of is not None):
        beside = trail.number(hedge.hedge_of or "")
        clauses.append(
            f"attempt {hedge.attempt_number} was a hedge beside {beside}, the first to answer "
            "winning and the other cancelled"
        )
    return clauses


# --- the decision path and the budget checks -------------------------------------------------


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


def _step(trail: _Trail, recorded: RecordedEvent, event: ev.Event) -> dict[str, Any]:
    return {
        "position": recorded.position,
        "recorded_at": recorded.recorded_at.isoformat(),
        "event": event.type,
        "text": _step_text(trail, event),
    }


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


def _step_text(trail: _Trail, event: ev.Event) -> str:
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
                f"evaluation {event.sequence}{_level(event)}: {eligible} of "
                f"{len(event.candidates)} candidates eligible"
            )
            excluded = [
                f"{_name(c)}: {_reason(c.reason_code, c.detail)}"
                for c in event.candidates
                if not c.eligible
            ]
            if excluded:
                text += f" (excluded {'; '.join(excluded)})"
            if event.chosen is None:
                return text + "; nothing eligible left"
            ch = event.chosen
            if ch.preferred:
                return (
                    f"{text}; chose {ch.endpoint}/{ch.model} on tier {ch.tier}, the caller's "
                    "preferred endpoint (X-Waybill-Prefer-Endpoint)"
                )
            return (
                f"{text}; chose {ch.endpoint}/{ch.model} on tier {ch.tier} "
                f"({_by_strategy(event)}weight {ch.weight}, round-robin position "
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
            started += _dispatch(event)
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
            cls = _failure_name(event)
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
                f"{event.action}{wait}, {verdict}: {_reason_words(event.reason)}"
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


def _budget_check(recorded: RecordedEvent, event: ev.Event) -> dict[str, Any]:
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
