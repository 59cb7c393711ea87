"""The request headers every door reads alike (contract §3 "Request headers"): the
``X-Waybill-*`` narrowing, ``Idempotency-Key`` and W3C trace context. Pure: header values in,
a frozen :class:`HeaderNarrowing` or a 400 ``invalid_request`` naming the header out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Final

from ledger.events import (
    DATA_CLASSES,
    RETENTION_PATTERN,
    DataClass,
    data_class_rank,
    retention_rank,
)
from ledger.support.frozen import direct_init
from ledger.types import MONEY_LIMIT, parse_money
from router.config import Workspace
from router.errors import GatewayError, invalid_request

__all__ = ["ALLOW_FAILOVER_VALUES", "MAX_JSON_INTEGER", "HeaderNarrowing", "read_headers"]

# A header's value, trimmed and lowercased, to the data class it names.
_DATA_CLASS_BY_NAME: Final[Mapping[str, DataClass]] = {c: c for c in DATA_CLASSES}
# X-Waybill-Allow-Failover, trimmed and lowercased: (failover allowed, a possible duplicate
# execution allowed).
_ALLOW_FAILOVER: Final[Mapping[str, tuple[bool, bool]]] = {
    "true": (True, False),
    "1": (True, False),
    "yes": (True, False),
    "false": (False, False),
    "0": (False, False),
    "no": (False, False),
    "unknown": (True, True),
}
ALLOW_FAILOVER_VALUES: Final = tuple(_ALLOW_FAILOVER)
"""What X-Waybill-Allow-Failover may say (trimmed, any case)."""
# I-JSON (RFC 7493): the largest integer every JSON parser reads exactly (orjson reads larger
# ones as floats, and cannot write integers beyond 64 bits into an event at all). Token counts
# and deadlines beyond it are refused rather than guessed at.
MAX_JSON_INTEGER: Final = 2**53 - 1
# W3C Trace Context: a tracestate of at most 32 list members, 512 characters being the
# length every vendor must be able to propagate.
_TRACESTATE_MAX_CHARS: Final = 512
_TRACESTATE_MAX_MEMBERS: Final = 32
_RETENTION = re.compile(RETENTION_PATTERN)


@direct_init
@dataclass(frozen=True, slots=True)
class HeaderNarrowing:
    """What the optional contract §3 headers asked for; each may only narrow the policy."""

    idempotency_key: str | None = None
    max_cost_usd: Decimal | None = None
    deadline_ms: int | None = None
    allow_failover: bool = True
    allow_unknown_execution: bool = False  # X-Waybill-Allow-Failover: unknown
    # The header was sent and allows failover (true or unknown): the grant a group's
    # `failover: on_grant` waits for; absent, failover is allowed but not granted.
    failover_granted: bool = False
    capabilities: tuple[str, ...] = ()
    regions: tuple[str, ...] | None = None
    data_class: DataClass | None = None
    retention: str | None = None  # X-Waybill-Retention: zero or <days>d
    endpoints: tuple[str, ...] | None = None  # endpoint ids and provider: labels
    prefer_endpoint: str | None = None
    require_endpoint: str | None = None  # pinned there: no other endpoint is ever tried
    traceparent: str | None = None
    tracestate: str | None = None  # W3C, opaque; forwarded only with a valid traceparent

    def narrowing(self, workspace: Workspace, capabilities: Iterable[str]) -> dict[str, Any]:
        """The fields of a request's ``Requirements`` that the caller's headers set, for
        ``workspace``'s key, beside the ``capabilities`` the door inferred from the body:
        every door's requirements are its body's needs and these."""
        return {
            "capabilities": tuple(sorted({*capabilities, *self.capabilities})),
            "regions": self.regions,
            "data_class": self.data_class_for(workspace),
            "retention": self.retention_for(workspace),
            "allow_failover": self.allow_failover,
            "max_cost_usd": self.max_cost_usd,
            "deadline_ms": self.deadline_ms,
            "allow_unknown_execution": self.allow_unknown_execution,
            "failover_granted": self.failover_granted,
            "endpoints": self.endpoints,
            "prefer_endpoint": self.prefer_endpoint,
            "require_endpoint": self.require_endpoint,
        }

    def data_class_for(self, workspace: Workspace) -> DataClass:
        """The request's data class: the workspace's, raised (never lowered) by the header."""
        wanted = self.data_class
        if wanted is not None and data_class_rank(wanted) > data_class_rank(workspace.data_class):
            return wanted
        return workspace.data_class

    def retention_for(self, workspace: Workspace) -> str | None:
        """The request's retention bound: the workspace's, narrowed (never widened) by the
        header; None when neither sets one."""
        bounds = [b for b in (workspace.retention, self.retention) if b is not None]
        return min(bounds, key=retention_rank) if bounds else None


def read_headers(headers: Mapping[str, str]) -> HeaderNarrowing:
    """The optional contract §3 request headers; a bad value is a 400 naming the header."""
    allow_failover, allow_unknown_execution = _allow_failover(
        headers.get("x-waybill-allow-failover")
    )
    return HeaderNarrowing(
        idempotency_key=_idempotency_key(headers.get("idempotency-key")),
        max_cost_usd=_max_cost(headers.get("x-waybill-max-cost-usd")),
        deadline_ms=_positive_int(headers.get("x-waybill-deadline-ms"), "X-Waybill-Deadline-Ms"),
        allow_failover=allow_failover,
        allow_unknown_execution=allow_unknown_execution,
        failover_granted=allow_failover and "x-waybill-allow-failover" in headers,
        capabilities=_csv(headers.get("x-waybill-capabilities"), "X-Waybill-Capabilities") or (),
        regions=_csv(headers.get("x-waybill-regions"), "X-Waybill-Regions"),
        endpoints=_csv(headers.get("x-waybill-endpoints"), "X-Waybill-Endpoints"),
        prefer_endpoint=_endpoint_id(
            headers.get("x-waybill-prefer-endpoint"), "X-Waybill-Prefer-Endpoint"
        ),
        require_endpoint=_endpoint_id(
            headers.get("x-waybill-require-endpoint"), "X-Waybill-Require-Endpoint"
        ),
        data_class=_data_class(headers.get("x-waybill-data-class")),
        retention=_retention(headers.get("x-waybill-retention")),
        traceparent=headers.get("traceparent"),
        tracestate=_tracestate(headers.get("tracestate")),
    )


def _bad_header(name: str, why: str) -> GatewayError:
    return invalid_request(f"header {name}: {why}", param=name)


def _idempotency_key(value: str | None) -> str | None:
    if value is None:
        return None
    value = value.strip()
    if not value or len(value) > 255:
        raise _bad_header("Idempotency-Key", "must be 1 to 255 characters")
    return value


def _max_cost(value: str | None) -> Decimal | None:
    if value is None:
        return None
    amount = parse_money(value)
    if amount is None:
        raise _bad_header(
            "X-Waybill-Max-Cost-Usd", f"must be a decimal amount (0.25) below {MONEY_LIMIT}"
        )
    return amount


def _positive_int(value: str | None, name: str) -> int | None:
    if value is None:
        return None
    text = value.strip()
    # ASCII digits only: "²" is a digit to str.isdigit, and not a number to int().
    if not (text.isascii() and text.isdigit()) or not 0 < int(text) <= MAX_JSON_INTEGER:
        raise _bad_header(name, f"must be an integer from 1 to {MAX_JSON_INTEGER}")
    return int(text)


def _allow_failover(value: str | None) -> tuple[bool, bool]:
    """(failover allowed, a possible duplicate execution allowed); absent: failover allowed."""
    if value is None:
        return True, False
    allowed = _ALLOW_FAILOVER.get(value.strip().lower())
    if allowed is None:
        raise _bad_header(
            "X-Waybill-Allow-Failover", "must be true, false or unknown (also 1, 0, yes, no)"
        )
    return allowed


def _csv(value: str | None, name: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    items = tuple(sorted({part.strip() for part in value.split(",") if part.strip()}))
    if not items:
        raise _bad_header(name, "must name at least one value")
    return items


def _endpoint_id(value: str | None, name: str) -> str | None:
    """One endpoint id, as X-Waybill-Prefer-Endpoint and X-Waybill-Require-Endpoint name it.
    An id the model group lacks is no error: it matches nothing, as a scope's names do."""
    if value is None:
        return None
    text = value.strip()
    if not text:
        raise _bad_header(name, "must name an endpoint id")
    return text


def _data_class(value: str | None) -> DataClass | None:
    if value is None:
        return None
    data_class = _DATA_CLASS_BY_NAME.get(value.strip().lower())
    if data_class is None:
        raise _bad_header("X-Waybill-Data-Class", f"must be one of {', '.join(DATA_CLASSES)}")
    return data_class


def _retention(value: str | None) -> str | None:
    if value is None:
        return None
    retention = value.strip().lower()
    # `none` is a provider's declaration, not a bound a caller asks for (contract §3).
    if retention == "none" or _RETENTION.fullmatch(retention) is None:
        raise _bad_header("X-Waybill-Retention", "must be zero or a number of days such as 30d")
    return retention


def _tracestate(value: str | None) -> str | None:
    """The caller's ``tracestate``, to forward unchanged; None if absent, empty, over the
    W3C limits or not printable ASCII. Its entries are other vendors' and opaque: the value
    is dropped, never trimmed or refused (trace context must not fail a request)."""
    if value is None:
        return None
    value = value.strip()
    if len(value) > _TRACESTATE_MAX_CHARS or not (value.isascii() and value.isprintable()):
        return None
    members = [member for member in value.split(",") if member.strip()]
    return value if 0 < len(members) <= _TRACESTATE_MAX_MEMBERS else None
