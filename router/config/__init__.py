"""The gateway's config (contract §2): one YAML file parsed once into frozen, validated objects.

Everything is checked at start-up, and every problem is reported at once as a `ConfigError`
whose lines read `models[0].mappings[1].weight: must be > 0`. Nothing downstream reads raw
dicts: routing, drivers and the ledger see only the typed objects defined here.

Secrets enter only as `${env:NAME}` references, resolved at load time into `SecretStr`, so
no repr, dump, log line or ledger event can carry them (contract §2, §7). Money is `Decimal`.
"""

from __future__ import annotations

import collections.abc as cabc
import functools
import hashlib
import itertools
import os
import re
from datetime import UTC, date, datetime
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal, TypeAlias, TypeVar
from urllib.parse import urlsplit

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

from ledger.audit.checkpoints import KeyFileError, SigningKey, load_signing_key
from ledger.events import RETENTION_PATTERN, DataClass, FailureClass, data_class_rank
from router.adapters.breaker_policy import RATE_SCALE, TIME_BUCKETS, BreakerSettings
from router.config import egress

__all__ = [
    "FAILURE_CLASSES",
    "KNOWN_CAPABILITIES",
    "MAX_POOL_DEPTH",
    "MAX_WINDOW_CALLS",
    "Breaker",
    "Budget",
    "BudgetWindow",
    "Checkpoints",
    "Config",
    "ConfigError",
    "Defaults",
    "Driver",
    "Endpoint",
    "Hedge",
    "Limits",
    "Mapping",
    "ModelGroup",
    "Otel",
    "OutputPrice",
    "PartPrice",
    "Pool",
    "Price",
    "Proxy",
    "RateLimits",
    "ResumeMode",
    "RetryRule",
    "RetrySameEndpoint",
    "SearchPrice",
    "Strategy",
    "Workspace",
    "load_config",
    "parse_config",
    "parse_config_file",
    "read_config_file",
]

Driver = Literal["openai", "anthropic"]
BudgetWindow = Literal["day", "month", "total"]
# How a mapping's upstream continues a partial assistant message: not at all; a trailing
# assistant message it continues natively (Anthropic); a `prefix: true` flag on that message
# (DeepSeek, Mistral); `continue_final_message` in the body (vLLM).
ResumeMode = Literal["none", "assistant_prefill", "prefix_flag", "continue_final_message"]
"""How a mapping's upstream continues a partial assistant message (contract §5, "Resume")."""
# The two conventions of OpenAI-compatible servers: an Anthropic endpoint knows neither.
_OPENAI_WIRE_RESUME: frozenset[str] = frozenset({"prefix_flag", "continue_final_message"})

# `retry_same_endpoint` takes exactly the failure classes of contract §5, as the classifier
# names them (its fields are made from the enum below).
FAILURE_CLASSES: tuple[str, ...] = tuple(c.value for c in FailureClass)

# Capabilities inferred from a request body. Other lowercase tokens are accepted too, because
# clients may require extra ones through `X-Waybill-Capabilities` (contract §3).
KNOWN_CAPABILITIES: frozenset[str] = frozenset(
    {"text", "stream", "tools", "json_schema", "vision", "responses"}
)

_Sized = TypeVar("_Sized", bound=cabc.Sized)

_ENV_REF = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}")
# A proxy URL's userinfo: `${env:USER}:${env:PASSWORD}`, or one reference holding `user:password`.
_CREDENTIAL_REFS = re.compile(
    r"\$\{env:(?P<user>[A-Za-z_][A-Za-z0-9_]*)\}(?::\$\{env:(?P<password>[A-Za-z_][A-Za-z0-9_]*)\})?"
)
_CAPABILITY = re.compile(r"[a-z][a-z0-9_.-]*")


class ConfigError(Exception):
    """A config that cannot be used; `errors` holds every `(path, message)` found."""

    def __init__(self, errors: cabc.Iterable[tuple[str, str]]) -> None:
        self.errors: tuple[tuple[str, str], ...] = tuple(errors)
        super().__init__("\n".join(f"{path}: {message}" for path, message in self.errors))


# --- field types -------------------------------------------------------------------------


def _error(message: str) -> PydanticCustomError:
    return PydanticCustomError("config", message)


def _check_name(value: str) -> str:
    if not value or any(ch.isspace() for ch in value):
        raise _error("must be a non-empty name without spaces")
    return value


def _check_capability(value: str) -> str:
    if not _CAPABILITY.fullmatch(value):
        raise _error("must be a lowercase capability token such as 'vision'")
    return value


def _non_empty(value: _Sized) -> _Sized:
    # An AfterValidator, not Field(min_length=1): pydantic would also report a list whose
    # only item is invalid as "too short", doubling that item's error.
    if not value:
        raise _error("must not be empty")
    return value


def _to_money(value: object) -> Decimal:
    # Via str(): the float 0.15 becomes Decimal('0.15'), not 0.1499999999999999944...
    if isinstance(value, bool) or not isinstance(value, int | float | str | Decimal):
        raise _error("must be a number")
    try:
        money = Decimal(str(value).strip())
    except InvalidOperation:
        raise _error("must be a number") from None
    if not money.is_finite():
        raise _error("must be a finite number")
    if money < 0:
        raise _error("must be >= 0")
    return money


_Name = Annotated[StrictStr, AfterValidator(_check_name)]
_Capability = Annotated[StrictStr, AfterValidator(_check_capability)]
_Money = Annotated[Decimal, BeforeValidator(_to_money)]
_PositiveInt = Annotated[StrictInt, Field(gt=0)]


_RETENTION = re.compile(RETENTION_PATTERN)


def _check_retention(value: str) -> str:
    if _RETENTION.fullmatch(value) is None:
        raise _error("must be none, zero or a number of days such as 30d (1d to 99999d)")
    return value


# What a provider keeps of a request, or a bound on it (contract §2 `retention`).
_Retention = Annotated[StrictStr, AfterValidator(_check_retention)]
_NonNegativeInt = Annotated[StrictInt, Field(ge=0)]
_NonEmpty = AfterValidator(_non_empty)


def _environ(info: ValidationInfo) -> cabc.Mapping[str, str]:
    context = info.context
    if isinstance(context, dict) and context.get("environ") is not None:
        environ: cabc.Mapping[str, str] = context["environ"]
        return environ
    return os.environ


def _resolve_env(name: str, environ: cabc.Mapping[str, str]) -> str:
    value = environ.get(name)
    if value is None:
        raise _error(f"unresolvable ${{env:{name}}}: environment variable '{name}' is not set")
    if not value:
        raise _error(f"unresolvable ${{env:{name}}}: environment variable '{name}' is empty")
    return value


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# --- defaults ----------------------------------------------------------------------------


class RetryRule(_Frozen):
    """How often one failure class may retry the same endpoint (contract §4)."""

    max: _NonNegativeInt = 0
    backoff_ms: tuple[_NonNegativeInt, _NonNegativeInt] = (100, 500)  # jittered between the two
    max_retry_after_ms: _NonNegativeInt = 5000  # a longer Retry-After is not waited for

    @field_validator("backoff_ms")
    @classmethod
    def _ordered(cls, value: tuple[int, int]) -> tuple[int, int]:
        if value[0] > value[1]:
            raise _error("must be [lo, hi] with lo <= hi")
        return value


class _RetryRules(_Frozen):
    """`defaults.retry_same_endpoint`: a rule for each failure class of contract §5."""

    def rule(self, failure_class: FailureClass) -> RetryRule:
        rule: RetryRule = getattr(self, failure_class.value)
        return rule


# A class left out of the file is never retried in place, except these, retried once.
_RETRIED_ONCE: frozenset[FailureClass] = frozenset(
    {FailureClass.RATE_LIMITED, FailureClass.UPSTREAM_UNAVAILABLE}
)

# The model is made from the enum, so the file accepts exactly the classes the classifier
# names, in their order, and an unknown one is refused as an unknown key (`_message`).
if TYPE_CHECKING:
    RetrySameEndpoint = _RetryRules
else:
    RetrySameEndpoint = create_model(
        "RetrySameEndpoint",
        __doc__=_RetryRules.__doc__,
        __base__=_RetryRules,
        __module__=__name__,
        **{
            c.value: (RetryRule, RetryRule(max=1 if c in _RETRIED_ONCE else 0))
            for c in FailureClass
        },
    )


def _to_rate(value: object) -> Decimal:
    # A share of the calls in a breaker's window, exact to 1/10,000 so that the breakers
    # compare whole numbers (router/adapters/breaker_policy.py), in Python and in Redis alike.
    rate = _to_money(value)
    if not 0 < rate <= 1:
        raise _error("must be > 0 and <= 1")
    if rate != rate.quantize(Decimal("0.0001")):
        raise _error("must have at most 4 decimal places")
    return rate


_Rate = Annotated[Decimal, BeforeValidator(_to_rate)]

MAX_WINDOW_CALLS = 1000
"""The largest count-based window: every call a breaker hears of walks it once."""

_ROLLING_KEYS = (
    "window_calls",
    "window_ms",
    "minimum_calls",
    "failure_rate",
    "slow_call_ms",
    "slow_call_rate",
)
_POLICY_KEYS: dict[str, tuple[str, ...]] = {
    "consecutive": ("failure_threshold",),
    "rolling": _ROLLING_KEYS,
}
"""The keys that mean something under one policy alone (the cool-downs serve both)."""
_OTHER_WINDOW = {"window_calls": "window_ms", "window_ms": "window_calls"}


class Breaker(_Frozen):
    """Contract §5 "Circuit breakers": when a closed breaker opens, and its cool-downs.

    ``consecutive`` opens after ``failure_threshold`` failures in a row; ``rolling`` opens
    when, over a window of the last ``window_calls`` calls or the last ``window_ms``, at
    least ``minimum_calls`` were heard of and ``failure_rate`` of them failed or
    ``slow_call_rate`` of them took ``slow_call_ms`` or longer. Each policy's keys are
    refused under the other. :meth:`settings` gives the effective values as plain numbers.
    """

    policy: Literal["consecutive", "rolling"] = "consecutive"
    failure_threshold: _PositiveInt = 2
    base_cooldown_ms: _PositiveInt = 5000
    max_cooldown_ms: _PositiveInt = 30000
    window_calls: Annotated[StrictInt, Field(gt=0, le=MAX_WINDOW_CALLS)] = 20
    window_ms: Annotated[StrictInt, Field(ge=1000)] | None = None
    minimum_calls: _PositiveInt | None = None  # 10, or window_calls if fewer
    failure_rate: _Rate = Decimal("0.5")
    slow_call_ms: _PositiveInt | None = None  # None: no call is slow
    slow_call_rate: _Rate = Decimal(1)

    @model_validator(mode="after")
    def _cooldowns_ordered(self) -> Breaker:
        if self.base_cooldown_ms > self.max_cooldown_ms:
            raise _error("base_cooldown_ms must be <= max_cooldown_ms")
        return self

    @model_validator(mode="after")
    def _keys_of_its_policy(self) -> Breaker:
        given = self.model_fields_set
        if self.policy == "consecutive":
            foreign = [key for key in _ROLLING_KEYS if key in given]
            if foreign:
                raise _error(f"{', '.join(foreign)}: only with policy: rolling")
            return self
        if "failure_threshold" in given:
            raise _error(
                "failure_threshold counts failures in a row (policy: consecutive); "
                "policy rolling opens at failure_rate"
            )
        if "window_calls" in given and "window_ms" in given:
            raise _error("give window_calls or window_ms, not both")
        if self.window_ms is not None and self.window_ms % TIME_BUCKETS:
            raise _error(f"window_ms must be a multiple of {TIME_BUCKETS}")
        if self.window_ms is None and (self.minimum_calls or 0) > self.window_calls:
            raise _error("minimum_calls must be <= window_calls: the window holds no more")
        if "slow_call_rate" in given and self.slow_call_ms is None:
            raise _error("slow_call_rate needs slow_call_ms: which calls are slow")
        return self

    def settings(self) -> BreakerSettings:
        """The effective values, as the breakers read them."""
        rolling = self.policy == "rolling"
        count = rolling and self.window_ms is None
        minimum = self.minimum_calls or (min(10, self.window_calls) if count else 10)
        return BreakerSettings(
            policy=self.policy,
            failure_threshold=self.failure_threshold,
            base_cooldown_ms=self.base_cooldown_ms,
            max_cooldown_ms=self.max_cooldown_ms,
            window_calls=self.window_calls if count else None,
            window_ms=self.window_ms if rolling else None,
            minimum_calls=minimum,
            failure_rate=int(self.failure_rate * RATE_SCALE),
            slow_call_ms=self.slow_call_ms if rolling else None,
            slow_call_rate=int(self.slow_call_rate * RATE_SCALE),
        )

    def summary(self) -> dict[str, Any]:
        """What ``ConfigActivated`` records: the effective values of the policy in force (a
        consecutive breaker's three keys alone, so a config that names no policy keeps its
        summary, and its ConfigActivated is not recorded again)."""
        if self.policy == "consecutive":
            return {
                "failure_threshold": self.failure_threshold,
                "base_cooldown_ms": self.base_cooldown_ms,
                "max_cooldown_ms": self.max_cooldown_ms,
            }
        settings = self.settings()
        summary: dict[str, Any] = {
            "policy": "rolling",
            "base_cooldown_ms": self.base_cooldown_ms,
            "max_cooldown_ms": self.max_cooldown_ms,
        }
        if settings.window_ms is not None:
            summary["window_ms"] = settings.window_ms
        else:
            summary["window_calls"] = settings.window_calls
        summary["minimum_calls"] = settings.minimum_calls
        summary["failure_rate"] = str(self.failure_rate)
        if self.slow_call_ms is not None:
            summary["slow_call_ms"] = self.slow_call_ms
            summary["slow_call_rate"] = str(self.slow_call_rate)
        return summary


class Hedge(_Frozen):
    """Hedged requests (contract §5 "Hedging"): a second way to the next failover candidate
    when the first has not answered after ``after_ms`` (its first content, for a stream)."""

    enabled: StrictBool = False
    after_ms: _PositiveInt = 2000
    # Instead of after_ms: after the group's observed p95 time to first byte.
    after_p95: StrictBool = False
    max_ways: Annotated[StrictInt, Field(ge=2)] = 2


class Defaults(_Frozen):
    """How one request walks its model group (contract §2 `defaults`, §4): a model group's
    `policy:` is read into one of these too, its keys laid over `defaults`."""

    max_attempts: _PositiveInt = 4
    deadline_ms: _PositiveInt = 60000
    attempt_timeout_ms: _PositiveInt = 30000
    first_token_timeout_ms: _PositiveInt = 10000
    stream_idle_timeout_ms: _PositiveInt = 15000
    retry_same_endpoint: RetrySameEndpoint = RetrySameEndpoint()
    breaker: Breaker = Breaker()
    on_credentials_error: Literal["stop", "failover"] = "stop"
    on_unknown_execution: Literal["failover", "stop"] = "failover"
    # A buffered answer that breaks the shape the request demanded (contract §5 "Output
    # validation"): another mapping answers, or the client gets it as it is.
    on_invalid_output: Literal["failover", "return"] = "failover"
    hedge: Hedge = Hedge()
    # Failover as an approved policy (contract §4 "Failover on grant"): `on_grant` moves to
    # another endpoint only when the request carries X-Waybill-Allow-Failover: true.
    failover: Literal["allowed", "on_grant"] = "allowed"
    # Quota failover as an approved policy (contract §4 "Quota failover"): a provider's
    # insufficient_quota stops (the default), or fails over to another provider account.
    on_quota_exhausted: Literal["stop", "failover"] = "stop"


# --- endpoints, model groups, workspaces ---------------------------------------------------


class EndpointTimeouts(_Frozen):
    """An endpoint's own timeouts (contract §2 `endpoints[].timeouts`): the timeout keys of
    `defaults`, each given laid over the model group's policy for attempts on the endpoint."""

    attempt_timeout_ms: _PositiveInt | None = None
    first_token_timeout_ms: _PositiveInt | None = None
    stream_idle_timeout_ms: _PositiveInt | None = None

    def over(self, policy: Defaults) -> Defaults:
        """``policy`` with each key this block gives replaced, the others kept."""
        return policy.model_copy(update=self.model_dump(exclude_none=True))


class Proxy(_Frozen):
    """The HTTP proxy an endpoint's connections are tunnelled through (CONNECT)."""

    host: StrictStr
    port: StrictInt
    username: SecretStr | None = None
    password: SecretStr | None = None
    source: Literal["config", "environment"]  # the endpoint's `proxy:`, or HTTPS_PROXY & co.

    @property
    def address(self) -> str:
        """Host and port only: what may be recorded and shown."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


# The default of an endpoint's `proxy`: whatever the standard environment variables say.
_PROXY_FROM_ENVIRONMENT = "environment"


class Endpoint(_Frozen):
    id: _Name
    driver: Driver
    base_url: StrictStr
    # Omitted for upstreams without auth; otherwise only ever a ${env:NAME} reference.
    api_key: SecretStr | None = None
    region: _Name
    data_classes: Annotated[frozenset[DataClass], _NonEmpty]
    trust_not_started: StrictBool = False
    enabled: StrictBool = True
    # At most this many attempts in flight to the endpoint at once (per process, or across
    # replicas through Redis when configured); a saturated endpoint is excluded. None: no limit.
    max_in_flight: _PositiveInt | None = None
    max_response_bytes: _PositiveInt = 8 * 1024 * 1024
    # What its provider keeps of a request (none, zero, <days>d). None: not declared, which
    # satisfies no workspace's or request's retention bound.
    retention: _Retention | None = None
    anthropic_version: StrictStr | None = None  # the driver's default when omitted
    # Resolved at load: `environment` (the default) follows HTTPS_PROXY / HTTP_PROXY and
    # NO_PROXY for base_url; a URL names the proxy; `none` is always direct. None: direct.
    proxy: Proxy | None = Field(default=_PROXY_FROM_ENVIRONMENT, validate_default=True)
    # The endpoint as its provider's usage and cost reports name it (contract §3
    # "Reconciliation"): OpenAI's project and API key ids, Anthropic's workspace and key ids.
    provider_project_id: _Name | None = None
    provider_api_key_id: _Name | None = None
    provider_workspace_id: _Name | None = None
    # The provider's admin key, for `waybill reconcile fetch`: only a ${env:NAME} reference.
    admin_api_key: SecretStr | None = None
    # Where the admin API is, in base_url's form for the driver (default: base_url).
    admin_base_url: StrictStr | None = None
    # Laid over the model group's policy for its attempts, key by key. None: the policy's.
    timeouts: EndpointTimeouts | None = None
    # Its breakers' settings (its own and its mappings'), when it has a `breaker:` block:
    # `Config` lays the block's keys over `defaults.breaker` before this is validated (see
    # Config._breakers_over_defaults). None: `defaults.breaker` as it is.
    breaker: Breaker | None = None

    @field_validator("api_key", "admin_api_key", mode="before")
    @classmethod
    def _api_key_by_reference(cls, value: object, info: ValidationInfo) -> object:
        if value is None:
            return None
        # The message never echoes the value: it may be a pasted secret.
        match = _ENV_REF.fullmatch(value) if isinstance(value, str) else None
        if match is None:
            raise _error("must be a ${env:NAME} reference, never a literal secret")
        return _resolve_env(match.group(1), _environ(info))

    @field_validator("base_url", "admin_base_url", mode="before")
    @classmethod
    def _base_url_references(cls, value: object, info: ValidationInfo) -> object:
        if not isinstance(value, str):
            return value
        environ = _environ(info)
        return _ENV_REF.sub(lambda m: _resolve_env(m.group(1), environ), value)

    @field_validator("base_url", "admin_base_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise _error("must be an http:// or https:// URL")
        if parts.username is not None or parts.password is not None:
            raise _error("must not embed credentials; use api_key")
        return value

    @field_validator("proxy", mode="before")
    @classmethod
    def _resolve_proxy(cls, value: object, info: ValidationInfo) -> object:
        if isinstance(value, Proxy):
            return value
        if value == "none":
            return None
        environ = _environ(info)
        if value == _PROXY_FROM_ENVIRONMENT:
            base_url = info.data.get("base_url")
            if not isinstance(base_url, str):
                return None  # base_url's own error is reported
            return _environment_proxy(base_url, environ)
        if not isinstance(value, str):
            raise _error(
                "must be a proxy URL such as http://proxy.example:3128, none or environment"
            )
        return _configured_proxy(value, environ)

    @model_validator(mode="after")
    def _identity_of_its_provider(self) -> Endpoint:
        # Each provider's reports name its own kinds of id: a key the driver's provider has
        # not would never match a report.
        wrong = "provider_workspace_id" if self.driver == "openai" else "provider_project_id"
        if getattr(self, wrong) is not None:
            raise _error(f"{wrong} is not an id {self.driver} reports name")
        return self

    @property
    def admin_url(self) -> str:
        """The base of the provider's admin API (usage and cost reports)."""
        return (self.admin_base_url or self.base_url).rstrip("/")

    @property
    def base_url_host(self) -> str:
        """Host and port only: what may be recorded and shown."""
        parts = urlsplit(self.base_url)
        host = parts.hostname or ""
        return f"{host}:{parts.port}" if parts.port else host

    @functools.cached_property
    def account(self) -> str:
        """The provider account whose balance the endpoint draws on (contract §4 "Quota
        failover"): its driver, host and port, and API key, as a digest (the key is never
        kept in the clear). Endpoints that share all three run out of quota together."""
        key = "" if self.api_key is None else self.api_key.get_secret_value()
        identity = "\0".join((self.driver, self.base_url_host, key))
        return hashlib.sha256(identity.encode()).hexdigest()[:16]


def _configured_proxy(url: str, environ: cabc.Mapping[str, str]) -> Proxy:
    # Messages never echo the URL: its userinfo may be a pasted secret.
    bare, userinfo = egress.split_userinfo(url)
    credentials = None if userinfo is None else _CREDENTIAL_REFS.fullmatch(userinfo)
    if userinfo is not None and credentials is None:
        raise _error("credentials must be ${env:NAME} references, never literal")
    try:
        host, port = egress.split_proxy_url(
            _ENV_REF.sub(lambda m: _resolve_env(m.group(1), environ), bare)
        )
    except ValueError as exc:
        raise _error(str(exc)) from None
    username = password = None
    if credentials is not None:
        username = _resolve_env(credentials["user"], environ)
        if credentials["password"] is not None:
            password = _resolve_env(credentials["password"], environ)
        else:  # one reference: `user:password` (or a user alone)
            username, _, password = username.partition(":")
    return _proxy(host, port, username, password, "config")


def _environment_proxy(base_url: str, environ: cabc.Mapping[str, str]) -> Proxy | None:
    found = egress.environment_proxy(base_url, environ)
    if found is None:
        return None
    name, url = found
    bare, userinfo = egress.split_userinfo(url)
    try:
        host, port = egress.split_proxy_url(bare)
    except ValueError as exc:
        raise _error(
            f"{name} (from the environment) {exc}; set `proxy:` on this endpoint to override it"
        ) from None
    username = password = None
    if userinfo is not None:
        username, password = egress.percent_decoded_credentials(userinfo)
    return _proxy(host, port, username, password, "environment")


def _proxy(
    host: str,
    port: int,
    username: str | None,
    password: str | None,
    source: Literal["config", "environment"],
) -> Proxy:
    return Proxy(
        host=host,
        port=port,
        username=None if username is None else SecretStr(username),
        password=None if password is None else SecretStr(password),
        source=source,
    )


class PartPrice(_Frozen):
    """A content part's worst case: the most input tokens one part of its kind may be billed
    as, at ``per_mtok`` (default: the mapping's input price)."""

    tokens: _NonNegativeInt
    per_mtok: _Money | None = None


class OutputPrice(_Frozen):
    """The price of output tokens of another kind (audio): the output bound is priced at it."""

    per_mtok: _Money


class SearchPrice(_Frozen):
    """The most a web search may add to one choice: call fees and search content alike."""

    per_choice_usd: _Money


class Price(_Frozen):
    """US dollars per million tokens, and the worst case of each billable dimension beyond
    text (router/request/worst_case.py). A dimension left out has no price: a request that may be
    billed for it excludes the mapping (reason code ``unpriced_input``)."""

    input_per_mtok: _Money
    output_per_mtok: _Money
    cached_input_per_mtok: _Money
    # Anthropic's prompt-cache writes, for 5 minutes and for an hour (Anthropic endpoints
    # only: no other dialect bills them). Left out: not priced (worst_case.unpriced).
    cache_write_per_mtok: _Money | None = None
    cache_write_1h_per_mtok: _Money | None = None
    image_input: PartPrice | None = None  # image_url / input_image parts
    audio_input: PartPrice | None = None  # input_audio parts, an assistant's earlier audio
    file_input: PartPrice | None = None  # file parts
    audio_output: OutputPrice | None = None  # modalities with "audio", or an audio parameter
    web_search: SearchPrice | None = None  # web_search_options

    @model_validator(mode="before")
    @classmethod
    def _cached_defaults_to_input(cls, data: object) -> object:
        if isinstance(data, dict) and "cached_input_per_mtok" not in data:
            # A stand-in 0 when input_per_mtok is missing too: that error is reported anyway.
            return {**data, "cached_input_per_mtok": data.get("input_per_mtok", 0)}
        return data


class DatedPrice(Price):
    """A price and the UTC day it takes effect: one entry of a mapping's price history."""

    effective_from: date = Field(alias="from")


class Mapping(_Frozen):
    """One route of a model group: an endpoint and the upstream model it serves.

    ``price:`` is one price block, or a list of dated ones (``from: 2026-12-01`` each, in
    order): then ``price_history`` holds them and ``price`` is the entry in force when the
    config was loaded; :meth:`priced_at` gives the mapping as priced at an instant."""

    endpoint: _Name
    model: _Name
    tier: _NonNegativeInt = 0  # 0 = primary pool; higher = fallback pools
    weight: _PositiveInt = 1  # an integer, so the weighted round-robin stays exact
    # The conservative default: never send a request needing what was not declared.
    capabilities: Annotated[frozenset[_Capability], _NonEmpty] = frozenset({"text"})
    context_window: _PositiveInt
    max_output_tokens: _PositiveInt
    price: Price
    price_history: tuple[DatedPrice, ...] = ()
    # `prefix_flag` and `continue_final_message` need an OpenAI-compatible endpoint
    # (refused on an Anthropic one by _reference_errors, which knows the endpoint's driver).
    resume: ResumeMode = "none"

    @model_validator(mode="before")
    @classmethod
    def _dated_prices(cls, data: object) -> object:
        if isinstance(data, dict) and "price_history" in data:
            raise _error("price_history: unknown key (give price: a list of dated entries)")
        if isinstance(data, dict) and isinstance(data.get("price"), list):
            entries = data["price"]
            # A stand-in for `price` until the history is read (_price_in_force); an empty
            # history is reported on its own.
            first = entries[0] if entries and isinstance(entries[0], dict) else {}
            stand_in = {k: v for k, v in first.items() if k != "from"}
            return {**data, "price": stand_in, "price_history": entries}
        return data

    @model_validator(mode="after")
    def _output_fits_context(self) -> Mapping:
        if self.max_output_tokens > self.context_window:
            raise _error("max_output_tokens must be <= context_window")
        return self

    @model_validator(mode="after")
    def _price_in_force(self) -> Mapping:
        history = self.price_history
        if not history:
            return self
        days = [entry.effective_from for entry in history]
        if any(later <= earlier for earlier, later in itertools.pairwise(days)):
            raise _error("price: dated entries must be in order of their from days, each once")
        return self.priced_at(datetime.now(UTC))

    def priced_at(self, at: datetime) -> Mapping:
        """This mapping with ``price`` the entry in force at ``at`` (the last whose ``from``
        day, UTC, has begun; before the first, the first): the price an attempt started at
        ``at`` is reserved and settled at. Itself when it has no history."""
        if not self.price_history:
            return self
        day = at.astimezone(UTC).date()
        entry = self.price_history[0]
        for dated in self.price_history:
            if dated.effective_from <= day:
                entry = dated
        price = Price.model_validate(entry.model_dump(exclude={"effective_from"}))
        return self if price == self.price else self.model_copy(update={"price": price})


MAX_POOL_DEPTH: Final = 1
"""How deep pools nest (contract §2 "Pools"): a composed group's pools are groups of
mappings; a pool that lists pools of its own is refused. Two levels of routing — one
router admits across pools, each pool's router selects inside its group — is what the
dispatch directives are defined for (contract §4)."""


Strategy: TypeAlias = Literal["weighted", "least_latency", "least_cost"]


class Pool(_Frozen):
    """One pool of a composed model group: another model group of the same kind, which
    keeps its own strategy, breakers, hedging and latency figures; the composer plans
    attempts across its pools by ``tier`` and ``weight`` as a group does across mappings."""

    group: _Name
    tier: _NonNegativeInt = 0
    weight: _PositiveInt = 1


class ModelGroup(_Frozen):
    name: _Name
    # What its requests are: chat (chat completions, Anthropic Messages) or embeddings
    # (POST /v1/embeddings). A request of the other kind is refused model_kind_mismatch.
    kind: Literal["chat", "embeddings"] = "chat"
    # A group lists mappings, pools, or both (contract §2 "Pools"); at least one of them.
    mappings: tuple[Mapping, ...] = ()
    pools: tuple[Pool, ...] = ()
    # How the mapping inside the best tier is chosen (contract §4 "Selection").
    strategy: Strategy = "weighted"
    # The group's whole policy, when it has a `policy:` block: `Config` lays the block's keys
    # over `defaults` before this is validated (see Config._policies_over_defaults). None:
    # `defaults` as they are. Read it through Config.policy_for.
    policy: Defaults | None = None

    @model_validator(mode="after")
    def _mappings_or_pools(self) -> ModelGroup:
        if not self.mappings and not self.pools:
            raise _error("a model group lists mappings, pools, or both: it has neither")
        return self

    def priced_at(self, at: datetime) -> ModelGroup:
        """The group with each mapping priced as at ``at`` (:meth:`Mapping.priced_at`)."""
        if not any(m.price_history for m in self.mappings):
            return self
        return self.model_copy(update={"mappings": tuple(m.priced_at(at) for m in self.mappings)})


class Budget(_Frozen):
    limit_usd: _Money
    window: BudgetWindow


class RateLimits(_Frozen):
    """Requests and tokens per minute (aligned one-minute windows), checked at admission
    (router.adapters.rate_limits); at least one is set."""

    requests_per_minute: _PositiveInt | None = None
    tokens_per_minute: _PositiveInt | None = None  # worst case at admission, then settled

    @model_validator(mode="after")
    def _some_limit(self) -> RateLimits:
        if self.requests_per_minute is None and self.tokens_per_minute is None:
            raise _error("set requests_per_minute, tokens_per_minute or both")
        return self


class Workspace(_Frozen):
    id: _Name
    models: Annotated[tuple[_Name, ...], _NonEmpty]
    regions: Annotated[frozenset[_Name], _NonEmpty]
    data_class: DataClass
    # The most an endpoint may keep of its requests (none, zero, <days>d); None: no bound.
    retention: _Retention | None = None
    budget: Budget | None = None
    key_budget: Budget | None = None  # the default for each of its keys
    limits: RateLimits | None = None  # the workspace's, all its keys together
    key_limits: RateLimits | None = None  # each of its keys', apart


class Limits(_Frozen):
    """Bounds on what one request may ask for, whatever its budget; beyond one: 400."""

    # `n` multiplies the output billed; OpenAI takes up to 128. A request above: 400 (param n).
    max_n: _PositiveInt = 8


def _base_dir(info: ValidationInfo) -> Path:
    """What a relative path in the config is relative to: the config file's directory."""
    context = info.context
    if isinstance(context, dict) and context.get("base_dir") is not None:
        return Path(context["base_dir"])
    return Path.cwd()


def _seconds(value: object) -> object:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _error("must be a number of seconds")
    return value


class Checkpoints(_Frozen):
    """Signed checkpoints of the ledger's Merkle tree, written to a directory outside the
    database (contract §2, §7) by ``waybill serve``, off the request path."""

    # The private key's PEM, read at load from a file or a ${env:NAME} reference: never
    # printed, recorded or sent anywhere (the summary names its key id only).
    signing_key: SecretStr
    out: Path  # the sink directory; its parent must exist
    every_events: _PositiveInt = 10_000
    every_seconds: Annotated[float, BeforeValidator(_seconds), Field(gt=0)] = 60.0

    @field_validator("signing_key", mode="before")
    @classmethod
    def _read_signing_key(cls, value: object, info: ValidationInfo) -> object:
        if not isinstance(value, str) or not value.strip():
            raise _error("must be a key file's path or a ${env:NAME} reference")
        reference = _ENV_REF.fullmatch(value.strip())
        if reference is not None:
            pem = _resolve_env(reference.group(1), _environ(info))
        else:
            path = _base_dir(info) / value
            try:
                pem = path.read_text(encoding="ascii")
            except (OSError, UnicodeDecodeError) as error:
                reason = getattr(error, "strerror", None) or "not a PEM text file"
                raise _error(f"cannot read the key file {path}: {reason}") from None
        try:
            load_signing_key(pem.encode("ascii", errors="replace"))
        except KeyFileError as error:
            raise _error(f"must hold an Ed25519 private key: {error}") from None
        return SecretStr(pem)

    @field_validator("out", mode="before")
    @classmethod
    def _sink_directory(cls, value: object, info: ValidationInfo) -> object:
        if not isinstance(value, str) or not value.strip():
            raise _error("must be a directory path")
        path = (_base_dir(info) / value).resolve()
        if path.exists() and not path.is_dir():
            raise _error(f"{path} is not a directory")
        if not path.exists() and not path.parent.is_dir():
            raise _error(f"{path.parent} does not exist (the sink directory's parent must)")
        return path

    @functools.cached_property
    def key(self) -> SigningKey:
        return load_signing_key(self.signing_key.get_secret_value().encode("ascii"))

    def summary(self) -> dict[str, Any]:
        return {
            "out": str(self.out),
            "key_id": self.key.key_id,
            "every_events": self.every_events,
            "every_seconds": self.every_seconds,
        }


_MIN_TENANT_SECRET: Final = 16


class Otel(_Frozen):
    """How traces name tenants (contract §8): with ``pseudonymous_tenants``, spans carry
    ``waybill.tenant``, an HMAC-SHA256 of the workspace id under ``tenant_secret``, instead
    of the workspace id itself, so a trace backend can group a tenant's requests without
    learning who the tenant is."""

    pseudonymous_tenants: StrictBool = False
    # Read at load from a file or a ${env:NAME} reference: never printed, recorded or sent.
    tenant_secret: SecretStr | None = None

    @field_validator("tenant_secret", mode="before")
    @classmethod
    def _read_tenant_secret(cls, value: object, info: ValidationInfo) -> object:
        if value is None:
            return None
        if not isinstance(value, str) or not value.strip():
            raise _error("must be a file's path or a ${env:NAME} reference")
        reference = _ENV_REF.fullmatch(value.strip())
        if reference is not None:
            secret = _resolve_env(reference.group(1), _environ(info))
        else:
            path = _base_dir(info) / value
            try:
                secret = path.read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as error:
                reason = getattr(error, "strerror", None) or "not a text file"
                raise _error(f"cannot read the secret file {path}: {reason}") from None
        if len(secret.encode()) < _MIN_TENANT_SECRET:
            # The message never echoes the value.
            raise _error(f"must be at least {_MIN_TENANT_SECRET} bytes")
        return SecretStr(secret)

    @model_validator(mode="after")
    def _secret_with_pseudonyms(self) -> Otel:
        if self.pseudonymous_tenants and self.tenant_secret is None:
            raise _error("pseudonymous_tenants needs a tenant_secret (a file or ${env:NAME})")
        if self.tenant_secret is not None and not self.pseudonymous_tenants:
            raise _error("tenant_secret is used only with pseudonymous_tenants: true")
        return self

    @property
    def tenant_key(self) -> bytes | None:
        """The HMAC key spans name tenants under, or None: spans carry the workspace id."""
        if not self.pseudonymous_tenants or self.tenant_secret is None:
            return None
        return self.tenant_secret.get_secret_value().encode()


class Config(_Frozen):
    """The whole config. Build it with `load_config` or `parse_config`: they also check
    cross-references and duplicate ids, which need the raw document and its paths."""

    generation: StrictStr
    defaults: Defaults = Defaults()
    limits: Limits = Limits()
    endpoints: Annotated[tuple[Endpoint, ...], _NonEmpty]
    models: Annotated[tuple[ModelGroup, ...], _NonEmpty]
    workspaces: Annotated[tuple[Workspace, ...], _NonEmpty]
    checkpoints: Checkpoints | None = None
    otel: Otel = Otel()

    @field_validator("generation", mode="before")
    @classmethod
    def _generation_as_text(cls, value: object) -> object:
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, str) and value.strip():
            return value.strip()
        raise _error("must be an integer or a non-empty string")

    @field_validator("models", mode="before")
    @classmethod
    def _policies_over_defaults(cls, value: object, info: ValidationInfo) -> object:
        """Each group's `policy:` block laid over `defaults` key by key, nested blocks too
        (`hedge`, `retry_same_endpoint` and its rules): a key the block leaves out keeps the
        value `defaults` gives it. The result is validated as a whole `Defaults`, by the same
        rules and with paths under `models[i].policy`. `defaults` come validated (fields are
        validated in order); when they are invalid (reported at `defaults.*`) the built-in
        ones stand in. A group's `breaker` is refused by _reference_errors: breakers belong to
        endpoints and mappings, which groups share (an endpoint's is laid over defaults by
        _breakers_over_defaults)."""
        if not isinstance(value, list):
            return value
        defaults = info.data.get("defaults")
        if not isinstance(defaults, Defaults):
            defaults = Defaults()
        base: dict[str, Any] = defaults.model_dump()
        # The breaker settings as validated, not their dump: which keys were given decides
        # what a policy allows, and a group never sets them anyway.
        base["breaker"] = defaults.breaker
        groups = []
        for group in value:
            policy = group.get("policy") if isinstance(group, dict) else None
            if isinstance(policy, dict):
                own = {k: v for k, v in policy.items() if k != "breaker"}
                group = {**group, "policy": _laid_over(base, own)}
            groups.append(group)
        return groups

    @field_validator("endpoints", mode="before")
    @classmethod
    def _breakers_over_defaults(cls, value: object, info: ValidationInfo) -> object:
        """Each endpoint's `breaker:` block laid over `defaults.breaker` (:func:`_breaker_over`),
        validated as a whole `Breaker` by the same rules and with paths under
        `endpoints[i].breaker`. As for group policies, invalid `defaults` (reported at
        `defaults.*`) leave the built-in ones to stand in."""
        if not isinstance(value, list):
            return value
        defaults = info.data.get("defaults")
        if not isinstance(defaults, Defaults):
            defaults = Defaults()
        endpoints = []
        for endpoint in value:
            own = endpoint.get("breaker") if isinstance(endpoint, dict) else None
            if isinstance(own, dict):
                endpoint = {**endpoint, "breaker": _breaker_over(defaults.breaker, own)}
            endpoints.append(endpoint)
        return endpoints

    # Lookups are computed once: the request path never scans lists. Cached properties, not
    # private attributes: reading one of those goes through pydantic's __getattr__, slow
    # enough to show at several lookups a request (bench/README.md, "Decisions").
    @functools.cached_property
    def _endpoints(self) -> dict[str, Endpoint]:
        return {e.id: e for e in self.endpoints}

    @functools.cached_property
    def _model_groups(self) -> dict[str, ModelGroup]:
        return {g.name: g for g in self.models}

    @functools.cached_property
    def _workspaces(self) -> dict[str, Workspace]:
        return {w.id: w for w in self.workspaces}

    def endpoint(self, endpoint_id: str) -> Endpoint | None:
        return self._endpoints.get(endpoint_id)

    def model_group(self, name: str) -> ModelGroup | None:
        return self._model_groups.get(name)

    def workspace(self, workspace_id: str) -> Workspace | None:
        return self._workspaces.get(workspace_id)

    def policy_for(self, group_name: str) -> Defaults:
        """The policy a request to this model group walks by: the group's `policy:` laid
        over `defaults`, or `defaults` when it has none. KeyError for an unknown group."""
        group = self._model_groups[group_name]
        return self.defaults if group.policy is None else group.policy

    def endpoint_breakers(self) -> dict[str, Breaker]:
        """The breaker settings of each endpoint that has its own, by id; every other
        endpoint's breakers, and its mappings', run by `defaults.breaker`."""
        return {e.id: e.breaker for e in self.endpoints if e.breaker is not None}

    def redacted_summary(self) -> dict[str, Any]:
        """What a `ConfigActivated` event records: JSON-able, deterministic, no secrets,
        no URL paths or queries (only the host), money as decimal strings."""
        summary = {
            "generation": self.generation,
            "defaults": _policy_summary(self.defaults),
            "limits": self.limits.model_dump(mode="json"),
            "endpoints": [_endpoint_summary(e) for e in self.endpoints],
            "models": [_group_summary(g) for g in self.models],
            "workspaces": [
                {
                    "id": w.id,
                    "models": list(w.models),
                    "regions": sorted(w.regions),
                    "data_class": w.data_class,
                    **({"retention": w.retention} if w.retention is not None else {}),
                    "budget": _budget_summary(w.budget),
                    "key_budget": _budget_summary(w.key_budget),
                }
                | _limits_summary(w)
                for w in self.workspaces
            ],
        }
        if self.checkpoints is not None:  # absent, it leaves earlier summaries as they were
            summary["checkpoints"] = self.checkpoints.summary()
        if self.otel.pseudonymous_tenants:  # the fact, never the secret
            summary["otel"] = {"pseudonymous_tenants": True}
        return summary


def _limits_summary(w: Workspace) -> dict[str, Any]:
    # Absent when unset, so that earlier summaries stay as they were.
    summary: dict[str, Any] = {}
    if w.limits is not None:
        summary["limits"] = w.limits.model_dump(mode="json", exclude_none=True)
    if w.key_limits is not None:
        summary["key_limits"] = w.key_limits.model_dump(mode="json", exclude_none=True)
    return summary


def _endpoint_summary(e: Endpoint) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "id": e.id,
        "driver": e.driver,
        "base_url_host": e.base_url_host,
        "region": e.region,
        "data_classes": sorted(e.data_classes, key=data_class_rank),
        "trust_not_started": e.trust_not_started,
        "enabled": e.enabled,
        "max_response_bytes": e.max_response_bytes,
        **({"retention": e.retention} if e.retention is not None else {}),
        **(
            {"timeouts": e.timeouts.model_dump(exclude_none=True)} if e.timeouts is not None else {}
        ),
        "has_api_key": e.api_key is not None,
        "proxy": _proxy_summary(e.proxy),
        "provider_identity": {
            k: v
            for k, v in (
                ("project_id", e.provider_project_id),
                ("api_key_id", e.provider_api_key_id),
                ("workspace_id", e.provider_workspace_id),
            )
            if v is not None
        },
        "has_admin_api_key": e.admin_api_key is not None,
    }
    if e.breaker is not None:  # absent, it leaves earlier summaries as they were
        # The effective settings, defaults' keys included: what the endpoint's breakers run by.
        summary["breaker"] = e.breaker.summary()
    return summary


def _group_summary(g: ModelGroup) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "name": g.name,
        "kind": g.kind,
        "mappings": [_mapping_summary(m) for m in g.mappings],
    }
    if g.pools:  # absent, it leaves earlier summaries as they were
        summary["pools"] = [p.model_dump(mode="json") for p in g.pools]
    if g.policy is not None:  # absent, it leaves earlier summaries as they were
        # The whole policy the group's requests walk by; breakers are the endpoints'.
        summary["policy"] = _policy_summary(g.policy, breaker=False)
    return summary


def _policy_summary(policy: Defaults, *, breaker: bool = True) -> dict[str, Any]:
    summary = policy.model_dump(mode="json", exclude=None if breaker else {"breaker"})
    if breaker:
        summary["breaker"] = policy.breaker.summary()
    if not policy.hedge.after_p95:  # the default leaves earlier summaries as they were
        del summary["hedge"]["after_p95"]
    for key in _LATER_POLICY_KEYS:  # their defaults leave earlier summaries as they were
        if summary[key] == Defaults.model_fields[key].default:
            del summary[key]
    return summary


# Policy keys added after configs were first activated: summarised only when set otherwise.
_LATER_POLICY_KEYS: Final = ("failover", "on_quota_exhausted")


def _mapping_summary(m: Mapping) -> dict[str, Any]:
    summary = {
        "endpoint": m.endpoint,
        "model": m.model,
        "tier": m.tier,
        "weight": m.weight,
        "capabilities": sorted(m.capabilities),
        "context_window": m.context_window,
        "max_output_tokens": m.max_output_tokens,
        # The whole history: a price change is a config change, recorded by ConfigActivated.
        "price": [
            {"from": entry.effective_from.isoformat(), **_price_summary(entry)}
            for entry in m.price_history
        ]
        if m.price_history
        else _price_summary(m.price),
    }
    if m.resume != "none":  # the default leaves earlier summaries as they were
        summary["resume"] = m.resume
    return summary


def _laid_over(base: cabc.Mapping[str, Any], over: cabc.Mapping[str, Any]) -> dict[str, Any]:
    """``over``'s keys laid over ``base``'s, key by key wherever both hold a mapping."""
    merged = dict(base)
    for key, value in over.items():
        below = merged.get(key)
        if isinstance(below, dict) and isinstance(value, dict):
            value = _laid_over(below, value)
        merged[key] = value
    return merged


def _breaker_over(defaults: Breaker, own: cabc.Mapping[str, Any]) -> dict[str, Any]:
    """An endpoint's `breaker:` block laid over the keys `defaults.breaker` was given: a key
    the block leaves out keeps the value defaults give it, and a key neither gives stays
    unset, so each policy's refusal of the other's keys judges what was written. What the
    block replaces is dropped first: defaults' keys of their own policy when the block names
    another, and defaults' window when the block gives one of the other kind."""
    base = defaults.model_dump(exclude_unset=True)
    if own.get("policy", defaults.policy) != defaults.policy:
        for key in _POLICY_KEYS[defaults.policy]:
            base.pop(key, None)
    for key, other in _OTHER_WINDOW.items():
        if key in own:
            base.pop(other, None)
    return _laid_over(base, own)


def _proxy_summary(proxy: Proxy | None) -> dict[str, Any] | None:
    if proxy is None:
        return None
    return {
        "address": proxy.address,
        "source": proxy.source,
        "has_credentials": proxy.username is not None,
    }


def _price_summary(price: Price) -> dict[str, Any]:
    # Money as decimal strings; a dimension without a price is left out.
    summary: dict[str, Any] = {}
    for name, value in price:
        if name == "effective_from":
            continue
        if isinstance(value, Decimal):
            summary[name] = str(value)
        elif value is not None:
            summary[name] = {k: _plain(v) for k, v in value if v is not None}
    return summary


def _plain(value: object) -> object:
    return str(value) if isinstance(value, Decimal) else value


def _budget_summary(budget: Budget | None) -> dict[str, str] | None:
    return None if budget is None else {"limit_usd": str(budget.limit_usd), "window": budget.window}


# --- loading -------------------------------------------------------------------------------


def load_config(
    path: str | os.PathLike[str], *, environ: cabc.Mapping[str, str] | None = None
) -> Config:
    """Read, parse and validate a config file; raise `ConfigError` on any problem."""
    return parse_config_file(read_config_file(path), path, environ=environ)


def read_config_file(path: str | os.PathLike[str]) -> bytes:
    """A config file's bytes; raise `ConfigError` when it cannot be read."""
    source = os.fspath(path)
    try:
        return Path(source).read_bytes()
    except FileNotFoundError:
        raise ConfigError([(source, "file not found")]) from None
    except OSError as exc:
        raise ConfigError([(source, f"cannot read file: {exc.strerror or exc}")]) from None


def parse_config_file(
    raw: bytes, path: str | os.PathLike[str], *, environ: cabc.Mapping[str, str] | None = None
) -> Config:
    """Bytes read from the config file ``path`` (now or earlier), parsed and validated as
    `load_config` does: relative paths in it are relative to the file's directory. (The
    workers of ``waybill serve --workers N`` parse the bytes one of them read.)"""
    source = os.fspath(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError([(source, "not UTF-8 text")]) from None
    return _build(text, raw, source, environ, Path(source).resolve().parent)


def parse_config(
    text: str, *, source: str = "<string>", environ: cabc.Mapping[str, str] | None = None
) -> Config:
    """Parse and validate config text; `source` names it in error messages (relative
    paths in it are relative to the working directory)."""
    return _build(text, text.encode("utf-8"), source, environ, None)


def _build(
    text: str,
    raw: bytes,
    source: str,
    environ: cabc.Mapping[str, str] | None,
    base_dir: Path | None,
) -> Config:
    document = _load_yaml(text, source)
    # The default generation names these exact bytes, so an unchanged file keeps it.
    data = {"generation": hashlib.sha256(raw).hexdigest()[:12], **document}
    errors: list[tuple[str, str]] = []
    config: Config | None = None
    # Validated outside any `except` block so a ValidationError (whose text echoes input
    # values, possibly a pasted secret) is never chained to the ConfigError.
    try:
        config = Config.model_validate(data, context={"environ": environ, "base_dir": base_dir})
    except ValidationError as exc:
        errors.extend((_path(e["loc"]), _message(e)) for e in exc.errors())
    errors.extend(_reference_errors(data))
    if errors or config is None:
        raise ConfigError(errors)
    return config


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate and non-string keys, which PyYAML would accept
    silently (the last duplicate wins; `on:` becomes True)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[str] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != "tag:yaml.org,2002:str":
                raise yaml.constructor.ConstructorError(
                    None, None, "keys must be strings (quote this one)", key_node.start_mark
                )
            if key_node.value in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key_node.value}'", key_node.start_mark
                )
            seen.add(key_node.value)
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str, source: str) -> dict[str, Any]:
    try:
        document = yaml.load(text, Loader=_Loader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        # Only the problem, never PyYAML's excerpt of the offending line.
        raise ConfigError([(source, f"invalid YAML: {where}{exc.problem}")]) from None
    except yaml.YAMLError:
        raise ConfigError([(source, "invalid YAML")]) from None
    if document is None:
        raise ConfigError([(source, "empty config file")])
    if not isinstance(document, dict):
        kind = type(document).__name__
        raise ConfigError([(source, f"must be a mapping of config keys, not a {kind}")])
    return document


# --- error paths -----------------------------------------------------------------------------


def _path(loc: cabc.Sequence[int | str]) -> str:
    path = ""
    for part in loc:
        # A dated price list is read into price_history; the user wrote it as price.
        part = "price" if part == "price_history" else part
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else part)
    return path


_SIMPLE_MESSAGES = {
    "extra_forbidden": "unknown key",
    "missing": "required",
    "int_type": "must be an integer",
    "bool_type": "must be a boolean (true or false)",
    "string_type": "must be a string",
    "tuple_type": "must be a list",
    "list_type": "must be a list",
    "frozen_set_type": "must be a list",
    "set_type": "must be a list",
    "model_type": "must be a mapping",
    "dict_type": "must be a mapping",
}


def _message(error: ErrorDetails) -> str:
    kind, ctx, loc = error["type"], error.get("ctx", {}), error["loc"]
    if kind == "extra_forbidden" and len(loc) >= 2 and loc[-2] == "retry_same_endpoint":
        return "unknown failure class; expected one of " + ", ".join(FAILURE_CLASSES)
    if kind == "extra_forbidden" and len(loc) == 4 and loc[0] == "models" and loc[2] == "policy":
        return "unknown key; a model group's policy takes the keys of defaults: " + ", ".join(
            _GROUP_POLICY_KEYS
        )
    if kind in _SIMPLE_MESSAGES:
        return _SIMPLE_MESSAGES[kind]
    if kind == "greater_than":
        return f"must be > {ctx['gt']}"
    if kind == "greater_than_equal":
        return f"must be >= {ctx['ge']}"
    if kind == "less_than_equal":
        return f"must be <= {ctx['le']}"
    if kind == "literal_error":
        return f"must be {ctx['expected']}"
    if kind == "too_short":
        return "must not be empty" if ctx["min_length"] == 1 else "has too few items"
    if kind == "too_long":
        return f"must have at most {ctx['max_length']} items"
    return error["msg"]  # our own PydanticCustomError messages, already in this style


# What a group's `policy:` may set: every key of `defaults` but the breakers' settings.
_GROUP_POLICY_KEYS: tuple[str, ...] = tuple(k for k in Defaults.model_fields if k != "breaker")


def _items(container: object, key: str) -> cabc.Iterator[tuple[int, dict[str, Any]]]:
    section = container.get(key) if isinstance(container, dict) else None
    if isinstance(section, list):
        for index, item in enumerate(section):
            if isinstance(item, dict):
                yield index, item


def _unique(
    data: dict[str, Any], section: str, key: str, noun: str, errors: list[tuple[str, str]]
) -> set[str] | None:
    """Names declared in a section, reporting repeats; None when the section is unusable,
    so a broken section does not make every reference to it an error as well."""
    if not isinstance(data.get(section), list):
        return None
    names: set[str] = set()
    for index, item in _items(data, section):
        name = item.get(key)
        if isinstance(name, str):
            if name in names:
                errors.append((f"{section}[{index}].{key}", f"duplicate {noun} '{name}'"))
            names.add(name)
    return names


def _cache_write_price_errors(
    mapping: dict[str, Any], driver: object, path: str
) -> list[tuple[str, str]]:
    """Cache-write prices on a mapping whose endpoint no driver reports cache writes for
    (only Anthropic's Messages API bills them): a price that could never act is refused."""
    if driver == "anthropic":
        return []
    price = mapping.get("price")
    entries = price if isinstance(price, list) else [price]
    return [
        (
            f"{path}.price" + (f"[{k}]" if isinstance(price, list) else "") + f".{key}",
            f"only an anthropic endpoint bills prompt-cache writes; endpoint "
            f"'{mapping.get('endpoint')}' reports none",
        )
        for k, entry in enumerate(entries)
        if isinstance(entry, dict)
        for key in ("cache_write_per_mtok", "cache_write_1h_per_mtok")
        if key in entry
    ]


def _embeddings_mapping_errors(
    mapping: dict[str, Any], driver: object, path: str
) -> list[tuple[str, str]]:
    """A mapping of an embeddings group declares it embeds (contract §2), and its endpoint
    can: only the OpenAI dialect has an embeddings API (Anthropic's has none)."""
    errors: list[tuple[str, str]] = []
    capabilities = mapping.get("capabilities")
    if not isinstance(capabilities, list) or "embeddings" not in capabilities:
        errors.append(
            (f"{path}.capabilities", "a mapping of an embeddings group must declare embeddings")
        )
    if driver == "anthropic":
        errors.append(
            (
                f"{path}.endpoint",
                f"endpoint '{mapping.get('endpoint')}' (driver anthropic) cannot embed: "
                "the Anthropic API has no embeddings",
            )
        )
    return errors


def _reference_errors(data: dict[str, Any]) -> list[tuple[str, str]]:
    """Duplicate ids and dangling references, read from the raw document so they are
    reported together with any type errors pydantic found."""
    errors: list[tuple[str, str]] = []
    endpoint_ids = _unique(data, "endpoints", "id", "id", errors)
    group_names = _unique(data, "models", "name", "name", errors)
    _unique(data, "workspaces", "id", "id", errors)
    drivers = {
        e["id"]: e.get("driver")
        for _, e in _items(data, "endpoints")
        if isinstance(e.get("id"), str)
    }
    for i, group in _items(data, "models"):
        policy = group.get("policy")
        if isinstance(policy, dict) and "breaker" in policy:
            errors.append(
                (
                    f"models[{i}].policy.breaker",
                    "breakers belong to endpoints and mappings, which model groups share: "
                    "set breaker under defaults or on an endpoint",
                )
            )
        for j, mapping in _items(group, "mappings"):
            ref = mapping.get("endpoint")
            if endpoint_ids is not None and isinstance(ref, str) and ref not in endpoint_ids:
                errors.append((f"models[{i}].mappings[{j}].endpoint", f"unknown endpoint '{ref}'"))
            if isinstance(ref, str) and ref in drivers:
                path = f"models[{i}].mappings[{j}]"
                errors += _cache_write_price_errors(mapping, drivers[ref], path)
            if group.get("kind") == "embeddings":
                path = f"models[{i}].mappings[{j}]"
                driver = drivers.get(ref) if isinstance(ref, str) else None
                errors += _embeddings_mapping_errors(mapping, driver, path)
            resume = mapping.get("resume")
            wire_only = isinstance(resume, str) and resume in _OPENAI_WIRE_RESUME
            if wire_only and isinstance(ref, str) and drivers.get(ref) == "anthropic":
                errors.append(
                    (
                        f"models[{i}].mappings[{j}].resume",
                        f"{resume} is an OpenAI-compatible server's convention; endpoint "
                        f"'{ref}' (driver anthropic) continues a trailing assistant message "
                        "itself: use assistant_prefill",
                    )
                )
    errors.extend(_pool_errors(data))
    for i, workspace in _items(data, "workspaces"):
        names = workspace.get("models")
        if group_names is None or not isinstance(names, list):
            continue
        for j, name in enumerate(names):
            if isinstance(name, str) and name not in group_names:
                errors.append((f"workspaces[{i}].models[{j}]", f"unknown model group '{name}'"))
    return errors


def _pool_errors(data: dict[str, Any]) -> list[tuple[str, str]]:
    """Pools that cannot be composed (contract §2 "Pools"): an unknown group, one of another
    kind, the group itself or a cycle, the same group twice, nesting deeper than
    :data:`MAX_POOL_DEPTH`."""
    errors: list[tuple[str, str]] = []
    groups = {g["name"]: g for _, g in _items(data, "models") if isinstance(g.get("name"), str)}

    def pools_of(group: dict[str, Any]) -> list[str]:
        return [p["group"] for _, p in _items(group, "pools") if isinstance(p.get("group"), str)]

    def cycle_from(start: str) -> list[str] | None:
        path, frontier = [start], pools_of(groups[start])
        seen: set[str] = set()
        while frontier:
            name = frontier.pop(0)
            if name == start:
                return [*path, start]
            if name in seen or name not in groups:
                continue
            seen.add(name)
            path.append(name)
            frontier.extend(pools_of(groups[name]))
        return None

    for i, group in _items(data, "models"):
        name, kind = group.get("name"), group.get("kind", "chat")
        named: set[str] = set()
        for j, pool in _items(group, "pools"):
            where, ref = f"models[{i}].pools[{j}].group", pool.get("group")
            if not isinstance(ref, str):
                continue
            target = groups.get(ref)
            if ref in named:
                errors.append((where, f"model group '{ref}' is already a pool of this group"))
            named.add(ref)
            if target is None:
                errors.append((where, f"unknown model group '{ref}'"))
            elif ref == name:
                errors.append((where, f"a model group cannot be a pool of itself ('{ref}')"))
            elif target.get("kind", "chat") != kind:
                errors.append(
                    (where, f"model group '{ref}' is of kind {target.get('kind')}, not {kind}")
                )
            elif pools_of(target):
                cycle = cycle_from(ref) if isinstance(name, str) else None
                if cycle is not None and name in cycle:
                    shown = " -> ".join([name, *cycle[: cycle.index(name) + 1]])
                    errors.append((where, f"pools form a cycle: {shown}"))
                else:
                    errors.append(
                        (
                            where,
                            f"model group '{ref}' lists pools itself: pools nest at most "
                            f"{MAX_POOL_DEPTH} level deep",
                        )
                    )
    return errors
