"""The error a request the walk ended is answered with (contract §3's error table), chosen
from plain values: how the walk ended (:class:`router.request.walk.Fail`), what the failed
attempts were (:class:`Tally`), the last evaluation's candidates.

The first cause that names what the client can do wins: a budget, a rate limit with its
``Retry-After``, a refused key only an operator fixes, breakers cooling down, and only then
"no eligible route", with every exclusion named.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from ledger import events as ev
from router.drivers import UpstreamFailure
from router.errors import (
    AttemptSummary,
    GatewayError,
    admission_refused,
    budget_exceeded,
    deadline_exceeded,
    error_for_failure,
    invalid_request,
    no_eligible_route,
    stream_broken,
)
from router.request.classify import Classification
from router.request.decision import Decision
from router.request.moves import (
    Fail,
)

__all__ = [
    "ADMISSION_REFUSALS",
    "MAX_ADMISSION_RETRY_AFTER_S",
    "Tally",
    "admission_retry_after_s",
    "decision_error",
    "final_error",
    "no_route_error",
]


@dataclass(slots=True)
class Tally:
    """What the request's attempts came to so far, for its final answer."""

    summaries: list[AttemptSummary] = field(default_factory=list)  # every attempt's end
    classes: list[ev.FailureClass] = field(default_factory=list)  # the failed ones' classes
    retry_after_ms: int | None = None  # the last one an upstream asked for

    def failed(self, summary: AttemptSummary, classification: Classification) -> None:
        self.summaries.append(summary)
        self.classes.append(classification.failure_class)
        if classification.retry_after_ms is not None:
            self.retry_after_ms = classification.retry_after_ms


def final_error(
    fail: Fail,
    *,
    committed: bool,
    tally: Tally,
    candidates: tuple[ev.Candidate, ...],
    group: str,
    budget_refusal: str,
    failed: tuple[Classification, UpstreamFailure | None] | None,
    probe_in_ms: Mapping[int, int] | None = None,
) -> GatewayError:
    """The error for ``fail``: ``committed``, the stream went to the client already;
    ``candidates``, the last evaluation's; ``budget_refusal``, the books' last refusal of a
    reservation; ``failed``, the classification and failure of the attempt a decision
    stopped after; ``probe_in_ms``, of the candidates an open breaker refused, how long
    until it admits a probe (by mapping index)."""
    if committed:
        last = tally.classes[-1] if tally.classes else None
        return stream_broken(last or ev.FailureClass.NETWORK_ERROR)
    match fail.why:
        case "no_route":
            return no_route_error(candidates, tally, group, probe_in_ms)
        case "budget_raced":
            return budget_exceeded(budget_refusal)
        case "decision":
            assert failed is not None and fail.decision is not None
            return decision_error(failed[0], failed[1], fail.decision)


def decision_error(
    classification: Classification, failure: UpstreamFailure | None, decision: Decision
) -> GatewayError:
    """The error of a request stopped after a failed attempt."""
    failure_class = classification.failure_class
    if failure_class is ev.FailureClass.DEADLINE_EXCEEDED or decision.reason == (
        "deadline_exceeded"
    ):
        return deadline_exceeded()
    if (
        classification.clients_own
        and classification.evidence is ev.Evidence.NOT_STARTED
        and failure is not None
        and failure.outcome.error_message
    ):
        # The request itself is wrong (contract §3 "Errors"): the client is told what the
        # provider said, as its own 400, not as the gateway's failure.
        outcome = failure.outcome
        message = f"the upstream refused the request as invalid: {outcome.error_message}"
        return invalid_request(message, param=outcome.error_param)
    return error_for_failure(
        failure_class,
        _failure_message(classification, failure, decision),
        retry_after_ms=classification.retry_after_ms,
    )


def no_route_error(
    candidates: tuple[ev.Candidate, ...],
    tally: Tally,
    group: str,
    probe_in_ms: Mapping[int, int] | None = None,
) -> GatewayError:
    """The error of a request no eligible mapping is left for; ``probe_in_ms`` as
    :func:`final_error` takes it."""
    reasons = {c.reason_code for c in candidates if not c.eligible}
    if ev.ReasonCode.OVER_BUDGET in reasons:
        return budget_exceeded(
            "no eligible route fits the remaining budget: "
            + _exclusions(candidates, ev.ReasonCode.OVER_BUDGET)
        )
    if tally.classes:
        # Attempts were made and nothing is left to fail over to: name the real cause.
        if all(c is ev.FailureClass.RATE_LIMITED for c in tally.classes):
            return error_for_failure(
                ev.FailureClass.RATE_LIMITED,
                "every eligible endpoint is rate-limited",
                retry_after_ms=tally.retry_after_ms or 1000,
            )
        last = tally.classes[-1]
        return error_for_failure(last, f"no endpoint left to fail over to after {last}")
    if ev.ReasonCode.CREDENTIALS_DISABLED in reasons and reasons <= {
        ev.ReasonCode.CREDENTIALS_DISABLED,
        ev.ReasonCode.BREAKER_OPEN,
        ev.ReasonCode.ALREADY_TRIED,
    }:
        # Never "all busy": the cause is a refused key, which only an operator fixes.
        return error_for_failure(
            ev.FailureClass.CREDENTIALS,
            "the upstream refused the credentials of every endpoint left: "
            + _exclusions(candidates, ev.ReasonCode.CREDENTIALS_DISABLED),
        )
    if reasons & ADMISSION_REFUSALS:
        # Every candidate that could carry the request was refused at admission, before any
        # upstream I/O: not an upstream failure, and not for good (contract §3).
        return admission_refused(
            "every eligible endpoint refused admission before any upstream was called: "
            + "; ".join(
                _exclusions(candidates, reason)
                for reason in sorted(ADMISSION_REFUSALS)
                if reason in reasons
            ),
            retry_after_s=admission_retry_after_s(candidates, probe_in_ms or {}),
        )
    return no_eligible_route(
        f"no endpoint of model group {group!r} can serve this request: "
        + _exclusions(candidates, None)
    )


# The exclusions that waiting lifts: an endpoint's breaker admits a probe after its cool-down,
# a slot frees when an attempt in flight ends. A request whose candidates are all either
# refused so or excluded for good (capability, region, scope, ...) is answered 503, not 422.
ADMISSION_REFUSALS: Final = frozenset(
    {ev.ReasonCode.BREAKER_OPEN, ev.ReasonCode.ENDPOINT_SATURATED}
)
MAX_ADMISSION_RETRY_AFTER_S: Final = 30


def admission_retry_after_s(
    candidates: tuple[ev.Candidate, ...], probe_in_ms: Mapping[int, int]
) -> int:
    """When a request every candidate refused at admission is worth sending again, in whole
    seconds from 1 to :data:`MAX_ADMISSION_RETRY_AFTER_S`: the soonest any refused candidate
    may admit it. A saturated endpoint's slot frees whenever one of its attempts ends, which
    nothing foresees: at once, so 1 s. An open breaker admits a probe when its cool-down ends
    (``probe_in_ms``; unknown: at once). The bound keeps a long cool-down from parking a
    client that an operator's enabling, a reload or another candidate could serve sooner."""
    waits = [
        0
        if c.reason_code is ev.ReasonCode.ENDPOINT_SATURATED
        else probe_in_ms.get(c.mapping_index, 0)
        for c in candidates
        if c.reason_code in ADMISSION_REFUSALS
    ]
    soonest_s = math.ceil(min(waits, default=0) / 1000)
    return min(MAX_ADMISSION_RETRY_AFTER_S, max(1, soonest_s))


def _failure_message(
    classification: Classification, failure: UpstreamFailure | None, decision: Decision
) -> str:
    what = f"upstream failed: {classification.failure_class} ({classification.evidence})"
    if failure is not None and failure.outcome.error_message:
        what += f": {failure.outcome.error_message}"
    return f"{what}; {decision.reason.replace('_', ' ')}"


def _exclusions(candidates: tuple[ev.Candidate, ...], only: ev.ReasonCode | None) -> str:
    parts = [
        f"{c.endpoint}/{c.model}: {c.reason_code}" + (f" ({c.detail})" if c.detail else "")
        for c in candidates
        if not c.eligible and (only is None or c.reason_code is only)
    ]
    return "; ".join(parts)
