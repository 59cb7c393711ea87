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

This module assembles the JSON; its parts live beside it: the fold of the events into a
trail (:mod:`ledger.views.explain_trail`), the summary (:mod:`ledger.views.explain_summary`),
the decision path and budget checks (:mod:`ledger.views.explain_steps`) and the phrases those
two share (:mod:`ledger.views.explain_words`).
"""

from __future__ import annotations

from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from ledger import events as ev
from ledger.store import RecordedEvent
from ledger.types import money_str
from ledger.views.explain_steps import BUDGET_TYPES, budget_check, step
from ledger.views.explain_summary import summary
from ledger.views.explain_text import render_text
from ledger.views.explain_trail import ZERO, Attempt, NotARequestTrail, Trail, gather_trail

__all__ = ["Explanation", "NotARequestTrail", "explain", "render_text"]

Explanation = dict[str, Any]
"""The JSON explanation: plain dicts, lists, strings, numbers, booleans and None."""


def explain(events: Sequence[RecordedEvent]) -> Explanation:
    """The explanation of the request whose recorded events these are (its whole stream)."""
    trail = gather_trail(events)
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
        "summary": summary(trail),
        "candidates": _candidates(trail),
        "attempts": [_attempt_json(trail, a) for a in trail.attempts.values()],
        "decision_path": [step(trail, r, e) for r, e in trail.steps],
        "budget_checks": [budget_check(r, e) for r, e in trail.steps if e.type in BUDGET_TYPES],
    }


def _money(amount: Decimal | None) -> str | None:
    return None if amount is None else money_str(amount)


def _final_endpoint(trail: Trail) -> str | None:
    end = trail.end
    if isinstance(end, ev.RequestCompleted | ev.RequestFailed):
        return end.endpoint
    return None


def _totals(trail: Trail) -> dict[str, str | None]:
    if not trail.budgeted:
        return dict.fromkeys(
            ("reserved_usd", "settled_usd", "released_usd", "held_unknown_usd", "overrun_usd")
        )
    ms = trail.money.values()
    return {
        "reserved_usd": money_str(sum((m.reserved or ZERO for m in ms), ZERO)),
        "settled_usd": money_str(sum((m.settled for m in ms), ZERO)),
        "released_usd": money_str(sum((m.released for m in ms), ZERO)),
        "held_unknown_usd": money_str(sum((m.held_unknown for m in ms), ZERO)),
        "overrun_usd": money_str(sum((m.overrun for m in ms), ZERO)),
    }


def _candidates(trail: Trail) -> list[dict[str, Any]]:
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
                    # Below weight while a breaker ramps up after closing (contract §5).
                    "effective_weight": None
                    if c.effective_weight is None
                    else format(c.effective_weight, "f"),
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


def _attempt_json(trail: Trail, attempt: Attempt) -> dict[str, Any]:
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
