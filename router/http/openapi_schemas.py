"""The OpenAPI component schemas: the error body, the shared views and the door bodies
(the later doors' bodies are added by openapi_bodies)."""

from __future__ import annotations

from typing import Final

from ledger.events import APIS, FailureClass, ReasonCode
from ledger.views.queries import REQUEST_STATUSES
from router.doors.chat import MAX_JSON_INTEGER
from router.http.openapi_parts import (
    CACHE,
    ERROR_CODES,
    HEX_HASH,
    ITEMS,
    MONEY,
    STRING,
    TOKENS,
    Schema,
    nullable,
    object_schema,
    ref,
    when,
)

SCHEMAS: Final[dict[str, Schema]] = {
    "Error": {
        "description": "The one controlled error body (contract §3): OpenAI-shaped, never a trace.",
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["type", "code", "message", "param", "request_id", "attempts"],
                "properties": {
                    "type": STRING,
                    "code": {"type": "string", "enum": list(ERROR_CODES)},
                    "message": STRING,
                    "param": nullable(STRING),
                    "request_id": STRING,
                    "attempts": {"type": "array", "items": ref("AttemptSummary")},
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
                    "type": STRING,
                    "message": STRING,
                    "code": {"type": "string", "enum": list(ERROR_CODES)},
                    "param": STRING,
                    "attempts": {"type": "array", "items": ref("AttemptSummary")},
                },
            },
            "request_id": nullable(STRING),
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
            "messages": {"type": "array", "minItems": 1, "items": ref("MessagesTurn")},
            "max_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_JSON_INTEGER},
            "system": nullable(
                {"anyOf": [STRING, {"type": "array", "items": ref("MessagesTextBlock")}]}
            ),
            "stream": nullable({"type": "boolean"}),
            "stop_sequences": nullable({"type": "array", "items": STRING}),
            "temperature": nullable({"type": "number"}),
            "top_p": nullable({"type": "number"}),
            "top_k": nullable(
                {"type": "integer", "minimum": -MAX_JSON_INTEGER, "maximum": MAX_JSON_INTEGER}
            ),
            "tools": nullable({"type": "array", "items": ref("MessagesTool")}),
            "tool_choice": nullable(
                {
                    "type": "object",
                    "required": ["type"],
                    "properties": {"type": {"enum": ["auto", "any", "none"]}},
                }
            ),
            "metadata": nullable({"type": "object", "properties": {"user_id": nullable(STRING)}}),
            "thinking": nullable(
                {
                    "type": "object",
                    "required": ["type"],
                    "properties": {"type": {"enum": ["adaptive", "disabled"]}},
                }
            ),
            "service_tier": nullable(STRING),
        },
        "additionalProperties": False,
    },
    "MessagesTurn": {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"enum": ["user", "assistant"]},
            "content": {"anyOf": [STRING, {"type": "array", "items": ref("MessagesBlock")}]},
        },
    },
    "MessagesTextBlock": {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": STRING, "cache_control": CACHE},
    },
    "MessagesBlock": {
        "description": (
            "A content block: text, image, document, tool_use, tool_result, thinking, ... "
            "(others are passed on natively to Anthropic endpoints)."
        ),
        "type": "object",
        "required": ["type"],
        "properties": {"type": STRING, "cache_control": CACHE},
        "allOf": [
            when("text", text=STRING),
            when("image", source={"type": "object"}),
            when("tool_use", id=STRING, name=STRING),
            {
                "if": {"properties": {"type": {"const": "tool_result"}}},
                "then": {
                    "required": ["tool_use_id"],
                    "properties": {
                        "tool_use_id": STRING,
                        "content": nullable(
                            {
                                "anyOf": [
                                    STRING,
                                    {"type": "array", "items": ref("MessagesPart")},
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
        "properties": {"type": STRING, "cache_control": CACHE},
        "allOf": [
            when("text", text=STRING),
            when("image", source={"type": "object"}),
            when("tool_use", id=STRING, name=STRING),
            when("tool_result", tool_use_id=STRING),
        ],
    },
    "MessagesTool": {
        "description": "A custom tool (input_schema required) or an Anthropic-defined one.",
        "type": "object",
        "required": ["name"],
        "properties": {"name": STRING, "cache_control": CACHE},
        "if": {"properties": {"type": {"const": "custom"}}},
        "then": {"required": ["input_schema"], "properties": {"input_schema": {"type": "object"}}},
    },
    "Message": {
        "description": "Anthropic's message object.",
        "type": "object",
        "required": ["id", "type", "role", "content", "model", "stop_reason", "usage"],
        "properties": {
            "id": STRING,
            "type": {"type": "string", "enum": ["message"]},
            "role": {"type": "string", "enum": ["assistant"]},
            "content": {"type": "array", "items": {"type": "object"}},
            "model": nullable(STRING),
            "stop_reason": nullable(STRING),
            "stop_sequence": nullable(STRING),
            "usage": {"type": "object"},
        },
    },
    "AttemptSummary": {
        "description": "One upstream attempt as a client may see it: no secret, no prompt.",
        "type": "object",
        "required": ["endpoint", "status", "failure_class"],
        "properties": {
            "endpoint": STRING,
            "status": nullable({"type": "integer"}),
            "failure_class": nullable({"type": "string", "enum": [c.value for c in FailureClass]}),
        },
    },
    "ChatMessage": {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"type": "string", "minLength": 1, "examples": ["user"]},
            "content": {
                "anyOf": [
                    STRING,
                    {"type": "null"},
                    {
                        "type": "array",
                        "items": {
                            "description": "A content part: text, image_url, input_image, ...",
                            "type": "object",
                            "required": ["type"],
                            "properties": {"type": STRING},
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
            "messages": {"type": "array", "minItems": 1, "items": ref("ChatMessage")},
            "stream": nullable({"type": "boolean"}),
            "stream_options": nullable(
                {
                    "type": "object",
                    "properties": {"include_usage": nullable({"type": "boolean"})},
                    "additionalProperties": True,
                }
            ),
            "max_tokens": nullable(TOKENS),
            "max_completion_tokens": nullable(
                {**TOKENS, "description": "Bounds every output token, reasoning included."}
            ),
            # Its maximum is the serving config's limits.max_n (install_openapi).
            "n": nullable({"type": "integer", "minimum": 1}),
            "tools": nullable(
                {
                    "type": "array",
                    "description": "Tool definitions; a non-empty list requires the tools "
                    "capability.",
                    "items": {},
                }
            ),
            "response_format": nullable(
                {
                    "type": "object",
                    "description": '{"type": "json_schema", ...} requires the json_schema '
                    "capability.",
                }
            ),
        },
        "additionalProperties": True,
    },
    "ChatCompletion": object_schema(
        ["choices"],
        id=STRING,
        object=STRING,
        model=STRING,
        choices={"type": "array", "items": ITEMS},
        usage=nullable(ITEMS),
    ),
    "ModelList": object_schema(
        ["object", "data"],
        object={"const": "list"},
        data={"type": "array", "items": object_schema(["id", "object"], id=STRING, object=STRING)},
    ),
    "RequestView": object_schema(
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
        request_id=STRING,
        workspace=STRING,
        key_id=STRING,
        model=STRING,
        status={"type": "string", "enum": list(REQUEST_STATUSES)},
        endpoint=nullable(STRING),
        reserved_usd=MONEY,
        settled_usd=MONEY,
        held_unknown_usd=MONEY,
        created_at=STRING,
        completed_at=nullable(STRING),
    ),
    "Event": object_schema(
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
        stream_id=STRING,
        version={"type": "integer"},
        type=STRING,
        schema_version={"type": "integer"},
        data=ITEMS,
        metadata=ITEMS,
        recorded_at=STRING,
        hash=STRING,
    ),
    "Proof": object_schema(
        ["format", "request_id", "checkpoint", "events", "stream"],
        format={"type": "string", "enum": ["waybill-proof/v2"]},
        request_id=STRING,
        checkpoint=object_schema(
            ["format", "size", "root", "head_hash", "time", "key_id", "signature"],
            format={"type": "string", "enum": ["waybill-checkpoint/v1"]},
            size={"type": "integer", "minimum": 1},
            root=HEX_HASH,
            head_hash=HEX_HASH,
            time=STRING,
            key_id=STRING,
            signature=STRING,
        ),
        events={
            "type": "array",
            "items": object_schema(
                ["position", "version", "type", "leaf_hash", "payload", "inclusion_proof"],
                position={"type": "integer", "minimum": 1},
                version={"type": "integer", "minimum": 1},
                type=STRING,
                leaf_hash=HEX_HASH,
                payload={
                    "type": "string",
                    "description": "The event's stored canonical bytes, standard base64.",
                },
                inclusion_proof={"type": "array", "items": HEX_HASH},
            ),
        },
        stream={
            **object_schema(
                ["first_version", "last_version", "key_id", "signature"],
                first_version={"type": "integer", "minimum": 1},
                last_version={"type": "integer", "minimum": 1},
                key_id=STRING,
                signature=STRING,
            ),
            "description": "The request stream's version range the checkpoint covers (every "
            "event in `events`), signed with a checkpoint key over the statement of contract "
            '§7 "Proofs": a proof with events left out fails.',
        },
    ),
    "Explanation": object_schema(
        ["api", "summary", "candidates", "attempts", "decision_path"],
        api={
            "type": "string",
            "enum": list(APIS),
            "description": "The client API (door) the request came through.",
        },
        summary=STRING,
        candidates={
            "type": "array",
            "items": object_schema(
                ["reason_code"],
                reason_code=nullable(
                    {
                        "type": "string",
                        "enum": [code.value for code in ReasonCode],
                        "description": "Why the mapping was excluded (contract §4), or null.",
                    }
                ),
                worst_case_usd=nullable(MONEY),
                effective_weight=nullable(
                    {
                        "type": "string",
                        "description": "The weight selection ranked it by while a breaker "
                        "of its endpoint or mapping ramps up after closing (contract §5), "
                        "a decimal string; null at full weight.",
                    }
                ),
            ),
        },
        attempts={"type": "array", "items": ITEMS},
        decision_path={"type": "array"},
    ),
    "Breaker": object_schema(
        ["state", "blocked", "consecutive_failures", "trips", "cooldown_ms", "probe_in_ms"],
        state={"type": "string", "enum": ["closed", "open", "half_open"]},
        blocked={"type": "boolean", "description": "An attempt would be refused now."},
        consecutive_failures={"type": "integer"},
        trips={"type": "integer"},
        cooldown_ms=nullable({"type": "integer"}),
        probe_in_ms=nullable(
            {"type": "integer", "description": "While open: how long until a probe may go."}
        ),
        ramp_share=nullable(
            {
                "type": "string",
                "description": "While ramping up after closing (breaker.ramp_up_ms): the "
                "share of its weight its endpoint or mapping gets now, a decimal string.",
            }
        ),
        calls=nullable({"type": "integer", "description": "A rolling breaker's window."}),
        failed_calls=nullable({"type": "integer"}),
        slow_calls=nullable({"type": "integer"}),
    ),
    "EndpointState": object_schema(
        ["id", "state", "enabled", "disabled", "breaker_policy", "breaker", "mappings"],
        id=STRING,
        driver=STRING,
        region=STRING,
        state={
            "type": "string",
            "enum": ["enabled", "disabled", "config_disabled"],
            "description": "disabled: a credentials failure disabled it (contract §5); "
            "config_disabled: the config says enabled: false.",
        },
        enabled={"type": "boolean", "description": "The config's enabled."},
        disabled=nullable(
            object_schema(
                ["disabled_at", "http_status", "error_code", "request_id"],
                disabled_at=STRING,
                http_status=nullable({"type": "integer"}),
                error_code=nullable(STRING),
                request_id=nullable(STRING),
                attempt_id=nullable(STRING),
                config_generation=STRING,
                position={"type": "integer"},
            )
        ),
        breaker_policy={
            "type": "string",
            "enum": ["consecutive", "rolling"],
            "description": "The policy this endpoint's breakers run by: its own breaker "
            "block's, else defaults.breaker's.",
        },
        breaker=ref("Breaker"),
        mappings={
            "type": "array",
            "items": object_schema(["model", "breaker"], model=STRING, breaker=ref("Breaker")),
        },
    ),
    "LedgerVerification": object_schema(
        ["ok", "checked"], ok={"type": "boolean"}, checked={"type": "integer"}
    ),
    "SpendRow": object_schema(
        ["settled_usd", "held_unknown_usd", "overrun_usd", "requests", "attempts"],
        api={"type": "string", "enum": list(APIS), "description": "With group_by=api."},
        settled_usd=MONEY,
        held_unknown_usd=MONEY,
        overrun_usd=MONEY,
        requests={"type": "integer"},
        attempts={"type": "integer"},
        # A closed period's rows are its closed totals; what changed since stands here.
        adjustment_settled_usd=MONEY,
        adjustment_held_unknown_usd=MONEY,
        adjustment_overrun_usd=MONEY,
    ),
    "BudgetBalance": object_schema(
        [
            "account_id",
            "kind",
            "limit_usd",
            "held_usd",
            "settled_usd",
            "overrun_usd",
            "available_usd",
        ],
        account_id=STRING,
        kind=STRING,
        limit_usd=MONEY,
        held_usd=MONEY,
        settled_usd=MONEY,
        overrun_usd=MONEY,
        available_usd=MONEY,
    ),
    "UnknownSettlement": object_schema(
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
        settlement_id=STRING,
        request_id=STRING,
        attempt_id=STRING,
        workspace=STRING,
        key_id=STRING,
        endpoint=STRING,
        held_usd=MONEY,
        state={"type": "string", "enum": ["open", "settled"]},
        settled_usd=nullable(MONEY),
    ),
    "ReconciliationReport": object_schema(
        [
            "id",
            "matched",
            "settled_unknown",
            "amount_mismatches",
            "unmatched_provider_lines",
            "unmatched_attempts",
            "overruns",
        ],
        id=STRING,
        matched={"type": "array", "items": ITEMS},
        settled_unknown={"type": "array", "items": ITEMS},
        amount_mismatches={"type": "array", "items": ITEMS},
        unmatched_provider_lines={"type": "array", "items": ITEMS},
        unmatched_attempts={"type": "array", "items": ITEMS},
        overruns={"type": "array", "items": ITEMS},
        format=STRING,
        buckets={"type": "array", "items": {"type": "object"}},
        unattributed_provider_usage={"type": "array", "items": {"type": "object"}},
        notes={"type": "array", "items": STRING},
    ),
    "Status": object_schema(["status"], status=STRING),
}
