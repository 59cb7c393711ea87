"""The console's Keys page (contract §3 "Console"), for admin keys: the keys listed (never a
secret), a form to create one (its secret shown once, on the page that answers the form)
and a button to revoke one, each form with the session's CSRF token.

It calls what the key API calls (``router.http.keys``): the same checks of a key's fields,
the same events with the signed-in admin key as the actor.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any, Final

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response
from starlette.datastructures import FormData

from ledger import apikeys
from ledger.store import EventStore
from router.errors import GatewayError, permission_denied
from router.http.console.web import PREFIX, Console, Visit, form_text, query_values
from router.http.keys import create_key_as, key_request, revoke_key_as

__all__ = ["add_key_pages", "key_names_of"]

_WINDOWS: Final = ("day", "month", "total")


async def key_names_of(request: Request, key_ids: Iterable[str | None]) -> dict[str, str]:
    """The names of the keys a page shows by id: the console shows a key's name beside its
    id wherever it shows the id (requests, spend, budgets, unknown usage)."""
    store: EventStore = request.app.state.store
    return await apikeys.key_names(store, [k for k in key_ids if k])


def add_key_pages(router: APIRouter, console: Console) -> None:
    async def keys_page(request: Request, visit: Visit) -> Response:
        _admin_only(visit)
        return await _keys(console, request, visit)

    async def create(request: Request, visit: Visit) -> Response:
        _admin_only(visit)
        form = await request.form()
        try:
            wanted = key_request(_body(form), console.serving_config(), datetime.now(UTC))
            new = await create_key_as(visit.caller, _store(request), wanted)
        except GatewayError as error:
            return await _keys(console, request, visit, problem=error, form=form)
        return await _keys(console, request, visit, created=new)

    async def revoke(request: Request, visit: Visit) -> Response:
        _admin_only(visit)
        key_id = request.path_params["key_id"]
        await revoke_key_as(visit.caller, _store(request), key_id)
        return RedirectResponse(f"{PREFIX}/keys?revoked={key_id}", status_code=303)

    console.route(router, "GET", "/keys", keys_page)
    console.route(router, "POST", "/keys", create)
    console.route(router, "POST", "/keys/{key_id}/revoke", revoke)


def _admin_only(visit: Visit) -> None:
    if visit.caller.role != "admin":
        raise permission_denied("the Keys page takes an admin key")


def _body(form: FormData) -> dict[str, Any]:
    """The form as the key API's body, so that one function checks both."""
    body: dict[str, Any] = {
        "workspace": form_text(form, "workspace"),
        "role": form_text(form, "role") or "client",
        "name": form_text(form, "name"),
        "expires_at": form_text(form, "expires_at"),
    }
    limit = form_text(form, "budget_usd")
    if limit is not None:
        body["budget"] = {"limit_usd": limit, "window": form_text(form, "budget_window") or "day"}
    endpoints = form_text(form, "endpoints")
    if endpoints is not None:
        body["endpoints"] = [part.strip() for part in endpoints.split(",") if part.strip()]
    limits = {}
    for name in ("requests_per_minute", "tokens_per_minute"):
        figure = form_text(form, name)
        if figure is not None:
            # A figure that is not a whole number is passed on as text: refused, named.
            limits[name] = int(figure) if figure.isdecimal() else figure
    if limits:
        body["limits"] = limits
    return body


async def _keys(
    console: Console,
    request: Request,
    visit: Visit,
    *,
    problem: GatewayError | None = None,
    form: FormData | None = None,
    created: apikeys.NewKey | None = None,
) -> Response:
    keys = await apikeys.list_keys(_store(request))
    config = console.serving_config()
    return console.render(
        request,
        "keys.html",
        visit,
        status=problem.status if problem else (201 if created else 200),
        keys=keys,
        now=datetime.now(UTC),
        workspaces=[w.id for w in config.workspaces],
        roles=apikeys.ROLES,
        windows=_WINDOWS,
        problem=problem,
        asked={} if form is None else {k: v for k, v in form.items() if isinstance(v, str)},
        created=created,
        revoked=query_values(request, "revoked")["revoked"],
    )


def _store(request: Request) -> EventStore:
    store: EventStore = request.app.state.store
    return store
