"""The endpoints' health (contract §3 "Endpoints"), for admin keys.

``GET /v1/endpoints`` lists each endpoint of the serving config: whether the config enables
it, whether a credentials failure disabled it (with the evidence), and its breaker and its
mappings' breakers as they stand. ``POST /v1/admin/endpoints/{id}/enable`` lifts a disabling,
recorded (``EndpointEnabled``) with the admin key that asked.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from router.adapters.breakers import BreakerKey, BreakerView
from router.errors import endpoint_not_disabled, endpoint_not_found, permission_denied
from router.http import openapi as api_doc
from router.request.gateway import Caller, Gateway

__all__ = ["endpoints_router"]

Authenticate = Callable[[Request], Awaitable[Caller]]

_JSON = "application/json"


def endpoints_router(authenticate: Authenticate, serving: Callable[[], Gateway]) -> APIRouter:
    """``serving``: the gateway new requests go to (a reload replaces it)."""
    router = APIRouter()

    @router.get("/v1/endpoints", openapi_extra=api_doc.LIST_ENDPOINTS)
    async def endpoints(request: Request) -> Response:
        caller = await authenticate(request)
        if caller.role != "admin":
            raise permission_denied("the endpoints' state takes an admin key")
        gateway = serving()
        await gateway.disabling.sync()  # another process may have changed it now
        body = {
            "data": await _endpoint_rows(gateway),
            "next_cursor": None,
            "config_generation": gateway.config.generation,
            "breaker_policy": gateway.breakers.settings.policy,
        }
        return Response(orjson.dumps(body), media_type=_JSON)

    @router.post("/v1/admin/endpoints/{endpoint_id}/enable", openapi_extra=api_doc.ENABLE_ENDPOINT)
    async def enable(endpoint_id: str, request: Request) -> Response:
        caller = await authenticate(request)
        if caller.role != "admin":
            raise permission_denied("enabling an endpoint takes an admin key")
        gateway = serving()
        if gateway.config.endpoint(endpoint_id) is None:
            raise endpoint_not_found(endpoint_id)
        enabled = await gateway.disabling.enable(
            endpoint_id, actor=caller.key_id, generation=gateway.config.generation
        )
        if enabled is None:
            raise endpoint_not_disabled(endpoint_id)
        return Response(orjson.dumps(enabled.model_dump(mode="json")), media_type=_JSON)

    return router


async def _endpoint_rows(gateway: Gateway) -> list[dict[str, Any]]:
    config = gateway.config
    disabled = await gateway.disabled.current()
    models: dict[str, list[str]] = {}
    for group in config.models:
        for mapping in group.mappings:
            served = models.setdefault(mapping.endpoint, [])
            if mapping.model not in served:
                served.append(mapping.model)
    keys = [BreakerKey.endpoint(e.id) for e in config.endpoints] + [
        BreakerKey.mapping(endpoint, model)
        for endpoint, served in models.items()
        for model in served
    ]
    views = await gateway.breakers.inspect(keys)
    rows = []
    for endpoint in config.endpoints:
        found = disabled.get(endpoint.id)
        state = "enabled"
        if not endpoint.enabled:
            state = "config_disabled"
        elif found is not None:
            state = "disabled"
        rows.append(
            {
                "id": endpoint.id,
                "driver": endpoint.driver,
                "region": endpoint.region,
                "state": state,
                "enabled": endpoint.enabled,
                "disabled": None if found is None else found.as_json(),
                "breaker_policy": gateway.breakers.settings_for(
                    BreakerKey.endpoint(endpoint.id)
                ).policy,
                "breaker": _breaker(views[BreakerKey.endpoint(endpoint.id)]),
                "mappings": [
                    {
                        "model": model,
                        "breaker": _breaker(views[BreakerKey.mapping(endpoint.id, model)]),
                    }
                    for model in models.get(endpoint.id, [])
                ],
            }
        )
    return rows


def _breaker(view: BreakerView) -> dict[str, Any]:
    figures = view.figures
    return {
        "state": view.state,
        "blocked": view.blocked,
        "consecutive_failures": view.consecutive_failures,
        "trips": view.trips,
        "cooldown_ms": view.cooldown_ms,
        "probe_in_ms": view.probe_in_ms,
        "calls": None if figures is None else figures.calls,
        "failed_calls": None if figures is None else figures.failed,
        "slow_calls": None if figures is None else figures.slow,
        "ramp_share": None if view.ramp_share is None else format(view.ramp_share, "f"),
    }
