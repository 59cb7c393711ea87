"""Deterministic trace and span ids, derived from the ledger's request and attempt ids.

The same request always yields the same ids: the live exporter, a re-export of a past
window and the gateway (which sends each attempt's span as the upstream's parent in
``traceparent``) all agree without sharing any state. A request that arrived with a
caller's ``traceparent`` keeps the caller's trace id, so its spans join the caller's trace.

Ids are lower-case hex strings, as in W3C trace context: 32 digits for a trace, 16 for a
span; an all-zero id is invalid there, so a derivation never returns one.
"""

from __future__ import annotations

import hashlib
import hmac

__all__ = [
    "attempt_span_id",
    "is_valid_span_id",
    "is_valid_trace_id",
    "pseudonymous_tenant",
    "request_span_id",
    "request_trace_id",
    "upstream_traceparent",
]

_HEX = frozenset("0123456789abcdef")


def _derive(label: str, value: str, size: int) -> str:
    digest = hashlib.sha256(f"{label}:{value}".encode()).digest()[:size]
    if not any(digest):  # all zero is "no id" in W3C trace context
        digest = digest[:-1] + b"\x01"
    return digest.hex()


def is_valid_trace_id(trace_id: str | None) -> bool:
    return (
        trace_id is not None
        and len(trace_id) == 32
        and set(trace_id) <= _HEX
        and trace_id != "0" * 32
    )


def is_valid_span_id(span_id: str | None) -> bool:
    return (
        span_id is not None and len(span_id) == 16 and set(span_id) <= _HEX and span_id != "0" * 16
    )


def request_trace_id(request_id: str, caller_trace_id: str | None = None) -> str:
    """The request's trace: the caller's (from its ``traceparent``) if valid, else derived."""
    if caller_trace_id is not None and is_valid_trace_id(caller_trace_id.lower()):
        return caller_trace_id.lower()
    return _derive("trace", request_id, 16)


def request_span_id(request_id: str) -> str:
    """The span of the logical request, ``chat {model group}``."""
    return _derive("span:request", request_id, 8)


def attempt_span_id(attempt_id: str) -> str:
    """The ``CLIENT`` span of one upstream attempt, ``chat {upstream model}``."""
    return _derive("span:attempt", attempt_id, 8)


def upstream_traceparent(trace_id: str, attempt_span_id: str) -> str:
    """The W3C ``traceparent`` sent upstream: the request's trace, the attempt's span as
    parent, sampled (every request is traced from the ledger)."""
    return f"00-{trace_id}-{attempt_span_id}-01"


def pseudonymous_tenant(workspace: str, key: bytes) -> str:
    """``waybill.tenant``: the HMAC-SHA256 of a workspace id under the configured secret, in
    hex. Stable (a tenant's spans group together across exports and replicas) and, without
    the secret, neither reversible nor guessable from a list of likely workspace ids."""
    return hmac.new(key, workspace.encode(), hashlib.sha256).hexdigest()
