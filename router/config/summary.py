"""The redacted summary of a config that `ConfigActivated` records."""

from __future__ import annotations

import collections.abc as cabc
from decimal import Decimal
from typing import Any, Final

from ledger.events import data_class_rank
from router.config.models import Budget, Endpoint, Mapping, ModelGroup, Price, Proxy, Workspace
from router.config.policies import OTHER_WINDOW, POLICY_KEYS, Breaker, Defaults


def limits_summary(w: Workspace) -> dict[str, Any]:
    # Absent when unset, so that earlier summaries stay as they were.
    summary: dict[str, Any] = {}
    if w.limits is not None:
        summary["limits"] = w.limits.model_dump(mode="json", exclude_none=True)
    if w.key_limits is not None:
        summary["key_limits"] = w.key_limits.model_dump(mode="json", exclude_none=True)
    return summary


def endpoint_summary(e: Endpoint) -> dict[str, Any]:
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


def group_summary(g: ModelGroup) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "name": g.name,
        "kind": g.kind,
        "mappings": [_mapping_summary(m) for m in g.mappings],
    }
    if g.pools:  # absent, it leaves earlier summaries as they were
        summary["pools"] = [p.model_dump(mode="json") for p in g.pools]
    if g.policy is not None:  # absent, it leaves earlier summaries as they were
        # The whole policy the group's requests walk by; breakers are the endpoints'.
        summary["policy"] = policy_summary(g.policy, breaker=False)
    return summary


def policy_summary(policy: Defaults, *, breaker: bool = True) -> dict[str, Any]:
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


def laid_over(base: cabc.Mapping[str, Any], over: cabc.Mapping[str, Any]) -> dict[str, Any]:
    """``over``'s keys laid over ``base``'s, key by key wherever both hold a mapping."""
    merged = dict(base)
    for key, value in over.items():
        below = merged.get(key)
        if isinstance(below, dict) and isinstance(value, dict):
            value = laid_over(below, value)
        merged[key] = value
    return merged


def breaker_over(defaults: Breaker, own: cabc.Mapping[str, Any]) -> dict[str, Any]:
    """An endpoint's `breaker:` block laid over the keys `defaults.breaker` was given: a key
    the block leaves out keeps the value defaults give it, and a key neither gives stays
    unset, so each policy's refusal of the other's keys judges what was written. What the
    block replaces is dropped first: defaults' keys of their own policy when the block names
    another, and defaults' window when the block gives one of the other kind."""
    base = defaults.model_dump(exclude_unset=True)
    if own.get("policy", defaults.policy) != defaults.policy:
        for key in POLICY_KEYS[defaults.policy]:
            base.pop(key, None)
    for key, other in OTHER_WINDOW.items():
        if key in own:
            base.pop(other, None)
    return laid_over(base, own)


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


def budget_summary(budget: Budget | None) -> dict[str, str] | None:
    return None if budget is None else {"limit_usd": str(budget.limit_usd), "window": budget.window}
