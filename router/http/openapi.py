"""The OpenAPI 3.1 description of the HTTP API (contract §3), served at ``GET /openapi.json``.

The handlers read raw requests on purpose (one JSON parse, errors in the contract's shape),
so FastAPI cannot infer what they accept or answer. Each route declares it here instead,
passed as ``openapi_extra`` on its decorator: the request body, the query and header
parameters, and every response, errors included. The declarations say what the gateway
checks, no more and no less: a fuzzer (tests/gateway/test_fuzz_api.py) holds the two to
each other. :func:`install_openapi` adds the shared components (the error body, the bearer
scheme) and drops what FastAPI guesses for typed parameters the handlers never validate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Final

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from ledger.events import APIS, DATA_CLASSES, FailureClass, ReasonCode
from ledger.types import MONEY_PATTERN
from ledger.views.queries import REQUEST_STATUSES
from ledger.views.spend_queries import GROUP_KEYS
from router.config import Limits
from router.doors.chat import ALLOW_FAILOVER_VALUES, MAX_JSON_INTEGER
from router.errors import ERRORS, sent_codes

__all__ = [
    "ADMIN_RELOAD",
    "BUDGETS",
    "CHAT_COMPLETIONS",
    "EMBEDDINGS",
    "ENABLE_ENDPOINT",
    "ERROR_CODES",
    "EXPLAIN_REQUEST",
    "HEALTHZ",
    "IMPORT_RECONCILIATION",
    "LIST_ENDPOINTS",
    "MESSAGES",
    "MESSAGES_COUNT_TOKENS",
    "METRICS",
    "MODELS",
    "READYZ",
    "READ_RECONCILIATION",
    "READ_RECONCILIATION_BUCKET",
    "REQUEST_EVENTS",
    "REQUEST_PROOF",
    "REQUEST_VIEW",
    "SEARCH_REQUESTS",
    "SETTLE_UNKNOWN",
    "SPEND",
    "UNKNOWN_SETTLEMENTS",
    "VERIFY_LEDGER",
    "install_openapi",
]

Schema = dict[str, Any]

_REF: Final = "#/components/schemas/"

# Every ``error.code`` an answer can carry: contract §3's table, as router.errors defines it.
ERROR_CODES: Final = tuple(code.value for code in sent_codes())


def _ref(name: str) -> Schema:
    return {"$ref": _REF + name}


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


_STRING: Final[Schema] = {"type": "string"}
_MONEY: Final[Schema] = {
    "type": "string",
    "pattern": r"^-?[0-9]+(\.[0-9]+)?$",
    "description": "A decimal amount in USD, as a string (never a float).",
}
_ITEMS: Final[Schema] = {"type": "object"}
_HEX_HASH: Final[Schema] = {"type": "string", "pattern": "^[0-9a-f]{64}$"}
_TOKENS: Final[Schema] = {"type": "integer", "minimum": 1, "maximum": MAX_JSON_INTEGER}


def _page(item: Schema) -> Schema:
    return {
        "type": "object",
        "required": ["data", "next_cursor"],
        "properties": {
            "data": {"type": "array", "items": item},
            "next_cursor": _nullable(_STRING),
        },
    }


def _when(kind: str, **required: Schema) -> Schema:
    """A block of type ``kind`` has these fields, of these types."""
    return {
        "if": {"properties": {"type": {"const": kind}}},
        "then": {"required": list(required), "properties": required},
    }


def _object(required: Iterable[str], **properties: Schema) -> Schema:
    """An object with these fields at least (more are welcome: contract §3)."""
    return {"type": "object", "required": list(required), "properties": properties}


# A cache_control marker: its lifetime is a cache write the request may be billed for.
_CACHE: Final[Schema] = _nullable({"type": "object", "properties": {"ttl": {"enum": ["5m", "1h"]}}})

_SCHEMAS: Final[dict[str, Schema]] = {
    "Error": {
        "description": "The one controlled error body (contract §3): OpenAI-shaped, never a trace.",
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["type", "code", "message", "param", "request_id", "attempts"],
                "properties": {
                    "type": _STRING,
                    "code": {"type": "string", "enum": list(ERROR_CODES)},
                    "message": _STRING,
                    "param": _nullable(_STRING),
                    "request_id": _STRING,
                    "attempts": {"type": "array", "items": _ref("AttemptSummary")},
                },
            }
        },
    },
    "AnthropicError": {
        "description": (
            'The Anthropic door\'s error body (contract §3 "The Anthropic door"): '
            "Anthropic's shape, Waybill's error code under error.code."
        ),
        "type": "object",
        "required": ["type", "error"],
        "properties": {
            "type": {"type": "string", "enum": ["error"]},
            "error": {
                "type": "object",
                "required": ["type", "message", "code"],
                "properties": {
                    "type": _STRING,
                    "message": _STRING,
                    "code": {"type": "string", "enum": list(ERROR_CODES)},
                    "param": _STRING,
                    "attempts": {"type": "array", "items": _ref("AttemptSummary")},
                },
            },
            "request_id": _nullable(_STRING),
        },
    },
    "MessagesRequest": {
        "description": (
            "An Anthropic Messages API request; model names a Waybill model group. A field "
            "outside the documented set is refused (400) unless it belongs to a beta named "
            "in anthropic-beta (contract §3 lists them). Anthropic endpoints receive the body "
            "natively; OpenAI-dialect endpoints its translation, or are excluded "
            "(dialect_unsupported). Also accepted, beyond what this schema can say: "
            'thinking {"type": "enabled", "budget_tokens"} below max_tokens, and tool_choice '
            '{"type": "tool", "name"} naming a declared tool.'
        ),
        "type": "object",
        "required": ["model", "messages", "max_tokens"],
        "properties": {
            "model": {"type": "string", "minLength": 1},
            "messages": {"type": "array", "minItems": 1, "items": _ref("MessagesTurn")},
            "max_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_JSON_INTEGER},
            "system": _nullable(
                {"anyOf": [_STRING, {"type": "array", "items": _ref("MessagesTextBlock")}]}
            ),
            "stream": _nullable({"type": "boolean"}),
            "stop_sequences": _nullable({"type": "array", "items": _STRING}),
            "temperature": _nullable({"type": "number"}),
            "top_p": _nullable({"type": "number"}),
            "top_k": _nullable(
                {"type": "integer", "minimum": -MAX_JSON_INTEGER, "maximum": MAX_JSON_INTEGER}
            ),
            "tools": _nullable({"type": "array", "items": _ref("MessagesTool")}),
            "tool_choice": _nullable(
                {
                    "type": "object",
                    "required": ["type"],
                    "properties": {"type": {"enum": ["auto", "any", "none"]}},
                }
            ),
            "metadata": _nullable(
                {"type": "object", "properties": {"user_id": _nullable(_STRING)}}
            ),
            "thinking": _nullable(
                {
                    "type": "object",
                    "required": ["type"],
                    "properties": {"type": {"enum": ["adaptive", "disabled"]}},
                }
            ),
            "service_tier": _nullable(_STRING),
        },
        "additionalProperties": False,
    },
    "MessagesTurn": {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"enum": ["user", "assistant"]},
            "content": {"anyOf": [_STRING, {"type": "array", "items": _ref("MessagesBlock")}]},
        },
    },
    "MessagesTextBlock": {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": _STRING, "cache_control": _CACHE},
    },
    "MessagesBlock": {
        "description": (
            "A content block: text, image, document, tool_use, tool_result, thinking, ... "
            "(others are passed on natively to Anthropic endpoints)."
        ),
        "type": "object",
        "required": ["type"],
        "properties": {"type": _STRING, "cache_control": _CACHE},
        "allOf": [
            _when("text", text=_STRING),
            _when("image", source={"type": "object"}),
            _when("tool_use", id=_STRING, name=_STRING),
            {
                "if": {"properties": {"type": {"const": "tool_result"}}},
                "then": {
                    "required": ["tool_use_id"],
                    "properties": {
                        "tool_use_id": _STRING,
                        "content": _nullable(
                            {
                                "anyOf": [
                                    _STRING,
                                    {"type": "array", "items": _ref("MessagesPart")},
                                ]
                            }
                        ),
                    },
                },
            },
        ],
    },
    "MessagesPart": {
        "description": "A block inside a tool_result's content.",
        "type": "object",
        "required": ["type"],
        "properties": {"type": _STRING, "cache_control": _CACHE},
        "allOf": [
            _when("text", text=_STRING),
            _when("image", source={"type": "object"}),
            _when("tool_use", id=_STRING, name=_STRING),
            _when("tool_result", tool_use_id=_STRING),
        ],
    },
    "MessagesTool": {
        "description": "A custom tool (input_schema required) or an Anthropic-defined one.",
        "type": "object",
        "required": ["name"],
        "properties": {"name": _STRING, "cache_control": _CACHE},
        "if": {"properties": {"type": {"const": "custom"}}},
        "then": {"required": ["input_schema"], "properties": {"input_schema": {"type": "object"}}},
    },
    "Message": {
        "description": "Anthropic's message object.",
        "type": "object",
        "required": ["id", "type", "role", "content", "model", "stop_reason", "usage"],
        "properties": {
            "id": _STRING,
            "type": {"type": "string", "enum": ["message"]},
            "role": {"type": "string", "enum": ["assistant"]},
            "content": {"type": "array", "items": {"type": "object"}},
            "model": _nullable(_STRING),
            "stop_reason": _nullable(_STRING),
            "stop_sequence": _nullable(_STRING),
            "usage": {"type": "object"},
        },
    },
    "AttemptSummary": {
        "description": "One upstream attempt as a client may see it: no secret, no prompt.",
        "type": "object",
        "required": ["endpoint", "status", "failure_class"],
        "properties": {
            "endpoint": _STRING,
            "status": _nullable({"type": "integer"}),
            "failure_class": _nullable({"type": "string", "enum": [c.value for c in FailureClass]}),
        },
    },
    "ChatMessage": {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"type": "string", "minLength": 1, "examples": ["user"]},
            "content": {
                "anyOf": [
                    _STRING,
                    {"type": "null"},
                    {
                        "type": "array",
                        "items": {
                            "description": "A content part: text, image_url, input_image, ...",
                            "type": "object",
                            "required": ["type"],
                            "properties": {"type": _STRING},
                        },
                    },
                ]
            },
        },
        "additionalProperties": True,
    },
    "ChatCompletionRequest": {
        "description": (
            "An OpenAI chat completion request. Fields the gateway does not read pass through "
            "to an OpenAI-compatible upstream unchanged. Before each attempt the gateway "
            "reserves the request's worst case on the chosen mapping: its text input, each "
            "image, audio or file part at the mapping's bound, and n times the output bound "
            "(plus a prediction's size); audio output and web_search_options at the "
            "mapping's prices. A mapping without a price for something the request may be "
            "billed for is excluded (reason code unpriced_input: 422 no_eligible_route if "
            "none is left)."
        ),
        "type": "object",
        "required": ["model", "messages"],
        # OpenAI refuses both bounds at once, and so does the gateway: 400, param max_tokens.
        "not": {
            "required": ["max_tokens", "max_completion_tokens"],
            "properties": {
                "max_tokens": {"type": "integer"},
                "max_completion_tokens": {"type": "integer"},
            },
        },
        "properties": {
            "model": {
                "type": "string",
                "minLength": 1,
                "description": "A model group the key may call (GET /v1/models).",
            },
            "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
            "stream": _nullable({"type": "boolean"}),
            "stream_options": _nullable(
                {
                    "type": "object",
                    "properties": {"include_usage": _nullable({"type": "boolean"})},
                    "additionalProperties": True,
                }
            ),
            "max_tokens": _nullable(_TOKENS),
            "max_completion_tokens": _nullable(
                {**_TOKENS, "description": "Bounds every output token, reasoning included."}
            ),
            # Its maximum is the serving config's limits.max_n (install_openapi).
            "n": _nullable({"type": "integer", "minimum": 1}),
            "tools": _nullable(
                {
                    "type": "array",
                    "description": "Tool definitions; a non-empty list requires the tools "
                    "capability.",
                    "items": {},
                }
            ),
            "response_format": _nullable(
                {
                    "type": "object",
                    "description": '{"type": "json_schema", ...} requires the json_schema '
                    "capability.",
                }
            ),
        },
        "additionalProperties": True,
    },
    "ChatCompletion": _object(
        ["choices"],
        id=_STRING,
        object=_STRING,
        model=_STRING,
        choices={"type": "array", "items": _ITEMS},
        usage=_nullable(_ITEMS),
    ),
    "ModelList": _object(
        ["object", "data"],
        object={"const": "list"},
        data={"type": "array", "items": _object(["id", "object"], id=_STRING, object=_STRING)},
    ),
    "RequestView": _object(
        [
            "request_id",
            "workspace",
            "key_id",
            "model",
            "status",
            "endpoint",
            "attempts",
            "reserved_usd",
            "settled_usd",
            "held_unknown_usd",
            "created_at",
            "completed_at",
        ],
        request_id=_STRING,
        workspace=_STRING,
        key_id=_STRING,
        model=_STRING,
        status={"type": "string", "enum": list(REQUEST_STATUSES)},
        endpoint=_nullable(_STRING),
        reserved_usd=_MONEY,
        settled_usd=_MONEY,
        held_unknown_usd=_MONEY,
        created_at=_STRING,
        completed_at=_nullable(_STRING),
    ),
    "Event": _object(
        [
            "position",
            "stream_id",
            "version",
            "type",
            "schema_version",
            "data",
            "metadata",
            "recorded_at",
            "hash",
        ],
        position={"type": "integer"},
        stream_id=_STRING,
        version={"type": "integer"},
        type=_STRING,
        schema_version={"type": "integer"},
        data=_ITEMS,
        metadata=_ITEMS,
        recorded_at=_STRING,
        hash=_STRING,
    ),
    "Proof": _object(
        ["format", "request_id", "checkpoint", "events", "stream"],
        format={"type": "string", "enum": ["waybill-proof/v2"]},
        request_id=_STRING,
        checkpoint=_object(
            ["format", "size", "root", "head_hash", "time", "key_id", "signature"],
            format={"type": "string", "enum": ["waybill-checkpoint/v1"]},
            size={"type": "integer", "minimum": 1},
            root=_HEX_HASH,
            head_hash=_HEX_HASH,
            time=_STRING,
            key_id=_STRING,
            signature=_STRING,
        ),
        events={
            "type": "array",
            "items": _object(
                ["position", "version", "type", "leaf_hash", "payload", "inclusion_proof"],
                position={"type": "integer", "minimum": 1},
                version={"type": "integer", "minimum": 1},
                type=_STRING,
                leaf_hash=_HEX_HASH,
                payload={
                    "type": "string",
                    "description": "The event's stored canonical bytes, standard base64.",
                },
                inclusion_proof={"type": "array", "items": _HEX_HASH},
            ),
        },
        stream={
            **_object(
                ["first_version", "last_version", "key_id", "signature"],
                first_version={"type": "integer", "minimum": 1},
                last_version={"type": "integer", "minimum": 1},
                key_id=_STRING,
                signature=_STRING,
            ),
            "description": "The request stream's version range the checkpoint covers (every "
            "event in `events`), signed with a checkpoint key over the statement of contract "
            '§7 "Proofs": a proof with events left out fails.',
        },
    ),
    "Explanation": _object(
        ["api", "summary", "candidates", "attempts", "decision_path"],
        api={
            "type": "string",
            "enum": list(APIS),
            "description": "The client API (door) the request came through.",
        },
        summary=_STRING,
        candidates={
            "type": "array",
            "items": _object(
                ["reason_code"],
                reason_code=_nullable(
                    {
                        "type": "string",
                        "enum": [code.value for code in ReasonCode],
                        "description": "Why the mapping was excluded (contract §4), or null.",
                    }
                ),
                worst_case_usd=_nullable(_MONEY),
            ),
        },
        attempts={"type": "array", "items": _ITEMS},
        decision_path={"type": "array"},
    ),
    "Breaker": _object(
        ["state", "blocked", "consecutive_failures", "trips", "cooldown_ms", "probe_in_ms"],
        state={"type": "string", "enum": ["closed", "open", "half_open"]},
        blocked={"type": "boolean", "description": "An attempt would be refused now."},
        consecutive_failures={"type": "integer"},
        trips={"type": "integer"},
        cooldown_ms=_nullable({"type": "integer"}),
        probe_in_ms=_nullable(
            {"type": "integer", "description": "While open: how long until a probe may go."}
        ),
        calls=_nullable({"type": "integer", "description": "A rolling breaker's window."}),
        failed_calls=_nullable({"type": "integer"}),
        slow_calls=_nullable({"type": "integer"}),
    ),
    "EndpointState": _object(
        ["id", "state", "enabled", "disabled", "breaker_policy", "breaker", "mappings"],
        id=_STRING,
        driver=_STRING,
        region=_STRING,
        state={
            "type": "string",
            "enum": ["enabled", "disabled", "config_disabled"],
            "description": "disabled: a credentials failure disabled it (contract §5); "
            "config_disabled: the config says enabled: false.",
        },
        enabled={"type": "boolean", "description": "The config's enabled."},
        disabled=_nullable(
            _object(
                ["disabled_at", "http_status", "error_code", "request_id"],
                disabled_at=_STRING,
                http_status=_nullable({"type": "integer"}),
                error_code=_nullable(_STRING),
                request_id=_nullable(_STRING),
                attempt_id=_nullable(_STRING),
                config_generation=_STRING,
                position={"type": "integer"},
            )
        ),
        breaker_policy={
            "type": "string",
            "enum": ["consecutive", "rolling"],
            "description": "The policy this endpoint's breakers run by: its own breaker "
            "block's, else defaults.breaker's.",
        },
        breaker=_ref("Breaker"),
        mappings={
            "type": "array",
            "items": _object(["model", "breaker"], model=_STRING, breaker=_ref("Breaker")),
        },
    ),
    "LedgerVerification": _object(
        ["ok", "checked"], ok={"type": "boolean"}, checked={"type": "integer"}
    ),
    "SpendRow": _object(
        ["settled_usd", "held_unknown_usd", "overrun_usd", "requests", "attempts"],
        api={"type": "string", "enum": list(APIS), "description": "With group_by=api."},
        settled_usd=_MONEY,
        held_unknown_usd=_MONEY,
        overrun_usd=_MONEY,
        requests={"type": "integer"},
        attempts={"type": "integer"},
        # A closed period's rows are its closed totals; what changed since stands here.
        adjustment_settled_usd=_MONEY,
        adjustment_held_unknown_usd=_MONEY,
        adjustment_overrun_usd=_MONEY,
    ),
    "BudgetBalance": _object(
        [
            "account_id",
            "kind",
            "limit_usd",
            "held_usd",
            "settled_usd",
            "overrun_usd",
            "available_usd",
        ],
        account_id=_STRING,
        kind=_STRING,
        limit_usd=_MONEY,
        held_usd=_MONEY,
        settled_usd=_MONEY,
        overrun_usd=_MONEY,
        available_usd=_MONEY,
    ),
    "UnknownSettlement": _object(
        [
            "settlement_id",
            "request_id",
            "attempt_id",
            "workspace",
            "key_id",
            "endpoint",
            "held_usd",
            "state",
            "settled_usd",
        ],
        settlement_id=_STRING,
        request_id=_STRING,
        attempt_id=_STRING,
        workspace=_STRING,
        key_id=_STRING,
        endpoint=_STRING,
        held_usd=_MONEY,
        state={"type": "string", "enum": ["open", "settled"]},
        settled_usd=_nullable(_MONEY),
    ),
    "ReconciliationReport": _object(
        [
            "id",
            "matched",
            "settled_unknown",
            "amount_mismatches",
            "unmatched_provider_lines",
            "unmatched_attempts",
            "overruns",
        ],
        id=_STRING,
        matched={"type": "array", "items": _ITEMS},
        settled_unknown={"type": "array", "items": _ITEMS},
        amount_mismatches={"type": "array", "items": _ITEMS},
        unmatched_provider_lines={"type": "array", "items": _ITEMS},
        unmatched_attempts={"type": "array", "items": _ITEMS},
        overruns={"type": "array", "items": _ITEMS},
        format=_STRING,
        buckets={"type": "array", "items": {"type": "object"}},
        unattributed_provider_usage={"type": "array", "items": {"type": "object"}},
        notes={"type": "array", "items": _STRING},
    ),
    "Status": _object(["status"], status=_STRING),
}

# --- responses ------------------------------------------------------------------------------

_REQUEST_ID_HEADER: Final[Schema] = {
    "description": "This request's id (every response carries it).",
    "schema": _STRING,
}


def _meanings() -> dict[int, str]:
    """Each status's description: the codes it may carry, and when (router.errors.ERRORS)."""
    meanings: dict[int, list[str]] = {}
    for row in ERRORS:
        if row.sent:
            meanings.setdefault(row.status, []).append(f"{row.code}: {row.when}")
    return {status: "; ".join(rows) for status, rows in meanings.items()}


_ERROR_MEANINGS: Final = _meanings()


def _error_responses(*statuses: int) -> dict[str, Schema]:
    """The controlled error body under each status; every authenticated route can also meet
    a 401 and, when the ledger's database is down, a 503."""
    return {
        str(status): {
            "description": _ERROR_MEANINGS[status],
            "headers": {
                "X-Request-Id": _REQUEST_ID_HEADER,
                "x-should-retry": {
                    "description": "false: the gateway has already retried or judged it final.",
                    "schema": {"type": "string", "enum": ["true", "false"]},
                },
            },
            "content": {"application/json": {"schema": _ref("Error")}},
        }
        for status in sorted({*statuses, 401, 503})
    }


def _ok(schema: Schema, media_type: str = "application/json", *, also: str = "") -> Schema:
    """A success response; ``also`` names a second media type, of plain text."""
    content = {media_type: {"schema": schema}}
    if also:
        content[also] = {"schema": _STRING}
    return {
        "description": "OK",
        "headers": {"X-Request-Id": _REQUEST_ID_HEADER},
        "content": content,
    }


# --- parameters -----------------------------------------------------------------------------


def _query(name: str, schema: Schema, description: str = "") -> Schema:
    parameter: Schema = {"name": name, "in": "query", "required": False, "schema": schema}
    if description:
        parameter["description"] = description
    return parameter


def _header(name: str, schema: Schema, description: str) -> Schema:
    return {
        "name": name,
        "in": "header",
        "required": False,
        "schema": schema,
        "description": description,
    }


# router.http.queries.DEFAULT_LIMIT and MAX_LIMIT (which imports this module, not the reverse).
_LIMIT: Final = _query("limit", {"type": "integer", "minimum": 1, "maximum": 500, "default": 100})
_CURSOR: Final = _query(
    "cursor", _STRING, "The opaque next_cursor of the previous page (only that is accepted)."
)
_INSTANT: Final[Schema] = {
    "anyOf": [{"type": "string", "format": "date"}, {"type": "string", "format": "date-time"}],
    "description": "ISO 8601 date or date-time; without an offset, UTC.",
}
_DAY: Final[Schema] = {"type": "string", "format": "date", "description": "A UTC day."}
_WORKSPACE: Final = _query(
    "workspace", _STRING, "Narrow to one workspace (admin keys; others see their own)."
)


def _kept(*excluded: str) -> str:
    """A character Python's str.strip() keeps (the gateway ignores blanks around keys, names
    and reasons, and Python's blanks are not quite JSON Schema's \\s), nor one of ``excluded``."""
    blanks = r"\t\n\v\f\r \x1c-\x1f\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
    return f"[^{blanks}{''.join(excluded)}]"


_NAMES: Final[Schema] = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "string", "pattern": f"^[^,]*{_kept(',')}[^,]*$"},
}

_ENDPOINT_ID: Final[Schema] = {"type": "string", "pattern": _kept()}

_CHAT_HEADERS: Final = [
    _header(
        "Idempotency-Key",
        {"type": "string", "maxLength": 255, "pattern": _kept()},
        "Scoped to the API key: a retry by the same API key with the same Idempotency-Key "
        "and body returns the recorded answer; 409 while the first is in flight or when "
        "reused with another body. Another API key's use of it is an independent request.",
    ),
    _header(
        "X-Waybill-Max-Cost-Usd",
        {"type": "string", "pattern": MONEY_PATTERN},
        "This request's budget in USD, across all attempts.",
    ),
    _header(
        "X-Waybill-Deadline-Ms",
        {"type": "integer", "minimum": 1, "maximum": MAX_JSON_INTEGER},
        "The whole-request deadline, in milliseconds.",
    ),
    _header(
        "X-Waybill-Allow-Failover",
        {"type": "string", "enum": list(ALLOW_FAILOVER_VALUES)},
        "false (also 0, no) forbids switching endpoints for this request; true (also 1, "
        "yes) or absent allows it; unknown also allows it and lets an attempt whose "
        "execution is unknown be followed by another (a retry or a failover: a possible "
        "duplicate execution) where the request is strict (on_unknown_execution: stop, or "
        "server-side tools or web search in the body). Any case.",
    ),
    _header(
        "X-Waybill-Capabilities",
        _NAMES,
        "Extra required capabilities, comma-separated (others are inferred from the body).",
    ),
    _header("X-Waybill-Regions", _NAMES, "A narrower region set, comma-separated."),
    _header(
        "X-Waybill-Endpoints",
        _NAMES,
        "A narrower endpoint set, comma-separated: endpoint ids and provider:NAME labels "
        "(expanded within the model group), intersected with the key's own scope; a name "
        "that matches nothing narrows to nothing.",
    ),
    _header(
        "X-Waybill-Prefer-Endpoint",
        _ENDPOINT_ID,
        "An endpoint id to choose when one of its mappings is eligible; the router overrules "
        "it otherwise.",
    ),
    _header(
        "X-Waybill-Require-Endpoint",
        _ENDPOINT_ID,
        "An endpoint id the request is pinned to: no other endpoint is ever tried.",
    ),
    _header(
        "X-Waybill-Data-Class",
        {"type": "string", "enum": list(DATA_CLASSES)},
        "This request's data class; it may raise the workspace's default, never lower it.",
    ),
    _header(
        "X-Waybill-Retention",
        {"type": "string", "pattern": "^([Zz][Ee][Rr][Oo]|[1-9][0-9]{0,4}[Dd])$"},
        "The most an endpoint may keep of this request: zero, or a number of days such as "
        "30d. It narrows the workspace's retention bound, never widens it.",
    ),
    _header("traceparent", _STRING, "W3C trace context: the request's trace joins it."),
    _header("tracestate", _STRING, "W3C trace state, forwarded with a valid traceparent."),
]

# --- operations, one per route --------------------------------------------------------------

_PUBLIC: Final[Schema] = {"security": []}

HEALTHZ: Final[Schema] = {
    **_PUBLIC,
    "summary": "Liveness, with the version and the schema revision the code migrates to",
    "responses": {
        "200": _ok(
            _object(
                ["status", "version", "schema"], status=_STRING, version=_STRING, schema=_STRING
            )
        )
    },
}
READYZ: Final[Schema] = {
    **_PUBLIC,
    "summary": "Readiness: the database is reachable and its migrations current",
    "responses": {
        "200": _ok(_ref("Status")),
        "503": {
            "description": "Not ready: the status object says why.",
            "headers": {"X-Request-Id": _REQUEST_ID_HEADER},
            "content": {"application/json": {"schema": _ref("Status")}},
        },
    },
}
METRICS: Final[Schema] = {
    **_PUBLIC,
    "summary": "Prometheus metrics",
    "responses": {"200": _ok(_STRING, "text/plain")},
}
MODELS: Final[Schema] = {
    "summary": "The model groups the key may call",
    "responses": {"200": _ok(_ref("ModelList")), **_error_responses()},
}
CHAT_COMPLETIONS: Final[Schema] = {
    "summary": "An OpenAI-compatible chat completion, buffered or streamed (SSE)",
    "parameters": _CHAT_HEADERS,
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": _ref("ChatCompletionRequest")}},
    },
    "responses": {
        "200": {
            **_ok(_ref("ChatCompletion"), also="text/event-stream"),
            "description": "The completion (JSON), or its stream (SSE) with stream: true.",
        },
        **_error_responses(400, 402, 404, 409, 413, 422, 429, 502, 504),
    },
}

EMBEDDINGS: Final[Schema] = {
    "summary": "OpenAI-compatible embeddings of a string, a batch or token arrays (buffered)",
    "parameters": _CHAT_HEADERS,
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": _ref("EmbeddingsRequest")}},
    },
    "responses": {
        "200": _ok(_ref("Embeddings")),
        **_error_responses(400, 402, 404, 409, 413, 422, 429, 502, 504),
    },
}


RESPONSES: Final[Schema] = {
    "summary": "An OpenAI Responses API request, buffered or streamed (SSE)",
    "parameters": _CHAT_HEADERS,
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": _ref("ResponsesRequest")}},
    },
    "responses": {
        "200": {
            **_ok(_ref("Response"), also="text/event-stream"),
            "description": "The response (JSON), or the Responses events (SSE) with stream: true.",
        },
        **_error_responses(400, 402, 404, 409, 413, 422, 429, 502, 504),
    },
}


def _anthropic_errors(*statuses: int) -> dict[str, Schema]:
    """The Anthropic door's errors: its statuses (a 503 of the gateway's is a 529)."""
    return {
        str(status): {
            "description": "Anthropic's error object; error.code is Waybill's error code.",
            "headers": {"X-Request-Id": _REQUEST_ID_HEADER},
            "content": {"application/json": {"schema": _ref("AnthropicError")}},
        }
        for status in sorted({*statuses, 401, 529})
    }


_ANTHROPIC_HEADERS: Final = [
    _header("x-api-key", _STRING, "The Waybill key (or Authorization: Bearer <key>)."),
    _header("anthropic-version", _STRING, "Accepted; Anthropic endpoints get their own."),
    _header(
        "anthropic-beta",
        _STRING,
        "Betas, comma-separated: their body fields are accepted, and the header is "
        "forwarded to Anthropic endpoints.",
    ),
    *_CHAT_HEADERS,
]
MESSAGES: Final[Schema] = {
    "summary": "An Anthropic Messages API request, buffered or streamed (SSE)",
    "parameters": [*_ANTHROPIC_HEADERS, _query("beta", _STRING, "Sent by Claude Code; ignored.")],
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": _ref("MessagesRequest")}},
    },
    "responses": {
        "200": {
            **_ok(_ref("Message"), also="text/event-stream"),
            "description": "The message (JSON), or Anthropic's events (SSE) with stream: true.",
        },
        **_anthropic_errors(400, 402, 404, 409, 413, 422, 429, 502, 504),
    },
}
MESSAGES_COUNT_TOKENS: Final[Schema] = {
    "summary": (
        "Count a Messages request's input tokens: an Anthropic endpoint of the group "
        "answers, else the gateway estimates (X-Waybill-Token-Count says which); never billed"
    ),
    "parameters": [*_ANTHROPIC_HEADERS[:3], _query("beta", _STRING, "Ignored.")],
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": _ref("MessagesCountRequest")}},
    },
    "responses": {
        "200": _ok(_object(["input_tokens"], input_tokens={"type": "integer", "minimum": 0})),
        **_anthropic_errors(400, 404, 413),
    },
}
ADMIN_RELOAD: Final[Schema] = {
    "summary": "Reload the config file (admin keys)",
    "responses": {
        "200": _ok(
            _object(
                ["previous_generation", "generation"],
                previous_generation=_STRING,
                generation=_STRING,
            )
        ),
        **_error_responses(400, 403, 409, 503),
    },
}
LIST_ENDPOINTS: Final[Schema] = {
    "summary": "Each endpoint's state: enabled or disabled, its breakers (admin keys)",
    "responses": {
        "200": _ok(
            {
                "type": "object",
                "required": ["data", "next_cursor", "config_generation", "breaker_policy"],
                "properties": {
                    **_page(_ref("EndpointState"))["properties"],
                    "config_generation": _STRING,
                    "breaker_policy": {"type": "string", "enum": ["consecutive", "rolling"]},
                },
            }
        ),
        **_error_responses(403),
    },
}
ENABLE_ENDPOINT: Final[Schema] = {
    "summary": "Enable an endpoint a credentials failure disabled (admin keys)",
    "responses": {
        "200": _ok(
            _object(
                ["endpoint", "cause", "actor", "config_generation"],
                endpoint=_STRING,
                cause={"const": "operator"},
                actor=_STRING,
                config_generation=_STRING,
            )
        ),
        **_error_responses(403, 404, 409),
    },
}
SEARCH_REQUESTS: Final[Schema] = {
    "summary": "Search request views, newest first",
    "parameters": [
        _query("status", {"type": "string", "enum": list(REQUEST_STATUSES)}),
        _query("model", _STRING, "A model group."),
        _query("endpoint", _STRING),
        _query("since", _INSTANT),
        _query("until", _INSTANT),
        _WORKSPACE,
        _query("key_id", _STRING),
        _LIMIT,
        _CURSOR,
    ],
    "responses": {"200": _ok(_page(_ref("RequestView"))), **_error_responses(400)},
}
REQUEST_VIEW: Final[Schema] = {
    "summary": "One request's view",
    "responses": {"200": _ok(_ref("RequestView")), **_error_responses(404)},
}
EXPLAIN_REQUEST: Final[Schema] = {
    "summary": "Why this route: candidates, attempts, decisions",
    "parameters": [_query("format", {"type": "string", "enum": ["json", "text"]})],
    "responses": {
        "200": _ok(_ref("Explanation"), also="text/plain"),
        **_error_responses(400, 404),
    },
}
REQUEST_EVENTS: Final[Schema] = {
    "summary": "A request's raw events, in order, with their hashes",
    "parameters": [_LIMIT, _CURSOR],
    "responses": {"200": _ok(_page(_ref("Event"))), **_error_responses(400, 404)},
}
REQUEST_PROOF: Final[Schema] = {
    "summary": "Every event of a request a signed checkpoint covers, with an inclusion proof "
    "of each and their version range signed (waybill verify-proof checks it offline)",
    "parameters": [
        _query(
            "size",
            {"type": "integer", "minimum": 1, "maximum": 2**63 - 1},
            "The checkpoint's tree size; default: the latest checkpoint.",
        )
    ],
    "responses": {"200": _ok(_ref("Proof")), **_error_responses(400, 404, 409)},
}
VERIFY_LEDGER: Final[Schema] = {
    "summary": "Verify the ledger's hash chain (admin and auditor keys)",
    "responses": {"200": _ok(_ref("LedgerVerification")), **_error_responses(403)},
}
SPEND: Final[Schema] = {
    "summary": "Spend, grouped",
    "parameters": [
        {
            **_query(
                "group_by",
                {
                    "type": "array",
                    "minItems": 1,
                    "uniqueItems": True,
                    "items": {"type": "string", "enum": sorted(GROUP_KEYS)},
                },
                "Comma-separated; default workspace.",
            ),
            "style": "form",
            "explode": False,
        },
        _query("since", _DAY),
        _query("until", _DAY),
        _query("format", {"type": "string", "enum": ["json", "csv"]}),
        _WORKSPACE,
    ],
    "responses": {
        "200": _ok(_page(_ref("SpendRow")), also="text/csv"),
        **_error_responses(400),
    },
}
BUDGETS: Final[Schema] = {
    "summary": "Budget balances per key and workspace",
    "parameters": [_WORKSPACE],
    "responses": {"200": _ok(_page(_ref("BudgetBalance"))), **_error_responses()},
}
UNKNOWN_SETTLEMENTS: Final[Schema] = {
    "summary": "Unknown-usage settlements, oldest first",
    "parameters": [
        _query("state", {"type": "string", "enum": ["open", "settled"]}),
        _WORKSPACE,
        _LIMIT,
        _CURSOR,
    ],
    "responses": {"200": _ok(_page(_ref("UnknownSettlement"))), **_error_responses(400)},
}
SETTLE_UNKNOWN: Final[Schema] = {
    "summary": "Settle unknown usage by hand (admin and finance keys)",
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": _object(
                    ["settled_usd", "reason"],
                    settled_usd={**_MONEY, "pattern": MONEY_PATTERN},
                    reason={"type": "string", "pattern": _kept()},
                    force={
                        "type": "boolean",
                        "description": "Settle an amount over 1,000x the hold all the same.",
                    },
                )
            }
        },
    },
    "responses": {"200": _ok(_ref("Event")), **_error_responses(400, 403, 404, 409)},
}
IMPORT_RECONCILIATION: Final[Schema] = {
    "summary": "Reconcile a provider usage export or report pages (admin and finance keys)",
    "parameters": [
        _query("provider", _STRING, "Reconcile only this endpoint's attempts."),
        _query(
            "format",
            {
                "type": "string",
                "enum": [
                    "openai-usage",
                    "openai-costs",
                    "anthropic-usage",
                    "anthropic-costs",
                    "anthropic-analytics",
                    "lines",
                ],
            },
            "What the body is (default: told from its content). Report pages: admin keys only.",
        ),
        _query(
            "force",
            {"type": "string", "enum": ["true", "false"]},
            "Settle lines over 1,000x their hold all the same.",
        ),
    ],
    "requestBody": {
        "required": True,
        "description": "Provider usage lines (CSV with a header row, or JSONL), or the pages "
        "of one provider report (a JSON page, a JSON array of pages, or one page a line).",
        "content": {
            media: {"schema": _STRING}
            for media in ("text/csv", "application/x-ndjson", "application/json")
        },
    },
    "responses": {
        "200": _ok(_ref("ReconciliationReport")),
        **_error_responses(400, 403, 413),
    },
}
READ_RECONCILIATION: Final[Schema] = {
    "summary": "A recorded reconciliation report",
    "responses": {"200": _ok(_ref("ReconciliationReport")), **_error_responses(403, 404)},
}
READ_RECONCILIATION_BUCKET: Final[Schema] = {
    "summary": "One bucket of a recorded provider report, with the attempts it speaks for",
    "parameters": [
        _query("model", _STRING, "Only the comparison of this model."),
        _query("endpoint", _STRING, "Only the comparison of this endpoint."),
    ],
    "responses": {"200": _ok({"type": "object"}), **_error_responses(403, 404)},
}


_DESCRIPTION: Final = (
    "Waybill, an OpenAI-compatible LLM gateway with a ledger. Authenticate with "
    "`Authorization: Bearer <key>`. Every error is the one JSON body `Error`, with a code "
    "named in its response's description; every response carries `X-Request-Id`. "
    "No URL may contain a NUL character (%00): 400 invalid_request."
)


def _n(max_n: int) -> Schema:
    return _nullable(
        {
            "type": "integer",
            "minimum": 1,
            "maximum": max_n,
            "description": "Choices to generate, each billed its own output tokens. At most "
            "the config's limits.max_n: more is refused (400 invalid_request, param n).",
        }
    )


_ANY: Final[Schema] = {}
_TEXT_PARTS: Final = ("input_text", "output_text", "text")
_SCHEMAS["ResponsesRequest"] = {
    "description": (
        "An OpenAI Responses API request; model names a Waybill model group. A field outside "
        "the documented set is refused (400). A stateless request is served by any eligible "
        "mapping, translated to chat completions; previous_response_id, conversation, "
        "store: true, background: true, a stored prompt and built-in tools need a mapping "
        'that declares the capability responses (contract §3 "The Responses door"). Also '
        'accepted, beyond what this schema can say: tool_choice {"type": "function", '
        '"name"} naming a declared function tool, or naming a built-in tool.'
    ),
    "type": "object",
    "required": ["model", "input"],
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "input": {
            "anyOf": [
                _STRING,
                {"type": "array", "minItems": 1, "items": _ref("ResponsesItem")},
            ]
        },
        "instructions": _nullable(_STRING),
        "tools": _nullable({"type": "array", "items": _ref("ResponsesTool")}),
        "tool_choice": _nullable({"enum": ["auto", "none", "required"]}),
        "parallel_tool_calls": _nullable({"type": "boolean"}),
        "max_output_tokens": _nullable(_TOKENS),
        "max_tool_calls": _nullable(_TOKENS),
        "temperature": _nullable({"type": "number"}),
        "top_p": _nullable({"type": "number"}),
        "text": _nullable(
            {
                "type": "object",
                "properties": {
                    "format": _nullable(_ref("ResponsesFormat")),
                    "verbosity": _nullable(_STRING),
                },
            }
        ),
        "reasoning": _nullable({"type": "object", "properties": {"effort": _nullable(_STRING)}}),
        "metadata": _nullable({"type": "object"}),
        "stream": _nullable({"type": "boolean"}),
        "store": _nullable({"type": "boolean"}),
        "background": _nullable({"type": "boolean"}),
        "previous_response_id": _nullable({"type": "string", "minLength": 1, "maxLength": 200}),
        "user": _nullable(_STRING),
        "safety_identifier": _nullable(_STRING),
        "prompt_cache_key": _nullable(_STRING),
        "service_tier": _nullable(_STRING),
        # Passed to a native endpoint as they are, or dropped on the translation.
        "conversation": _ANY,
        "prompt": _ANY,
        "context_management": _ANY,
        "include": _ANY,
        "truncation": _ANY,
        "top_logprobs": _ANY,
        "stream_options": _ANY,
        "prompt_cache_retention": _ANY,
    },
    "additionalProperties": False,
}
_SCHEMAS["ResponsesItem"] = {
    "description": (
        "An input item: a message (the default type), function_call, function_call_output, "
        "reasoning; other types are sent natively to a mapping that declares responses."
    ),
    "type": "object",
    "properties": {"type": _STRING},
    "allOf": [
        _when(
            "message",
            role={"enum": ["user", "assistant", "system", "developer"]},
            content={"anyOf": [_STRING, {"type": "array", "items": _ref("ResponsesPart")}]},
        ),
        _when("function_call", call_id=_STRING, name=_STRING, arguments=_STRING),
        _when(
            "function_call_output",
            call_id=_STRING,
            output={"anyOf": [_STRING, {"type": "array", "items": _ref("ResponsesPart")}]},
        ),
    ],
}
_SCHEMAS["ResponsesPart"] = {
    "description": "A content part: input_text, input_image, input_file, output_text, ...",
    "type": "object",
    "required": ["type"],
    "properties": {"type": _STRING},
    "allOf": [_when(kind, text=_STRING) for kind in _TEXT_PARTS],
}
_SCHEMAS["ResponsesTool"] = {
    "description": "A function tool (name required), or a built-in tool of another type.",
    "type": "object",
    "required": ["type"],
    "properties": {"type": _STRING},
    "allOf": [_when("function", name=_STRING)],
}
_SCHEMAS["ResponsesFormat"] = {
    "type": "object",
    "required": ["type"],
    "properties": {"type": {"enum": ["text", "json_object", "json_schema"]}},
    "allOf": [_when("json_schema", name=_STRING, schema={"type": "object"})],
}
_SCHEMAS["Response"] = {
    "description": "OpenAI's response object.",
    "type": "object",
    "required": ["id", "object", "status", "output", "model"],
    "properties": {
        "id": _STRING,
        "object": {"type": "string", "enum": ["response"]},
        "status": _STRING,
        "output": {"type": "array", "items": {"type": "object"}},
        "model": _nullable(_STRING),
        "usage": _nullable({"type": "object"}),
    },
}


# A count_tokens body is a Messages body whose max_tokens may be left out.
_SCHEMAS["MessagesCountRequest"] = {
    **_SCHEMAS["MessagesRequest"],
    "description": "A Messages API request to count (max_tokens may be left out).",
    "required": ["model", "messages"],
}


# The embeddings door (router/doors/embeddings.py).
_TOKEN_ARRAY: Final[Schema] = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "integer", "minimum": 0, "maximum": MAX_JSON_INTEGER},
}
_SCHEMAS["EmbeddingsRequest"] = {
    "description": (
        "An OpenAI embeddings request, for a model group of kind embeddings (another kind: "
        "400 model_kind_mismatch). Fields the gateway does not read pass through to the "
        "upstream unchanged. Before each attempt the gateway reserves the input at the "
        "mapping's input_per_mtok: exact for token arrays, a token per byte for text; "
        "there is no output."
    ),
    "type": "object",
    "required": ["model", "input"],
    "properties": {
        "model": {
            "type": "string",
            "minLength": 1,
            "description": "A model group of kind embeddings the key may call.",
        },
        "input": {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 2048,
                    "items": {"type": "string", "minLength": 1},
                },
                _TOKEN_ARRAY,
                {"type": "array", "minItems": 1, "maxItems": 2048, "items": _TOKEN_ARRAY},
            ]
        },
        "dimensions": _nullable(_TOKENS),
        "encoding_format": _nullable({"enum": ["float", "base64"]}),
        "user": _nullable(_STRING),
    },
    "additionalProperties": True,
}
_SCHEMAS["Embeddings"] = {
    "description": "OpenAI's embeddings list: one embedding per input, in order.",
    "type": "object",
    "required": ["object", "data", "model", "usage"],
    "properties": {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "items": _object(
                ["object", "index", "embedding"],
                object={"const": "embedding"},
                index={"type": "integer", "minimum": 0},
                embedding={
                    "anyOf": [
                        {"type": "array", "items": {"type": "number"}},
                        {"type": "string", "description": "base64 of float32s, little-endian"},
                    ]
                },
            ),
        },
        "model": _STRING,
        "usage": _object(
            ["prompt_tokens", "total_tokens"],
            prompt_tokens={"type": "integer", "minimum": 0},
            total_tokens={"type": "integer", "minimum": 0},
        ),
    },
}


def _schemas(limits: Limits) -> dict[str, Schema]:
    request = _SCHEMAS["ChatCompletionRequest"]
    properties = {**request["properties"], "n": _n(limits.max_n)}
    return {**_SCHEMAS, "ChatCompletionRequest": {**request, "properties": properties}}


def install_openapi(app: FastAPI, limits: Callable[[], Limits] = Limits) -> None:
    """Serve the described schema as the app's OpenAPI: built on first request, and again
    when ``limits`` (the serving config's, which a reload may change) are not the same."""
    built_for: list[Limits] = []

    def build() -> dict[str, Any]:
        current = limits()
        if built_for != [current]:
            app.openapi_schema = None
            built_for[:] = [current]
        if app.openapi_schema is None:
            document = get_openapi(
                title=app.title, version=app.version, description=_DESCRIPTION, routes=app.routes
            )
            components = document.setdefault("components", {})
            # FastAPI documents a 422 for the typed path parameters; the handlers validate
            # nothing there, and their errors are ours, declared route by route.
            for schema_name in ("HTTPValidationError", "ValidationError"):
                components.get("schemas", {}).pop(schema_name, None)
            for operations in document["paths"].values():
                for operation in operations.values():
                    responses = operation["responses"]
                    if "HTTPValidationError" in str(responses.get("422", "")):
                        del responses["422"]
            components.setdefault("schemas", {}).update(_schemas(current))
            components["securitySchemes"] = {
                "api_key": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "A Waybill API key: Authorization: Bearer <key>.",
                }
            }
            document["security"] = [{"api_key": []}]
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = build  # type: ignore[method-assign]
