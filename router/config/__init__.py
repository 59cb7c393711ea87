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
import os
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import StrictStr, ValidationError, ValidationInfo, field_validator

from router.config.fields import (
    FAILURE_CLASSES,
    KNOWN_CAPABILITIES,
    BudgetWindow,
    ConfigError,
    Driver,
    Frozen,
    NonEmpty,
    ResumeMode,
    custom_error,
)
from router.config.models import (
    MAX_POOL_DEPTH,
    Budget,
    Checkpoints,
    DatedPrice,
    Endpoint,
    EndpointTimeouts,
    Limits,
    Mapping,
    ModelGroup,
    Otel,
    OutputPrice,
    PartPrice,
    Pool,
    Price,
    Proxy,
    RateLimits,
    SearchPrice,
    Strategy,
    Workspace,
)
from router.config.policies import (
    MAX_WINDOW_CALLS,
    Breaker,
    Defaults,
    Hedge,
    RetryRule,
    RetrySameEndpoint,
)
from router.config.summary import (
    breaker_over,
    budget_summary,
    endpoint_summary,
    group_summary,
    laid_over,
    limits_summary,
    policy_summary,
)
from router.config.validation import error_message, error_path, reference_errors

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
    "DatedPrice",
    "Defaults",
    "Driver",
    "Endpoint",
    "EndpointTimeouts",
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


class Config(Frozen):
    """The whole config. Build it with `load_config` or `parse_config`: they also check
    cross-references and duplicate ids, which need the raw document and its paths."""

    generation: StrictStr
    defaults: Defaults = Defaults()
    limits: Limits = Limits()
    endpoints: Annotated[tuple[Endpoint, ...], NonEmpty]
    models: Annotated[tuple[ModelGroup, ...], NonEmpty]
    workspaces: Annotated[tuple[Workspace, ...], NonEmpty]
    checkpoints: Checkpoints | None = None
    otel: Otel = Otel()

    @field_validator("generation", mode="before")
    @classmethod
    def _generation_as_text(cls, value: object) -> object:
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, str) and value.strip():
            return value.strip()
        raise custom_error("must be an integer or a non-empty string")

    @field_validator("models", mode="before")
    @classmethod
    def _policies_over_defaults(cls, value: object, info: ValidationInfo) -> object:
        """Each group's `policy:` block laid over `defaults` key by key, nested blocks too
        (`hedge`, `retry_same_endpoint` and its rules): a key the block leaves out keeps the
        value `defaults` gives it. The result is validated as a whole `Defaults`, by the same
        rules and with paths under `models[i].policy`. `defaults` come validated (fields are
        validated in order); when they are invalid (reported at `defaults.*`) the built-in
        ones stand in. A group's `breaker` is refused by reference_errors: breakers belong to
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
                group = {**group, "policy": laid_over(base, own)}
            groups.append(group)
        return groups

    @field_validator("endpoints", mode="before")
    @classmethod
    def _breakers_over_defaults(cls, value: object, info: ValidationInfo) -> object:
        """Each endpoint's `breaker:` block laid over `defaults.breaker` (:func:`breaker_over`),
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
                endpoint = {**endpoint, "breaker": breaker_over(defaults.breaker, own)}
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
            "defaults": policy_summary(self.defaults),
            "limits": self.limits.model_dump(mode="json"),
            "endpoints": [endpoint_summary(e) for e in self.endpoints],
            "models": [group_summary(g) for g in self.models],
            "workspaces": [
                {
                    "id": w.id,
                    "models": list(w.models),
                    "regions": sorted(w.regions),
                    "data_class": w.data_class,
                    **({"retention": w.retention} if w.retention is not None else {}),
                    "budget": budget_summary(w.budget),
                    "key_budget": budget_summary(w.key_budget),
                }
                | limits_summary(w)
                for w in self.workspaces
            ],
        }
        if self.checkpoints is not None:  # absent, it leaves earlier summaries as they were
            summary["checkpoints"] = self.checkpoints.summary()
        if self.otel.pseudonymous_tenants:  # the fact, never the secret
            summary["otel"] = {"pseudonymous_tenants": True}
        return summary


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
        errors.extend((error_path(e["loc"]), error_message(e)) for e in exc.errors())
    errors.extend(reference_errors(data))
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
