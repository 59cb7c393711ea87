"""The building blocks of the OpenAPI description: schema helpers, shared schemas,
the error responses and the query and header parameters the routes declare."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

from ledger.events import DATA_CLASSES
from ledger.types import MONEY_PATTERN
from router.doors.chat import ALLOW_FAILOVER_VALUES, MAX_JSON_INTEGER
from router.errors import ERRORS, sent_codes

Schema = dict[str, Any]

REF: Final = "#/components/schemas/"

# Every ``error.code`` an answer can carry: contract §3's table, as router.errors defines it.
ERROR_CODES: Final = tuple(code.value for code in sent_codes())


def ref(name: str) -> Schema:
    return {"$ref": REF + name}


def nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


STRING: Final[Schema] = {"type": "string"}
MONEY: Final[Schema] = {
    "type": "string",
    "pattern": r"^-?[0-9]+(\.[0-9]+)?$",
    "description": "A decimal amount in USD, as a string (never a float).",
}
ITEMS: Final[Schema] = {"type": "object"}
HEX_HASH: Final[Schema] = {"type": "string", "pattern": "^[0-9a-f]{64}$"}
TOKENS: Final[Schema] = {"type": "integer", "minimum": 1, "maximum": MAX_JSON_INTEGER}


def page(item: Schema) -> Schema:
    return {
        "type": "object",
        "required": ["data", "next_cursor"],
        "properties": {
            "data": {"type": "array", "items": item},
            "next_cursor": nullable(STRING),
        },
    }


def when(kind: str, **required: Schema) -> Schema:
    """A block of type ``kind`` has these fields, of these types."""
    return {
        "if": {"properties": {"type": {"const": kind}}},
        "then": {"required": list(required), "properties": required},
    }


def object_schema(required: Iterable[str], **properties: Schema) -> Schema:
    """An object with these fields at least (more are welcome: contract §3)."""
    return {"type": "object", "required": list(required), "properties": properties}


# A cache_control marker: its lifetime is a cache write the request may be billed for.
CACHE: Final[Schema] = nullable({"type": "object", "properties": {"ttl": {"enum": ["5m", "1h"]}}})

# --- responses ------------------------------------------------------------------------------

REQUEST_ID_HEADER: Final[Schema] = {
    "description": "This request's id (every response carries it).",
    "schema": STRING,
}


def meanings() -> dict[int, str]:
    """Each status's description: the codes it may carry, and when (router.errors.ERRORS)."""
    meanings: dict[int, list[str]] = {}
    for row in ERRORS:
        if row.sent:
            meanings.setdefault(row.status, []).append(f"{row.code}: {row.when}")
    return {status: "; ".join(rows) for status, rows in meanings.items()}


ERROR_MEANINGS: Final = meanings()


def error_responses(*statuses: int) -> dict[str, Schema]:
    """The controlled error body under each status; every authenticated route can also meet
    a 401 and, when the ledger's database is down, a 503."""
    return {
        str(status): {
            "description": ERROR_MEANINGS[status],
            "headers": {
                "X-Request-Id": REQUEST_ID_HEADER,
                "x-should-retry": {
                    "description": "false: the gateway has already retried or judged it final.",
                    "schema": {"type": "string", "enum": ["true", "false"]},
                },
            },
            "content": {"application/json": {"schema": ref("Error")}},
        }
        for status in sorted({*statuses, 401, 503})
    }


def ok(schema: Schema, media_type: str = "application/json", *, also: str = "") -> Schema:
    """A success response; ``also`` names a second media type, of plain text."""
    content = {media_type: {"schema": schema}}
    if also:
        content[also] = {"schema": STRING}
    return {
        "description": "OK",
        "headers": {"X-Request-Id": REQUEST_ID_HEADER},
        "content": content,
    }


# --- parameters -----------------------------------------------------------------------------


def query(name: str, schema: Schema, description: str = "") -> Schema:
    parameter: Schema = {"name": name, "in": "query", "required": False, "schema": schema}
    if description:
        parameter["description"] = description
    return parameter


def header(name: str, schema: Schema, description: str) -> Schema:
    return {
        "name": name,
        "in": "header",
        "required": False,
        "schema": schema,
        "description": description,
    }


# router.http.queries.DEFAULT_LIMIT and MAX_LIMIT (which imports this module, not the reverse).
LIMIT: Final = query("limit", {"type": "integer", "minimum": 1, "maximum": 500, "default": 100})
CURSOR: Final = query(
    "cursor", STRING, "The opaque next_cursor of the previous page (only that is accepted)."
)
INSTANT: Final[Schema] = {
    "anyOf": [{"type": "string", "format": "date"}, {"type": "string", "format": "date-time"}],
    "description": "ISO 8601 date or date-time; without an offset, UTC.",
}
DAY: Final[Schema] = {"type": "string", "format": "date", "description": "A UTC day."}
WORKSPACE: Final = query(
    "workspace", STRING, "Narrow to one workspace (admin keys; others see their own)."
)


def kept(*excluded: str) -> str:
    """A character Python's str.strip() keeps (the gateway ignores blanks around keys, names
    and reasons, and Python's blanks are not quite JSON Schema's \\s), nor one of ``excluded``."""
    blanks = r"\t\n\v\f\r \x1c-\x1f\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
    return f"[^{blanks}{''.join(excluded)}]"


NAMES: Final[Schema] = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "string", "pattern": f"^[^,]*{kept(',')}[^,]*$"},
}

ENDPOINT_ID: Final[Schema] = {"type": "string", "pattern": kept()}

CHAT_HEADERS: Final = [
    header(
        "Idempotency-Key",
        {"type": "string", "maxLength": 255, "pattern": kept()},
        "Scoped to the API key: a retry by the same API key with the same Idempotency-Key "
        "and body returns the recorded answer; 409 while the first is in flight or when "
        "reused with another body. Another API key's use of it is an independent request.",
    ),
    header(
        "X-Waybill-Max-Cost-Usd",
        {"type": "string", "pattern": MONEY_PATTERN},
        "This request's budget in USD, across all attempts.",
    ),
    header(
        "X-Waybill-Deadline-Ms",
        {"type": "integer", "minimum": 1, "maximum": MAX_JSON_INTEGER},
        "The whole-request deadline, in milliseconds.",
    ),
    header(
        "X-Waybill-Allow-Failover",
        {"type": "string", "enum": list(ALLOW_FAILOVER_VALUES)},
        "false (also 0, no) forbids switching endpoints for this request; true (also 1, "
        "yes) or absent allows it; unknown also allows it and lets an attempt whose "
        "execution is unknown be followed by another (a retry or a failover: a possible "
        "duplicate execution) where the request is strict (on_unknown_execution: stop, or "
        "server-side tools or web search in the body). Any case.",
    ),
    header(
        "X-Waybill-Capabilities",
        NAMES,
        "Extra required capabilities, comma-separated (others are inferred from the body).",
    ),
    header("X-Waybill-Regions", NAMES, "A narrower region set, comma-separated."),
    header(
        "X-Waybill-Endpoints",
        NAMES,
        "A narrower endpoint set, comma-separated: endpoint ids and provider:NAME labels "
        "(expanded within the model group), intersected with the key's own scope; a name "
        "that matches nothing narrows to nothing.",
    ),
    header(
        "X-Waybill-Prefer-Endpoint",
        ENDPOINT_ID,
        "An endpoint id to choose when one of its mappings is eligible; the router overrules "
        "it otherwise.",
    ),
    header(
        "X-Waybill-Require-Endpoint",
        ENDPOINT_ID,
        "An endpoint id the request is pinned to: no other endpoint is ever tried.",
    ),
    header(
        "X-Waybill-Data-Class",
        {"type": "string", "enum": list(DATA_CLASSES)},
        "This request's data class; it may raise the workspace's default, never lower it.",
    ),
    header(
        "X-Waybill-Retention",
        {"type": "string", "pattern": "^([Zz][Ee][Rr][Oo]|[1-9][0-9]{0,4}[Dd])$"},
        "The most an endpoint may keep of this request: zero, or a number of days such as "
        "30d. It narrows the workspace's retention bound, never widens it.",
    ),
    header("traceparent", STRING, "W3C trace context: the request's trace joins it."),
    header("tracestate", STRING, "W3C trace state, forwarded with a valid traceparent."),
]

# --- operations, one per route --------------------------------------------------------------
