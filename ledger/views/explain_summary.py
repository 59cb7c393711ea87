"""The explanation's ``summary``: one paragraph on a request's route, failures and money.

The outcome with each failed attempt and its failover decision, the resumes and hedges, why
each mapping never chosen was not, the money and the config generation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from ledger import events as ev
from ledger.types import money_str
from ledger.views.explain_trail import ZERO, Attempt, Trail
from ledger.views.explain_words import candidate_name, failure_name, reason_text, reason_words

__all__ = ["summary"]

_EVIDENCE_PHRASE: Final[Mapping[str, str]] = {
    ev.Evidence.NOT_STARTED: "before starting work",
    ev.Evidence.UNKNOWN: "with execution unknown",
    ev.Evidence.STARTED: "after starting work",
}


def summary(trail: Trail) -> str:
    clauses = [
        _outcome(trail),
        *_resumes_and_hedges(trail),
        *_not_chosen(trail),
        *_money_clause(trail),
        f"config generation {trail.received.config_generation}",
    ]
    return "; ".join(clauses) + "."


def _outcome(trail: Trail) -> str:
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
            f"{failure_name(f)} {_EVIDENCE_PHRASE[f.evidence]}"
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


def _failure(attempt: Attempt) -> str:
    s, f = attempt.started, attempt.finished
    where = f"tier {s.tier}'s {attempt.name}"
    if f is None:
        return f"{where} (in flight)"
    cls = failure_name(f)
    verb = f"answered {f.http_status} {cls}" if f.http_status else f"failed with {cls}"
    return f"{where} {verb} {_EVIDENCE_PHRASE[f.evidence]}{_decision(attempt.decided)}"


def _decision(d: ev.FailoverDecided | None) -> str:
    if d is None:
        return ""
    if d.action == "retry" and d.backoff_ms:
        return f" (retry in {d.backoff_ms} ms: {reason_words(d.reason)})"
    return f" ({d.action}: {reason_words(d.reason)})"


def _resumes_and_hedges(trail: Trail) -> list[str]:
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


def _not_chosen(trail: Trail) -> list[str]:
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
        name = candidate_name(c0)
        if not any(c.eligible for _, c in views):
            reasons = list(dict.fromkeys(reason_text(c.reason_code, c.detail) for _, c in views))
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
                    f"{reason_text(c.reason_code, c.detail)}"
                )
    return clauses


def _money_clause(trail: Trail) -> list[str]:
    clauses = []
    if trail.money:
        ms = list(trail.money.values())
        held = sum((m.held_unknown for m in ms), ZERO)
        open_ = sum((m.reserved or ZERO for m in ms if m.outcome == "held"), ZERO)
        text = (
            f"cost ${money_str(sum((m.settled for m in ms), ZERO))} settled, "
            f"${money_str(sum((m.released for m in ms), ZERO))} released"
        )
        if held:
            text += f", ${money_str(held)} held as unknown usage"
        if open_:
            text += f", ${money_str(open_)} still reserved"
        overrun = sum((m.overrun for m in ms), ZERO)
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
