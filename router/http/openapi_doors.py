"""The OpenAPI operations, one per route: each door's request, parameters and responses."""

from __future__ import annotations

from typing import Final

from ledger.types import MONEY_PATTERN
from ledger.views.queries import REQUEST_STATUSES
from ledger.views.spend_queries import GROUP_KEYS
from router.http.openapi_parts import (
    CHAT_HEADERS,
    CURSOR,
    DAY,
    INSTANT,
    LIMIT,
    MONEY,
    REQUEST_ID_HEADER,
    STRING,
    WORKSPACE,
    Schema,
    error_responses,
    header,
    kept,
    object_schema,
    ok,
    page,
    query,
    ref,
)

PUBLIC: Final[Schema] = {"security": []}

HEALTHZ: Final[Schema] = {
    **PUBLIC,
    "summary": "Liveness, with the version and the schema revision the code migrates to",
    "responses": {
        "200": ok(
            object_schema(
                ["status", "version", "schema"], status=STRING, version=STRING, schema=STRING
            )
        )
    },
}
READYZ: Final[Schema] = {
    **PUBLIC,
    "summary": "Readiness: the database is reachable and its migrations current",
    "responses": {
        "200": ok(ref("Status")),
        "503": {
            "description": "Not ready: the status object says why.",
            "headers": {"X-Request-Id": REQUEST_ID_HEADER},
            "content": {"application/json": {"schema": ref("Status")}},
        },
    },
}
METRICS: Final[Schema] = {
    **PUBLIC,
    "summary": "Prometheus metrics",
    "responses": {"200": ok(STRING, "text/plain")},
}
MODELS: Final[Schema] = {
    "summary": "The model groups the key may call",
    "responses": {"200": ok(ref("ModelList")), **error_responses()},
}
CHAT_COMPLETIONS: Final[Schema] = {
    "summary": "An OpenAI-compatible chat completion, buffered or streamed (SSE)",
    "parameters": CHAT_HEADERS,
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": ref("ChatCompletionRequest")}},
    },
    "responses": {
        "200": {
            **ok(ref("ChatCompletion"), also="text/event-stream"),
            "description": "The completion (JSON), or its stream (SSE) with stream: true.",
        },
        **error_responses(400, 402, 404, 409, 413, 422, 429, 502, 504),
    },
}

EMBEDDINGS: Final[Schema] = {
    "summary": "OpenAI-compatible embeddings of a string, a batch or token arrays (buffered)",
    "parameters": CHAT_HEADERS,
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": ref("EmbeddingsRequest")}},
    },
    "responses": {
        "200": ok(ref("Embeddings")),
        **error_responses(400, 402, 404, 409, 413, 422, 429, 502, 504),
    },
}


RESPONSES: Final[Schema] = {
    "summary": "An OpenAI Responses API request, buffered or streamed (SSE)",
    "parameters": CHAT_HEADERS,
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": ref("ResponsesRequest")}},
    },
    "responses": {
        "200": {
            **ok(ref("Response"), also="text/event-stream"),
            "description": "The response (JSON), or the Responses events (SSE) with stream: true.",
        },
        **error_responses(400, 402, 404, 409, 413, 422, 429, 502, 504),
    },
}


def anthropic_errors(*statuses: int) -> dict[str, Schema]:
    """The Anthropic door's errors: its statuses (a 503 of the gateway's is a 529)."""
    return {
        str(status): {
            "description": "Anthropic's error object; error.code is Waybill's error code.",
            "headers": {"X-Request-Id": REQUEST_ID_HEADER},
            "content": {"application/json": {"schema": ref("AnthropicError")}},
        }
        for status in sorted({*statuses, 401, 529})
    }


ANTHROPIC_HEADERS: Final = [
    header("x-api-key", STRING, "The Waybill key (or Authorization: Bearer <key>)."),
    header("anthropic-version", STRING, "Accepted; Anthropic endpoints get their own."),
    header(
        "anthropic-beta",
        STRING,
        "Betas, comma-separated: their body fields are accepted, and the header is "
        "forwarded to Anthropic endpoints.",
    ),
    *CHAT_HEADERS,
]
MESSAGES: Final[Schema] = {
    "summary": "An Anthropic Messages API request, buffered or streamed (SSE)",
    "parameters": [*ANTHROPIC_HEADERS, query("beta", STRING, "Sent by Claude Code; ignored.")],
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": ref("MessagesRequest")}},
    },
    "responses": {
        "200": {
            **ok(ref("Message"), also="text/event-stream"),
            "description": "The message (JSON), or Anthropic's events (SSE) with stream: true.",
        },
        **anthropic_errors(400, 402, 404, 409, 413, 422, 429, 502, 504),
    },
}
MESSAGES_COUNT_TOKENS: Final[Schema] = {
    "summary": (
        "Count a Messages request's input tokens: an Anthropic endpoint of the group "
        "answers, else the gateway estimates (X-Waybill-Token-Count says which); never billed"
    ),
    "parameters": [*ANTHROPIC_HEADERS[:3], query("beta", STRING, "Ignored.")],
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": ref("MessagesCountRequest")}},
    },
    "responses": {
        "200": ok(object_schema(["input_tokens"], input_tokens={"type": "integer", "minimum": 0})),
        **anthropic_errors(400, 404, 413),
    },
}
ADMIN_RELOAD: Final[Schema] = {
    "summary": "Reload the config file (admin keys)",
    "responses": {
        "200": ok(
            object_schema(
                ["previous_generation", "generation"],
                previous_generation=STRING,
                generation=STRING,
            )
        ),
        **error_responses(400, 403, 409, 503),
    },
}
LIST_ENDPOINTS: Final[Schema] = {
    "summary": "Each endpoint's state: enabled or disabled, its breakers (admin keys)",
    "responses": {
        "200": ok(
            {
                "type": "object",
                "required": ["data", "next_cursor", "config_generation", "breaker_policy"],
                "properties": {
                    **page(ref("EndpointState"))["properties"],
                    "config_generation": STRING,
                    "breaker_policy": {"type": "string", "enum": ["consecutive", "rolling"]},
                },
            }
        ),
        **error_responses(403),
    },
}
ENABLE_ENDPOINT: Final[Schema] = {
    "summary": "Enable an endpoint a credentials failure disabled (admin keys)",
    "responses": {
        "200": ok(
            object_schema(
                ["endpoint", "cause", "actor", "config_generation"],
                endpoint=STRING,
                cause={"const": "operator"},
                actor=STRING,
                config_generation=STRING,
            )
        ),
        **error_responses(403, 404, 409),
    },
}
SEARCH_REQUESTS: Final[Schema] = {
    "summary": "Search request views, newest first",
    "parameters": [
        query("status", {"type": "string", "enum": list(REQUEST_STATUSES)}),
        query("model", STRING, "A model group."),
        query("endpoint", STRING),
        query("since", INSTANT),
        query("until", INSTANT),
        WORKSPACE,
        query("key_id", STRING),
        LIMIT,
        CURSOR,
    ],
    "responses": {"200": ok(page(ref("RequestView"))), **error_responses(400)},
}
REQUEST_VIEW: Final[Schema] = {
    "summary": "One request's view",
    "responses": {"200": ok(ref("RequestView")), **error_responses(404)},
}
EXPLAIN_REQUEST: Final[Schema] = {
    "summary": "Why this route: candidates, attempts, decisions",
    "parameters": [query("format", {"type": "string", "enum": ["json", "text"]})],
    "responses": {
        "200": ok(ref("Explanation"), also="text/plain"),
        **error_responses(400, 404),
    },
}
REQUEST_EVENTS: Final[Schema] = {
    "summary": "A request's raw events, in order, with their hashes",
    "parameters": [LIMIT, CURSOR],
    "responses": {"200": ok(page(ref("Event"))), **error_responses(400, 404)},
}
REQUEST_PROOF: Final[Schema] = {
    "summary": "Every event of a request a signed checkpoint covers, with an inclusion proof "
    "of each and their version range signed (waybill verify-proof checks it offline)",
    "parameters": [
        query(
            "size",
            {"type": "integer", "minimum": 1, "maximum": 2**63 - 1},
            "The checkpoint's tree size; default: the latest checkpoint.",
        )
    ],
    "responses": {"200": ok(ref("Proof")), **error_responses(400, 404, 409)},
}
VERIFY_LEDGER: Final[Schema] = {
    "summary": "Verify the ledger's hash chain (admin and auditor keys)",
    "responses": {"200": ok(ref("LedgerVerification")), **error_responses(403)},
}
SPEND: Final[Schema] = {
    "summary": "Spend, grouped",
    "parameters": [
        {
            **query(
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
        query("since", DAY),
        query("until", DAY),
        query("format", {"type": "string", "enum": ["json", "csv"]}),
        WORKSPACE,
    ],
    "responses": {
        "200": ok(page(ref("SpendRow")), also="text/csv"),
        **error_responses(400),
    },
}
BUDGETS: Final[Schema] = {
    "summary": "Budget balances per key and workspace",
    "parameters": [WORKSPACE],
    "responses": {"200": ok(page(ref("BudgetBalance"))), **error_responses()},
}
UNKNOWN_SETTLEMENTS: Final[Schema] = {
    "summary": "Unknown-usage settlements, oldest first",
    "parameters": [
        query("state", {"type": "string", "enum": ["open", "settled"]}),
        WORKSPACE,
        LIMIT,
        CURSOR,
    ],
    "responses": {"200": ok(page(ref("UnknownSettlement"))), **error_responses(400)},
}
SETTLE_UNKNOWN: Final[Schema] = {
    "summary": "Settle unknown usage by hand (admin and finance keys)",
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": object_schema(
                    ["settled_usd", "reason"],
                    settled_usd={**MONEY, "pattern": MONEY_PATTERN},
                    reason={"type": "string", "pattern": kept()},
                    force={
                        "type": "boolean",
                        "description": "Settle an amount over 1,000x the hold all the same.",
                    },
                )
            }
        },
    },
    "responses": {"200": ok(ref("Event")), **error_responses(400, 403, 404, 409)},
}
IMPORT_RECONCILIATION: Final[Schema] = {
    "summary": "Reconcile a provider usage export or report pages (admin and finance keys)",
    "parameters": [
        query("provider", STRING, "Reconcile only this endpoint's attempts."),
        query(
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
        query(
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
            media: {"schema": STRING}
            for media in ("text/csv", "application/x-ndjson", "application/json")
        },
    },
    "responses": {
        "200": ok(ref("ReconciliationReport")),
        **error_responses(400, 403, 413),
    },
}
READ_RECONCILIATION: Final[Schema] = {
    "summary": "A recorded reconciliation report",
    "responses": {"200": ok(ref("ReconciliationReport")), **error_responses(403, 404)},
}
READ_RECONCILIATION_BUCKET: Final[Schema] = {
    "summary": "One bucket of a recorded provider report, with the attempts it speaks for",
    "parameters": [
        query("model", STRING, "Only the comparison of this model."),
        query("endpoint", STRING, "Only the comparison of this endpoint."),
    ],
    "responses": {"200": ok({"type": "object"}), **error_responses(403, 404)},
}
