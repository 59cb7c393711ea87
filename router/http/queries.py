"""The ledger query API (contract §3 "Ledger queries"): request views, explanations, raw events,
search, and the hash-chain check.

A thin edge: authenticate, parse and bound the query values (a bad one is a 400
``invalid_request`` naming the parameter), apply the caller's read scope from
:mod:`router.http.access`, call :mod:`ledger.views.queries` or :mod:`ledger.views.explain`, write
JSON.
A request the caller may not read gets the very answer a request that does not exist gets.

Lists are ``{"data": [...], "next_cursor": "..." | null}`` with ``limit`` (1..500, default
100) and an opaque ``cursor`` that the previous page handed out.
"""

from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Final

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from ledger.audit.verify import record_verification, verify_chain
from ledger.events import RequestReceived
from ledger.store import EventStore, RecordedEvent
from ledger.store.archived import ArchiveError
from ledger.views.explain import explain, render_text
from ledger.views.queries import (
    REQUEST_STATUSES,
    RequestArchived,
    RequestKey,
    RequestSearch,
    find_request_view,
    read_request_events,
    request_trail,
    request_view_json,
    search_request_views,
)
from router.errors import (
    GatewayError,
    invalid_request,
    ledger_unavailable,
    permission_denied,
    request_not_found,
)
from router.http import openapi as api_doc
from router.http.access import can_read_request, can_verify_ledger, narrowed
from router.request.gateway import Caller

_log = logging.getLogger("waybill.queries")

__all__ = [
    "DEFAULT_LIMIT",
    "MAX_LIMIT",
    "check_readable",
    "decode_cursor",
    "encode_cursor",
    "instant_param",
    "limit_param",
    "queries_router",
    "request_cursor",
    "request_search",
]

DEFAULT_LIMIT: Final = 100
MAX_LIMIT: Final = 500
_JSON: Final = "application/json"
_TEXT: Final = "text/plain; charset=utf-8"

Authenticate = Callable[[Request], Awaitable[Caller]]


def queries_router(authenticate: Authenticate) -> APIRouter:
    """The query routes, authenticating each call with ``authenticate``."""
    router = APIRouter()

    @router.get("/v1/requests", openapi_extra=api_doc.SEARCH_REQUESTS)
    async def search_requests(request: Request) -> Response:
        caller = await authenticate(request)
        params = request.query_params
        limit = limit_param(params)
        search = _search(caller, params)
        after = request_cursor(params.get("cursor"))
        if search is None:  # the caller asked for a workspace or key it may not read
            return _json({"data": [], "next_cursor": None})
        rows, next_key = await search_request_views(
            _store(request).engine, search, limit=limit, after=after
        )
        next_cursor = None
        if next_key is not None:
            next_cursor = encode_cursor("requests", [next_key[0].isoformat(), next_key[1]])
        return _json({"data": [request_view_json(r) for r in rows], "next_cursor": next_cursor})

    @router.get("/v1/requests/{request_id}", openapi_extra=api_doc.REQUEST_VIEW)
    async def request_view(request_id: str, request: Request) -> Response:
        caller = await authenticate(request)
        row = await find_request_view(_store(request).engine, request_id)
        if row is None or not can_read_request(caller, row["workspace"], row["key_id"]):
            raise request_not_found(request_id)
        return _json(request_view_json(row))

    @router.get("/v1/requests/{request_id}/explain", openapi_extra=api_doc.EXPLAIN_REQUEST)
    async def explain_request(request_id: str, request: Request) -> Response:
        caller = await authenticate(request)
        text = _format(request.query_params)
        trail = await request_trail_of(request, request_id)
        check_readable(caller, request_id, trail[:1])
        explanation = explain(trail)
        if text:
            return Response(render_text(explanation).encode(), media_type=_TEXT)
        return _json(explanation)

    @router.get("/v1/requests/{request_id}/events", openapi_extra=api_doc.REQUEST_EVENTS)
    async def request_events(request_id: str, request: Request) -> Response:
        caller = await authenticate(request)
        params = request.query_params
        limit = limit_param(params)
        after = _events_cursor(params.get("cursor"))
        engine = _store(request).engine
        first = await read_request_events(engine, request_id, limit=1)
        if first and first[0].version == 1:
            check_readable(caller, request_id, first)
            page = await read_request_events(
                engine, request_id, after_version=after, limit=limit + 1
            )
        else:  # none live, or not its first: archived months may hold them
            trail = await request_trail_of(request, request_id)
            check_readable(caller, request_id, trail[:1])
            page = [e for e in trail if e.version > after][: limit + 1]
        next_cursor = None
        if len(page) > limit:
            page = page[:limit]
            next_cursor = encode_cursor("events", [page[-1].version])
        return _json({"data": [e.as_json() for e in page], "next_cursor": next_cursor})

    @router.get("/v1/ledger/verify", openapi_extra=api_doc.VERIFY_LEDGER)
    async def verify_ledger(request: Request) -> Response:
        caller = await authenticate(request)
        if not can_verify_ledger(caller):
            raise permission_denied("verifying the ledger needs an admin or auditor key")
        store = _store(request)
        result = await verify_chain(store)
        await record_verification(store.engine, result, verified_by=caller.key_id)
        return _json(result.as_json())

    return router


async def request_trail_of(request: Request, request_id: str) -> list[RecordedEvent]:
    """All of a request's events, those of archived months read from the gateway's archive
    directory (``WAYBILL_ARCHIVE_DIR``; ``ledger.views.queries.request_trail``)."""
    archive = request.app.state.settings.archive_dir
    try:
        return await request_trail(_store(request).engine, request_id, archive)
    except RequestArchived:
        raise request_not_found(
            request_id,
            "it was recorded in an archived month, and this gateway has no archive directory "
            "(WAYBILL_ARCHIVE_DIR)",
        ) from None
    except ArchiveError as error:
        _log.error("request %s: the archive cannot be read: %s", request_id, error)
        raise ledger_unavailable() from None


def _store(request: Request) -> EventStore:
    store: EventStore = request.app.state.store
    return store


def _json(body: Any) -> Response:
    return Response(orjson.dumps(body), media_type=_JSON)


def check_readable(caller: Caller, request_id: str, first: list[RecordedEvent]) -> None:
    """404 unless the request exists and ``caller`` may read it (the same 404 either way)."""
    received = first[0].event() if first else None
    if not isinstance(received, RequestReceived) or not can_read_request(
        caller, received.workspace, received.key_id
    ):
        raise request_not_found(request_id)


# --- query values ------------------------------------------------------------------------


def limit_param(params: Mapping[str, str]) -> int:
    raw = params.get("limit")
    if raw is None:
        return DEFAULT_LIMIT
    # ASCII digits only: "²" is a digit to str.isdigit, and not a number to int().
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_LIMIT:
        raise invalid_request(
            f"limit must be an integer from 1 to {MAX_LIMIT}, not {raw!r}", param="limit"
        )
    return int(raw)


def _format(params: Mapping[str, str]) -> bool:
    """True for ``format=text``; JSON is the default."""
    value = params.get("format", "json")
    if value not in ("json", "text"):
        raise invalid_request(f"format must be json or text, not {value!r}", param="format")
    return value == "text"


def instant_param(params: Mapping[str, str], name: str) -> datetime | None:
    raw = params.get(name)
    if raw is None:
        return None
    try:
        return _utc(datetime.fromisoformat(raw))
    except (ValueError, OverflowError):
        raise invalid_request(
            f"{name} must be an ISO 8601 date or time (2026-11-30, 2026-11-30T12:00:00Z), "
            f"not {raw!r}",
            param=name,
        ) from None


def _utc(moment: datetime) -> datetime:
    """In UTC (a date or a time without offset is UTC already). OverflowError when the UTC
    time falls outside the calendar (0001-01-01T00:00+01:00): as malformed as any other."""
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _search(caller: Caller, params: Mapping[str, str]) -> RequestSearch | None:
    """The search the caller asked for, narrowed to its read scope; None if the filters it
    gave fall wholly outside that scope."""
    return request_search(
        caller,
        status=params.get("status"),
        model=params.get("model"),
        endpoint=params.get("endpoint"),
        workspace=params.get("workspace"),
        key_id=params.get("key_id"),
        since=instant_param(params, "since"),
        until=instant_param(params, "until"),
    )


def request_search(
    caller: Caller,
    *,
    status: str | None = None,
    model: str | None = None,
    endpoint: str | None = None,
    workspace: str | None = None,
    key_id: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> RequestSearch | None:
    """A search of request views as ``caller`` may run it (the API's and the console's):
    its scope from :func:`router.http.access.narrowed`; None when the workspace or key asked for
    lies outside it. A status that is not one of ``REQUEST_STATUSES`` is a 400."""
    if status is not None and status not in REQUEST_STATUSES:
        raise invalid_request(
            f"status must be one of {', '.join(REQUEST_STATUSES)}, not {status!r}",
            param="status",
        )
    scope = narrowed(caller, workspace, key_id)
    if scope is None:
        return None
    return RequestSearch(
        workspace=scope.workspace,
        key_id=scope.key_id,
        status=status,
        model=model,
        endpoint=endpoint,
        since=since,
        until=until,
    )


# --- cursors: opaque to clients, checked on the way back ----------------------------------


def encode_cursor(kind: str, values: list[Any]) -> str:
    return base64.urlsafe_b64encode(orjson.dumps([kind, *values])).rstrip(b"=").decode()


def _bad_cursor() -> GatewayError:
    return invalid_request("cursor is not one this endpoint handed out", param="cursor")


def decode_cursor(kind: str, cursor: str) -> list[Any]:
    try:
        decoded = orjson.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError):
        decoded = None
    if not isinstance(decoded, list) or not decoded or decoded[0] != kind:
        raise _bad_cursor()
    return decoded[1:]


def request_cursor(cursor: str | None) -> RequestKey | None:
    if cursor is None:
        return None
    values = decode_cursor("requests", cursor)
    if len(values) != 2 or not all(isinstance(v, str) for v in values):
        raise _bad_cursor()
    try:
        return _utc(datetime.fromisoformat(values[0])), values[1]
    except (ValueError, OverflowError):
        raise _bad_cursor() from None


def _events_cursor(cursor: str | None) -> int:
    if cursor is None:
        return 0
    values = decode_cursor("events", cursor)
    if len(values) != 1 or type(values[0]) is not int or values[0] < 0:
        raise _bad_cursor()
    return int(values[0])
