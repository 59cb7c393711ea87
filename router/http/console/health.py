"""What the Health page knows of the endpoints: each one's breaker, disabled state and the
mappings behind it, for the endpoints the caller's workspace routes to (an admin: all).

:func:`endpoint_states` is the one place the page asks; it reads what ``GET /v1/endpoints``
reads: the serving gateway's config, the endpoints a refused key disabled, and the breakers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal

from ledger.endpoints import DisabledEndpoint
from router.adapters.breakers import BreakerKey, BreakerStoreUnavailable
from router.config import Config
from router.request.gateway import Caller, Gateway

__all__ = ["BreakerView", "EndpointState", "endpoint_states", "visible_endpoints", "visible_groups"]


@dataclass(frozen=True, slots=True)
class BreakerView:
    target: str  # the endpoint id, or "endpoint/model" for a mapping's breaker
    state: str  # closed | open | half_open | unknown (the shared store did not answer)
    refusing: bool  # it would refuse an attempt now
    ramp_share: Decimal | None = None  # ramping up after closing: the share of its weight


@dataclass(frozen=True, slots=True)
class EndpointState:
    endpoint: str
    driver: str
    region: str
    disabled: str | None  # why it takes no request: "config" or the refused key's evidence
    breaker: BreakerView
    mappings: tuple[BreakerView, ...]


def visible_groups(config: Config, caller: Caller) -> list[str]:
    """The model groups the caller may see requests of: its workspace's; an admin's, all."""
    if caller.role == "admin":
        return [group.name for group in config.models]
    return [name for name in caller.workspace.models if config.model_group(name)]


def visible_endpoints(config: Config, caller: Caller) -> list[str]:
    """The endpoints the caller's model groups route to (an admin: every endpoint)."""
    if caller.role == "admin":
        return [endpoint.id for endpoint in config.endpoints]
    named: set[str] = set()
    for name in visible_groups(config, caller):
        group = config.model_group(name)
        if group is not None:
            named.update(m.endpoint for m in group.mappings)
    return [endpoint.id for endpoint in config.endpoints if endpoint.id in named]


async def endpoint_states(gateway: Gateway, caller: Caller) -> list[EndpointState]:
    config = gateway.config
    await gateway.disabling.sync()  # another process may have changed it now
    refused = await gateway.disabled.current()
    states = []
    for endpoint_id in visible_endpoints(config, caller):
        endpoint = config.endpoint(endpoint_id)
        if endpoint is None:
            continue
        models = sorted(
            {m.model for g in config.models for m in g.mappings if m.endpoint == endpoint_id}
        )
        keys = [BreakerKey.endpoint(endpoint_id)]
        keys += [BreakerKey.mapping(endpoint_id, model) for model in models]
        views = await _views(gateway, keys)
        states.append(
            EndpointState(
                endpoint_id,
                endpoint.driver,
                endpoint.region,
                _why_disabled(endpoint.enabled, refused.get(endpoint_id)),
                views[0],
                tuple(views[1:]),
            )
        )
    return states


def _why_disabled(enabled: bool, refused: DisabledEndpoint | None) -> str | None:
    if not enabled:
        return "enabled: false in the config"
    if refused is None:
        return None
    status = f"{refused.http_status} " if refused.http_status else ""
    code = refused.error_code or "credentials"
    return f"key refused ({status}{code}): waybill endpoints enable {refused.endpoint}"


async def _views(gateway: Gateway, keys: Sequence[BreakerKey]) -> list[BreakerView]:
    board = gateway.breakers
    try:
        standing = await board.standing(keys)
        return [
            BreakerView(
                k.target,
                await board.state(k),
                standing[k].blocked,
                standing[k].share if standing[k].share < 1 else None,
            )
            for k in keys
        ]
    except BreakerStoreUnavailable:
        return [BreakerView(k.target, "unknown", False) for k in keys]
