"""The gateway's errors: contract §3's error table, defined here once.

:class:`ErrorCode` names every ``error.code`` the gateway records, and :data:`ERRORS` gives
each its HTTP status and when it is answered, row for row as the contract's table; the error
``type`` follows the status (:func:`error_type`). The OpenAPI schema and the fuzzer derive
from these, and tests/test_vocabulary.py holds the contract's tables to them.

Everything a client can be told goes through :class:`GatewayError`, built by the
constructors below: an HTTP status, a code, a message without secrets or prompt text, and
the attempt chain. The app turns it into the OpenAI-shaped JSON body; nothing else reaches a
client.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from ledger.books.recovery import GATEWAY_LOST
from ledger.events import FailureClass

__all__ = [
    "ERRORS",
    "FAILURE_ERRORS",
    "AttemptSummary",
    "ErrorCode",
    "ErrorRow",
    "GatewayError",
    "admission_refused",
    "budget_exceeded",
    "capacity_error",
    "client_canceled",
    "codes_by_status",
    "composition_error",
    "deadline_exceeded",
    "endpoint_not_disabled",
    "endpoint_not_found",
    "error_for_failure",
    "error_type",
    "idempotency_conflict",
    "internal_error",
    "invalid_api_key",
    "invalid_request",
    "key_not_found",
    "ledger_unavailable",
    "model_kind_mismatch",
    "model_not_found",
    "no_eligible_route",
    "permission_denied",
    "proof_unavailable",
    "rate_limited",
    "reconciliation_not_found",
    "reload_incomplete",
    "reload_unavailable",
    "request_not_found",
    "response_not_found",
    "route_not_found",
    "sent_codes",
    "settlement_conflict",
    "settlement_not_found",
    "stream_broken",
    "upstream_unavailable",
]


class ErrorCode(StrEnum):
    """Every ``error.code`` of contract §3, in the order of its table."""

    INVALID_REQUEST = "invalid_request"
    MODEL_KIND_MISMATCH = "model_kind_mismatch"
    INVALID_API_KEY = "invalid_api_key"
    BUDGET_EXCEEDED = "budget_exceeded"
    PERMISSION_DENIED = "permission_denied"
    MODEL_NOT_FOUND = "model_not_found"
    REQUEST_NOT_FOUND = "request_not_found"
    RESPONSE_NOT_FOUND = "response_not_found"
    SETTLEMENT_NOT_FOUND = "settlement_not_found"
    RECONCILIATION_NOT_FOUND = "reconciliation_not_found"
    ENDPOINT_NOT_FOUND = "endpoint_not_found"
    KEY_NOT_FOUND = "key_not_found"
    NOT_FOUND = "not_found"
    IDEMPOTENCY_CONFLICT = "idempotency_conflict"
    SETTLEMENT_CONFLICT = "settlement_conflict"
    RELOAD_UNAVAILABLE = "reload_unavailable"
    PROOF_UNAVAILABLE = "proof_unavailable"
    ENDPOINT_NOT_DISABLED = "endpoint_not_disabled"
    NO_ELIGIBLE_ROUTE = "no_eligible_route"
    RATE_LIMITED = "rate_limited"
    UPSTREAM_RATE_LIMITED = "upstream_rate_limited"
    CLIENT_CANCELED = "client_canceled"
    INTERNAL_ERROR = "internal_error"
    COMPOSITION_ERROR = "composition_error"
    GATEWAY_LOST = GATEWAY_LOST  # crash recovery writes it (ledger.books.recovery), never sent
    UPSTREAM_QUOTA_EXHAUSTED = "upstream_quota_exhausted"
    UPSTREAM_CREDENTIALS = "upstream_credentials"
    UPSTREAM_POLICY_DENIED = "upstream_policy_denied"
    UPSTREAM_RESPONSE_TOO_LARGE = "upstream_response_too_large"
    UPSTREAM_ERROR = "upstream_error"
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"
    CAPACITY_ERROR = "capacity_error"
    LEDGER_UNAVAILABLE = "ledger_unavailable"
    RELOAD_INCOMPLETE = "reload_incomplete"
    DEADLINE_EXCEEDED = "deadline_exceeded"


@dataclass(frozen=True, slots=True)
class ErrorRow:
    """One row of contract §3's error table: a code and a status it is answered with."""

    status: int
    code: ErrorCode
    when: str  # in brief, for the OpenAPI descriptions; the contract says it in full
    sent: bool = True  # False: recorded in the ledger, never an HTTP answer

    @property
    def error_type(self) -> str:
        return error_type(self.status)


_E = ErrorCode

# fmt: off
ERRORS: Final[tuple[ErrorRow, ...]] = (
    ErrorRow(400, _E.INVALID_REQUEST, "a malformed body, header, query value or cursor"),
    ErrorRow(400, _E.MODEL_KIND_MISMATCH, "the model group is not of the route's kind"),
    ErrorRow(401, _E.INVALID_API_KEY, "missing, unknown, revoked or expired key"),
    ErrorRow(402, _E.BUDGET_EXCEEDED, "no budget covers an eligible attempt's worst case"),
    ErrorRow(403, _E.PERMISSION_DENIED, "the key's role may not do this"),
    ErrorRow(404, _E.MODEL_NOT_FOUND, "the model group is unknown or not allowed for the key"),
    ErrorRow(404, _E.REQUEST_NOT_FOUND, "no such request in the caller's scope (never 403)"),
    ErrorRow(404, _E.RESPONSE_NOT_FOUND, "no such response answered in the caller's workspace"),
    ErrorRow(404, _E.SETTLEMENT_NOT_FOUND, "no such settlement in the caller's scope"),
    ErrorRow(404, _E.RECONCILIATION_NOT_FOUND, "no such reconciliation in the caller's scope"),
    ErrorRow(404, _E.ENDPOINT_NOT_FOUND, "no such endpoint in the serving config"),
    ErrorRow(404, _E.KEY_NOT_FOUND, "no key with that id"),
    ErrorRow(404, _E.NOT_FOUND, "no such route"),
    ErrorRow(405, _E.INVALID_REQUEST, "method not allowed on the route"),
    ErrorRow(409, _E.IDEMPOTENCY_CONFLICT, "the Idempotency-Key is in flight or had another body"),
    ErrorRow(409, _E.SETTLEMENT_CONFLICT, "the settlement is no longer open"),
    ErrorRow(409, _E.RELOAD_UNAVAILABLE, "the gateway was not started from a config file"),
    ErrorRow(409, _E.PROOF_UNAVAILABLE, "no signed checkpoint covers the request (yet)"),
    ErrorRow(409, _E.ENDPOINT_NOT_DISABLED, "the endpoint is not disabled"),
    ErrorRow(413, _E.INVALID_REQUEST, "the body is too large"),
    ErrorRow(422, _E.NO_ELIGIBLE_ROUTE, "no candidate meets the requirements; nothing reserved"),
    ErrorRow(429, _E.RATE_LIMITED, "a rate limit of the key or its workspace is reached"),
    ErrorRow(429, _E.UPSTREAM_RATE_LIMITED, "every candidate tried was rate-limited"),
    ErrorRow(431, _E.INVALID_REQUEST, "the request line and headers are too large"),
    ErrorRow(499, _E.CLIENT_CANCELED, "the client closed the connection"),
    ErrorRow(500, _E.INTERNAL_ERROR, "a bug: logged, no detail given"),
    ErrorRow(500, _E.COMPOSITION_ERROR, "a pool cannot carry out its dispatch directive"),
    ErrorRow(500, _E.GATEWAY_LOST, "the gateway died during the request", sent=False),
    ErrorRow(502, _E.UPSTREAM_QUOTA_EXHAUSTED, "the upstream's quota is exhausted"),
    ErrorRow(502, _E.UPSTREAM_CREDENTIALS, "the upstream refused the gateway's credentials"),
    ErrorRow(502, _E.UPSTREAM_POLICY_DENIED, "the upstream refused by a content policy"),
    ErrorRow(502, _E.UPSTREAM_RESPONSE_TOO_LARGE, "every response was too large"),
    ErrorRow(502, _E.UPSTREAM_ERROR, "any other terminal upstream outcome"),
    ErrorRow(503, _E.UPSTREAM_UNAVAILABLE, "no upstream reachable, or all behind open breakers"),
    ErrorRow(503, _E.CAPACITY_ERROR, "the gateway's own bounded resources are full"),
    ErrorRow(503, _E.LEDGER_UNAVAILABLE, "the ledger's database cannot do the work now"),
    ErrorRow(503, _E.RELOAD_INCOMPLETE, "a worker did not take the reloaded config (named)"),
    ErrorRow(504, _E.DEADLINE_EXCEEDED, "the whole-request deadline ran out"),
)
# fmt: on

# Contract §3: the error ``type`` follows the status; any other status is an "api_error".
_TYPE_BY_STATUS: Final[Mapping[int, str]] = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "budget_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    499: "client_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}

# The status a code is answered with unless its constructor says otherwise (its first row).
_STATUS: Final[Mapping[ErrorCode, int]] = {
    code: next(row.status for row in ERRORS if row.code is code) for code in ErrorCode
}


def error_type(status: int) -> str:
    """The error body's ``type`` for an HTTP status (contract §3)."""
    return _TYPE_BY_STATUS.get(status, "api_error")


def codes_by_status() -> dict[int, tuple[ErrorCode, ...]]:
    """Each status with the codes an HTTP answer of that status may carry, in table order."""
    by_status: dict[int, tuple[ErrorCode, ...]] = {}
    for row in ERRORS:
        if row.sent:
            by_status[row.status] = (*by_status.get(row.status, ()), row.code)
    return by_status


def sent_codes() -> tuple[ErrorCode, ...]:
    """Every code an HTTP answer may carry (all but those only ever recorded)."""
    return tuple(dict.fromkeys(row.code for row in ERRORS if row.sent))


@dataclass(frozen=True, slots=True)
class AttemptSummary:
    """One attempt as a client may see it: no secret, no prompt text."""

    endpoint: str
    status: int | None
    failure_class: str | None

    def as_json(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "status": self.status,
            "failure_class": self.failure_class,
        }


class GatewayError(Exception):
    """An answer the gateway gives instead of a completion.

    ``should_retry`` False (the default) sends ``x-should-retry: false``: the gateway is the
    one retry owner and has already retried or judged the error terminal (contract §3).
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        status: int | None = None,
        attempts: tuple[AttemptSummary, ...] = (),
        retry_after_s: int | None = None,
        should_retry: bool = False,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = _STATUS[code] if status is None else status
        self.code = code
        self.message = message
        self.error_type = error_type(self.status)
        self.attempts = attempts
        self.retry_after_s = retry_after_s
        self.should_retry = should_retry
        self.param = param

    def with_attempts(self, attempts: tuple[AttemptSummary, ...]) -> GatewayError:
        self.attempts = attempts
        return self

    def body(self, request_id: str | None) -> dict[str, Any]:
        error: dict[str, Any] = {
            "type": self.error_type,
            "code": self.code,
            "message": self.message,
            "param": self.param,
            "request_id": request_id,
            "attempts": [a.as_json() for a in self.attempts],
        }
        return {"error": error}

    def headers(self) -> dict[str, str]:
        headers = {"x-should-retry": "true" if self.should_retry else "false"}
        if self.retry_after_s is not None:
            headers["retry-after"] = str(self.retry_after_s)
        return headers


def invalid_request(message: str, *, param: str | None = None, status: int = 400) -> GatewayError:
    return GatewayError(_E.INVALID_REQUEST, message, param=param, status=status)


def invalid_api_key(message: str = "missing, unknown, revoked or expired API key") -> GatewayError:
    return GatewayError(_E.INVALID_API_KEY, message)


def model_kind_mismatch(model: str, kind: str, wanted: str) -> GatewayError:
    """A model group of one kind asked through a route of another (contract §3): a chat
    group on ``/v1/embeddings``, an embeddings group on a chat route."""
    return GatewayError(
        _E.MODEL_KIND_MISMATCH,
        f"model {model!r} is a {kind} model group; this route serves {wanted} requests",
        param="model",
    )


def model_not_found(model: str) -> GatewayError:
    return GatewayError(
        _E.MODEL_NOT_FOUND, f"model {model!r} does not exist or is not allowed for this key"
    )


# A request, settlement or reconciliation gets the same answer whether it does not exist or
# belongs to someone the caller may not read: its existence is not disclosed (contract §3:
# 404, never 403).


def request_not_found(request_id: str, why: str | None = None) -> GatewayError:
    said = f"no request {request_id!r}"
    return GatewayError(_E.REQUEST_NOT_FOUND, f"{said}: {why}" if why else said)


def response_not_found(response_id: str) -> GatewayError:
    """A Responses ``previous_response_id`` no attempt of the caller's workspace answered."""
    return GatewayError(
        _E.RESPONSE_NOT_FOUND,
        f"no response {response_id!r} was answered through this gateway for this workspace",
        param="previous_response_id",
    )


def settlement_not_found(settlement_id: str) -> GatewayError:
    return GatewayError(_E.SETTLEMENT_NOT_FOUND, f"no settlement {settlement_id!r}")


def reconciliation_not_found(reconciliation_id: str, bucket: str | None = None) -> GatewayError:
    if bucket is not None:  # the report exists, but not that bucket of it
        message = f"reconciliation {reconciliation_id} has no bucket {bucket!r} (so narrowed)"
        return GatewayError(_E.RECONCILIATION_NOT_FOUND, message)
    return GatewayError(_E.RECONCILIATION_NOT_FOUND, f"no reconciliation {reconciliation_id!r}")


def endpoint_not_found(endpoint_id: str) -> GatewayError:
    return GatewayError(_E.ENDPOINT_NOT_FOUND, f"no endpoint {endpoint_id!r} in the serving config")


def key_not_found(key_id: str) -> GatewayError:
    return GatewayError(_E.KEY_NOT_FOUND, f"no key {key_id!r}")


def endpoint_not_disabled(endpoint_id: str) -> GatewayError:
    return GatewayError(
        _E.ENDPOINT_NOT_DISABLED, f"endpoint {endpoint_id!r} is not disabled: nothing to enable"
    )


def route_not_found() -> GatewayError:
    return GatewayError(_E.NOT_FOUND, "no such route")


def proof_unavailable(message: str) -> GatewayError:
    # The request exists and may be read, but no signed checkpoint covers it (yet), or this
    # gateway keeps none (contract §3, §7).
    return GatewayError(_E.PROOF_UNAVAILABLE, message)


def permission_denied(message: str) -> GatewayError:
    return GatewayError(_E.PERMISSION_DENIED, message)


def idempotency_conflict(message: str, *, in_flight: bool) -> GatewayError:
    # While the first request is in flight a later retry may succeed: let the client retry.
    return GatewayError(
        _E.IDEMPOTENCY_CONFLICT,
        message,
        retry_after_s=1 if in_flight else None,
        should_retry=in_flight,
    )


def settlement_conflict(message: str) -> GatewayError:
    return GatewayError(_E.SETTLEMENT_CONFLICT, message)


def reload_incomplete(message: str) -> GatewayError:
    return GatewayError(_E.RELOAD_INCOMPLETE, message)


def reload_unavailable() -> GatewayError:
    return GatewayError(_E.RELOAD_UNAVAILABLE, "this gateway was not started from a file")


def no_eligible_route(message: str) -> GatewayError:
    return GatewayError(_E.NO_ELIGIBLE_ROUTE, message)


def budget_exceeded(message: str) -> GatewayError:
    return GatewayError(_E.BUDGET_EXCEEDED, message)


def client_canceled(message: str = "the client closed the connection") -> GatewayError:
    # Recorded; nobody reads the answer.
    return GatewayError(_E.CLIENT_CANCELED, message)


def internal_error() -> GatewayError:
    # A bug: logged where it is caught, never described to the client.
    return GatewayError(_E.INTERNAL_ERROR, "internal error")


def composition_error(rule: str, detail: str) -> GatewayError:
    """A pool of a composed group cannot carry out what the composer asked (contract §4
    "Pools"): found before any upstream I/O, never failed over, never counted against an
    upstream. The message names the rule broken; retrying the same request meets it again."""
    return GatewayError(_E.COMPOSITION_ERROR, f"composition error ({rule}): {detail}")


def stream_broken(failure_class: FailureClass) -> GatewayError:
    """A committed stream that broke: whatever the class, the code of its final SSE event
    (contract §3 "Streams") is ``upstream_error``."""
    return GatewayError(_E.UPSTREAM_ERROR, f"the upstream stream broke: {failure_class}")


def rate_limited(message: str, retry_after_s: int) -> GatewayError:
    # The caller's own limit (config `limits`): a retry once its window ends may pass.
    return GatewayError(_E.RATE_LIMITED, message, retry_after_s=retry_after_s, should_retry=True)


def capacity_error(message: str) -> GatewayError:
    # The gateway's own bounded resources: a retry a moment later is sensible.
    return GatewayError(_E.CAPACITY_ERROR, message, retry_after_s=1, should_retry=True)


def ledger_unavailable() -> GatewayError:
    # Without the ledger nothing may be reserved or recorded, so no upstream is called: the
    # request fails fast, and a retry a moment later is sensible.
    return GatewayError(
        _E.LEDGER_UNAVAILABLE,
        "the ledger's database is unreachable; nothing was sent upstream",
        retry_after_s=1,
        should_retry=True,
    )


def deadline_exceeded(message: str = "the whole-request deadline ran out") -> GatewayError:
    return GatewayError(_E.DEADLINE_EXCEEDED, message)


def upstream_unavailable(message: str, *, retry_after_s: int | None = None) -> GatewayError:
    return GatewayError(_E.UPSTREAM_UNAVAILABLE, message, retry_after_s=retry_after_s)


def admission_refused(message: str, *, retry_after_s: int) -> GatewayError:
    """Every attempt was refused at admission (open breakers, full ``max_in_flight`` slots)
    before any upstream I/O (contract §3): nothing was sent, so a retry is no duplicate, and
    ``Retry-After`` says when one is worth it
    (:func:`router.request.final_error.admission_retry_after_s`)."""
    return GatewayError(
        _E.UPSTREAM_UNAVAILABLE, message, retry_after_s=retry_after_s, should_retry=True
    )


# Contract §5: a request that ends on a failure is answered with a code named for its cause,
# never masked as "all busy"; the status is the code's (ERRORS).
FAILURE_ERRORS: Final[Mapping[FailureClass, ErrorCode]] = {
    FailureClass.RATE_LIMITED: _E.UPSTREAM_RATE_LIMITED,
    FailureClass.QUOTA_EXHAUSTED: _E.UPSTREAM_QUOTA_EXHAUSTED,
    FailureClass.CREDENTIALS: _E.UPSTREAM_CREDENTIALS,
    FailureClass.POLICY_DENIED: _E.UPSTREAM_POLICY_DENIED,
    FailureClass.MODEL_UNAVAILABLE: _E.UPSTREAM_UNAVAILABLE,
    FailureClass.CONTEXT_TOO_SMALL: _E.UPSTREAM_ERROR,
    FailureClass.UPSTREAM_UNAVAILABLE: _E.UPSTREAM_UNAVAILABLE,
    FailureClass.NETWORK_ERROR: _E.UPSTREAM_UNAVAILABLE,
    FailureClass.TIMEOUT: _E.UPSTREAM_UNAVAILABLE,
    FailureClass.RESPONSE_TOO_LARGE: _E.UPSTREAM_RESPONSE_TOO_LARGE,
    FailureClass.INVALID_OUTPUT: _E.UPSTREAM_ERROR,
    FailureClass.NON_RETRYABLE: _E.UPSTREAM_ERROR,
    FailureClass.CLIENT_CANCELED: _E.CLIENT_CANCELED,
    FailureClass.DEADLINE_EXCEEDED: _E.DEADLINE_EXCEEDED,
}


def error_for_failure(
    failure_class: FailureClass, message: str, *, retry_after_ms: int | None = None
) -> GatewayError:
    """The client's answer when the request ends on an upstream failure of this class."""
    error = GatewayError(FAILURE_ERRORS[failure_class], message)
    if error.status == 429 and retry_after_ms is not None:
        error.retry_after_s = max(1, -(-retry_after_ms // 1000))
    return error
