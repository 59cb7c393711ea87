"""The ledger's vocabulary and value records: what the events are made of.

Reason codes, failure classes and evidence (defined once: config validation, the OpenAPI
schema and the contract's tables derive from them), data classes, APIs and retention with
their ranks, the exact field types (money, rates, ids), and the frozen records events carry
(usage, requirements, candidates, account references, reconciliation lines). The event
types themselves, and their catalogue, are in ``ledger.events``.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable
from decimal import Decimal
from enum import StrEnum
from functools import partial
from typing import Annotated, Any, Final, Literal, Self, get_args

import orjson
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    model_validator,
)
from pydantic_core import PydanticUndefined

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
    # A hedge's evaluation under the group's `failover: on_grant` without the caller's grant
    # (X-Waybill-Allow-Failover: true): a second way may not go to another endpoint.
    FAILOVER_NOT_GRANTED = "failover_not_granted"


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


# The serializers and the ``exclude_if`` tests below are called by pydantic's serializer for
# every field they hold, each time an event is encoded: C callables, which it calls without a
# Python frame (bench/README.md, "Issue 44's levers": the events' encoding). The same
# results as ``format(d, "f")``, ``value is None`` and ``not value``.
_plain_decimal: Final[Callable[[Decimal], str]] = operator.methodcaller("__format__", "f")
"""A decimal as a plain string, never an exponent: ``format(d, "f")``."""

Money = Annotated[
    Decimal,
    BeforeValidator(_refuse_float),
    Field(allow_inf_nan=False),
    PlainSerializer(_plain_decimal, return_type=str, when_used="json"),
]
"""An exact amount of US dollars; serialized as a plain decimal string (no exponent)."""

EffectiveWeight = Annotated[
    Decimal,
    BeforeValidator(_refuse_float),
    Field(gt=0, allow_inf_nan=False),
    PlainSerializer(_plain_decimal, return_type=str, when_used="json"),
]
"""A mapping's weight as a ramp-up scales it: exact, > 0, a plain decimal string."""

NonNegInt = Annotated[int, Field(ge=0)]
Id = Annotated[str, Field(min_length=1, max_length=200)]
Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
# A key's name, as people call it (``KeyCreated.name``): shown in lists and the console, one
# line of printable text.
KeyName = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]+$")]


class Record(BaseModel):
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

    @classmethod
    def trusted(cls, /, **values: Any) -> Self:
        """The record ``cls(**values)`` would be, built without validating ``values``: for the
        records the gateway builds on every request from values already of their fields'
        types and bounds (its own ids, counts, config's values, other records), never from
        what a client, an upstream or the ledger sent. The same record field for field, in
        the same order, with the same fields given and so the same JSON, byte for byte
        (tests/ledger/test_trusted.py; tests/conftest.py checks every trusted record the
        in-process tests build against its validated twin). Validation is most of what
        building an event costs (bench/README.md, "Issue 44's levers": trusted records).
        A name ``cls`` does not have, or a required field left out, is a ``TypeError``."""
        form = _TRUSTED_FORMS.get(cls)
        if form is None:
            form = _TRUSTED_FORMS[cls] = _trusted_form(cls)
        defaults, required = form
        data = defaults.copy()
        data.update(values)  # the fields keep their order: validation's, the JSON's
        if len(data) != len(defaults) or not required <= values.keys():
            unknown = sorted(values.keys() - defaults.keys())
            missing = sorted(required - values.keys())
            raise TypeError(f"{cls.__name__}: unknown fields {unknown}, missing {missing}")
        names = tuple(values)
        given = _GIVEN_BY_NAMES.get(names)
        if given is None:
            given = _given(names)
        record = cls.__new__(cls)
        # What pydantic's validator sets on an instance, no more (model_construct does the
        # same, more slowly: bench/README.md).
        _setattr(record, "__dict__", data)
        _setattr(record, "__pydantic_fields_set__", given)
        _setattr(record, "__pydantic_extra__", None)
        _setattr(record, "__pydantic_private__", None)
        if CHECK_TRUSTED:
            difference = trusted_difference(record, cls(**values))
            if difference is not None:
                raise AssertionError(f"{cls.__name__} built trusted is not its twin: {difference}")
        return record


_setattr: Final = object.__setattr__

# WAYBILL_CHECK_TRUSTED=1: every record built trusted is built validated as well and must be
# the same (``trusted_difference``), at the cost of the validation trusted records save. The
# test suite sets it for the gateways it starts as processes of their own.
CHECK_TRUSTED = os.environ.get("WAYBILL_CHECK_TRUSTED") == "1"


def trusted_difference(fast: Record, validated: Record) -> str | None:
    """Where ``fast``, built by ``Record.trusted``, differs from ``validated``, built from the
    same values by validation (None: nowhere): the class, the fields in order holding equal
    values of the same types (a list is not a tuple, a str not an enum), the fields given,
    pydantic's own attributes, and the JSON, byte for byte, as recorded and hashed."""
    if type(fast) is not type(validated):
        return f"a {type(fast).__name__} against a {type(validated).__name__}"
    if list(fast.__dict__) != list(validated.__dict__):
        return f"fields {list(fast.__dict__)} against {list(validated.__dict__)}"
    for name, value in validated.__dict__.items():
        mine = fast.__dict__[name]
        if type(mine) is not type(value) or mine != value:
            return f"{name}: {mine!r} against {value!r}"
    if fast.model_fields_set != validated.model_fields_set:
        given, expected = sorted(fast.model_fields_set), sorted(validated.model_fields_set)
        return f"fields given {given} against {expected}"
    for record in (fast, validated):
        if record.__pydantic_extra__ is not None or record.__pydantic_private__ is not None:
            return "pydantic's extra or private values"
    if fast != validated:
        return f"{fast!r} against {validated!r}"
    if orjson.dumps(fast.model_dump(mode="json")) != orjson.dumps(
        validated.model_dump(mode="json")
    ):
        return "its JSON"
    return None


_FIELDS_GIVEN: dict[tuple[str, ...], set[str]] = {}
_MAX_FIELDS_GIVEN: Final = 4096
_TRUSTED_FORMS: dict[type[Record], tuple[dict[str, Any], frozenset[str]]] = {}
# The set of fields given, by the names as ``Record.trusted`` was given them (a call site
# gives the same names in the same order every time): one of ``_FIELDS_GIVEN``'s sets.
_GIVEN_BY_NAMES: dict[tuple[str, ...], set[str]] = {}


def _trusted_form(cls: type[Record]) -> tuple[dict[str, Any], frozenset[str]]:
    """Every field of ``cls`` in order with its default (required ones: None, to be given),
    and the required ones. Only for a record whose validation checks types and bounds and
    nothing else: no validator of its own, and defaults that validation would not copy."""
    decorators = cls.__pydantic_decorators__
    if decorators.model_validators or decorators.field_validators:
        raise TypeError(f"{cls.__name__} has validators of its own: build it validated")
    defaults: dict[str, Any] = {}
    required = set()
    for name, info in cls.model_fields.items():
        if info.default_factory is not None:
            raise TypeError(f"{cls.__name__}.{name} has a default factory")
        if info.default is PydanticUndefined:
            required.add(name)
            defaults[name] = None
        else:
            hash(info.default)  # pydantic copies an unhashable (mutable) default: refuse it
            defaults[name] = info.default
    return defaults, frozenset(required)


def _given(names: tuple[str, ...]) -> set[str]:
    """The shared set of fields given for ``names`` (see ``Record.model_post_init``)."""
    given = set(names)
    if len(_FIELDS_GIVEN) >= _MAX_FIELDS_GIVEN or len(_GIVEN_BY_NAMES) >= _MAX_FIELDS_GIVEN:
        return given
    given = _FIELDS_GIVEN.setdefault(tuple(given), given)
    _GIVEN_BY_NAMES[names] = given
    return given


# --- value objects shared by several events ---


class KeyLimits(Record):
    """One key's own rate limits (``KeyCreated.limits``), in aligned one-minute windows as a
    workspace's ``key_limits`` (contract §2), which they override for that key."""

    requests_per_minute: Annotated[int, Field(gt=0)] | None = None
    tokens_per_minute: Annotated[int, Field(gt=0)] | None = None

    @model_validator(mode="after")
    def _some_limit(self) -> KeyLimits:
        if self.requests_per_minute is None and self.tokens_per_minute is None:
            raise ValueError("set requests_per_minute, tokens_per_minute or both")
        return self


absent: Final[Callable[[object], bool]] = partial(operator.is_, None)
"""A field added with the default None, left out of the recorded form while None (where
an empty value means something else than an absent one): ``value is None``, as a C callable
(see ``_plain_decimal``)."""

nothing: Final[Callable[[object], bool]] = operator.not_
"""A field added with a default that is left out of the recorded form while it holds that
default (0, empty), so events that do not use it keep their bytes: ``not value``."""


class Usage(Record):
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
    cache_write_input_tokens: NonNegInt = Field(0, exclude_if=nothing)
    cache_write_1h_input_tokens: NonNegInt = Field(0, exclude_if=nothing)
    audio_input_tokens: NonNegInt = 0  # of input_tokens (prompt_tokens_details.audio_tokens)
    audio_output_tokens: NonNegInt = 0  # of output_tokens (completion_tokens_details.audio_tokens)
    # Billed per search, and no provider reports them in usage: the gateway counts one per
    # choice of a request that asked for web search, the unit its price is given in.
    web_searches: NonNegInt = 0


class Requirements(Record):
    """What a request needs from an endpoint, inferred from its body and headers."""

    kind: str = "chat"
    capabilities: tuple[str, ...] = ()
    regions: tuple[str, ...] | None = None  # None: the workspace's regions apply unnarrowed
    data_class: DataClass = "internal"
    # The most an endpoint may keep of the request (RETENTION_PATTERN): the workspace's
    # bound, narrowed by X-Waybill-Retention. None: no bound.
    retention: Annotated[str, Field(pattern=f"^(?:{RETENTION_PATTERN})$")] | None = Field(
        None, exclude_if=nothing
    )
    estimated_input_tokens: NonNegInt = 0  # text: the prompt's bytes bound its tokens
    # Embeddings: the longest input's bound. Each input is embedded alone, so it, not the
    # batch, must fit a mapping's context window.
    largest_input_tokens: NonNegInt = Field(0, exclude_if=nothing)
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
    cache_writes: tuple[Literal["5m", "1h"], ...] = Field((), exclude_if=nothing)
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
    failover_granted: bool = Field(False, exclude_if=nothing)
    # The body asks the provider for effects of its own (server-side tools, web search):
    # the request is strict whatever its model group's policy.
    server_side_effects: bool = False
    # The upstream dialect the body arrived in ("anthropic" through the Anthropic door): an
    # endpoint of that dialect is sent the body as it came, every content part in it. None:
    # the canonical chat body (router/request/call.py).
    native: str | None = Field(None, exclude_if=nothing)
    # (upstream dialect, feature) for each dialect that cannot carry a feature the request
    # needs (thinking, documents, a beta field): its endpoints are excluded
    # `dialect_unsupported` (router/doors/messages.py says which feature where).
    unsupported: tuple[tuple[str, str], ...] = Field((), exclude_if=nothing)
    # The caller's endpoint scope (contract §4 "Endpoint scope"): endpoint ids and
    # `provider:NAME` labels as X-Waybill-Endpoints named them, and as the key's standing
    # scope names them; each None: not narrowed that way (an empty one narrows to nothing,
    # so only None is left out of the recorded form). Labels are expanded within the model
    # group when the request is routed, so the record keeps what was asked.
    endpoints: tuple[str, ...] | None = Field(None, exclude_if=absent)
    key_endpoints: tuple[str, ...] | None = Field(None, exclude_if=absent)
    # X-Waybill-Prefer-Endpoint: a preference the router may overrule.
    prefer_endpoint: str | None = Field(None, exclude_if=absent)
    # X-Waybill-Require-Endpoint: the request is pinned there (`require_target`), no other
    # endpoint is ever tried.
    require_endpoint: str | None = Field(None, exclude_if=absent)
    # The endpoint that holds the provider-side state the request continues (the response a
    # Responses previous_response_id names, found in the ledger): every other candidate is
    # excluded `response_affinity`. None: any endpoint.
    affinity_endpoint: str | None = Field(None, exclude_if=nothing)


class Candidate(Record):
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
    # The weight selection ranked it by while a breaker of its endpoint or mapping ramps up
    # after closing (contract §5 "Circuit breakers", ramp_up_ms): below ``weight``, exact to
    # a thousandth. Left out at full weight, so evaluations without a ramp keep their bytes.
    effective_weight: EffectiveWeight | None = Field(None, exclude_if=absent)


class RouteChoice(Record):
    endpoint: Id
    model: Id
    mapping_index: NonNegInt
    tier: NonNegInt
    weight: Annotated[int, Field(gt=0)]
    selection_position: NonNegInt  # position in the tier's smooth weighted round-robin
    # Chosen as the caller's X-Waybill-Prefer-Endpoint, ahead of tier and strategy (the
    # round-robin was not consulted: selection_position is 0). Left out while False.
    preferred: bool = Field(False, exclude_if=nothing)


class AccountRef(Record):
    """A budget account touched by a reservation, with the window it was charged to."""

    account_id: Id  # e.g. "workspace:acme:2026-11", "key:k_123:2026-11-30", "request:r_1"
    kind: Literal["request", "key", "workspace"]
    window_start: str | None = None  # ISO date of the window's first day (UTC); None: total
    limit_usd: Money


# --- value records carried by single events ---


class Timeouts(Record):
    """An attempt's timeouts as in force (contract §2 `defaults` and an endpoint's
    `timeouts:`), in milliseconds."""

    attempt_timeout_ms: Annotated[int, Field(gt=0)]
    first_token_timeout_ms: Annotated[int, Field(gt=0)]
    stream_idle_timeout_ms: Annotated[int, Field(gt=0)]


Rate = Annotated[
    Decimal,
    BeforeValidator(_refuse_float),
    Field(ge=0, le=1, allow_inf_nan=False),
    PlainSerializer(_plain_decimal, return_type=str, when_used="json"),
]
"""A share of calls, 0 to 1, exact (a decimal string, like money), e.g. ``"0.5000"``."""


class ReconciliationLine(Record):
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


class BucketComparison(Record):
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


class UnattributedUsage(Record):
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


Period = Annotated[str, Field(pattern=r"^[0-9]{4}-(0[1-9]|1[0-2])$")]
"""A calendar month, UTC: ``2026-11``."""


class PeriodTotal(Record):
    """One workspace's spend in a closed period (the spend report's columns)."""

    workspace: str
    settled_usd: Money
    held_unknown_usd: Money
    overrun_usd: Money
    requests: NonNegInt
    attempts: NonNegInt
