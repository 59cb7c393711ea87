"""The console's pages of requests and health, and signing in and out.

Thin like the API's routes: parse the query, ask :mod:`router.http.access` (through the same
helpers the API uses) what the caller may read, call the ledger's queries, render.
"""

from __future__ import annotations

import secrets
import time
from datetime import UTC, datetime
from typing import Any, Final

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response
from sqlalchemy import select

from ledger.audit.verify import last_verification
from ledger.store import EventStore
from ledger.store.schema import ledger_head
from ledger.views import all_projections
from ledger.views.explain import explain
from ledger.views.projection import ProjectionRunner
from ledger.views.queries import (
    REQUEST_STATUSES,
    recent_failures,
    search_request_views,
)
from ledger.views.spend_queries import attempt_owner
from router.errors import GatewayError, invalid_request, request_not_found
from router.http.access import can_read_request, can_use_console, can_verify_ledger, read_scope
from router.http.console.charts import timeline_chart
from router.http.console.health import endpoint_states, visible_endpoints, visible_groups
from router.http.console.keys import key_names_of
from router.http.console.sessions import CSRF_FIELD, SIGN_IN_COOKIE, record_sign_out
from router.http.console.timeline import timeline
from router.http.console.web import (
    PREFIX,
    Console,
    Visit,
    clear_session,
    form_text,
    query_values,
    secured,
    set_session,
)
from router.http.proofs import prove_as
from router.http.queries import (
    check_readable,
    encode_cursor,
    request_cursor,
    request_search,
    request_trail_of,
)
from router.request.gateway import Gateway

__all__ = ["add_request_pages"]

PAGE_SIZE: Final = 50
_MAX_EVENTS: Final = 1000


def add_request_pages(router: APIRouter, console: Console) -> None:
    @router.get(PREFIX, include_in_schema=False)
    async def home() -> Response:
        return secured(RedirectResponse(f"{PREFIX}/requests", status_code=303))

    @router.get(f"{PREFIX}/sign-in", include_in_schema=False)
    async def sign_in_page(request: Request) -> Response:
        return _sign_in_form(console, request, None, 200, request.query_params.get("next"))

    @router.post(f"{PREFIX}/sign-in", include_in_schema=False)
    async def sign_in(request: Request) -> Response:
        form = await request.form()
        wanted = form_text(form, "next")
        token = form.get(CSRF_FIELD)
        if not console.keeper.sign_in_ok(
            request.cookies.get(SIGN_IN_COOKIE), token if isinstance(token, str) else None
        ):
            return _sign_in_form(console, request, "the form expired: sign in again", 403, wanted)
        secret = form_text(form, "api_key")
        if secret is None:
            return _sign_in_form(console, request, "give an API key", 400, wanted)
        try:
            caller = await console.identify.by_secret(request, secret)
        except GatewayError:
            return _sign_in_form(
                console, request, "this key is unknown or revoked (or expired)", 401, wanted
            )
        if not can_use_console(caller):
            return _sign_in_form(
                console,
                request,
                f"a {caller.role} key cannot sign in: the console takes admin, auditor "
                "and finance keys",
                403,
                wanted,
            )
        _, cookie = console.keeper.issue(caller.key_id, caller.role, caller.workspace.id)
        response = RedirectResponse(_next(wanted), status_code=303)
        set_session(response, cookie, https=request.url.scheme == "https")
        response.delete_cookie(SIGN_IN_COOKIE, path=f"{PREFIX}/sign-in")
        return secured(response)

    async def sign_out(request: Request, visit: Visit) -> Response:
        console.keeper.end(visit.session)
        await record_sign_out(_store(request).engine, visit.session, time.time())
        response = RedirectResponse(f"{PREFIX}/sign-in?ended=you+signed+out", status_code=303)
        clear_session(response)
        return response

    async def requests_page(request: Request, visit: Visit) -> Response:
        return await _requests(console, request, visit)

    async def request_page(request: Request, visit: Visit) -> Response:
        request_id = request.path_params["request_id"]
        trail = await request_trail_of(request, request_id)
        check_readable(visit.caller, request_id, trail[:1])
        explanation = explain(trail)
        steps = timeline(explanation, trail)
        return console.render(
            request,
            "request.html",
            visit,
            explanation=explanation,
            timeline=steps,
            timeline_svg=timeline_chart(
                "the attempts in time", steps.bars, steps.total_ms, steps.late
            ),
            proof=console.serving_config().checkpoints is not None,
            key_names=await key_names_of(request, [explanation.get("key_id")]),
        )

    async def events_page(request: Request, visit: Visit) -> Response:
        request_id = request.path_params["request_id"]
        trail = (await request_trail_of(request, request_id))[:_MAX_EVENTS]
        check_readable(visit.caller, request_id, trail[:1])
        shown = [(e, orjson.dumps(e.as_json(), option=orjson.OPT_INDENT_2).decode()) for e in trail]
        return console.render(
            request, "events.html", visit, request_id=request_id, events=shown, cut=_MAX_EVENTS
        )

    async def proof(request: Request, visit: Visit) -> Response:
        request_id = request.path_params["request_id"]
        document = await prove_as(
            visit.caller, _store(request), console.serving_config(), request_id, None
        )
        return Response(
            document,
            media_type="application/json",
            headers={"content-disposition": f'attachment; filename="{request_id}-proof.json"'},
        )

    async def attempt(request: Request, visit: Visit) -> Response:
        attempt_id = request.path_params["attempt_id"]
        owner = await attempt_owner(_store(request).engine, attempt_id)
        if owner is None or not can_read_request(visit.caller, owner[1], owner[2]):
            raise request_not_found(attempt_id)
        return RedirectResponse(f"{PREFIX}/requests/{owner[0]}", status_code=303)

    async def health(request: Request, visit: Visit) -> Response:
        gateway: Gateway = request.app.state.gateway
        store = _store(request)
        scope = read_scope(visit.caller)
        failures = await recent_failures(store.engine, workspace=scope.workspace)
        ledger = None
        if can_verify_ledger(visit.caller):
            async with store.engine.connect() as conn:
                head = (await conn.execute(select(ledger_head.c.position))).scalar_one()
            ledger = {
                "head": int(head),
                "lag": await ProjectionRunner(store, all_projections()).lag(),
                "verified": await last_verification(store.engine),
            }
        return console.render(
            request,
            "health.html",
            visit,
            endpoints=await endpoint_states(gateway, visit.caller),
            failures=failures,
            ledger=ledger,
            now=datetime.now(UTC),
        )

    console.route(router, "POST", "/sign-out", sign_out)
    console.route(router, "GET", "/requests", requests_page)
    console.route(router, "GET", "/requests/{request_id}", request_page)
    console.route(router, "GET", "/requests/{request_id}/events", events_page)
    console.route(router, "GET", "/requests/{request_id}/proof", proof)
    console.route(router, "GET", "/attempts/{attempt_id}", attempt)
    console.route(router, "GET", "/health", health)


async def _requests(console: Console, request: Request, visit: Visit) -> Response:
    asked = query_values(request, "status", "model", "endpoint", "workspace", "key_id")
    since, until = _when(request, "since"), _when(request, "until")
    search = request_search(
        visit.caller,
        status=asked["status"],
        model=asked["model"],
        endpoint=asked["endpoint"],
        workspace=asked["workspace"],
        key_id=asked["key_id"],
        since=since,
        until=until,
    )
    rows: list[dict[str, Any]] = []
    next_cursor = None
    if search is not None:
        after = request_cursor(request.query_params.get("cursor") or None)
        rows, next_key = await search_request_views(
            _store(request).engine, search, limit=PAGE_SIZE, after=after
        )
        if next_key is not None:
            next_cursor = encode_cursor("requests", [next_key[0].isoformat(), next_key[1]])
    config = console.serving_config()
    return console.render(
        request,
        "requests.html",
        visit,
        rows=rows,
        next_cursor=next_cursor,
        paged=bool(request.query_params.get("cursor")),
        asked=asked,
        since=request.query_params.get("since", ""),
        until=request.query_params.get("until", ""),
        statuses=REQUEST_STATUSES,
        groups=visible_groups(config, visit.caller),
        endpoints=visible_endpoints(config, visit.caller),
        workspaces=[w.id for w in config.workspaces] if visit.caller.role == "admin" else [],
        key_names=await key_names_of(request, (r["key_id"] for r in rows)),
    )


def _when(request: Request, name: str) -> datetime | None:
    """A time filter from a ``datetime-local`` field (UTC) or any ISO 8601 form."""
    raw = (request.query_params.get(name) or "").strip()
    if not raw:
        return None
    try:
        moment = datetime.fromisoformat(raw)
    except ValueError:
        raise invalid_request(
            f"{name} must be a date or a time (2026-11-30, 2026-11-30T12:00), not {raw!r}",
            param=name,
        ) from None
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _next(target: str | None) -> str:
    """Where to go after signing in: a console page, never another site."""
    if target and target.startswith(f"{PREFIX}/") and not target.startswith("//"):
        return target
    return f"{PREFIX}/requests"


def _sign_in_form(
    console: Console, request: Request, problem: str | None, status: int, wanted: str | None
) -> Response:
    nonce = secrets.token_urlsafe(24)
    response = console.render(
        request,
        "sign_in.html",
        None,
        status=status,
        problem=problem,
        ended=request.query_params.get("ended"),
        next=_next(wanted),
        token=console.keeper.sign_in_token(nonce),
    )
    response.set_cookie(
        SIGN_IN_COOKIE,
        nonce,
        max_age=3600,
        path=f"{PREFIX}/sign-in",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return secured(response)


def _store(request: Request) -> EventStore:
    store: EventStore = request.app.state.store
    return store
