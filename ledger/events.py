"""The event catalogue: every fact Waybill records, in one place.

Each event type is a frozen pydantic model with a past-tense name, a schema version and
exactly the fields it carries; anything else is refused before it can reach the store.
The catalogue follows contract §7. Rules that hold for every type:

- no prompt or completion text and no secret, ever: prompts appear as a hash and sizes;
- money is an exact ``Decimal`` (serialized as a plain decimal string, never a float);
- durations are integer milliseconds; instants are the store's ``recorded_at`` unless a
  field says otherwise;
- reason codes, failure classes and evidence use the vocabularies defined here once.

Changing a type's fields means a new ``schema_version`` and an upcaster in ``UPCASTERS``
that turns the old payload into the new one, so that old events keep their meaning. A
new field needs none when its default is what every older event meant (``RequestReceived.api``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from decimal import Decimal
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Final, Literal, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
)

__all__ = [
    "APIS",
    "CATALOGUE",
    "DATA_CLASSES",
    "RETENTION_PATTERN",
    "UPCASTERS",
    "AccountRef",
    "Api",
    "AttemptFinished",
    "AttemptStarted",
    "BreakerTransitioned",
    "BucketComparison",
    "BudgetOverrun",
    "BudgetReleased",
    "BudgetReservationDenied",
    "BudgetReserved",
    "BudgetSettled",
    "Candidate",
    "CheckpointTaken",
    "ConfigActivated",
    "DataClass",
    "EndpointDisabled",
    "EndpointEnabled",
    "Event",
    "EventValidationError",
    "Evidence",
    "FailoverDecided",
    "FailureClass",
    "InvalidEventPayload",
    "KeyCreated",
    "KeyRevoked",
    "Money",
    "PeriodAdjusted",
    "PeriodClosed",
    "PeriodTotal",
    "Rate",
    "RateLimitExceeded",
    "ReasonCode",
    "ReconciliationImported",
    "RequestCompleted",
    "RequestFailed",
    "RequestReceived",
    "Requirements",
    "RouteChoice",
    "RouteEvaluated",
    "StreamCommitted",
    "Timeouts",
    "UnattributedUsage",
    "UnknownEventType",
    "UnknownUsageOpened",
    "UnknownUsageSettled",
    "Usage",
    "data_class_rank",
    "decode_event",
    "encode_event",
    "retention_rank",
    "type_names",
]


# --- vocabularies (contract §2, §4, §5): defined once; config validation, the OpenAPI schema
# and the contract's tables (checked by tests/test_vocabulary.py) all derive from these ---


class ReasonCode(StrEnum):
    """Why a mapping was excluded from a route evaluation (contract §4)."""

    ENDPOINT_DISABLED = "endpoint_disabled"
    MODEL_KIND_MISMATCH = "model_kind_mismatch"
    MISSING_CAPABILITY = "missing_capability"
    CONTEXT_TOO_SMALL = "context_too_small"
    REGION_NOT_ALLOWED = "region_not_allowed"
    DATA_CLASS_NOT_ALLOWED = "data_class_not_allowed"
    BREAKER_OPEN = "breaker_open"
    ALREADY_TRIED = "already_tried"
    OVER_BUDGET = "over_budget"
    SCOPE_EMPTY = "scope_empty"
    UNPRICED_INPUT = "unpriced_input"  # a billable input or output the mapping has no price for
    ENDPOINT_SATURATED = "endpoint_saturated"  # its max_in_flight attempts are in flight
    CREDENTIALS_DISABLED = "credentials_disabled"  # its key was refused: EndpointDisabled
    # The endpoint's dialect cannot carry a feature the request needs (the detail names it).
    DIALECT_UNSUPPORTED = "dialect_unsupported"
    # A composed group's pools (contract §4 "Pools"): the workspace may not use the pool's
    # group; or none of the pool's own mappings is eligible (its evaluation says why).
    POOL_NOT_PERMITTED = "pool_not_permitted"
    POOL_UNAVAILABLE = "pool_unavailable"
    # The endpoint keeps requests longer than the request's retention bound allows, or does
    # not say what it keeps (contract §4; the detail names both).
    RETENTION_EXCEEDED = "retention_exceeded"
    # Its measured p95 time to first content is longer than the request's deadline has
    # left: a failover must not start what cannot finish (contract §4; both figures).
    DEADLINE_INSUFFICIENT = "deadline_insufficient"
    # Its provider account answered insufficient_quota (contract §4 "Quota failover").
    QUOTA_EXHAUSTED = "quota_exhausted"
    OUT_OF_SCOPE = "out_of_scope"  # outside the caller's endpoint scope (key, header, pin)
    # The request continues a response whose state another endpoint holds (a Responses
    # previous_response_id): no other endpoint can know it.
    RESPONSE_AFFINITY = "response_affinity"


class FailureClass(StrEnum):
    """How an attempt failed (contract §5)."""

    RATE_LIMITED = "rate_limited"
    QUOTA_EXHAUSTED = "quota_exhausted"
    CREDENTIALS = "credentials"
    POLICY_DENIED = "policy_denied"
    MODEL_UNAVAILABLE = "model_unavailable"
    CONTEXT_TOO_SMALL = "context_too_small"
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"
    NETWORK_ERROR = "network_error"
    TIMEOUT = "timeout"
    RESPONSE_TOO_LARGE = "response_too_large"
    INVALID_OUTPUT = "invalid_output"  # an answer that breaks the shape the request demanded
    NON_RETRYABLE = "non_retryable"
    CLIENT_CANCELED = "client_canceled"
    DEADLINE_EXCEEDED = "deadline_exceeded"


class Evidence(StrEnum):
    """What we know about whether the upstream started (and so may bill) the work."""

    NOT_STARTED = "not_started"
    UNKNOWN = "unknown"
    STARTED = "started"


DataClass = Literal["public", "internal", "restricted"]
"""How sensitive a request's data is (contract §2), least to most: a request may raise its
workspace's class, never lower it, and an endpoint receives only the classes it lists."""

DATA_CLASSES: Final[tuple[DataClass, ...]] = get_args(DataClass)
"""The data classes in order, least sensitive first."""

Api = Literal[
    "openai.chat_completions", "anthropic.messages", "openai.responses", "openai.embeddings"
]
"""The client API (door) a request came through (contract §3 "Inference"). Events recorded
before doors were named all came through the first."""

APIS: Final[tuple[Api, ...]] = get_args(Api)


def data_class_rank(data_class: DataClass) -> int:
    """Position in public < internal < restricted."""
    return DATA_CLASSES.index(data_class)


RETENTION_PATTERN: Final = r"none|zero|[1-9][0-9]{0,4}d"
"""What a provider keeps of a request (contract §2 ``retention``), least first: ``none``
(nothing, not even for abuse monitoring), ``zero`` (zero data retention: nothing once the
answer is delivered), ``<days>d`` (kept that many days, 1 to 99999)."""


def retention_rank(retention: str) -> int:
    """Position in none < zero < 1d < 2d < ...: a retention satisfies a bound it does not
    exceed. ``retention`` matches :data:`RETENTION_PATTERN` (the config and the header
    parsers see to it)."""
    if retention == "none":
        return -1
    if retention == "zero":
        return 0
    return int(retention.removesuffix("d"))


# --- field types ---


def _refuse_float(value: Any) -> Any:
    # A float has already lost exactness; money must arrive as Decimal, int or string.
    if isinstance(value, float):
        raise ValueError("money must be a decimal string or Decimal, not a float")
    return value


Money = Annotated[
    Decimal,
    BeforeValidator(_refuse_float),
    Field(allow_inf_nan=False),
    PlainSerializer(lambda d: format(d, "f"), return_type=str, when_used="json"),
]
"""An exact amount of US dollars; serialized as a plain decimal string (no exponent)."""

NonNegInt = Annotated[int, Field(ge=0)]
Id = Annotated[str, Field(min_length=1, max_length=200)]
Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class _Record(BaseModel):
    """Base for every value inside an event: frozen, closed, exact."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)

    def model_post_init(self, context: Any, /) -> None:
        # pydantic gives each instance a set of the fields it was given: a hash table larger
        # than the record's values (bench/README.md, "Long streams"), held by every event an
        # open request keeps. A record never changes it (frozen; model_copy changes a copy),
        # and records are made the same few ways: those given the same fields share one.
        given = self.__pydantic_fields_set__
        key = tuple(given)
        shared = _FIELDS_GIVEN.get(key)
        if shared is None:
            if len(_FIELDS_GIVEN) >= _MAX_FIELDS_GIVEN:
                return
            shared = _FIELDS_GIVEN[key] = given
        object.__setattr__(self, "__pydantic_fields_set__", shared)


_FIELDS_GIVEN: dict[tuple[str, ...], set[str]] = {}
_MAX_FIELDS_GIVEN: Final = 4096


# --- value objects shared by several events ---


def _absent(value: object) -> bool:
    """A field added with the default None, left out of the recorded form while None (where
    an empty value means something else than an absent one)."""
    return value is None


def _nothing(value: object) -> bool:
    """A field added with a default that is left out of the recorded form while it holds
    that default (0, empty), so events that do not use it keep their bytes."""
    return not value


class Usage(_Record):
    """What an attempt is billed for, dimension by dimension; a settlement prices each one
    (``ledger.books.accounting.usage_cost``). Audio, cached and cache-write tokens are parts
    of the input and output counts, as OpenAI reports them; image and file tokens are not
    told apart from text (OpenAI bills them inside the prompt tokens, at the input price)."""

    input_tokens: NonNegInt
    output_tokens: NonNegInt
    cached_input_tokens: NonNegInt = 0  # of input_tokens, read from the provider's cache
    # Of input_tokens, written to Anthropic's prompt cache (cache_creation_input_tokens, by
    # its cache_creation breakdown): for 5 minutes, and for an hour. Events recorded before
    # these fields knew no cache writes (they were settled as input). Left out of the
    # recorded form when 0, as they were before they existed: most usage has none, and the
    # ledger's bytes per request stay as they were (bench/README.md, "Ledger size").
    cache_write_input_tokens: NonNegInt = Field(0, exclude_if=_nothing)
    cache_write_1h_input_tokens: NonNegInt = Field(0, exclude_if=_nothing)
    audio_input_tokens: NonNegInt = 0  # of input_tokens (prompt_tokens_details.audio_tokens)
    audio_output_tokens: NonNegInt = 0  # of output_tokens (completion_tokens_details.audio_tokens)
    # Billed per search, and no provider reports them in usage: the gateway counts one per
    # choice of a request that asked for web search, the unit its price is given in.
    web_searches: NonNegInt = 0


class Requirements(_Record):
    """What a request needs from an endpoint, inferred from its body and headers."""

    kind: str = "chat"
    capabilities: tuple[str, ...] = ()
    regions: tuple[str, ...] | None = None  # None: the workspace's regions apply unnarrowed
    data_class: DataClass = "internal"
    # The most an endpoint may keep of the request (RETENTION_PATTERN): the workspace's
    # bound, narrowed by X-Waybill-Retention. None: no bound.
    retention: Annotated[str, Field(pattern=f"^(?:{RETENTION_PATTERN})$")] | None = Field(
        None, exclude_if=_nothing
    )
    estimated_input_tokens: NonNegInt = 0  # text: the prompt's bytes bound its tokens
    # Embeddings: the longest input's bound. Each input is embedded alone, so it, not the
    # batch, must fit a mapping's context window.
    largest_input_tokens: NonNegInt = Field(0, exclude_if=_nothing)
    max_output_tokens: NonNegInt | None = None
    # What else the request may be billed for (the worst case, router/request/worst_case.py):
    choices: Annotated[int, Field(ge=1)] = 1  # `n`: every choice's output is billed
    prediction_tokens: NonNegInt = 0  # a predicted output's bytes: rejected ones bill as output
    image_inputs: NonNegInt = 0  # content parts of each kind
    audio_inputs: NonNegInt = 0
    file_inputs: NonNegInt = 0
    audio_output: bool = False  # `modalities` with "audio", or an `audio` parameter
    web_search: bool = False  # `web_search_options`
    # The lifetimes ("5m", "1h") of the prompt-cache writes the request's cache_control
    # markers ask for: an Anthropic endpoint bills them at the cache-write prices.
    cache_writes: tuple[Literal["5m", "1h"], ...] = Field((), exclude_if=_nothing)
    unknown_inputs: tuple[str, ...] = ()  # content part types no price can cover
    stream: bool = False
    allow_failover: bool = True
    max_cost_usd: Money | None = None
    deadline_ms: NonNegInt | None = None
    # X-Waybill-Allow-Failover: unknown: an attempt of unknown execution may be followed by
    # another even where the request is strict (contract §5 "Per on_unknown_execution").
    allow_unknown_execution: bool = False
    # X-Waybill-Allow-Failover was sent allowing failover: the grant a model group's
    # `failover: on_grant` waits for (contract §4 "Failover on grant").
    failover_granted: bool = Field(False, exclude_if=_nothing)
    # The body asks the provider for effects of its own (server-side tools, web search):
    # the request is strict whatever its model group's policy.
    server_side_effects: bool = False
    # The upstream dialect the body arrived in ("anthropic" through the Anthropic door): an
    # endpoint of that dialect is sent the body as it came, every content part in it. None:
    # the canonical chat body (router/request/call.py).
    native: str | None = Field(None, exclude_if=_nothing)
    # (upstream dialect, feature) for each dialect that cannot carry a feature the request
    # needs (thinking, documents, a beta field): its endpoints are excluded
    # `dialect_unsupported` (router/doors/messages.py says which feature where).
    unsupported: tuple[tuple[str, str], ...] = Field((), exclude_if=_nothing)
    # The caller's endpoint scope (contract §4 "Endpoint scope"): endpoint ids and
    # `provider:NAME` labels as X-Waybill-Endpoints named them, and as the key's standing
    # scope names them; each None: not narrowed that way (an empty one narrows to nothing,
    # so only None is left out of the recorded form). Labels are expanded within the model
    # group when the request is routed, so the record keeps what was asked.
    endpoints: tuple[str, ...] | None = Field(None, exclude_if=_absent)
    key_endpoints: tuple[str, ...] | None = Field(None, exclude_if=_absent)
    # X-Waybill-Prefer-Endpoint: a preference the router may overrule.
    prefer_endpoint: str | None = Field(None, exclude_if=_absent)
    # X-Waybill-Require-Endpoint: the request is pinned there (`require_target`), no other
    # endpoint is ever tried.
    require_endpoint: str | None = Field(None, exclude_if=_absent)
    # The endpoint that holds the provider-side state the request continues (the response a
    # Responses previous_response_id names, found in the ledger): every other candidate is
    # excluded `response_affinity`. None: any endpoint.
    affinity_endpoint: str | None = Field(None, exclude_if=_nothing)


class Candidate(_Record):
    """One mapping of the model group as seen by one route evaluation."""

    endpoint: Id
    model: Id
    mapping_index: NonNegInt
    tier: NonNegInt
    weight: Annotated[int, Field(gt=0)]
    eligible: bool
    reason_code: ReasonCode | None = None
    detail: str | None = None  # e.g. the missing capability, the region, the breaker scope
    worst_case_usd: Money | None = None
    # The mapping's moving average of time to first content / answer when it was evaluated
    # (the least_latency strategy reads it); None: not measured yet.
    latency_ms: NonNegInt | None = None
    # A composer's candidate that is a pool (contract §4 "Pools"): the pool's model group;
    # then endpoint and model are the binding the composer prefers inside it.
    pool: Id | None = None


class RouteChoice(_Record):
    endpoint: Id
    model: Id
    mapping_index: NonNegInt
    tier: NonNegInt
    weight: Annotated[int, Field(gt=0)]
    selection_position: NonNegInt  # position in the tier's smooth weighted round-robin
    # Chosen as the caller's X-Waybill-Prefer-Endpoint, ahead of tier and strategy (the
    # round-robin was not consulted: selection_position is 0). Left out while False.
    preferred: bool = Field(False, exclude_if=_nothing)


class AccountRef(_Record):
    """A budget account touched by a reservation, with the window it was charged to."""

    account_id: Id  # e.g. "workspace:acme:2026-11", "key:k_123:2026-11-30", "request:r_1"
    kind: Literal["request", "key", "workspace"]
    window_start: str | None = None  # ISO date of the window's first day (UTC); None: total
    limit_usd: Money


# --- the events ---


class Event(_Record):
    """Base of every ledger event. Subclasses set ``type`` and ``schema_version``."""

    type: ClassVar[str]
    schema_version: ClassVar[int] = 1


class RequestReceived(Event):
    type: ClassVar[str] = "RequestReceived"

    request_id: Id
    workspace: Id
    key_id: Id
    model_group: str
    requirements: Requirements
    config_generation: str
    prompt_sha256: Sha256Hex
    prompt_bytes: NonNegInt
    message_count: NonNegInt
    idempotency_key_sha256: Sha256Hex | None = None
    trace_id: str | None = None  # the caller's W3C trace id, if it sent a traceparent
    parent_span_id: str | None = None  # the caller's span the request's span hangs from
    api: Api = "openai.chat_completions"  # the door the request came through


class RouteEvaluated(Event):
    type: ClassVar[str] = "RouteEvaluated"

    request_id: Id
    sequence: Annotated[int, Field(ge=1)]  # 1 for the first evaluation, +1 per re-evaluation
    candidates: tuple[Candidate, ...]
    tried_endpoints: tuple[str, ...] = ()
    chosen: RouteChoice | None = None  # None: nothing eligible is left
    # How the choice inside the tier was made (contract §4 "Selection").
    strategy: Literal["weighted", "least_latency", "least_cost"] = "weighted"
    # Which level of a composed group this evaluation is (contract §4 "Pools"): the path of
    # model groups down to the one evaluated — (composed,) for the composer's evaluation of
    # its pools, (composed, pool) for the pool's of its mappings. Empty: a plain group's.
    group_path: tuple[Id, ...] = ()


class BudgetReserved(Event):
    type: ClassVar[str] = "BudgetReserved"

    request_id: Id
    attempt_id: Id
    reservation_id: Id
    amount_usd: Money
    accounts: tuple[AccountRef, ...]  # empty when no budget applies: the hold is still kept
    endpoint: Id
    model: Id
    workspace: Id | None = None  # who the spend belongs to, for the spend views
    key_id: Id | None = None
    model_group: str | None = None
    owner: str | None = None  # the gateway instance that took the hold (crash recovery)
    # The door its request came through (RequestReceived.api), for the spend views; holds
    # taken before it was recorded here were all of chat completions.
    api: Api = "openai.chat_completions"


class RateLimitExceeded(Event):
    """A request refused at admission by a rate limit (config ``limits``): no upstream was
    called, nothing reserved. Followed by its ``RequestFailed`` (429 ``rate_limited``)."""

    type: ClassVar[str] = "RateLimitExceeded"

    request_id: Id
    subject: Id  # "workspace:acme" or "key:k_123"
    limit_name: Literal["requests_per_minute", "tokens_per_minute"]
    limit: NonNegInt
    window_start: str  # the one-minute window's start, ISO 8601 UTC
    window_s: NonNegInt = 60
    tokens: NonNegInt  # the request's worst-case tokens, as counted
    retry_after_s: NonNegInt


class BudgetReservationDenied(Event):
    type: ClassVar[str] = "BudgetReservationDenied"

    request_id: Id
    endpoint: Id
    model: Id
    amount_usd: Money
    account_id: Id
    account_kind: Literal["request", "key", "workspace"]
    limit_usd: Money
    available_usd: Money


class Timeouts(_Record):
    """An attempt's timeouts as in force (contract §2 `defaults` and an endpoint's
    `timeouts:`), in milliseconds."""

    attempt_timeout_ms: Annotated[int, Field(gt=0)]
    first_token_timeout_ms: Annotated[int, Field(gt=0)]
    stream_idle_timeout_ms: Annotated[int, Field(gt=0)]


class AttemptStarted(Event):
    type: ClassVar[str] = "AttemptStarted"

    request_id: Id
    attempt_id: Id
    attempt_number: Annotated[int, Field(ge=1)]
    cause: Literal["first", "retry", "failover", "hedge"]
    endpoint: Id
    driver: Literal["openai", "anthropic"]
    model: Id  # the upstream model name
    tier: NonNegInt
    weight: Annotated[int, Field(gt=0)]
    reservation_id: Id | None = None
    server_address: str | None = None
    server_port: int | None = None
    stream: bool = False
    # A resume continues a committed stream that broke (contract §5 "Resume"): the attempt
    # it continues and how many characters of text the client already had (never the text).
    # A hedge is a second way started while the first had not answered (§5 "Hedging").
    kind: Literal["call", "resume", "hedge"] = "call"
    resumed_from: Id | None = None
    delivered_chars: NonNegInt | None = None
    hedge_of: Id | None = None
    # What the breakers admitted it under: "closed", or "probe:endpoint" / "probe:mapping"
    # (/ both) when it carried a half-open breaker's one probe (contract §5).
    admitted_as: str | None = None
    # The dispatch directive an attempt of a composed group ran under (contract §4 "Pools"):
    # delegate_pool (the pool's router selected inside it; ``preferred_endpoint`` was the
    # composer's preference) or execute_endpoint (exactly the bound endpoint); the pool, and
    # the path of model groups from the requested one down to the endpoint's. None and
    # empty: a plain group's attempt.
    dispatch: Literal["delegate_pool", "execute_endpoint"] | None = None
    pool: Id | None = None
    group_path: tuple[Id, ...] = ()
    preferred_endpoint: Id | None = None
    # The timeouts it ran under, when its endpoint has a `timeouts:` block laid over its
    # model group's policy; None: the policy's own, as ConfigActivated records them.
    timeouts: Timeouts | None = Field(None, exclude_if=_nothing)


HEDGE_LOST: Final = "hedge_lost"
"""``AttemptFinished.error_code`` of a hedged way that lost the race and was cancelled."""


class StreamCommitted(Event):
    """A stream was committed to the client: appended, and durable, after its attempt's
    first content arrived and before the client's first byte (contract §5). From here on the
    endpoint is fixed and an end other than success is a partial failure; crash recovery
    reads it to record what the client saw. If the commit's answer is lost, the client
    gets a 503 instead, and the request's ``RequestFailed`` (``stream_started`` false) says
    so."""

    type: ClassVar[str] = "StreamCommitted"

    request_id: Id
    attempt_id: Id
    endpoint: Id
    time_to_first_chunk_ms: NonNegInt | None = None


class AttemptFinished(Event):
    type: ClassVar[str] = "AttemptFinished"

    request_id: Id
    attempt_id: Id
    status: Literal["succeeded", "failed"]
    failure_class: FailureClass | None = None
    evidence: Evidence
    http_status: int | None = None
    error_code: str | None = None  # the upstream's own error code, if it gave one
    usage: Usage | None = None  # None: usage unknown
    upstream_request_id: str | None = None
    response_id: str | None = None
    response_model: str | None = None
    finish_reason: str | None = None
    retry_after_ms: NonNegInt | None = None
    duration_ms: NonNegInt
    time_to_first_chunk_ms: NonNegInt | None = None
    stream_committed: bool = False  # at least one event reached the client
    invalid_events: NonNegInt = 0  # stream events skipped as not valid JSON
    # What in the answer broke the shape the request demanded (contract §5 "Output
    # validation"): where and which rule, never the content. Set on a failed attempt
    # (invalid_output) and on one returned as it was (on_invalid_output: return).
    invalid_output: str | None = None
    response_bytes: NonNegInt = 0


class FailoverDecided(Event):
    type: ClassVar[str] = "FailoverDecided"

    request_id: Id
    after_attempt_id: Id
    failure_class: FailureClass
    evidence: Evidence
    action: Literal["retry", "failover", "resume", "stop"]
    allowed: bool
    reason: str  # a stable code, e.g. "quota_exhausted_stops"
    backoff_ms: NonNegInt | None = None
    attempts_left: NonNegInt | None = None  # under max_attempts, after this one
    deadline_left_ms: NonNegInt | None = None  # of the whole-request deadline
    policy: str | None = (
        None  # the config policy that applied, e.g. "on_unknown_execution=failover"
    )


class BudgetSettled(Event):
    type: ClassVar[str] = "BudgetSettled"

    request_id: Id
    attempt_id: Id
    reservation_id: Id
    reserved_usd: Money
    settled_usd: Money
    released_usd: Money
    usage: Usage


class BudgetOverrun(Event):
    """A hold resolved above its amount: the whole actual cost was settled (never capped),
    and the excess over the reservation is this fact. Appended with the settlement it
    follows, it is the only way spend can go beyond what was reserved: for every account,
    ``settled - overrun`` stays within what its holds reserved, so within its limit."""

    type: ClassVar[str] = "BudgetOverrun"

    request_id: Id
    attempt_id: Id
    reservation_id: Id
    accounts: tuple[Id, ...]  # every account the hold was charged to (none: no budget applied)
    held_usd: Money  # the reservation's amount
    actual_usd: Money  # what was settled
    excess_usd: Money  # actual - held, > 0
    cause: Literal["usage_above_reservation", "operator_settlement", "reconciliation"]


class BudgetReleased(Event):
    type: ClassVar[str] = "BudgetReleased"

    request_id: Id
    attempt_id: Id
    reservation_id: Id
    released_usd: Money
    reason: str  # e.g. "not_started"


class UnknownUsageOpened(Event):
    type: ClassVar[str] = "UnknownUsageOpened"

    settlement_id: Id
    request_id: Id
    attempt_id: Id
    reservation_id: Id
    workspace: Id
    key_id: Id
    endpoint: Id
    model: Id
    held_usd: Money
    cause: str  # failure class, "broken_stream" or "crash_recovery"


class UnknownUsageSettled(Event):
    type: ClassVar[str] = "UnknownUsageSettled"

    settlement_id: Id
    request_id: Id
    attempt_id: Id
    reservation_id: Id
    held_usd: Money
    settled_usd: Money
    released_usd: Money
    source: Literal["reconciliation", "operator"]
    actor: Id  # key id of who settled it
    reason: str | None = None
    reconciliation_id: Id | None = None
    usage: Usage | None = None
    # Settled from a provider report's bucket: its start, "2026-11-30T14:00Z" (§3, §6).
    bucket: str | None = None


class RequestCompleted(Event):
    type: ClassVar[str] = "RequestCompleted"

    request_id: Id
    endpoint: Id
    model: Id
    attempts: Annotated[int, Field(ge=1)]
    http_status: int = 200
    usage: Usage | None = None
    cost_usd: Money | None = None
    finish_reason: str | None = None
    duration_ms: NonNegInt


class RequestFailed(Event):
    type: ClassVar[str] = "RequestFailed"

    request_id: Id
    http_status: int
    error_code: str
    error_type: str
    message: str
    attempts: NonNegInt
    endpoint: str | None = None  # the endpoint a broken stream was committed to
    stream_started: bool = False  # True: a partial failure (contract §3 status partial_failure)
    duration_ms: NonNegInt


Rate = Annotated[
    Decimal,
    BeforeValidator(_refuse_float),
    Field(ge=0, le=1, allow_inf_nan=False),
    PlainSerializer(lambda d: format(d, "f"), return_type=str, when_used="json"),
]
"""A share of calls, 0 to 1, exact (a decimal string, like money), e.g. ``"0.5000"``."""


class BreakerTransitioned(Event):
    """A breaker changed state (contract §5 "Circuit breakers"), with what made it: the
    policy, the reason (a threshold, a probe), and for a rolling breaker that opened the
    window's figures. The rolling figures are absent from consecutive breakers' events."""

    type: ClassVar[str] = "BreakerTransitioned"

    scope: Literal["endpoint", "mapping"]
    target: Id  # endpoint id, or "endpoint/model" for mapping scope
    from_state: Literal["closed", "open", "half_open"]
    to_state: Literal["closed", "open", "half_open"]
    failure_class: FailureClass | None = None
    consecutive_failures: NonNegInt = 0
    cooldown_ms: NonNegInt | None = None
    config_generation: str
    request_id: Id | None = None
    policy: Literal["consecutive", "rolling"] | None = None
    # failure_threshold, opens_at_once, failure_rate, slow_call_rate, probe, probe_failed,
    # probe_slow, probe_succeeded (router.adapters.breaker_policy.StepReason)
    reason: str | None = None
    duration_ms: NonNegInt | None = None  # the latency of the call that caused it
    calls: NonNegInt | None = None  # in the rolling window, that call included
    failed_calls: NonNegInt | None = None
    slow_calls: NonNegInt | None = None
    failure_rate: Rate | None = None  # failed_calls / calls, rounded down to 4 places
    slow_call_rate: Rate | None = None
    # The threshold an opening crossed, as configured (reason failure_threshold: the count;
    # failure_rate or slow_call_rate: the rate and the window's minimum_calls).
    failure_threshold: NonNegInt | None = None
    minimum_calls: NonNegInt | None = None
    failure_rate_threshold: Rate | None = None
    slow_call_rate_threshold: Rate | None = None


class EndpointDisabled(Event):
    """An upstream refused an endpoint's credentials (401/403, failure class ``credentials``):
    the endpoint is disabled until an operator enables it or its key changes (contract §5
    "Disabled endpoints"). On stream ``endpoints``. The key itself is never recorded:
    ``key_check`` only tells a later config whether its key for the endpoint is this one."""

    type: ClassVar[str] = "EndpointDisabled"

    endpoint: Id
    http_status: int | None = None
    error_code: str | None = None  # the provider's error code (or type), as it gave it
    key_check: str | None = (
        None  # router.adapters.disabling.key_check; None: the endpoint has no key
    )
    request_id: Id | None = None
    attempt_id: Id | None = None
    config_generation: str


class EndpointEnabled(Event):
    """A disabled endpoint is enabled again: by an operator (``actor``: the admin key id, or
    ``cli``), or because the config now gives it another key. On stream ``endpoints``."""

    type: ClassVar[str] = "EndpointEnabled"

    endpoint: Id
    cause: Literal["operator", "key_changed"]
    actor: str | None = None
    config_generation: str | None = None  # None: enabled from the CLI


class ReconciliationLine(_Record):
    """One entry of a reconciliation report: a provider line, an attempt, or both."""

    line: Annotated[int, Field(ge=1)] | None = None  # None: an attempt no line billed
    attempt_id: str | None = None
    provider_request_id: str | None = None
    detail: str | None = None
    expected_usd: Money | None = None
    provider_usd: Money | None = None


ReportStatus = Literal[
    "matched",
    "settled_unknown",
    "released_unknown",
    "unattributed",
    "ledger_above_provider",
    "in_progress",
    "unpriced",
]


class BucketComparison(_Record):
    """One bucket x model x provider identity of a provider report, against the ledger's
    attempts of the endpoints that identity maps to, started in that bucket (§3)."""

    bucket: str  # the bucket's start, "2026-11-30T14:00Z" (UTC)
    bucket_end: str
    model: str | None = None  # None: every model (the report is not grouped by model)
    endpoints: tuple[str, ...]
    project_id: str | None = None
    api_key_id: str | None = None
    workspace_id: str | None = None
    provider_usage: Usage | None = None  # usage reports
    provider_requests: NonNegInt | None = None  # OpenAI's num_model_requests
    provider_usd: Money | None = None  # a cost report's amount, or its usage at the prices
    ledger_attempts: NonNegInt = 0
    ledger_usage: Usage | None = None  # what the attempts of known usage reported
    ledger_usd: Money  # settled before this import
    held_unknown_usd: Money = Decimal(0)  # open unknown-usage holds, before this import
    settled_unknown_usd: Money = Decimal(0)  # settled from this bucket by this import
    unknown_settlements: NonNegInt = 0
    difference_input_tokens: int | None = None  # provider - ledger (known usage)
    difference_cached_input_tokens: int | None = None
    difference_output_tokens: int | None = None
    difference_usd: Money | None = None  # provider - (ledger + settled now)
    within_tolerance: bool
    status: ReportStatus


class UnattributedUsage(_Record):
    """Provider usage on a mapped identity that no attempt of the ledger explains."""

    bucket: str
    bucket_end: str
    model: str | None = None
    endpoints: tuple[str, ...]
    project_id: str | None = None
    api_key_id: str | None = None
    workspace_id: str | None = None
    input_tokens: NonNegInt = 0
    cached_input_tokens: NonNegInt = 0
    output_tokens: NonNegInt = 0
    requests: NonNegInt | None = None
    usd: Money | None = None  # None: no price for the model on these endpoints


class ReconciliationImported(Event):
    type: ClassVar[str] = "ReconciliationImported"

    reconciliation_id: Id
    provider: str | None = None  # the endpoint id reconciled; None: every endpoint
    workspace: Id | None = None  # the workspace reconciled; None: every workspace (admin)
    file_sha256: Sha256Hex
    lines: NonNegInt
    matched: tuple[ReconciliationLine, ...] = ()
    settled_unknown: tuple[ReconciliationLine, ...] = ()
    amount_mismatches: tuple[ReconciliationLine, ...] = ()
    unmatched_provider_lines: tuple[ReconciliationLine, ...] = ()
    unmatched_attempts: tuple[ReconciliationLine, ...] = ()
    overruns: tuple[ReconciliationLine, ...] = ()  # settled above the hold (BudgetOverrun)
    imported_by: Id
    # A provider report (§3): its format, its buckets against the ledger, what is not ours.
    report_format: Literal[
        "lines",
        "openai-usage",
        "openai-costs",
        "anthropic-usage",
        "anthropic-costs",
        "anthropic-analytics",
    ] = "lines"
    buckets: tuple[BucketComparison, ...] = ()
    unattributed_provider_usage: tuple[UnattributedUsage, ...] = ()
    notes: tuple[str, ...] = ()


class KeyCreated(Event):
    type: ClassVar[str] = "KeyCreated"

    key_id: Id
    workspace: Id
    role: Literal["client", "admin", "finance", "auditor"]
    secret_sha256: Sha256Hex  # the secret itself is never recorded
    created_by: str | None = None
    label: str | None = None
    # This key's own budget, overriding its workspace's key_budget (contract §6).
    budget_limit_usd: Money | None = None
    budget_window: Literal["day", "month", "total"] | None = None
    # The key's standing endpoint scope (contract §4 "Endpoint scope"): endpoint ids and
    # `provider:NAME` labels every request of the key is narrowed to. None: unrestricted.
    endpoints: tuple[str, ...] | None = Field(None, exclude_if=_absent)


class KeyRevoked(Event):
    type: ClassVar[str] = "KeyRevoked"

    key_id: Id
    revoked_by: str | None = None
    reason: str | None = None


class ConfigActivated(Event):
    type: ClassVar[str] = "ConfigActivated"

    generation: str
    config_sha256: Sha256Hex
    summary: dict[str, Any]  # the redacted config: ids, drivers, regions, mappings — no secret


Period = Annotated[str, Field(pattern=r"^[0-9]{4}-(0[1-9]|1[0-2])$")]
"""A calendar month, UTC: ``2026-11``."""


class PeriodTotal(_Record):
    """One workspace's spend in a closed period (the spend report's columns)."""

    workspace: str
    settled_usd: Money
    held_unknown_usd: Money
    overrun_usd: Money
    requests: NonNegInt
    attempts: NonNegInt


class PeriodClosed(Event):
    """A month's books closed (contract §6), on stream ``period-YYYY-MM``: the spend of the
    attempts reserved in it, per workspace, as the spend read model stood at ``position``.
    Nothing changes these totals afterwards; a later change is a ``PeriodAdjusted``."""

    type: ClassVar[str] = "PeriodClosed"

    period: Period
    position: NonNegInt  # the ledger position the totals include, and nothing after
    totals: tuple[PeriodTotal, ...]
    open_unknown: NonNegInt = 0  # unknown-usage settlements still open (--allow-open)
    closed_by: Id


class PeriodAdjusted(Event):
    """A change to an attempt of a closed period, recorded in the period open when it
    happened, appended with the event that made it (an unknown-usage settlement and its
    overrun). Not a book effect: the settlement beside it is. The deltas are what the
    attempt's spend row moved by."""

    type: ClassVar[str] = "PeriodAdjusted"

    period: Period  # the closed period the attempt belongs to (its reservation day)
    in_period: Period  # the period the adjustment is recorded in
    request_id: Id
    attempt_id: Id
    reservation_id: Id
    workspace: str
    cause: Literal["operator_settlement", "reconciliation"]
    settled_usd: Money  # delta, may be negative
    held_unknown_usd: Money
    overrun_usd: Money


class CheckpointTaken(Event):
    """A signed checkpoint of the ledger's Merkle tree was written to a sink outside the
    database (contract §7): kept here for reference only. What proves the history is the line
    in the sink, which the database's operator cannot rewrite; this event is a leaf of the
    next checkpoint like any other. The signing key is never recorded."""

    type: ClassVar[str] = "CheckpointTaken"

    size: Annotated[int, Field(ge=1)]  # the tree's size: positions 1 .. size
    root: Sha256Hex
    head_hash: Sha256Hex  # the hash chain's hash at position ``size``
    time: str  # as signed, e.g. "2026-05-01T12:00:00.123456Z"
    key_id: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]
    signature: Annotated[str, Field(pattern=r"^[0-9a-f]{128}$")]
    sink: str  # the sink directory it was written to


# --- the registry ---


CATALOGUE: Mapping[str, type[Event]] = {
    cls.type: cls
    for cls in (
        RequestReceived,
        RouteEvaluated,
        BudgetReserved,
        BudgetReservationDenied,
        RateLimitExceeded,
        AttemptStarted,
        StreamCommitted,
        AttemptFinished,
        FailoverDecided,
        BudgetSettled,
        BudgetReleased,
        BudgetOverrun,
        UnknownUsageOpened,
        UnknownUsageSettled,
        RequestCompleted,
        RequestFailed,
        BreakerTransitioned,
        EndpointDisabled,
        EndpointEnabled,
        ReconciliationImported,
        KeyCreated,
        KeyRevoked,
        ConfigActivated,
        PeriodClosed,
        PeriodAdjusted,
        CheckpointTaken,
    )
}

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]

UPCASTERS: Mapping[tuple[str, int], Upcaster] = {}
"""(type, old schema version) → function returning the payload at version + 1."""


class EventValidationError(ValueError):
    """An event that the catalogue refuses; nothing is written."""


class UnknownEventType(EventValidationError):
    def __init__(self, event_type: str) -> None:
        super().__init__(f"unknown event type {event_type!r}: not in the event catalogue")
        self.event_type = event_type


class InvalidEventPayload(EventValidationError):
    def __init__(self, event_type: str, error: ValidationError) -> None:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<payload>'}: {e['msg']}"
            for e in error.errors()
        )
        super().__init__(f"invalid {event_type} payload: {problems}")
        self.event_type = event_type


def type_names(*classes: type[Event]) -> frozenset[str]:
    """The stored type names of ``classes``: what a reader filters recorded events by."""
    return frozenset(cls.type for cls in classes)


def encode_event(event: Event) -> dict[str, Any]:
    """The JSON form of an event's data, as recorded and hashed."""
    cls = CATALOGUE.get(type(event).type)
    if cls is not type(event):
        raise UnknownEventType(type(event).type)
    return event.model_dump(mode="json")


def decode_event(event_type: str, schema_version: int, data: Mapping[str, Any]) -> Event:
    """Validate a payload against the catalogue, upcasting older schema versions first."""
    cls = CATALOGUE.get(event_type)
    if cls is None:
        raise UnknownEventType(event_type)
    payload = dict(data)
    version = schema_version
    while version < cls.schema_version:
        upcast = UPCASTERS.get((event_type, version))
        if upcast is None:
            raise EventValidationError(
                f"no upcaster for {event_type} schema version {version} → {version + 1}"
            )
        payload = upcast(payload)
        version += 1
    if version != cls.schema_version:
        raise EventValidationError(
            f"{event_type} schema version {schema_version} is newer than this code's "
            f"{cls.schema_version}"
        )
    try:
        return cls.model_validate(payload)
    except ValidationError as error:
        raise InvalidEventPayload(event_type, error) from None
