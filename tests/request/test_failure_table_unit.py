"""contract §5's failure table, row by row, as pure calls of the request core.

Each row's upstream outcome goes through the classifier (:func:`router.request.classify.classify`)
and the walk (:func:`router.request.walk.advance`, which asks
:func:`router.request.decision.decide`), under the default policy, with failover forbidden
(``X-Waybill-Allow-Failover: false``) and, where the row's last column defers to a rule of the
policy, with that rule set the other way. Each asserts the class, the evidence, the breaker
scope, the walk's next action with its reason code, and the answer the client gets if the
request ends on that failure (:func:`router.request.final_error.decision_error`). No socket, no
database: tests/gateway/test_failure_table.py keeps the rows only a transport can prove.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

import pytest

from ledger.events import Evidence, FailureClass
from router.config import Defaults
from router.drivers import UpstreamFailure
from router.request.classify import RULES, BreakerScope, Transport, UpstreamOutcome, classify
from router.request.decision import Decision
from router.request.final_error import decision_error
from router.request.moves import (
    Begin,
    Commit,
    Content,
    Decided,
    Fail,
    Failed,
    Happening,
    Route,
    Routed,
    Run,
    Start,
    Started,
    Target,
    Unroutable,
    Wait,
)
from router.request.selection import RouteContext
from router.request.walk import (
    Walk,
    WalkPolicy,
    advance,
)

EAST = Target("east", 0, "big", 8000, "assistant_prefill")  # where the attempt fails
WEST = Target("west", 1, "small", 16000)
TWIN = Target("north", 2, "big", 8000, "prefix_flag")  # the same upstream model elsewhere
DEADLINE_LEFT_MS = 30_000
DELIVERED_CHARS = 120  # of a committed stream's text, when it breaks

Next = tuple[Literal["retry", "failover", "resume", "stop"], str]

# What a policy can be, besides the default: the names the rows use for their columns.
FORBIDDEN = "failover forbidden"
UNKNOWN_STOPS = "on_unknown_execution: stop"
CREDENTIALS_FAIL_OVER = "on_credentials_error: failover"
QUOTA_FAILS_OVER = "on_quota_exhausted: failover"

POLICIES: dict[str, WalkPolicy] = {
    "default": WalkPolicy(Defaults(), siblings=(EAST, WEST, TWIN)),
    FORBIDDEN: WalkPolicy(Defaults(), allow_failover=False, siblings=(EAST, WEST, TWIN)),
    UNKNOWN_STOPS: WalkPolicy(Defaults(on_unknown_execution="stop"), siblings=(EAST, WEST, TWIN)),
    CREDENTIALS_FAIL_OVER: WalkPolicy(
        Defaults(on_credentials_error="failover"), siblings=(EAST, WEST, TWIN)
    ),
    QUOTA_FAILS_OVER: WalkPolicy(
        Defaults(on_quota_exhausted="failover"), siblings=(EAST, WEST, TWIN)
    ),
}

FAILED_OVER = RouteContext(tried_endpoints=frozenset({"east"}))


@dataclass(frozen=True)
class Row:
    name: str  # the row's upstream outcome, in the contract's words
    outcome: UpstreamOutcome
    failure_class: FailureClass
    evidence: Evidence
    breaker: tuple[BreakerScope | None, bool]  # scope, and whether it opens at once
    next: dict[str, Next]  # what the walk does next, by policy
    answer: tuple[int, str]  # the client's status and error code if the request ends here
    defers_to: (
        Literal["on_unknown_execution", "on_credentials_error", "on_quota_exhausted"] | None
    ) = None
    trust_not_started: bool = False
    committed: bool = False  # the stream's first event had reached the client
    after_failover: RouteContext = FAILED_OVER  # the context the failover evaluates in


STOPS_ON_HEADER: Next = ("stop", "failover_forbidden_by_header")
UNKNOWN_FAILS_OVER: Next = ("failover", "unknown_execution_policy_failover")
STRICT_STOP: Next = ("stop", "on_unknown_execution_stop")
RETRIED: Next = ("retry", "retry_with_backoff")
RESUMED: Next = ("resume", "resume_same_model")
UNAVAILABLE = (503, "upstream_unavailable")


def _unknown_execution(
    name: str, transport: Transport, failure_class: FailureClass, status: int | None = None
) -> Row:
    """A row of an attempt that may have run: it moves on per on_unknown_execution."""
    return Row(
        name,
        UpstreamOutcome(transport=transport, http_status=status),
        failure_class,
        Evidence.UNKNOWN,
        ("endpoint", False),
        {"default": UNKNOWN_FAILS_OVER, FORBIDDEN: STOPS_ON_HEADER, UNKNOWN_STOPS: STRICT_STOP},
        UNAVAILABLE,
        defers_to="on_unknown_execution",
    )


def _after_commit(row: Row) -> Row:
    """The same outcome once the stream is committed: a resume on the same upstream model."""
    return Row(
        f"{row.name}, after the stream was committed",
        row.outcome,
        row.failure_class,
        row.evidence,
        row.breaker,
        {"default": RESUMED, FORBIDDEN: RESUMED, UNKNOWN_STOPS: STRICT_STOP},
        row.answer,
        defers_to=row.defers_to,
        committed=True,
    )


_STALLED = _unknown_execution(
    "stream: silent for longer than stream_idle_timeout_ms after its first event",
    "stream_stalled",
    FailureClass.TIMEOUT,
    200,
)
_CUT = _unknown_execution(
    "a 200 stream that ends or is cut without a finish reason",
    "broken_stream",
    FailureClass.NETWORK_ERROR,
    200,
)

ROWS: tuple[Row, ...] = (
    Row(
        "connect error: nothing was sent",
        UpstreamOutcome(transport="connect_error"),
        FailureClass.NETWORK_ERROR,
        Evidence.NOT_STARTED,
        ("endpoint", False),
        {"default": ("failover", "not_started_failover"), FORBIDDEN: STOPS_ON_HEADER},
        UNAVAILABLE,
    ),
    _unknown_execution(
        "connection reset after the request was sent",
        "sent_then_reset",
        FailureClass.NETWORK_ERROR,
    ),
    _unknown_execution(
        "no response headers within the attempt timeout",
        "timeout_before_headers",
        FailureClass.TIMEOUT,
    ),
    _unknown_execution(
        "stream: no first event within first_token_timeout_ms",
        "first_token_timeout",
        FailureClass.TIMEOUT,
        200,
    ),
    _STALLED,
    _after_commit(_STALLED),
    _CUT,
    _after_commit(_CUT),
    Row(
        "response over max_response_bytes",
        UpstreamOutcome(transport="response_too_large", http_status=200),
        FailureClass.RESPONSE_TOO_LARGE,
        Evidence.STARTED,
        ("mapping", True),
        {"default": ("failover", "class_allows_failover"), FORBIDDEN: STOPS_ON_HEADER},
        (502, "upstream_response_too_large"),
    ),
    Row(
        "a 200 whose body is not a usable completion",
        UpstreamOutcome(transport="invalid_response", http_status=200),
        FailureClass.UPSTREAM_UNAVAILABLE,
        Evidence.STARTED,
        ("endpoint", False),
        # upstream_unavailable is retried once in place by default, before any failover.
        {"default": RETRIED, FORBIDDEN: RETRIED, UNKNOWN_STOPS: STRICT_STOP},
        UNAVAILABLE,
        defers_to="on_unknown_execution",
    ),
    Row(
        "402, or 429 naming quota, billing, balance, credit or payment",
        UpstreamOutcome(http_status=429, error_code="insufficient_quota"),
        FailureClass.QUOTA_EXHAUSTED,
        Evidence.NOT_STARTED,
        ("endpoint", False),
        {
            "default": ("stop", "quota_exhausted_stops"),
            FORBIDDEN: ("stop", "quota_exhausted_stops"),
            QUOTA_FAILS_OVER: ("failover", "quota_failover_policy"),
        },
        (502, "upstream_quota_exhausted"),
        defers_to="on_quota_exhausted",
        # Every endpoint of its provider account is left, not only this one.
        after_failover=RouteContext(
            tried_endpoints=frozenset({"east"}), quota_exhausted=frozenset({"east"})
        ),
    ),
    Row(
        "429 with a Retry-After within max_retry_after_ms",
        UpstreamOutcome(http_status=429, error_code="rate_limit_exceeded", retry_after_ms=200),
        FailureClass.RATE_LIMITED,
        Evidence.NOT_STARTED,
        ("endpoint", True),
        {
            "default": ("retry", "retry_after_honoured"),
            FORBIDDEN: ("retry", "retry_after_honoured"),
        },
        (429, "upstream_rate_limited"),
    ),
    Row(
        "429 with a Retry-After over max_retry_after_ms",
        UpstreamOutcome(http_status=429, error_code="rate_limit_exceeded", retry_after_ms=9000),
        FailureClass.RATE_LIMITED,
        Evidence.NOT_STARTED,
        ("endpoint", True),
        {"default": ("failover", "not_started_failover"), FORBIDDEN: STOPS_ON_HEADER},
        (429, "upstream_rate_limited"),
    ),
    Row(
        "429 without a Retry-After",
        UpstreamOutcome(http_status=429, error_code="rate_limit_exceeded"),
        FailureClass.RATE_LIMITED,
        Evidence.NOT_STARTED,
        ("endpoint", True),
        {"default": ("failover", "not_started_failover"), FORBIDDEN: STOPS_ON_HEADER},
        (429, "upstream_rate_limited"),
    ),
    Row(
        "400 / 403 naming a content or compliance policy",
        UpstreamOutcome(http_status=400, error_code="content_policy_violation"),
        FailureClass.POLICY_DENIED,
        Evidence.NOT_STARTED,
        (None, False),
        {
            "default": ("stop", "policy_denied_never_routed_around"),
            FORBIDDEN: ("stop", "policy_denied_never_routed_around"),
        },
        (502, "upstream_policy_denied"),
    ),
    Row(
        "401 / 403",
        UpstreamOutcome(http_status=401, error_code="invalid_api_key"),
        FailureClass.CREDENTIALS,
        Evidence.NOT_STARTED,
        ("endpoint", True),
        {
            "default": ("stop", "on_credentials_error_stop"),
            FORBIDDEN: ("stop", "on_credentials_error_stop"),
            CREDENTIALS_FAIL_OVER: ("failover", "credentials_policy_failover"),
        },
        (502, "upstream_credentials"),
        defers_to="on_credentials_error",
    ),
    Row(
        "404 naming the model",
        UpstreamOutcome(http_status=404, error_code="model_not_found"),
        FailureClass.MODEL_UNAVAILABLE,
        Evidence.NOT_STARTED,
        ("mapping", True),
        {"default": ("failover", "not_started_failover"), FORBIDDEN: STOPS_ON_HEADER},
        UNAVAILABLE,
    ),
    Row(
        "400 / 413 naming the context length",
        UpstreamOutcome(http_status=400, error_code="context_length_exceeded"),
        FailureClass.CONTEXT_TOO_SMALL,
        Evidence.NOT_STARTED,
        (None, False),
        {"default": ("failover", "larger_context_failover"), FORBIDDEN: STOPS_ON_HEADER},
        (502, "upstream_error"),
        # Only a larger window than the one that refused, never the same upstream model.
        after_failover=RouteContext(
            tried_endpoints=frozenset({"east"}),
            larger_context_than=EAST.context_window,
            excluded_models=frozenset({EAST.model}),
        ),
    ),
    Row(
        "408, 5xx",
        UpstreamOutcome(http_status=500),
        FailureClass.UPSTREAM_UNAVAILABLE,
        Evidence.UNKNOWN,
        ("endpoint", False),
        {"default": RETRIED, FORBIDDEN: RETRIED, UNKNOWN_STOPS: STRICT_STOP},
        UNAVAILABLE,
        defers_to="on_unknown_execution",
    ),
    Row(
        "408, 5xx: X-Execution-State: not-started from an endpoint with trust_not_started",
        UpstreamOutcome(http_status=503, execution_state_header="not-started"),
        FailureClass.UPSTREAM_UNAVAILABLE,
        Evidence.NOT_STARTED,
        ("endpoint", False),
        # Nothing ran: it moves on even where the policy is strict.
        {"default": RETRIED, FORBIDDEN: RETRIED, UNKNOWN_STOPS: RETRIED},
        UNAVAILABLE,
        trust_not_started=True,
    ),
    Row(
        "408, 5xx: X-Execution-State: not-started from an endpoint without trust_not_started",
        UpstreamOutcome(http_status=503, execution_state_header="not-started"),
        FailureClass.UPSTREAM_UNAVAILABLE,
        Evidence.UNKNOWN,
        ("endpoint", False),
        {"default": RETRIED, FORBIDDEN: RETRIED, UNKNOWN_STOPS: STRICT_STOP},
        UNAVAILABLE,
        defers_to="on_unknown_execution",
    ),
    Row(
        "400 naming a field the client wrote and nothing of the gateway's: the client's own",
        UpstreamOutcome(
            http_status=400,
            error_type="invalid_request_error",
            error_code="invalid_function_parameters",
            error_param="tools[0].function.parameters",
            error_message="Invalid schema for function 'f': 'additionalProperties' is required",
        ),
        FailureClass.NON_RETRYABLE,
        Evidence.NOT_STARTED,
        (None, False),
        {"default": ("stop", "non_retryable_stops"), FORBIDDEN: ("stop", "non_retryable_stops")},
        (400, "invalid_request"),
    ),
    Row(
        "any other 4xx",
        UpstreamOutcome(http_status=422, error_message="bad field"),
        FailureClass.NON_RETRYABLE,
        Evidence.NOT_STARTED,
        (None, False),
        {"default": ("stop", "non_retryable_stops"), FORBIDDEN: ("stop", "non_retryable_stops")},
        (502, "upstream_error"),
    ),
    Row(
        "anything else",
        UpstreamOutcome(http_status=302),
        FailureClass.UPSTREAM_UNAVAILABLE,
        Evidence.UNKNOWN,
        ("endpoint", False),
        {"default": RETRIED, FORBIDDEN: RETRIED, UNKNOWN_STOPS: STRICT_STOP},
        UNAVAILABLE,
        defers_to="on_unknown_execution",
    ),
)


class _Walker:
    """Feeds the walk as the gateway's executor does, keeping its state."""

    def __init__(self, policy: WalkPolicy) -> None:
        self.walk = Walk(policy=policy)
        self.rng = random.Random(7)

    def __call__(self, happening: Happening) -> tuple[object, ...]:
        step = advance(self.walk, happening, self.rng)
        self.walk = step.walk
        return step.actions


def _attempt_failed(row: Row, policy: WalkPolicy) -> tuple[_Walker, tuple[object, ...]]:
    """A first attempt on EAST that ends in ``row``'s outcome; the walk's actions after it."""
    walker = _Walker(policy)
    assert walker(Begin()) == (Route("first", RouteContext()),)
    assert walker(Routed(EAST)) == (Start(EAST, "first"),)
    assert walker(Started("a1", EAST)) == (Run("a1"),)
    if row.committed:
        assert walker(Content("a1")) == (Commit("a1"),)
    classification = classify(row.outcome, trust_not_started=row.trust_not_started)
    failed = Failed(
        "a1",
        classification,
        remaining_ms=DEADLINE_LEFT_MS,
        delivered_chars=DELIVERED_CHARS if row.committed else 0,
        resumable=row.committed,
    )
    return walker, walker(failed)


def _assert_next(row: Row, under: str, expected: Next) -> None:
    policy = POLICIES[under]
    walker, actions = _attempt_failed(row, policy)
    decided = actions[0]
    assert isinstance(decided, Decided) and decided.attempt_id == "a1"
    decision = decided.decision
    assert (decision.action, decision.reason) == expected, f"under {under}"
    if decision.action != "resume":  # the walk's own decision defers to no rule
        # The rule the class deferred to, as FailoverDecided.policy records it.
        rule = row.defers_to
        stood = None if rule is None else f"{rule}={getattr(policy.defaults, rule)}"
        assert decision.policy == stood, f"under {under}"
    match decision.action:
        case "stop":
            assert actions[1:] == (Fail("decision", "a1", decision),)
            assert walker.walk.ended
        case "retry":
            assert decision.backoff_ms is not None
            # The same endpoint again after the wait, nothing excluded.
            route = Route("retry", RouteContext(), (EAST,))
            assert actions[1:] == (Wait(decision.backoff_ms), route)
        case "failover":
            assert actions[1:] == (Route("failover", row.after_failover),)
            # Nowhere left to go: the request ends, answered for this failure's cause.
            assert walker(Unroutable()) == (Fail("no_route"),)
        case "resume":
            # Its own mapping first, then the same upstream model elsewhere unless forbidden.
            targets = (EAST, TWIN) if policy.allow_failover else (EAST,)
            assert actions[1:] == (Route("resume", RouteContext(), targets),)


@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
def test_failure_table_row(row: Row) -> None:
    c = classify(row.outcome, trust_not_started=row.trust_not_started)
    assert (c.failure_class, c.evidence) == (row.failure_class, row.evidence)
    assert (c.breaker_scope, c.breaker_opens_at_once) == row.breaker
    assert c.disables_endpoint == (row.failure_class is FailureClass.CREDENTIALS)
    for under, expected in row.next.items():
        _assert_next(row, under, expected)
    stopped = Decision("stop", "non_retryable_stops")
    answer = decision_error(c, UpstreamFailure(row.outcome, c), stopped)
    assert (answer.status, answer.code) == row.answer


def test_every_row_of_the_contract_has_a_case() -> None:
    # The classifier's table is the contract's, row for row (router/request/classify.py).
    matched = {next(rule for rule in RULES if rule.matches(row.outcome)).outcome for row in ROWS}
    assert matched == {rule.outcome for rule in RULES}
