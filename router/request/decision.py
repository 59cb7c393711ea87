"""What follows a failed attempt (contract §4 "Retry and failover are different acts", §5):
retry the same endpoint, fail over to another or stop (:func:`decide`), with the stable
reason recorded on ``FailoverDecided``; then the context of the next evaluation
(:func:`next_context`).

Pure: an attempt's outcome and the group's policy in, a decision out; randomness (a retry's
jittered back-off) only from the caller's ``random.Random``.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Final, Literal, Protocol, TypeAlias

from ledger.events import Evidence, FailureClass
from ledger.support.frozen import evolve
from router.config import Defaults
from router.request.classify import Classification
from router.request.selection import RouteContext

__all__ = [
    "BREAKER_SCOPES",
    "DECISION_REASONS",
    "REFUSALS",
    "WALK_REASONS",
    "Action",
    "AttemptOutcome",
    "Decision",
    "Place",
    "decide",
    "next_context",
]

Action: TypeAlias = Literal["retry", "failover", "resume", "stop"]

# --- after a failed attempt: retry, failover or stop ----------------------------------------

# Step 2's stop for a class whose "may fail over" is "no", e.g. "quota_exhausted_stops";
# client_canceled and deadline_exceeded have stopped in step 1 before.
_STOPS_BY_CLASS: Final = tuple(
    f"{c.value}_stops"
    for c in FailureClass
    if c not in (FailureClass.CLIENT_CANCELED, FailureClass.DEADLINE_EXCEEDED)
)

DECISION_REASONS: Final[tuple[str, ...]] = (
    # stop: limits of the whole request
    "stream_committed",
    "client_canceled",
    "deadline_exceeded",
    "max_attempts_reached",
    # stop: the failure class or the config's policy for it
    *_STOPS_BY_CLASS,
    "policy_denied_never_routed_around",
    "on_credentials_error_stop",
    "on_unknown_execution_stop",
    "server_side_effects_strict",
    # retry the same endpoint
    "retry_after_honoured",
    "retry_with_backoff",
    # stop: the caller forbade moving, or did not grant it where the group's policy asks
    "failover_forbidden_by_header",
    "failover_not_granted",
    # failover
    "larger_context_failover",
    "credentials_policy_failover",
    "quota_failover_policy",
    "invalid_output_policy_failover",
    "not_started_failover",
    "unknown_execution_policy_failover",
    "unknown_execution_allowed_by_header",
    "class_allows_failover",
)
"""Every reason :func:`decide` may give, a stable code recorded on ``FailoverDecided``."""

BREAKER_SCOPES: Final = ("endpoint", "mapping")
REFUSALS: Final = (
    "breaker_open",
    "saturated",
    "credentials_disabled",
    "over_budget",
    "unavailable",
)
"""Why the target of a planned retry or resume refused it when it came to start (the probe
taken by another request, the endpoint's slots full, its key refused, the budget taken by
another request; ``unavailable``: none of those was told)."""

WALK_REASONS: Final[tuple[str, ...]] = (
    # a hedged request: another way still runs and carries it on
    "other_way_running",
    # a committed stream broke: continue it on the same upstream model
    "resume_same_model",
    # the failed attempt's own outcome opened its endpoint's or mapping's breaker: a retry
    # would be refused, so fail over at once (or stop, where moving is forbidden)
    *(f"{scope}_breaker_opened" for scope in BREAKER_SCOPES),
    # a planned retry or resume refused when it came to start: the plan changes, and says why
    *(f"retry_refused_{why}" for why in REFUSALS),
    *(f"resume_refused_{why}" for why in REFUSALS),
)
"""The reasons only the request's walk (:mod:`router.request.walk`) gives, beside
:func:`decide`'s."""


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str  # one of DECISION_REASONS
    backoff_ms: int | None = None  # retry: how long to wait first
    # The rule the failure class defers to, as it stood for this request, e.g.
    # "on_unknown_execution=stop" (recorded as FailoverDecided.policy); None: the class does
    # not defer to one.
    policy: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.reason not in DECISION_REASONS and self.reason not in WALK_REASONS:
            raise ValueError(f"unknown decision reason {self.reason!r}")

    @property
    def allowed(self) -> bool:
        return self.action != "stop"


@dataclass(frozen=True)
class AttemptOutcome:
    classification: Classification
    attempts_made: int  # attempts of this request so far, including the one that just failed
    retries_on_endpoint: int  # same-endpoint retries already made for this endpoint
    remaining_ms: int  # whole-request deadline left
    allow_failover: bool = True  # X-Waybill-Allow-Failover
    # Failover is not allowed because the group's `failover: on_grant` found no grant (the
    # caller did not forbid it): the stop says so rather than naming the header.
    failover_not_granted: bool = False
    stream_committed: bool = False  # an event reached the client: the endpoint is fixed
    # X-Waybill-Allow-Failover: unknown: the caller accepts that an attempt of unknown
    # execution is followed by another (a possible duplicate), even where the policy is strict.
    allow_unknown_execution: bool = False
    # The request asks the provider for effects of its own (server-side tools, web search):
    # strict whatever the policy says, for such effects cannot be taken back.
    server_side_effects: bool = False
    # The breaker of the failed attempt's endpoint or mapping that its own outcome opened
    # (or re-opened): a retry there would be refused at admission.
    breaker_opened: Literal["endpoint", "mapping"] | None = None


def _stop(reason: str) -> Decision:
    return Decision("stop", reason)


def decide(outcome: AttemptOutcome, defaults: Defaults, rng: random.Random) -> Decision:
    """What follows a failed attempt (contract §4 "Retry and failover are different acts", §5).

    ``defaults`` is the policy of the request's model group (``Config.policy_for``). Whether a
    candidate is left to fail over to is the next evaluation's question.
    """
    decision = _decide(outcome, defaults, rng)
    if decision.reason == "failover_not_granted":
        return dataclasses.replace(decision, policy="failover=on_grant")
    return dataclasses.replace(decision, policy=_policy(outcome, defaults))


def _decide(outcome: AttemptOutcome, defaults: Defaults, rng: random.Random) -> Decision:
    c = outcome.classification
    # 1. Limits of the whole request.
    if outcome.stream_committed:
        return _stop("stream_committed")
    if c.failure_class is FailureClass.CLIENT_CANCELED:
        return _stop("client_canceled")
    if c.failure_class is FailureClass.DEADLINE_EXCEEDED or outcome.remaining_ms <= 0:
        return _stop("deadline_exceeded")
    if outcome.attempts_made >= defaults.max_attempts:
        return _stop("max_attempts_reached")
    # 2. May this class go on at all?
    stop_reason = _class_stops(outcome, defaults)
    if stop_reason is not None:
        return _stop(stop_reason)
    # 3. Retry the same endpoint first, where the config allows it — unless this attempt
    # opened a breaker the retry would meet: then the failover (or the stop) comes at once,
    # naming that breaker, rather than a retry the record would contradict.
    retry = _retry(outcome, defaults, rng)
    if (
        retry is not None
        and outcome.breaker_opened is not None
        and retry.reason != "retry_after_honoured"
    ):
        # This attempt opened a breaker the retry would meet: the failover (or the stop)
        # comes at once, naming that breaker, rather than a retry the record would contradict.
        # A Retry-After the retry waits out is the breaker's cool-down too (contract §5), so
        # that retry comes when the breaker admits its probe: it stands.
        opened = f"{outcome.breaker_opened}_breaker_opened"
        return Decision("failover", opened) if outcome.allow_failover else _stop(opened)
    if retry is not None:
        return retry
    # 4. Otherwise move to another endpoint, if the caller lets us.
    if not outcome.allow_failover:
        return _stop(_forbidden(outcome))
    return Decision("failover", _failover_reason(outcome, defaults))


def _forbidden(outcome: AttemptOutcome) -> str:
    """Why the request may not move to another endpoint (the stop's reason)."""
    if outcome.failover_not_granted:
        return "failover_not_granted"
    return "failover_forbidden_by_header"


def _strict(outcome: AttemptOutcome, defaults: Defaults) -> str | None:
    """Why an attempt of unknown execution may not be followed by another (contract §5
    "Per on_unknown_execution"), as the stop's reason; None if the request is not strict.
    The group's policy comes first: it would stop the request whatever its body asks for."""
    if defaults.on_unknown_execution == "stop":
        return "on_unknown_execution_stop"
    if outcome.server_side_effects:
        return "server_side_effects_strict"
    return None


def _class_stops(outcome: AttemptOutcome, defaults: Defaults) -> str | None:
    """None if contract §5's "may fail over" column lets the request go on, else why not."""
    c = outcome.classification
    match c.may_fail_over:
        case "yes" | "larger_context_only":
            return None
        case "no":
            return f"{c.failure_class.value}_stops"
        case "never":
            return "policy_denied_never_routed_around"
        case "per_on_credentials_error":
            if defaults.on_credentials_error == "failover":
                return None
            return "on_credentials_error_stop"
        case "per_on_unknown_execution":
            # Not-started evidence makes another execution safe, whatever the policy; a strict
            # request goes on only where its caller allowed a possible duplicate.
            if c.evidence is Evidence.NOT_STARTED or outcome.allow_unknown_execution:
                return None
            return _strict(outcome, defaults)
        case "per_on_quota_exhausted":
            # Only an approved policy moves a request off an account whose balance ran out.
            if defaults.on_quota_exhausted == "failover":
                return None
            return f"{c.failure_class.value}_stops"
        case "per_on_invalid_output":
            # With `return` the gateway gives the answer as it is and never asks; here for
            # completeness of the table.
            return None if defaults.on_invalid_output == "failover" else "invalid_output_stops"


def _retry(outcome: AttemptOutcome, defaults: Defaults, rng: random.Random) -> Decision | None:
    c = outcome.classification
    if c.may_fail_over == "larger_context_only" or c.failure_class in (
        FailureClass.CONTEXT_TOO_SMALL,  # the same model would refuse the same prompt again
        FailureClass.TIMEOUT,  # a silent route is never retried, whatever the config says
        FailureClass.QUOTA_EXHAUSTED,  # the same account has no more balance a moment later
    ):
        return None
    rule = defaults.retry_same_endpoint.rule(c.failure_class)
    if outcome.retries_on_endpoint >= rule.max:
        return None
    if c.failure_class is FailureClass.RATE_LIMITED:
        # Only a Retry-After that fits both the rule and the deadline is waited for.
        wait = c.retry_after_ms
        if wait is None or wait > rule.max_retry_after_ms or wait >= outcome.remaining_ms:
            return None
        return Decision("retry", "retry_after_honoured", backoff_ms=wait)
    low, high = rule.backoff_ms
    backoff = rng.randint(low, high)
    if backoff >= outcome.remaining_ms:
        return None
    return Decision("retry", "retry_with_backoff", backoff_ms=backoff)


def _failover_reason(outcome: AttemptOutcome, defaults: Defaults) -> str:
    c = outcome.classification
    if c.may_fail_over == "larger_context_only":
        return "larger_context_failover"
    if c.may_fail_over == "per_on_credentials_error":
        return "credentials_policy_failover"
    if c.may_fail_over == "per_on_quota_exhausted":
        return "quota_failover_policy"
    if c.may_fail_over == "per_on_invalid_output":
        return "invalid_output_policy_failover"
    if c.evidence is Evidence.NOT_STARTED:
        return "not_started_failover"
    if c.may_fail_over == "per_on_unknown_execution":
        # The attempt may have run: the core holds its reservation as unknown usage. A
        # strict request got here only because its caller allowed it (step 2).
        if _strict(outcome, defaults) is not None:
            return "unknown_execution_allowed_by_header"
        return "unknown_execution_policy_failover"
    # "yes" with the work started (response_too_large): the table allows it outright.
    return "class_allows_failover"


def _policy(outcome: AttemptOutcome, defaults: Defaults) -> str | None:
    """The rule the failure class defers to, as it stood for this request: the group's
    ``on_credentials_error`` or ``on_unknown_execution``, the strictness a request with
    server-side effects gets, or the caller's ``X-Waybill-Allow-Failover: unknown`` that
    lifted a strict one."""
    c = outcome.classification
    if c.may_fail_over == "per_on_credentials_error":
        return f"on_credentials_error={defaults.on_credentials_error}"
    if c.may_fail_over == "per_on_invalid_output":
        return f"on_invalid_output={defaults.on_invalid_output}"
    if c.may_fail_over == "per_on_quota_exhausted":
        return f"on_quota_exhausted={defaults.on_quota_exhausted}"
    if c.may_fail_over != "per_on_unknown_execution":
        return None
    strict = _strict(outcome, defaults)
    if strict is None or c.evidence is Evidence.NOT_STARTED:
        return f"on_unknown_execution={defaults.on_unknown_execution}"
    if outcome.allow_unknown_execution:
        return "X-Waybill-Allow-Failover=unknown"
    if strict == "server_side_effects_strict":
        return "server_side_effects=strict"
    return "on_unknown_execution=stop"


class Place(Protocol):
    """Where an attempt ran: a mapping of the config, or the walk's target for it."""

    @property
    def endpoint(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def context_window(self) -> int: ...


def next_context(
    context: RouteContext, action: Action, place: Place, failure_class: FailureClass
) -> RouteContext:
    """The context of the next evaluation after ``action`` on ``place``'s endpoint and model."""
    if action != "failover":
        return context
    tried = context.tried_endpoints | {place.endpoint}
    if failure_class is FailureClass.QUOTA_EXHAUSTED:
        # Its provider account ran out: every endpoint drawing on it is left too.
        exhausted = context.quota_exhausted | {place.endpoint}
        return evolve(context, tried_endpoints=tried, quota_exhausted=exhausted)
    if failure_class is not FailureClass.CONTEXT_TOO_SMALL:
        return evolve(context, tried_endpoints=tried)
    floor = context.larger_context_than
    return evolve(
        context,
        tried_endpoints=tried,
        larger_context_than=place.context_window
        if floor is None
        else max(floor, place.context_window),
        excluded_models=context.excluded_models | {place.model},
    )
