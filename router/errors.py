"""The gateway's errors, mapped to SPEC §3's error table in this one place.

Everything a client can be told goes through :class:`GatewayError`: an HTTP status, a code
from the contract, a message without secrets or prompt text, and the attempt chain. The app
turns it into the OpenAI-shaped JSON body; nothing else reaches a client.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from ledger.events import FailureClass

__all__ = [
    "AttemptSummary",
    "GatewayError",
    "budget_exceeded",
    "capacity_error",
    "deadline_exceeded",
    "error_for_failure",
    "idempotency_conflict",
    "invalid_api_key",
    "invalid_request",
    "ledger_unavailable",
    "model_not_found",
    "no_eligible_route",
    "permission_denied",
    "proof_unavailable",
    "request_not_found",
    "upstream_unavailable",
]


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
    one retry owner and has already retried or judged the error terminal (SPEC §3).
    """

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        error_type: str | None = None,
        attempts: tuple[AttemptSummary, ...] = (),
        retry_after_s: int | None = None,
        should_retry: bool = False,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.error_type = error_type or _TYPE_BY_STATUS.get(status, "api_error")
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


_TYPE_BY_STATUS: Final[Mapping[int, str]] = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "budget_error",
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


def invalid_request(message: str, *, param: str | None = None, status: int = 400) -> GatewayError:
    return GatewayError(status, "invalid_request", message, param=param)


def invalid_api_key(message: str = "missing, unknown or revoked API key") -> GatewayError:
    return GatewayError(401, "invalid_api_key", message)


def model_not_found(model: str) -> GatewayError:
    return GatewayError(
        404, "model_not_found", f"model {model!r} does not exist or is not allowed for this key"
    )


def request_not_found(request_id: str) -> GatewayError:
    # The same answer whether the request does not exist or belongs to someone the caller
    # may not read: its existence is not disclosed (SPEC §3: 404, never 403).
    return GatewayError(404, "request_not_found", f"no request {request_id!r}")


def proof_unavailable(message: str) -> GatewayError:
    # The request exists and may be read, but no signed checkpoint covers it (yet), or this
    # gateway keeps none (SPEC §3, §7).
    return GatewayError(409, "proof_unavailable", message)


def permission_denied(message: str) -> GatewayError:
    return GatewayError(403, "permission_denied", message, error_type="permission_error")


def idempotency_conflict(message: str, *, in_flight: bool) -> GatewayError:
    # While the first request is in flight a later retry may succeed: let the client retry.
    return GatewayError(
        409,
        "idempotency_conflict",
        message,
        retry_after_s=1 if in_flight else None,
        should_retry=in_flight,
    )


def no_eligible_route(message: str) -> GatewayError:
    return GatewayError(422, "no_eligible_route", message)


def budget_exceeded(message: str) -> GatewayError:
    return GatewayError(402, "budget_exceeded", message)


def capacity_error(message: str) -> GatewayError:
    # The gateway's own bounded resources: a retry a moment later is sensible.
    return GatewayError(503, "capacity_error", message, retry_after_s=1, should_retry=True)


def ledger_unavailable() -> GatewayError:
    # Without the ledger nothing may be reserved or recorded, so no upstream is called: the
    # request fails fast, and a retry a moment later is sensible.
    return GatewayError(
        503,
        "ledger_unavailable",
        "the ledger's database is unreachable; nothing was sent upstream",
        retry_after_s=1,
        should_retry=True,
    )


def deadline_exceeded(message: str = "the whole-request deadline ran out") -> GatewayError:
    return GatewayError(504, "deadline_exceeded", message)


def upstream_unavailable(message: str, *, retry_after_s: int | None = None) -> GatewayError:
    return GatewayError(503, "upstream_unavailable", message, retry_after_s=retry_after_s)


# SPEC §3: terminal upstream outcomes are named for their cause, never masked as "all busy".
_BY_FAILURE_CLASS: Final[Mapping[FailureClass, tuple[int, str]]] = {
    FailureClass.RATE_LIMITED: (429, "upstream_rate_limited"),
    FailureClass.QUOTA_EXHAUSTED: (502, "upstream_quota_exhausted"),
    FailureClass.CREDENTIALS: (502, "upstream_credentials"),
    FailureClass.POLICY_DENIED: (502, "upstream_policy_denied"),
    FailureClass.RESPONSE_TOO_LARGE: (502, "upstream_response_too_large"),
    FailureClass.NON_RETRYABLE: (502, "upstream_error"),
    FailureClass.CONTEXT_TOO_SMALL: (502, "upstream_error"),
    FailureClass.MODEL_UNAVAILABLE: (503, "upstream_unavailable"),
    FailureClass.UPSTREAM_UNAVAILABLE: (503, "upstream_unavailable"),
    FailureClass.NETWORK_ERROR: (503, "upstream_unavailable"),
    FailureClass.TIMEOUT: (503, "upstream_unavailable"),
    FailureClass.DEADLINE_EXCEEDED: (504, "deadline_exceeded"),
    FailureClass.CLIENT_CANCELED: (499, "client_canceled"),
}


def error_for_failure(
    failure_class: FailureClass, message: str, *, retry_after_ms: int | None = None
) -> GatewayError:
    """The client's answer when the request ends on an upstream failure of this class."""
    status, code = _BY_FAILURE_CLASS[failure_class]
    retry_after_s = None
    if status == 429 and retry_after_ms is not None:
        retry_after_s = max(1, -(-retry_after_ms // 1000))
    return GatewayError(status, code, message, retry_after_s=retry_after_s)
