"""The event catalogue: every fact Waybill records, in one place.

Each event type is a frozen pydantic model with a past-tense name, a schema version and
exactly the fields it carries; anything else is refused before it can reach the store. The
events a request records are built by the gateway from its own typed values without
validating them again (``Record.trusted``: the same record, held to it by the tests).
The catalogue follows contract §7. Rules that hold for every type:

- no prompt or completion text and no secret, ever: prompts appear as a hash and sizes;
- money is an exact ``Decimal`` (serialized as a plain decimal string, never a float);
- durations are integer milliseconds; instants are the store's ``recorded_at`` unless a
  field says otherwise;
- reason codes, failure classes and evidence use the vocabularies defined once in
  ``ledger.values``, with the value records events carry (re-exported here).

Changing a type's fields means a new ``schema_version`` and an upcaster in ``UPCASTERS``
that turns the old payload into the new one, so that old events keep their meaning. A
new field needs none when its default is what every older event meant (``RequestReceived.api``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Final, Literal

from pydantic import AwareDatetime, Field, ValidationError

from ledger.codec import (
    UPCASTERS,
    EventValidationError,
    InvalidEventPayload,
    UnknownEventType,
    upcast,
)
from ledger.codec import (
    Upcaster as Upcaster,
)
from ledger.values import (
    APIS,
    DATA_CLASSES,
    RETENTION_PATTERN,
    AccountRef,
    Api,
    BucketComparison,
    Candidate,
    DataClass,
    Evidence,
    FailureClass,
    KeyLimits,
    KeyName,
    Money,
    PeriodTotal,
    Rate,
    ReasonCode,
    Record,
    Requirements,
    RouteChoice,
    Timeouts,
    UnattributedUsage,
    Usage,
    absent,
    data_class_rank,
    nothing,
    retention_rank,
)
from ledger.values import (
    Id as Id,
)
from ledger.values import (
    NonNegInt as NonNegInt,
)
from ledger.values import (
    Period as Period,
)
from ledger.values import (
    ReconciliationLine as ReconciliationLine,
)
from ledger.values import (
    ReportStatus as ReportStatus,
)
from ledger.values import (
    Sha256Hex as Sha256Hex,
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
    "KeyLimits",
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


# --- the events ---


class Event(Record):
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
    timeouts: Timeouts | None = Field(None, exclude_if=nothing)


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
    """A key made (contract §3 "Keys"), on stream ``key-<id>``. Schema 2 calls the key's name
    ``name`` (schema 1 said ``label``; its upcaster renames it) and adds ``expires_at`` and
    ``limits``, left out of the recorded form while absent."""

    type: ClassVar[str] = "KeyCreated"
    schema_version: ClassVar[int] = 2

    key_id: Id
    workspace: Id
    role: Literal["client", "admin", "finance", "auditor"]
    secret_sha256: Sha256Hex  # the secret itself is never recorded
    created_by: str | None = None  # the actor: the admin key's id, or "cli"
    name: KeyName | None = None  # what people call the key; None: a key made without one
    # From this instant on the key is refused as a revoked one is; None: it never expires.
    expires_at: AwareDatetime | None = Field(None, exclude_if=absent)
    # This key's own rate limits, overriding its workspace's key_limits (contract §2).
    limits: KeyLimits | None = Field(None, exclude_if=absent)
    # This key's own budget, overriding its workspace's key_budget (contract §6).
    budget_limit_usd: Money | None = None
    budget_window: Literal["day", "month", "total"] | None = None
    # The key's standing endpoint scope (contract §4 "Endpoint scope"): endpoint ids and
    # `provider:NAME` labels every request of the key is narrowed to. None: unrestricted.
    endpoints: tuple[str, ...] | None = Field(None, exclude_if=absent)


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


def type_names(*classes: type[Event]) -> frozenset[str]:
    """The stored type names of ``classes``: what a reader filters recorded events by."""
    return frozenset(cls.type for cls in classes)


def encode_event(event: Event) -> dict[str, Any]:
    """The JSON form of an event's data, as recorded and hashed."""
    cls = CATALOGUE.get(type(event).type)
    if cls is not type(event):
        raise UnknownEventType(type(event).type)
    # The model's serializer itself: ``model_dump`` is this call behind a Python wrapper
    # that sorts out a dozen keyword arguments, a fifth of the cost on the append path
    # (bench/README.md, "Decisions": the events' encoding).
    result: dict[str, Any] = cls.__pydantic_serializer__.to_python(event, mode="json")
    return result


def decode_event(event_type: str, schema_version: int, data: Mapping[str, Any]) -> Event:
    """Validate a payload against the catalogue, upcasting older schema versions first."""
    cls = CATALOGUE.get(event_type)
    if cls is None:
        raise UnknownEventType(event_type)
    payload = upcast(event_type, schema_version, cls.schema_version, data)
    try:
        return cls.model_validate(payload)
    except ValidationError as error:
        raise InvalidEventPayload(event_type, error) from None
