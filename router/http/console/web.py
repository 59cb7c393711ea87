"""The console's edge: who is signed in, CSRF on every form, pages rendered from templates.

Each console route is a handler of ``(request, visit)`` wrapped by :meth:`Console.route`,
which (1) reads the session cookie and checks its key again, as the API checks a key on
every call: a key revoked, unknown or no longer of a console role ends the session and sends
the browser to the sign-in page; (2) on a POST, checks the form's CSRF token; (3) renders a
:class:`router.errors.GatewayError` the handler raised as an HTML page with the error's
status and message, so a request outside the caller's scope reads exactly as one that does
not exist; (4) adds the headers every page carries (no caching, no framing, no script).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.datastructures import FormData

from ledger import apikeys
from router.config import Config
from router.errors import GatewayError, permission_denied
from router.http.access import (
    can_reconcile,
    can_settle,
    can_use_console,
    can_verify_ledger,
    read_scope,
)
from router.http.console.sessions import (
    CSRF_FIELD,
    SESSION_COOKIE,
    SESSION_TTL_S,
    Session,
    SessionKeeper,
    is_signed_out,
)
from router.request.gateway import Caller

__all__ = ["Console", "Identify", "Visit"]

log = logging.getLogger("waybill.console")

PREFIX: Final = "/console"
_SECURITY_HEADERS: Final = {
    "cache-control": "no-store",
    "content-security-policy": (
        "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "referrer-policy": "same-origin",
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
}


@dataclass(frozen=True)
class Identify:
    """How the app turns a secret (sign-in) or a key id (every later request) into the
    caller, with the API's own rules: 401 ``invalid_api_key`` when unknown, revoked or of a
    workspace the config no longer has."""

    by_secret: Callable[[Request, str], Awaitable[Caller]]
    by_key_id: Callable[[Request, str], Awaitable[Caller]]


@dataclass(frozen=True)
class Visit:
    """A signed-in request: the caller (its key read again just now) and its session."""

    caller: Caller
    session: Session
    csrf: str
    key_name: str | None = None  # the signed-in key's name, shown beside its id


class _SignInFirst(Exception):
    def __init__(self, reason: str | None) -> None:
        self.reason = reason


Handler = Callable[[Request, Visit], Awaitable[Response]]


class Console:
    def __init__(
        self,
        identify: Identify,
        keeper: SessionKeeper,
        serving_config: Callable[[], Config],
    ) -> None:
        self.identify = identify
        self.keeper = keeper
        self.serving_config = serving_config
        self._templates = Environment(
            loader=PackageLoader("router.http.console", "templates"),
            autoescape=select_autoescape(default=True, default_for_string=True),
            trim_blocks=True,
            lstrip_blocks=True,
        )

    # --- pages ------------------------------------------------------------------------

    def render(
        self,
        request: Request,
        template: str,
        visit: Visit | None,
        *,
        status: int = 200,
        **context: Any,
    ) -> HTMLResponse:
        caller = visit.caller if visit else None
        html = self._templates.get_template(template).render(
            visit=visit,
            caller=caller,
            scope=read_scope(caller) if caller else None,
            may_settle=caller is not None and can_settle(caller),
            may_reconcile=caller is not None and can_reconcile(caller),
            may_verify=caller is not None and can_verify_ledger(caller),
            may_manage_keys=caller is not None and caller.role == "admin",
            csrf_field=CSRF_FIELD,
            path=request.url.path,
            url_with=_url_with(request),
            **{"key_names": {}, **context},
        )
        return HTMLResponse(html, status_code=status)

    def error_page(self, request: Request, visit: Visit | None, error: GatewayError) -> Response:
        return self.render(request, "error.html", visit, status=error.status, error=error)

    # --- routes -----------------------------------------------------------------------

    def route(self, router: APIRouter, method: str, path: str, handler: Handler) -> None:
        """Serve ``handler`` at ``PREFIX + path`` for signed-in callers only."""

        async def endpoint(request: Request) -> Response:
            visit = None
            try:
                visit = await self.visit(request)
                if method == "POST":
                    await self.check_csrf(request, visit)
                response = await handler(request, visit)
            except _SignInFirst as signed_out:
                response = self.to_sign_in(request, signed_out.reason)
            except GatewayError as error:
                response = self.error_page(request, visit, error)
            return secured(response)

        router.add_api_route(PREFIX + path, endpoint, methods=[method], include_in_schema=False)

    async def visit(self, request: Request) -> Visit:
        session = self.keeper.read(request.cookies.get(SESSION_COOKIE))
        if session is None:
            raise _SignInFirst(None)
        if await is_signed_out(request.app.state.store.engine, session.session_id):
            self.keeper.end(session)  # signed out through another process
            raise _SignInFirst(None)
        try:
            caller = await self.identify.by_key_id(request, session.key_id)
        except GatewayError:
            self.keeper.end(session)
            raise _SignInFirst(
                "your session ended: its key was revoked, expired or is unknown"
            ) from None
        if (
            caller.role != session.role
            or caller.workspace.id != session.workspace
            or not can_use_console(caller)
        ):
            self.keeper.end(session)
            raise _SignInFirst("your session ended: its key changed")
        names = await apikeys.key_names(request.app.state.store, [caller.key_id])
        return Visit(caller, session, self.keeper.csrf_token(session), names.get(caller.key_id))

    async def check_csrf(self, request: Request, visit: Visit) -> None:
        form = await request.form()
        token = form.get(CSRF_FIELD)
        if not self.keeper.csrf_ok(visit.session, token if isinstance(token, str) else None):
            raise csrf_refused()

    def to_sign_in(self, request: Request, reason: str | None) -> Response:
        query: dict[str, str] = {}
        if request.method == "GET":
            target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            query["next"] = target
        if reason:
            query["ended"] = reason
        location = f"{PREFIX}/sign-in" + (f"?{urlencode(query)}" if query else "")
        response = RedirectResponse(location, status_code=303)
        if reason:
            clear_session(response)
        return response


def csrf_refused() -> GatewayError:
    return permission_denied(
        "this form's CSRF token is missing or not this sign-in's: reload the page and send it again"
    )


def secured(response: Response) -> Response:
    for name, value in _SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    return response


def set_session(response: Response, cookie: str, *, https: bool) -> None:
    response.set_cookie(
        SESSION_COOKIE,
        cookie,
        max_age=SESSION_TTL_S,
        path=PREFIX,
        httponly=True,
        samesite="lax",
        secure=https,
    )


def clear_session(response: Response) -> None:
    response.delete_cookie(SESSION_COOKIE, path=PREFIX, httponly=True, samesite="lax")


def form_text(form: FormData, name: str) -> str | None:
    """A text field of the form, stripped; None when absent or blank (or a file)."""
    value = form.get(name)
    if not isinstance(value, str) or not value.strip():
        return None
    return value.strip()


def _url_with(request: Request) -> Callable[..., str]:
    """``url_with(cursor=...)``: this page's URL with some query values replaced (None
    removes one), for pagination and filter links."""

    def build(**changes: str | None) -> str:
        params: dict[str, str] = dict(request.query_params)
        for name, value in changes.items():
            if value is None:
                params.pop(name, None)
            else:
                params[name] = value
        query = urlencode(params)
        return quote(request.url.path) + (f"?{query}" if query else "")

    return build


def query_values(request: Request, *names: str) -> Mapping[str, str | None]:
    """The named query values, blank ones as None (an empty filter field means any)."""
    params = request.query_params
    return {name: (params.get(name) or "").strip() or None for name in names}
