"""Endpoints, prices, model groups and pools, workspaces, limits, checkpoints and otel."""

from __future__ import annotations

import collections.abc as cabc
import functools
import hashlib
import itertools
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Annotated, Any, Final, Literal, TypeAlias
from urllib.parse import urlsplit

from pydantic import (
    BeforeValidator,
    Field,
    SecretStr,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ledger.audit.checkpoints import KeyFileError, SigningKey, load_signing_key
from ledger.events import DataClass
from router.config import egress
from router.config.fields import (
    CREDENTIAL_REFS,
    ENV_REF,
    BudgetWindow,
    Capability,
    Driver,
    Frozen,
    Money,
    Name,
    NonEmpty,
    NonNegativeInt,
    PositiveInt,
    ResumeMode,
    Retention,
    custom_error,
    environ_of,
    resolve_env,
)
from router.config.policies import Breaker, Defaults

# --- endpoints, model groups, workspaces ---------------------------------------------------


class EndpointTimeouts(Frozen):
    """An endpoint's own timeouts (contract §2 `endpoints[].timeouts`): the timeout keys of
    `defaults`, each given laid over the model group's policy for attempts on the endpoint."""

    attempt_timeout_ms: PositiveInt | None = None
    first_token_timeout_ms: PositiveInt | None = None
    stream_idle_timeout_ms: PositiveInt | None = None

    def over(self, policy: Defaults) -> Defaults:
        """``policy`` with each key this block gives replaced, the others kept."""
        return policy.model_copy(update=self.model_dump(exclude_none=True))


class Proxy(Frozen):
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


class Endpoint(Frozen):
    id: Name
    driver: Driver
    base_url: StrictStr
    # Omitted for upstreams without auth; otherwise only ever a ${env:NAME} reference.
    api_key: SecretStr | None = None
    region: Name
    data_classes: Annotated[frozenset[DataClass], NonEmpty]
    trust_not_started: StrictBool = False
    enabled: StrictBool = True
    # At most this many attempts in flight to the endpoint at once (per process, or across
    # replicas through Redis when configured); a saturated endpoint is excluded. None: no limit.
    max_in_flight: PositiveInt | None = None
    max_response_bytes: PositiveInt = 8 * 1024 * 1024
    # What its provider keeps of a request (none, zero, <days>d). None: not declared, which
    # satisfies no workspace's or request's retention bound.
    retention: Retention | None = None
    anthropic_version: StrictStr | None = None  # the driver's default when omitted
    # Resolved at load: `environment` (the default) follows HTTPS_PROXY / HTTP_PROXY and
    # NO_PROXY for base_url; a URL names the proxy; `none` is always direct. None: direct.
    proxy: Proxy | None = Field(default=_PROXY_FROM_ENVIRONMENT, validate_default=True)
    # The endpoint as its provider's usage and cost reports name it (contract §3
    # "Reconciliation"): OpenAI's project and API key ids, Anthropic's workspace and key ids.
    provider_project_id: Name | None = None
    provider_api_key_id: Name | None = None
    provider_workspace_id: Name | None = None
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
        match = ENV_REF.fullmatch(value) if isinstance(value, str) else None
        if match is None:
            raise custom_error("must be a ${env:NAME} reference, never a literal secret")
        return resolve_env(match.group(1), environ_of(info))

    @field_validator("base_url", "admin_base_url", mode="before")
    @classmethod
    def _base_url_references(cls, value: object, info: ValidationInfo) -> object:
        if not isinstance(value, str):
            return value
        environ = environ_of(info)
        return ENV_REF.sub(lambda m: resolve_env(m.group(1), environ), value)

    @field_validator("base_url", "admin_base_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise custom_error("must be an http:// or https:// URL")
        if parts.username is not None or parts.password is not None:
            raise custom_error("must not embed credentials; use api_key")
        return value

    @field_validator("proxy", mode="before")
    @classmethod
    def _resolve_proxy(cls, value: object, info: ValidationInfo) -> object:
        if isinstance(value, Proxy):
            return value
        if value == "none":
            return None
        environ = environ_of(info)
        if value == _PROXY_FROM_ENVIRONMENT:
            base_url = info.data.get("base_url")
            if not isinstance(base_url, str):
                return None  # base_url's own error is reported
            return _environment_proxy(base_url, environ)
        if not isinstance(value, str):
            raise custom_error(
                "must be a proxy URL such as http://proxy.example:3128, none or environment"
            )
        return _configured_proxy(value, environ)

    @model_validator(mode="after")
    def _identity_of_its_provider(self) -> Endpoint:
        # Each provider's reports name its own kinds of id: a key the driver's provider has
        # not would never match a report.
        wrong = "provider_workspace_id" if self.driver == "openai" else "provider_project_id"
        if getattr(self, wrong) is not None:
            raise custom_error(f"{wrong} is not an id {self.driver} reports name")
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
    credentials = None if userinfo is None else CREDENTIAL_REFS.fullmatch(userinfo)
    if userinfo is not None and credentials is None:
        raise custom_error("credentials must be ${env:NAME} references, never literal")
    try:
        host, port = egress.split_proxy_url(
            ENV_REF.sub(lambda m: resolve_env(m.group(1), environ), bare)
        )
    except ValueError as exc:
        raise custom_error(str(exc)) from None
    username = password = None
    if credentials is not None:
        username = resolve_env(credentials["user"], environ)
        if credentials["password"] is not None:
            password = resolve_env(credentials["password"], environ)
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
        raise custom_error(
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


class PartPrice(Frozen):
    """A content part's worst case: the most input tokens one part of its kind may be billed
    as, at ``per_mtok`` (default: the mapping's input price)."""

    tokens: NonNegativeInt
    per_mtok: Money | None = None


class OutputPrice(Frozen):
    """The price of output tokens of another kind (audio): the output bound is priced at it."""

    per_mtok: Money


class SearchPrice(Frozen):
    """The most a web search may add to one choice: call fees and search content alike."""

    per_choice_usd: Money


class Price(Frozen):
    """US dollars per million tokens, and the worst case of each billable dimension beyond
    text (router/request/worst_case.py). A dimension left out has no price: a request that may be
    billed for it excludes the mapping (reason code ``unpriced_input``)."""

    input_per_mtok: Money
    output_per_mtok: Money
    cached_input_per_mtok: Money
    # Anthropic's prompt-cache writes, for 5 minutes and for an hour (Anthropic endpoints
    # only: no other dialect bills them). Left out: not priced (worst_case.unpriced).
    cache_write_per_mtok: Money | None = None
    cache_write_1h_per_mtok: Money | None = None
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


class Mapping(Frozen):
    """One route of a model group: an endpoint and the upstream model it serves.

    ``price:`` is one price block, or a list of dated ones (``from: 2026-12-01`` each, in
    order): then ``price_history`` holds them and ``price`` is the entry in force when the
    config was loaded; :meth:`priced_at` gives the mapping as priced at an instant."""

    endpoint: Name
    model: Name
    tier: NonNegativeInt = 0  # 0 = primary pool; higher = fallback pools
    weight: PositiveInt = 1  # an integer, so the weighted round-robin stays exact
    # The conservative default: never send a request needing what was not declared.
    capabilities: Annotated[frozenset[Capability], NonEmpty] = frozenset({"text"})
    context_window: PositiveInt
    max_output_tokens: PositiveInt
    price: Price
    price_history: tuple[DatedPrice, ...] = ()
    # `prefix_flag` and `continue_final_message` need an OpenAI-compatible endpoint
    # (refused on an Anthropic one by reference_errors, which knows the endpoint's driver).
    resume: ResumeMode = "none"

    @model_validator(mode="before")
    @classmethod
    def _dated_prices(cls, data: object) -> object:
        if isinstance(data, dict) and "price_history" in data:
            raise custom_error("price_history: unknown key (give price: a list of dated entries)")
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
            raise custom_error("max_output_tokens must be <= context_window")
        return self

    @model_validator(mode="after")
    def _price_in_force(self) -> Mapping:
        history = self.price_history
        if not history:
            return self
        days = [entry.effective_from for entry in history]
        if any(later <= earlier for earlier, later in itertools.pairwise(days)):
            raise custom_error(
                "price: dated entries must be in order of their from days, each once"
            )
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


class Pool(Frozen):
    """One pool of a composed model group: another model group of the same kind, which
    keeps its own strategy, breakers, hedging and latency figures; the composer plans
    attempts across its pools by ``tier`` and ``weight`` as a group does across mappings."""

    group: Name
    tier: NonNegativeInt = 0
    weight: PositiveInt = 1


class ModelGroup(Frozen):
    name: Name
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
            raise custom_error("a model group lists mappings, pools, or both: it has neither")
        return self

    def priced_at(self, at: datetime) -> ModelGroup:
        """The group with each mapping priced as at ``at`` (:meth:`Mapping.priced_at`)."""
        if not any(m.price_history for m in self.mappings):
            return self
        return self.model_copy(update={"mappings": tuple(m.priced_at(at) for m in self.mappings)})


class Budget(Frozen):
    limit_usd: Money
    window: BudgetWindow


class RateLimits(Frozen):
    """Requests and tokens per minute (aligned one-minute windows), checked at admission
    (router.adapters.rate_limits); at least one is set."""

    requests_per_minute: PositiveInt | None = None
    tokens_per_minute: PositiveInt | None = None  # worst case at admission, then settled

    @model_validator(mode="after")
    def _some_limit(self) -> RateLimits:
        if self.requests_per_minute is None and self.tokens_per_minute is None:
            raise custom_error("set requests_per_minute, tokens_per_minute or both")
        return self


class Workspace(Frozen):
    id: Name
    models: Annotated[tuple[Name, ...], NonEmpty]
    regions: Annotated[frozenset[Name], NonEmpty]
    data_class: DataClass
    # The most an endpoint may keep of its requests (none, zero, <days>d); None: no bound.
    retention: Retention | None = None
    budget: Budget | None = None
    key_budget: Budget | None = None  # the default for each of its keys
    limits: RateLimits | None = None  # the workspace's, all its keys together
    key_limits: RateLimits | None = None  # each of its keys', apart


class Limits(Frozen):
    """Bounds on what one request may ask for, whatever its budget; beyond one: 400."""

    # `n` multiplies the output billed; OpenAI takes up to 128. A request above: 400 (param n).
    max_n: PositiveInt = 8


def _base_dir(info: ValidationInfo) -> Path:
    """What a relative path in the config is relative to: the config file's directory."""
    context = info.context
    if isinstance(context, dict) and context.get("base_dir") is not None:
        return Path(context["base_dir"])
    return Path.cwd()


def _seconds(value: object) -> object:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise custom_error("must be a number of seconds")
    return value


class Checkpoints(Frozen):
    """Signed checkpoints of the ledger's Merkle tree, written to a directory outside the
    database (contract §2, §7) by ``waybill serve``, off the request path."""

    # The private key's PEM, read at load from a file or a ${env:NAME} reference: never
    # printed, recorded or sent anywhere (the summary names its key id only).
    signing_key: SecretStr
    out: Path  # the sink directory; its parent must exist
    every_events: PositiveInt = 10_000
    every_seconds: Annotated[float, BeforeValidator(_seconds), Field(gt=0)] = 60.0

    @field_validator("signing_key", mode="before")
    @classmethod
    def _read_signing_key(cls, value: object, info: ValidationInfo) -> object:
        if not isinstance(value, str) or not value.strip():
            raise custom_error("must be a key file's path or a ${env:NAME} reference")
        reference = ENV_REF.fullmatch(value.strip())
        if reference is not None:
            pem = resolve_env(reference.group(1), environ_of(info))
        else:
            path = _base_dir(info) / value
            try:
                pem = path.read_text(encoding="ascii")
            except (OSError, UnicodeDecodeError) as error:
                reason = getattr(error, "strerror", None) or "not a PEM text file"
                raise custom_error(f"cannot read the key file {path}: {reason}") from None
        try:
            load_signing_key(pem.encode("ascii", errors="replace"))
        except KeyFileError as error:
            raise custom_error(f"must hold an Ed25519 private key: {error}") from None
        return SecretStr(pem)

    @field_validator("out", mode="before")
    @classmethod
    def _sink_directory(cls, value: object, info: ValidationInfo) -> object:
        if not isinstance(value, str) or not value.strip():
            raise custom_error("must be a directory path")
        path = (_base_dir(info) / value).resolve()
        if path.exists() and not path.is_dir():
            raise custom_error(f"{path} is not a directory")
        if not path.exists() and not path.parent.is_dir():
            raise custom_error(f"{path.parent} does not exist (the sink directory's parent must)")
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


class Otel(Frozen):
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
            raise custom_error("must be a file's path or a ${env:NAME} reference")
        reference = ENV_REF.fullmatch(value.strip())
        if reference is not None:
            secret = resolve_env(reference.group(1), environ_of(info))
        else:
            path = _base_dir(info) / value
            try:
                secret = path.read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as error:
                reason = getattr(error, "strerror", None) or "not a text file"
                raise custom_error(f"cannot read the secret file {path}: {reason}") from None
        if len(secret.encode()) < _MIN_TENANT_SECRET:
            # The message never echoes the value.
            raise custom_error(f"must be at least {_MIN_TENANT_SECRET} bytes")
        return SecretStr(secret)

    @model_validator(mode="after")
    def _secret_with_pseudonyms(self) -> Otel:
        if self.pseudonymous_tenants and self.tenant_secret is None:
            raise custom_error("pseudonymous_tenants needs a tenant_secret (a file or ${env:NAME})")
        if self.tenant_secret is not None and not self.pseudonymous_tenants:
            raise custom_error("tenant_secret is used only with pseudonymous_tenants: true")
        return self

    @property
    def tenant_key(self) -> bytes | None:
        """The HMAC key spans name tenants under, or None: spans carry the workspace id."""
        if not self.pseudonymous_tenants or self.tenant_secret is None:
            return None
        return self.tenant_secret.get_secret_value().encode()
