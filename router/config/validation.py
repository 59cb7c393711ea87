"""Error paths and messages, and the checks that need the raw document (references, ids, pools)."""

from __future__ import annotations

import collections.abc as cabc
from typing import Any

from pydantic_core import ErrorDetails

from router.config.fields import FAILURE_CLASSES, OPENAI_WIRE_RESUME
from router.config.models import MAX_POOL_DEPTH
from router.config.policies import Defaults

# --- error paths -----------------------------------------------------------------------------


def error_path(loc: cabc.Sequence[int | str]) -> str:
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


def error_message(error: ErrorDetails) -> str:
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


def reference_errors(data: dict[str, Any]) -> list[tuple[str, str]]:
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
            wire_only = isinstance(resume, str) and resume in OPENAI_WIRE_RESUME
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
