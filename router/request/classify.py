"""The failure classifier: one table-driven, pure function from an upstream outcome to a class.

The table :data:`RULES` is contract §5's failure-class table written as data, row for row and in
the order that decides between overlapping rows (a quota 429 before a plain 429, a policy
403 before a credentials 403). :func:`classify` takes plain facts a driver observed
(:class:`UpstreamOutcome`) and returns what they mean (:class:`Classification`). It decides
nothing about failover: ``may_fail_over`` only names which rule of the table applies; the
routing core applies it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

from ledger.events import Evidence, FailureClass

__all__ = [
    "MAX_RETRY_AFTER_MS",
    "RULES",
    "BreakerScope",
    "Classification",
    "MayFailOver",
    "Rule",
    "Transport",
    "UpstreamOutcome",
    "classify",
]

Transport: TypeAlias = Literal[
    "connect_error",  # nothing was sent: DNS, refused, connect timeout, pool exhausted, or a
    # proxy that would not open its tunnel (whatever status it answered: it is not the upstream's)
    "sent_then_reset",  # the request (maybe partly) left, then the connection broke
    "timeout_before_headers",  # the request left; no response headers within the attempt
    "first_token_timeout",  # stream: headers came, no first event in time
    "response_too_large",  # the body went over the endpoint's max_response_bytes
    "stream_stalled",  # a 200 stream silent for longer than stream_idle_timeout_ms after content
    "broken_stream",  # a 200 stream that ended or was cut without a finish reason
    "invalid_response",  # a 200 whose body is not a usable completion
]
BreakerScope: TypeAlias = Literal["endpoint", "mapping"]
MayFailOver: TypeAlias = Literal[
    "yes",
    "no",
    "never",  # no routing around a control, whatever the config says
    "per_on_credentials_error",
    "per_on_unknown_execution",
    "per_on_invalid_output",
    "per_on_quota_exhausted",
    "larger_context_only",
]

MAX_RETRY_AFTER_MS: Final = 5 * 60 * 1000
"""contract §5: a Retry-After sets the breaker's cool-down, capped at 5 minutes."""

_NOT_STARTED_HEADER_VALUE: Final = "not-started"


@dataclass(frozen=True)
class UpstreamOutcome:
    """What a driver saw of one failed attempt: plain facts, no interpretation.

    ``error_message`` is short and sanitized (no secret, no prompt text) by the driver.
    """

    http_status: int | None = None
    error_code: str | None = None
    error_type: str | None = None
    error_message: str | None = None
    error_param: str | None = None  # the request field the error names (OpenAI's ``param``)
    retry_after_ms: int | None = None
    execution_state_header: str | None = None
    transport: Transport | None = None


@dataclass(frozen=True)
class Classification:
    failure_class: FailureClass
    evidence: Evidence
    breaker_scope: BreakerScope | None
    breaker_opens_at_once: bool
    may_fail_over: MayFailOver
    retry_after_ms: int | None = None
    # The endpoint's key was refused: the endpoint is disabled (contract §5 "Disabled
    # endpoints"); its breaker opens at once only while that cannot be recorded.
    disables_endpoint: bool = False
    # The client's own error (a 400 naming a field it wrote): a request that ends on it is
    # answered 400 invalid_request with the provider's message (contract §3 "Errors").
    clients_own: bool = False


# --- predicates over an outcome -------------------------------------------------------------

_QUOTA_WORDS: Final = re.compile(
    r"insufficient_quota|quota|billing|balance|credit|payment", re.IGNORECASE
)
_POLICY_CODES: Final = frozenset(
    {"content_policy_violation", "content_filter", "policy_violation", "safety", "compliance"}
)
_POLICY_WORDS: Final = re.compile(
    r"content[ _]?(?:management )?polic|content[ _]filter|safety system|compliance|"
    r"usage polic|policy",
    re.IGNORECASE,
)
_CONTEXT_WORDS: Final = re.compile(
    r"context_length_exceeded|context length|context window|prompt is too long|"
    r"too many tokens|maximum context",
    re.IGNORECASE,
)
_MODEL_NOT_FOUND_CODES: Final = frozenset({"model_not_found", "not_found_error"})


def _text(o: UpstreamOutcome) -> str:
    return " ".join(filter(None, (o.error_code, o.error_type, o.error_message)))


def _transport(kind: Transport) -> Callable[[UpstreamOutcome], bool]:
    def matches(o: UpstreamOutcome) -> bool:
        return o.transport == kind

    return matches


def _http(o: UpstreamOutcome, *statuses: int) -> bool:
    return o.transport is None and o.http_status in statuses


_connect_error = _transport("connect_error")
_reset_after_send = _transport("sent_then_reset")
_timeout_after_send = _transport("timeout_before_headers")
_no_first_event = _transport("first_token_timeout")
_stream_stalled = _transport("stream_stalled")
_broken_stream = _transport("broken_stream")
_too_large = _transport("response_too_large")
_invalid_response = _transport("invalid_response")


def _quota_exhausted(o: UpstreamOutcome) -> bool:
    # Anthropic reports an exhausted balance as 402 billing_error rather than a 429.
    return _http(o, 402) or (_http(o, 429) and bool(_QUOTA_WORDS.search(_text(o))))


def _rate_limited(o: UpstreamOutcome) -> bool:
    return _http(o, 429)


def _names_a_policy(o: UpstreamOutcome) -> bool:
    return _http(o, 400, 403) and (
        (o.error_code or "") in _POLICY_CODES or bool(_POLICY_WORDS.search(_text(o)))
    )


def _unauthorized(o: UpstreamOutcome) -> bool:
    return _http(o, 401, 403)


def _model_not_found(o: UpstreamOutcome) -> bool:
    return _http(o, 404) and (
        o.error_code in _MODEL_NOT_FOUND_CODES
        or o.error_type in _MODEL_NOT_FOUND_CODES
        or "model" in (o.error_message or "").lower()
    )


def _context_exceeded(o: UpstreamOutcome) -> bool:
    return _http(o, 400, 413) and bool(_CONTEXT_WORDS.search(_text(o)))


# The fields of a request the client wrote and the gateway passes on as they are (the
# gateway sets `model`, `stream`, `stream_options` and the output bound itself). An upstream's
# 400 naming one of them, in its `param` or its message, is the client's own error ...
_CLIENT_FIELDS: Final = (
    "messages|tools|tool_choice|functions|function_call|response_format|input|system|"
    "temperature|top_p|top_k|stop|stop_sequences|n|seed|logit_bias|logprobs|top_logprobs|"
    "presence_penalty|frequency_penalty|user|metadata|parallel_tool_calls|modalities|audio|"
    "prediction|reasoning_effort|dimensions|encoding_format"
)
_NAMES_A_CLIENT_FIELD: Final = re.compile(
    # "tools.0.input_schema: ..." (Anthropic), "Invalid 'messages[1].content'", "Invalid value
    # for 'tool_choice'", "Invalid schema for function 'f'" (OpenAI)
    rf"^(?:{_CLIENT_FIELDS})(?:[.\[:]|$)|['`\"](?:{_CLIENT_FIELDS})(?:[.\[]|['`\"])"
    r"|\bfor (?:function|tool)\b",
    re.IGNORECASE,
)
# ... unless it names anything of the gateway's or the endpoint's own: its key, account or
# billing, the model or deployment the gateway chose, what that model supports (the
# gateway's choice of mapping), the resume prefill, the fields the gateway sets.
_NAMES_THE_GATEWAYS: Final = re.compile(
    r"api[ _-]?key|auth|credential|permission|access|organi[sz]ation|project|account|"
    r"billing|credit|quota|balance|payment|\bmodels?\b|deployment|region|support|"
    r"prefill|\bstream\b|stream_options|max_(?:completion_)?tokens|max_output_tokens",
    re.IGNORECASE,
)


def _clients_own_error(o: UpstreamOutcome) -> bool:
    if not _http(o, 400) or _NAMES_THE_GATEWAYS.search(" ".join((_text(o), o.error_param or ""))):
        return False
    return bool(
        _NAMES_A_CLIENT_FIELD.search(o.error_param or "")
        or _NAMES_A_CLIENT_FIELD.search(o.error_message or "")
    )


def _unavailable(o: UpstreamOutcome) -> bool:
    status = o.http_status
    return o.transport is None and status is not None and (status == 408 or status >= 500)


def _other_4xx(o: UpstreamOutcome) -> bool:
    status = o.http_status
    return o.transport is None and status is not None and 400 <= status < 500


def _anything(o: UpstreamOutcome) -> bool:
    return True


# --- the table ------------------------------------------------------------------------------

_TRUSTED: Final = "trusted_not_started_else_unknown"
"""Evidence of a row whose answer depends on the endpoint's trust (the 408/5xx row)."""


@dataclass(frozen=True)
class Rule:
    """One row of contract §5's table; ``matches`` is its first column, the upstream outcome."""

    matches: Callable[[UpstreamOutcome], bool]
    failure_class: FailureClass
    breaker_scope: BreakerScope | None
    breaker_opens_at_once: bool
    evidence: Evidence | Literal["trusted_not_started_else_unknown"]
    may_fail_over: MayFailOver
    disables_endpoint: bool = False
    clients_own: bool = False

    @property
    def outcome(self) -> str:
        """The row's name, for explanations and test ids."""
        return self.matches.__name__.strip("_")


_E: Final = "endpoint"
_M: Final = "mapping"
_NS, _UNK, _ST = Evidence.NOT_STARTED, Evidence.UNKNOWN, Evidence.STARTED
_F = FailureClass
_CRED: Final = "per_on_credentials_error"
_EXEC: Final = "per_on_unknown_execution"
_LARGER: Final = "larger_context_only"
_QUOTA: Final = "per_on_quota_exhausted"

# fmt: off
RULES: Final[tuple[Rule, ...]] = (
    #    upstream outcome      class                    scope at once evidence  may fail over
    Rule(_connect_error,       _F.NETWORK_ERROR,        _E,   False, _NS,      "yes"),
    Rule(_reset_after_send,    _F.NETWORK_ERROR,        _E,   False, _UNK,     _EXEC),
    Rule(_timeout_after_send,  _F.TIMEOUT,              _E,   False, _UNK,     _EXEC),
    Rule(_no_first_event,      _F.TIMEOUT,              _E,   False, _UNK,     _EXEC),
    Rule(_stream_stalled,      _F.TIMEOUT,              _E,   False, _UNK,     _EXEC),
    Rule(_broken_stream,       _F.NETWORK_ERROR,        _E,   False, _UNK,     _EXEC),
    Rule(_too_large,           _F.RESPONSE_TOO_LARGE,   _M,   True,  _ST,      "yes"),
    Rule(_invalid_response,    _F.UPSTREAM_UNAVAILABLE, _E,   False, _ST,      _EXEC),
    Rule(_quota_exhausted,     _F.QUOTA_EXHAUSTED,      _E,   False, _NS,      _QUOTA),
    Rule(_rate_limited,        _F.RATE_LIMITED,         _E,   True,  _NS,      "yes"),
    Rule(_names_a_policy,      _F.POLICY_DENIED,        None, False, _NS,      "never"),
    Rule(_unauthorized,        _F.CREDENTIALS,          _E,   True,  _NS,      _CRED,
         disables_endpoint=True),
    Rule(_model_not_found,     _F.MODEL_UNAVAILABLE,    _M,   True,  _NS,      "yes"),
    Rule(_context_exceeded,    _F.CONTEXT_TOO_SMALL,    None, False, _NS,      _LARGER),
    Rule(_unavailable,         _F.UPSTREAM_UNAVAILABLE, _E,   False, _TRUSTED, _EXEC),
    Rule(_clients_own_error,   _F.NON_RETRYABLE,        None, False, _NS,      "no",
         clients_own=True),
    Rule(_other_4xx,           _F.NON_RETRYABLE,        None, False, _NS,      "no"),
    # Anything the table does not name (a 1xx/3xx, a status-less outcome) is read like a
    # 5xx of unknown execution: the conservative reading, since it may have been billed.
    Rule(_anything,            _F.UPSTREAM_UNAVAILABLE, _E,   False, _UNK,     _EXEC),
)
# fmt: on


def classify(outcome: UpstreamOutcome, *, trust_not_started: bool) -> Classification:
    """The class of one failed attempt, by the first row of :data:`RULES` that matches."""
    rule = next(r for r in RULES if r.matches(outcome))
    evidence: Evidence
    may_fail_over = rule.may_fail_over
    if rule.evidence == _TRUSTED:
        # Only a trusted endpoint's own word that it did not start makes a 5xx safe to repeat.
        said_not_started = (
            outcome.execution_state_header or ""
        ).strip().lower() == _NOT_STARTED_HEADER_VALUE
        if trust_not_started and said_not_started:
            evidence, may_fail_over = Evidence.NOT_STARTED, "yes"
        else:
            evidence = Evidence.UNKNOWN
    else:
        evidence = Evidence(rule.evidence)
    retry_after = outcome.retry_after_ms
    if retry_after is not None:
        retry_after = max(0, min(retry_after, MAX_RETRY_AFTER_MS))
    return Classification(
        failure_class=rule.failure_class,
        evidence=evidence,
        breaker_scope=rule.breaker_scope,
        breaker_opens_at_once=rule.breaker_opens_at_once,
        may_fail_over=may_fail_over,
        retry_after_ms=retry_after,
        disables_endpoint=rule.disables_endpoint,
        clients_own=rule.clients_own,
    )
