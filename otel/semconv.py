"""Every name Waybill's traces and metrics use, in one place (contract §8).

The ``gen_ai.*`` names follow the OpenTelemetry GenAI semantic conventions as released in
v1.41.1. They are experimental upstream, so they live here as constants: a rename in a
later release is one edit. ``gen_ai.system`` is deliberately absent: v1.41.1 replaced it
with ``gen_ai.provider.name``. The ``waybill.*`` names are ours, in the contract's words.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

__all__ = [
    "COST_BUCKETS",
    "DURATION_BUCKETS",
    "ERROR_TYPE",
    "EVENT_BUDGET_DENIED",
    "EVENT_CANDIDATE_EXCLUDED",
    "EVENT_FAILOVER_DECIDED",
    "EVENT_ROUTE_EVALUATED",
    "GEN_AI_CLIENT_OPERATION_DURATION",
    "GEN_AI_CLIENT_OPERATION_TIME_TO_FIRST_CHUNK",
    "GEN_AI_CLIENT_TOKEN_USAGE",
    "GEN_AI_OPERATION_NAME",
    "GEN_AI_PROVIDER_NAME",
    "GEN_AI_REQUEST_CHOICE_COUNT",
    "GEN_AI_REQUEST_MAX_TOKENS",
    "GEN_AI_REQUEST_MODEL",
    "GEN_AI_REQUEST_STREAM",
    "GEN_AI_RESPONSE_FINISH_REASONS",
    "GEN_AI_RESPONSE_ID",
    "GEN_AI_RESPONSE_MODEL",
    "GEN_AI_TOKEN_TYPE",
    "GEN_AI_USAGE_INPUT_TOKENS",
    "GEN_AI_USAGE_OUTPUT_TOKENS",
    "HTTP_RESPONSE_STATUS_CODE",
    "OPERATION_CHAT",
    "OPERATION_EMBEDDINGS",
    "PROVIDER_BY_DRIVER",
    "SCHEMA_URL",
    "SERVER_ADDRESS",
    "SERVER_PORT",
    "TOKEN_BUCKETS",
    "TOKEN_TYPE_INPUT",
    "TOKEN_TYPE_OUTPUT",
    "WAYBILL_ACCOUNT_ID",
    "WAYBILL_ACCOUNT_KIND",
    "WAYBILL_ACTION",
    "WAYBILL_AFTER_ATTEMPT_ID",
    "WAYBILL_ALLOWED",
    "WAYBILL_AMOUNT_USD",
    "WAYBILL_ATTEMPTS",
    "WAYBILL_ATTEMPT_ADMITTED_AS",
    "WAYBILL_ATTEMPT_CAUSE",
    "WAYBILL_ATTEMPT_ID",
    "WAYBILL_ATTEMPT_INVALID_OUTPUT",
    "WAYBILL_ATTEMPT_KIND",
    "WAYBILL_ATTEMPT_NUMBER",
    "WAYBILL_ATTEMPT_RESPONSE_BYTES",
    "WAYBILL_ATTEMPT_TIME_TO_FIRST_CHUNK_MS",
    "WAYBILL_AVAILABLE_USD",
    "WAYBILL_BACKOFF_MS",
    "WAYBILL_BREAKER_OPEN_TIME",
    "WAYBILL_BREAKER_SCOPE",
    "WAYBILL_BREAKER_STATE",
    "WAYBILL_BREAKER_TRANSITIONS",
    "WAYBILL_BUDGET_REJECTIONS",
    "WAYBILL_CACHED_INPUT_TOKENS",
    "WAYBILL_CANCELED_COST",
    "WAYBILL_CANCELED_TOKENS",
    "WAYBILL_CANDIDATES",
    "WAYBILL_CONFIG_GENERATION",
    "WAYBILL_COST_USD",
    "WAYBILL_DETAIL",
    "WAYBILL_ELIGIBLE",
    "WAYBILL_ENDPOINT",
    "WAYBILL_ENDPOINTS_DISABLED",
    "WAYBILL_ENDPOINT_DISABLINGS",
    "WAYBILL_ERROR_CODE",
    "WAYBILL_EVIDENCE",
    "WAYBILL_EXCLUDED_CANDIDATES",
    "WAYBILL_FAILOVERS",
    "WAYBILL_FAILURE_CLASS",
    "WAYBILL_FOLLOWER",
    "WAYBILL_HEDGES",
    "WAYBILL_HEDGE_LOSER_COST",
    "WAYBILL_HEDGE_LOSER_TOKENS",
    "WAYBILL_HEDGE_OUTCOME",
    "WAYBILL_HELD_UNKNOWN_USD",
    "WAYBILL_KEY_ID",
    "WAYBILL_LEDGER_LAG",
    "WAYBILL_MODEL",
    "WAYBILL_MODEL_GROUP",
    "WAYBILL_RATE_LIMIT",
    "WAYBILL_RATE_LIMIT_REJECTIONS",
    "WAYBILL_RATE_LIMIT_SUBJECT",
    "WAYBILL_REASON",
    "WAYBILL_REASON_CODE",
    "WAYBILL_REQUESTS",
    "WAYBILL_REQUEST_COST",
    "WAYBILL_REQUEST_ID",
    "WAYBILL_RESERVED_USD",
    "WAYBILL_SELECTION_POSITION",
    "WAYBILL_SEQUENCE",
    "WAYBILL_SETTLED_USD",
    "WAYBILL_SETTLEMENT",
    "WAYBILL_STATUS",
    "WAYBILL_STREAM_COMMITTED",
    "WAYBILL_TENANT",
    "WAYBILL_TIER",
    "WAYBILL_TRIED_ENDPOINTS",
    "WAYBILL_UNATTRIBUTED_TOKENS",
    "WAYBILL_UNKNOWN_USAGE_OPENED",
    "WAYBILL_UPSTREAM_REQUEST_ID",
    "WAYBILL_WEIGHT",
    "WAYBILL_WORKSPACE",
    "operation_of",
    "span_name",
]

SCHEMA_URL: Final = "https://opentelemetry.io/schemas/1.41.1"

# --- GenAI attributes ---

GEN_AI_OPERATION_NAME: Final = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME: Final = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL: Final = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS: Final = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_CHOICE_COUNT: Final = "gen_ai.request.choice.count"  # when not 1
GEN_AI_REQUEST_STREAM: Final = "gen_ai.request.stream"
GEN_AI_RESPONSE_MODEL: Final = "gen_ai.response.model"
GEN_AI_RESPONSE_ID: Final = "gen_ai.response.id"
GEN_AI_RESPONSE_FINISH_REASONS: Final = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"
GEN_AI_TOKEN_TYPE: Final = "gen_ai.token.type"

OPERATION_CHAT: Final = "chat"
OPERATION_EMBEDDINGS: Final = "embeddings"
# The client API a request came through (RequestReceived.api) to its operation; every other
# API is a chat (contract §8).
_OPERATION_BY_API: Final[Mapping[str, str]] = {"openai.embeddings": OPERATION_EMBEDDINGS}
TOKEN_TYPE_INPUT: Final = "input"
TOKEN_TYPE_OUTPUT: Final = "output"

PROVIDER_BY_DRIVER: Final[Mapping[str, str]] = {"openai": "openai", "anthropic": "anthropic"}
"""``gen_ai.provider.name`` for each endpoint driver (well-known values of v1.41.1)."""

# --- general attributes ---

ERROR_TYPE: Final = "error.type"
SERVER_ADDRESS: Final = "server.address"
SERVER_PORT: Final = "server.port"
HTTP_RESPONSE_STATUS_CODE: Final = "http.response.status_code"

# --- GenAI metrics ---

GEN_AI_CLIENT_TOKEN_USAGE: Final = "gen_ai.client.token.usage"
GEN_AI_CLIENT_OPERATION_DURATION: Final = "gen_ai.client.operation.duration"
GEN_AI_CLIENT_OPERATION_TIME_TO_FIRST_CHUNK: Final = "gen_ai.client.operation.time_to_first_chunk"

TOKEN_BUCKETS: Final = (
    1,
    4,
    16,
    64,
    256,
    1024,
    4096,
    16384,
    65536,
    262144,
    1048576,
    4194304,
    16777216,
    67108864,
)
"""Explicit bucket boundaries the conventions advise for ``gen_ai.client.token.usage``."""
DURATION_BUCKETS: Final = (
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
    20.48,
    40.96,
    81.92,
)
"""Explicit bucket boundaries the conventions advise for the GenAI durations (seconds)."""
COST_BUCKETS: Final = (
    0.00001,
    0.0001,
    0.0005,
    0.001,
    0.005,
    0.01,
    0.05,
    0.1,
    0.5,
    1,
    5,
)
"""Bucket boundaries of ``waybill.request.cost`` (USD): a cheap call is a fraction of a cent."""


# --- waybill.* attributes ---

WAYBILL_REQUEST_ID: Final = "waybill.request_id"
WAYBILL_ATTEMPT_ID: Final = "waybill.attempt_id"
WAYBILL_ATTEMPT_NUMBER: Final = "waybill.attempt_number"
WAYBILL_ATTEMPT_CAUSE: Final = "waybill.attempt.cause"
WAYBILL_ATTEMPT_KIND: Final = "waybill.attempt.kind"  # call, resume or hedge
WAYBILL_ATTEMPT_ADMITTED_AS: Final = "waybill.attempt.admitted_as"  # closed or probe:...
WAYBILL_ATTEMPT_TIME_TO_FIRST_CHUNK_MS: Final = "waybill.attempt.time_to_first_chunk_ms"
WAYBILL_ATTEMPT_RESPONSE_BYTES: Final = "waybill.attempt.response_bytes"
WAYBILL_ATTEMPT_INVALID_OUTPUT: Final = "waybill.attempt.invalid_output"  # where, never what
WAYBILL_ATTEMPTS: Final = "waybill.attempts"
WAYBILL_WORKSPACE: Final = "waybill.workspace"
WAYBILL_TENANT: Final = "waybill.tenant"  # instead of the workspace, when pseudonymous
WAYBILL_KEY_ID: Final = "waybill.key_id"
WAYBILL_MODEL_GROUP: Final = "waybill.model_group"
WAYBILL_ENDPOINT: Final = "waybill.endpoint"
WAYBILL_TIER: Final = "waybill.tier"
WAYBILL_WEIGHT: Final = "waybill.weight"
WAYBILL_STATUS: Final = "waybill.status"
WAYBILL_FAILURE_CLASS: Final = "waybill.failure_class"
WAYBILL_EVIDENCE: Final = "waybill.evidence"
WAYBILL_ERROR_CODE: Final = "waybill.error_code"
WAYBILL_UPSTREAM_REQUEST_ID: Final = "waybill.upstream_request_id"
WAYBILL_STREAM_COMMITTED: Final = "waybill.stream_committed"
WAYBILL_CONFIG_GENERATION: Final = "waybill.config_generation"
WAYBILL_RESERVED_USD: Final = "waybill.reserved_usd"
WAYBILL_SETTLED_USD: Final = "waybill.settled_usd"
WAYBILL_HELD_UNKNOWN_USD: Final = "waybill.held_unknown_usd"
WAYBILL_COST_USD: Final = "waybill.cost_usd"
WAYBILL_CACHED_INPUT_TOKENS: Final = "waybill.usage.cached_input_tokens"
WAYBILL_CACHE_WRITE_INPUT_TOKENS: Final = "waybill.usage.cache_write_input_tokens"
WAYBILL_CACHE_WRITE_1H_INPUT_TOKENS: Final = "waybill.usage.cache_write_1h_input_tokens"

# span events and their attributes
EVENT_ROUTE_EVALUATED: Final = "waybill.route.evaluated"
EVENT_CANDIDATE_EXCLUDED: Final = "waybill.route.candidate_excluded"
EVENT_FAILOVER_DECIDED: Final = "waybill.failover.decided"
EVENT_BUDGET_DENIED: Final = "waybill.budget.reservation_denied"
WAYBILL_SEQUENCE: Final = "waybill.route.sequence"
WAYBILL_CANDIDATES: Final = "waybill.route.candidates"
WAYBILL_ELIGIBLE: Final = "waybill.route.eligible"
WAYBILL_TRIED_ENDPOINTS: Final = "waybill.route.tried_endpoints"
WAYBILL_SELECTION_POSITION: Final = "waybill.route.selection_position"
WAYBILL_MODEL: Final = "waybill.model"
WAYBILL_REASON_CODE: Final = "waybill.reason_code"
WAYBILL_DETAIL: Final = "waybill.detail"
WAYBILL_AFTER_ATTEMPT_ID: Final = "waybill.failover.after_attempt_id"
WAYBILL_ACTION: Final = "waybill.failover.action"
WAYBILL_ALLOWED: Final = "waybill.failover.allowed"
WAYBILL_REASON: Final = "waybill.failover.reason"
WAYBILL_BACKOFF_MS: Final = "waybill.failover.backoff_ms"
WAYBILL_ACCOUNT_KIND: Final = "waybill.budget.account_kind"
WAYBILL_ACCOUNT_ID: Final = "waybill.budget.account_id"
WAYBILL_AMOUNT_USD: Final = "waybill.budget.amount_usd"
WAYBILL_AVAILABLE_USD: Final = "waybill.budget.available_usd"

# --- waybill.* metrics ---

WAYBILL_REQUESTS: Final = "waybill.requests"
WAYBILL_FAILOVERS: Final = "waybill.failovers"
WAYBILL_BREAKER_TRANSITIONS: Final = "waybill.breaker.transitions"
WAYBILL_BUDGET_REJECTIONS: Final = "waybill.budget.rejections"
WAYBILL_UNKNOWN_USAGE_OPENED: Final = "waybill.unknown_usage.opened"
# Provider usage a reconciliation found that no attempt explains (contract §3).
WAYBILL_UNATTRIBUTED_TOKENS: Final = "waybill.reconciliation.unattributed_tokens"
WAYBILL_LEDGER_LAG: Final = "waybill.ledger.lag"
# Hedged requests (contract §5 "Hedging"): second ways launched, and how each race ended.
WAYBILL_HEDGES: Final = "waybill.hedges"
WAYBILL_HEDGE_OUTCOME: Final = "waybill.hedge.outcome"  # launched, won or lost
# What the ways that lost a race cost: settled, or held as unknown usage until reconciled.
WAYBILL_HEDGE_LOSER_COST: Final = "waybill.hedge.loser_cost"
WAYBILL_SETTLEMENT: Final = "waybill.settlement"  # settled or held_unknown
WAYBILL_BREAKER_SCOPE: Final = "waybill.breaker.scope"
WAYBILL_BREAKER_STATE: Final = "waybill.breaker.to_state"
WAYBILL_FOLLOWER: Final = "waybill.follower"
# Disabled endpoints (contract §5): each disabling, and 1 per endpoint while it is disabled.
WAYBILL_ENDPOINT_DISABLINGS: Final = "waybill.endpoint.disablings"
WAYBILL_ENDPOINTS_DISABLED: Final = "waybill.endpoints.disabled"
# The numbers an operator watches beside those (issue 43): seconds breakers spent open, what a
# successful request cost, candidates excluded by reason code, what attempts a client
# cancelled still used, and the tokens of the ways that lost a hedged race.
WAYBILL_BREAKER_OPEN_TIME: Final = "waybill.breaker.open_time"
WAYBILL_REQUEST_COST: Final = "waybill.request.cost"
WAYBILL_EXCLUDED_CANDIDATES: Final = "waybill.route.excluded_candidates"
WAYBILL_CANCELED_TOKENS: Final = "waybill.canceled.tokens"
WAYBILL_CANCELED_COST: Final = "waybill.canceled.cost"
WAYBILL_HEDGE_LOSER_TOKENS: Final = "waybill.hedge.loser_tokens"
# Requests refused at admission by a rate limit (config `limits`, `key_limits`).
WAYBILL_RATE_LIMIT_REJECTIONS: Final = "waybill.rate_limit.rejections"
WAYBILL_RATE_LIMIT: Final = "waybill.rate_limit.name"  # requests_per_minute, tokens_per_minute
WAYBILL_RATE_LIMIT_SUBJECT: Final = "waybill.rate_limit.subject"  # workspace or key


def operation_of(api: str) -> str:
    """``gen_ai.operation.name`` of a request that came through ``api``."""
    return _OPERATION_BY_API.get(api, OPERATION_CHAT)


def span_name(model: str, operation: str = OPERATION_CHAT) -> str:
    """``{gen_ai.operation.name} {model}``, the conventions' inference span name."""
    return f"{operation} {model}"
