"""The key API (contract §3 "Keys"), for admin keys: ``POST /v1/admin/keys`` creates a key and
shows its secret once, ``GET /v1/admin/keys`` lists them (never a secret or its hash),
``POST /v1/admin/keys/{id}/revoke`` revokes one.

Each change is an event on the key's stream (``KeyCreated``, ``KeyRevoked``) with the admin
key's id as the actor, written by ``ledger.apikeys`` as ``waybill keys`` writes it; so a key
created or revoked here acts on every worker and replica the way one from the CLI does (the
keys read model is brought up to date before the answer; a worker's cached key is refused
by its first append once the key's stream has moved, ``ledger.apikeys.KeyCache``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Final

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from ledger import apikeys
from ledger.events import KeyLimits
from ledger.store import EventStore
from ledger.types import MONEY_LIMIT, money_str, parse_money
from router.config import Config
from router.errors import invalid_request, key_not_found, permission_denied
from router.http import openapi as api_doc
from router.request.gateway import Caller, Gateway
from router.request.scope import PROVIDER_PREFIX, bad_scope_name

__all__ = ["KeyRequest", "key_json", "key_request", "keys_router"]

Authenticate = Callable[[Request], Awaitable[Caller]]

_JSON: Final = "application/json"
_WINDOWS: Final = ("day", "month", "total")


@dataclass(frozen=True, slots=True)
class KeyRequest:
    """A key to create, as the key API's body (or the console's form) asks for it."""

    workspace: str
    role: apikeys.Role = "client"
    name: str | None = None
    budget: tuple[Decimal, apikeys.Window] | None = None
    endpoints: tuple[str, ...] | None = None
    expires_at: datetime | None = None
    limits: KeyLimits | None = None


def key_request(body: object, config: Config, now: datetime) -> KeyRequest:
    """The key ``body`` asks for, checked against the serving ``config`` at ``now``: 400
    ``invalid_request`` naming the field otherwise. Fields the contract does not name are
    ignored (contract §3: more are welcome)."""
    if not isinstance(body, Mapping):
        raise invalid_request("request body must be a JSON object")
    workspace = body.get("workspace")
    if not isinstance(workspace, str) or config.workspace(workspace) is None:
        known = ", ".join(w.id for w in config.workspaces) or "none"
        raise invalid_request(
            f"workspace must be a workspace of the serving config (it has: {known})",
            param="workspace",
        )
    role = body.get("role", "client")
    if not isinstance(role, str) or not apikeys.is_role(role):
        raise invalid_request(f"role must be one of {', '.join(apikeys.ROLES)}", param="role")
    return KeyRequest(
        workspace,
        role,
        _name(body.get("name")),
        _budget(body.get("budget")),
        _endpoints(body.get("endpoints"), config),
        _expiry(body.get("expires_at"), now),
        key_limits(body.get("limits")),
    )


def _name(value: object) -> str | None:
    if value is None:
        return None
    # The length is the one given (the schema's maxLength), before blanks around are dropped.
    if not isinstance(value, str) or len(value) > 200:
        raise invalid_request("name must be a string of at most 200 characters", param="name")
    try:
        return apikeys.key_name_of(value)
    except ValueError as error:
        raise invalid_request(f"name: {error}", param="name") from None


def _budget(value: object) -> tuple[Decimal, apikeys.Window] | None:
    if value is None:
        return None
    limit = value.get("limit_usd") if isinstance(value, Mapping) else None
    window = value.get("window", "day") if isinstance(value, Mapping) else None
    amount = parse_money(limit) if isinstance(limit, str) else None
    if amount is None or amount < 0:
        raise invalid_request(
            f"budget.limit_usd must be a non-negative decimal string (5.00) below {MONEY_LIMIT}",
            param="budget.limit_usd",
        )
    if window == "day" or window == "month" or window == "total":
        return amount, window
    raise invalid_request("budget.window must be day, month or total", param="budget.window")


def _endpoints(value: object, config: Config) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise invalid_request(
            "endpoints must be a non-empty list of endpoint ids and provider:NAME labels",
            param="endpoints",
        )
    names = tuple(sorted({v.strip() for v in value}))
    for name in names:
        why = bad_scope_name(name) if name else "an empty name"
        if why is None and not name.startswith(PROVIDER_PREFIX) and config.endpoint(name) is None:
            why = f"{name!r} is not an endpoint of the serving config"
        if why is not None:
            raise invalid_request(f"endpoints: {why}", param="endpoints")
    return names


def _expiry(value: object, now: datetime) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise invalid_request("expires_at must be an ISO 8601 date or instant", param="expires_at")
    try:
        return apikeys.parse_expiry(value, now)
    except ValueError as error:
        raise invalid_request(f"expires_at: {error}", param="expires_at") from None


def key_limits(value: object) -> KeyLimits | None:
    """A key's own ``limits`` as the key API takes them: ``{"requests_per_minute",
    "tokens_per_minute"}``, positive integers, at least one; None when not given."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise invalid_request(
            "limits must be an object {requests_per_minute, tokens_per_minute}", param="limits"
        )
    given: dict[str, int] = {}
    for name in ("requests_per_minute", "tokens_per_minute"):
        figure = value.get(name)
        if figure is None:
            continue
        # bool is an int to Python, never a count to a client.
        if isinstance(figure, bool) or not isinstance(figure, int) or not 0 < figure < 2**53:
            field = f"limits.{name}"
            raise invalid_request(f"{field} must be a positive integer", param=field)
        given[name] = figure
    if not given:
        raise invalid_request(
            "limits must set requests_per_minute, tokens_per_minute or both", param="limits"
        )
    return KeyLimits(**given)


def _instant(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat().replace("+00:00", "Z")


def key_json(key: apikeys.KeyListing, now: datetime) -> dict[str, Any]:
    """A key as the key API shows it: never its secret, nor its hash."""
    return {
        "key_id": key.key_id,
        "name": key.name,
        "workspace": key.workspace,
        "role": key.role,
        "state": key.state(now),
        "created_at": _instant(key.created_at),
        "created_by": key.created_by,
        "revoked_at": _instant(key.revoked_at),
        "expires_at": _instant(key.expires_at),
        "budget": None
        if key.budget is None
        else {"limit_usd": money_str(key.budget[0]), "window": key.budget[1]},
        "endpoints": None if key.endpoints is None else list(key.endpoints),
        "limits": None if key.limits is None else key.limits.model_dump(exclude_none=True),
    }


async def create_key_as(caller: Caller, store: EventStore, wanted: KeyRequest) -> apikeys.NewKey:
    """Create the key ``wanted`` with ``caller`` (an admin key) as the actor recorded."""
    return await apikeys.create_key(
        store,
        wanted.workspace,
        wanted.role,
        created_by=caller.key_id,
        budget=wanted.budget,
        endpoints=wanted.endpoints,
        name=wanted.name,
        expires_at=wanted.expires_at,
        limits=wanted.limits,
    )


async def revoke_key_as(caller: Caller, store: EventStore, key_id: str) -> apikeys.KeyListing:
    """Revoke ``key_id`` with ``caller`` as the actor (again: nothing new is recorded); 404
    ``key_not_found`` for a key there is not."""
    try:
        await apikeys.revoke_key(store, key_id, revoked_by=caller.key_id)
    except apikeys.UnknownKey:
        raise key_not_found(key_id) from None
    listed = await apikeys.key_listing(store, key_id)
    if listed is None:  # recorded, yet not in the read model: it was brought up to date
        raise key_not_found(key_id)
    return listed


def _admin(caller: Caller, what: str) -> None:
    if caller.role != "admin":
        raise permission_denied(f"{what} takes an admin key")


def keys_router(authenticate: Authenticate, serving: Callable[[], Gateway]) -> APIRouter:
    """``serving``: the gateway new requests go to (its config says which workspaces and
    endpoints a key may name)."""
    router = APIRouter()

    @router.post("/v1/admin/keys", openapi_extra=api_doc.CREATE_KEY, status_code=201)
    async def create(request: Request) -> Response:
        caller = await authenticate(request)
        _admin(caller, "creating a key")
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            raise invalid_request("request body is not valid JSON") from None
        now = datetime.now(UTC)
        wanted = key_request(body, serving().config, now)
        store: EventStore = request.app.state.store
        new = await create_key_as(caller, store, wanted)
        listed = await apikeys.key_listing(store, new.key_id)
        if listed is None:  # never: create_key brings the read model up to date
            raise key_not_found(new.key_id)
        answer = {**key_json(listed, now), "secret": new.secret}
        return Response(orjson.dumps(answer), status_code=201, media_type=_JSON)

    @router.get("/v1/admin/keys", openapi_extra=api_doc.LIST_KEYS)
    async def list_keys(request: Request) -> Response:
        caller = await authenticate(request)
        _admin(caller, "listing keys")
        workspace = request.query_params.get("workspace")
        store: EventStore = request.app.state.store
        now = datetime.now(UTC)
        keys = await apikeys.list_keys(store, workspace)
        body = {"data": [key_json(key, now) for key in keys], "next_cursor": None}
        return Response(orjson.dumps(body), media_type=_JSON)

    @router.post("/v1/admin/keys/{key_id}/revoke", openapi_extra=api_doc.REVOKE_KEY)
    async def revoke(key_id: str, request: Request) -> Response:
        caller = await authenticate(request)
        _admin(caller, "revoking a key")
        listed = await revoke_key_as(caller, request.app.state.store, key_id)
        return Response(orjson.dumps(key_json(listed, datetime.now(UTC))), media_type=_JSON)

    return router
