"""The caller's endpoint scope (contract §4 "Endpoint scope"), free of I/O: which endpoints of
a model group one request may be routed to, after the key's standing scope, the
``X-Waybill-Endpoints`` header and an ``X-Waybill-Require-Endpoint`` pin have each narrowed it.

A scope is a list of endpoint ids and ``provider:NAME`` labels; a label stands for every
endpoint of the requested model group whose driver is ``NAME``, so it is expanded within the
group before anything is compared. The narrowings intersect: a header can only narrow what
the key allows. What is left, if not every endpoint of the group, is the request's
:class:`EndpointScope`; an empty one is refused (``scope_empty``), never read as
"unrestricted".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, get_args

from ledger.events import Requirements
from router.config import Config, Driver, ModelGroup

__all__ = [
    "PROVIDERS",
    "PROVIDER_PREFIX",
    "EndpointScope",
    "bad_scope_name",
    "endpoint_scope",
    "expand",
]

PROVIDER_PREFIX: Final = "provider:"
PROVIDERS: Final[tuple[str, ...]] = get_args(Driver)
"""The provider labels a scope may name: the drivers (``provider:openai``, ...)."""

# Where each narrowing comes from, as an out_of_scope candidate's detail names it.
KEY_SCOPE: Final = "the key's endpoint scope"
HEADER_SCOPE: Final = "X-Waybill-Endpoints"
PINNED: Final = "X-Waybill-Require-Endpoint"


@dataclass(frozen=True, slots=True)
class EndpointScope:
    """The endpoints of a group one request may use, and what narrowed it to them."""

    endpoints: frozenset[str]  # empty: the narrowings left nothing (scope_empty)
    narrowings: tuple[tuple[str, frozenset[str]], ...]  # (source, its endpoint ids), in order

    def excluded_by(self, endpoint_id: str) -> str | None:
        """The first narrowing that leaves ``endpoint_id`` out, or None if it is in scope."""
        for source, allowed in self.narrowings:
            if endpoint_id not in allowed:
                return f"not in {source}"
        return None


def bad_scope_name(name: str) -> str | None:
    """Why ``name`` cannot be a scope entry (None: it can): a ``provider:`` label must name
    a known provider; an endpoint id is any non-empty name."""
    if not name:
        return "an empty name"
    if name.startswith(PROVIDER_PREFIX):
        provider = name.removeprefix(PROVIDER_PREFIX)
        if provider not in PROVIDERS:
            return f"unknown provider {provider!r} (known: {', '.join(PROVIDERS)})"
    return None


def expand(config: Config, group: ModelGroup, names: Iterable[str]) -> frozenset[str]:
    """The endpoint ids of ``group`` that ``names`` stand for: an endpoint id if one of the
    group's mappings leads there, a ``provider:NAME`` label as every such endpoint whose
    driver is ``NAME``. A name that matches nothing in the group adds nothing."""
    in_group = {m.endpoint for m in group.mappings}
    wanted = set(names)
    providers = {n.removeprefix(PROVIDER_PREFIX) for n in wanted if n.startswith(PROVIDER_PREFIX)}
    found = set()
    for endpoint_id in in_group:
        endpoint = config.endpoint(endpoint_id)
        if endpoint_id in wanted or (endpoint is not None and endpoint.driver in providers):
            found.add(endpoint_id)
    return frozenset(found)


def endpoint_scope(
    config: Config, group: ModelGroup, requirements: Requirements
) -> EndpointScope | None:
    """The request's endpoint scope within ``group``: the key's, narrowed by the header's,
    narrowed to the pinned target; None when nothing narrows it."""
    sources: list[tuple[str, Iterable[str]]] = []
    if requirements.key_endpoints is not None:
        sources.append((KEY_SCOPE, requirements.key_endpoints))
    if requirements.endpoints is not None:
        sources.append((HEADER_SCOPE, requirements.endpoints))
    if requirements.require_endpoint is not None:
        sources.append((PINNED, (requirements.require_endpoint,)))
    if not sources:
        return None
    narrowings = tuple((source, expand(config, group, names)) for source, names in sources)
    endpoints = frozenset({m.endpoint for m in group.mappings})
    for _, allowed in narrowings:
        endpoints &= allowed
    return EndpointScope(endpoints, narrowings)
