"""The web console (contract §3 "Console"): server-rendered pages at ``/console`` for the
people who ask the ledger questions — why this route, what we spent, what is still unknown.

- ``web.py``: the edge every page goes through (session, CSRF, errors, headers);
- ``sessions.py``: signed session cookies and CSRF tokens;
- ``pages.py``: signing in and out, requests, a request's timeline, health;
- ``money.py``: spend and budgets, unknown usage, reconciliations;
- ``keys.py``: the keys, for admins: list, create, revoke;
- ``timeline.py``, ``charts.py``, ``health.py``: pure helpers the pages draw with;
- ``templates/``, ``static/``: Jinja2 templates and the one stylesheet. No script.

What a signed-in key may see is decided by :mod:`router.http.access`, as for the API.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.resources import files
from typing import Final

from fastapi import APIRouter
from fastapi.responses import Response

from router.config import Config
from router.http.console.keys import add_key_pages
from router.http.console.money import add_money_pages
from router.http.console.pages import add_request_pages
from router.http.console.sessions import SessionKeeper, secret_from
from router.http.console.web import PREFIX, Console, Identify

__all__ = ["Identify", "console_router", "secret_from"]

_STYLESHEET: Final = files("router.http.console").joinpath("static/console.css").read_bytes()


def console_router(
    identify: Identify, secret: bytes, serving_config: Callable[[], Config]
) -> APIRouter:
    """Every console route, none of them in the API's schema."""
    router = APIRouter()
    console = Console(identify, SessionKeeper(secret), serving_config)

    @router.get(f"{PREFIX}/static/console.css", include_in_schema=False)
    async def stylesheet() -> Response:
        return Response(
            _STYLESHEET,
            media_type="text/css; charset=utf-8",
            headers={"cache-control": "public, max-age=3600"},
        )

    add_request_pages(router, console)
    add_money_pages(router, console)
    add_key_pages(router, console)
    return router
