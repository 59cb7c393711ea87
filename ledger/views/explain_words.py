"""The phrases the summary and the decision path share: candidates, levels, reasons, failures.

A candidate's name, a composed group's level and dispatch, a reason code with its detail, a
failover decision's reason with the rule behind it in plain words, a failure's name and
the figures a strategy compared. Codes are the contract's words, never paraphrased.
"""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from typing import Final

from ledger import events as ev
from ledger.types import money_str

__all__ = [
    "by_strategy",
    "candidate_name",
    "dispatch_text",
    "failure_name",
    "level_text",
    "reason_text",
    "reason_words",
    "weight_text",
]

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


def reason_text(code: ev.ReasonCode | None, detail: str | None) -> str:
    text = code.value if code else "ineligible"
    if not detail:
        return text
    return f"{text} {detail}" if " " not in detail else f"{text} ({detail})"


def reason_words(reason: str) -> str:
    """A decision's reason code, with the rule behind it in plain words where it has one."""
    words = _RULE_WORDS.get(reason)
    return reason if words is None else f"{reason}, {words}"


def failure_name(finished: ev.AttemptFinished) -> str:
    """A failed attempt's failure class, else its error code (``gateway_lost``: crash
    recovery ended it), else plain "failure"."""
    if finished.failure_class is not None:
        return finished.failure_class.value
    return finished.error_code or "failure"


def weight_text(weight: int, effective: Decimal | None) -> str:
    """A chosen candidate's weight: as configured, and while a breaker of its endpoint or
    mapping ramps up after closing (contract §5), the weight selection ranked it by."""
    if effective is None:
        return f"weight {weight}"
    return (
        f"weight {weight}, ramping up after its breaker closed: effective weight "
        f"{format(effective, 'f')}"
    )


def candidate_name(c: ev.Candidate) -> str:
    """A candidate as the explanation names it: a composer's pool, or a mapping."""
    if c.pool is not None:
        return f"pool {c.pool}"
    return f"{c.endpoint}/{c.model}"


def level_text(event: ev.RouteEvaluated) -> str:
    """Which level of a composed group an evaluation is ("" for a plain group's)."""
    path = event.group_path
    if not path:
        return ""
    if len(path) == 1:
        return f" of the members of composed group {path[0]}"
    return f" inside pool {path[-1]} ({' > '.join(path)})"


def dispatch_text(event: ev.AttemptStarted) -> str:
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


def by_strategy(evaluation: ev.RouteEvaluated) -> str:
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
