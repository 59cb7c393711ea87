"""Errors on the wire: a :class:`router.errors.GatewayError` (or an unexpected exception) as a
door's answer, and the request id that answer carries."""

from __future__ import annotations

import logging
from collections.abc import (
    Callable,
)
from typing import Final

import orjson
from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from ledger.store import EventStore
from ledger.store.db import is_unavailable
from router.doors import messages_wire
from router.errors import (
    ErrorCode,
    GatewayError,
    client_canceled,
    internal_error,
    invalid_request,
    ledger_unavailable,
)
from router.support.ids import new_id

log = logging.getLogger("waybill.app")

_JSON: Final = "application/json"
MESSAGES_PATH: Final = "/v1/messages"


ErrorWire = Callable[[GatewayError, str | None], tuple[int, bytes]]
"""A door's error on its wire: (status, body)."""


def chat_error(error: GatewayError, request_id: str | None) -> tuple[int, bytes]:
    return error.status, orjson.dumps(error.body(request_id))


def messages_error(error: GatewayError, request_id: str | None) -> tuple[int, bytes]:
    body = messages_wire.error_body(error, request_id)
    return messages_wire.error_status(error), orjson.dumps(body)


def error_response(
    error: GatewayError, request_id: str | None, wire: ErrorWire = chat_error
) -> Response:
    status, body = wire(error, request_id)
    return Response(body, status_code=status, media_type=_JSON, headers=error.headers())


async def refuse_nul(request: Request) -> None:
    """PostgreSQL text cannot hold NUL, so no id, name or filter contains one: a URL that
    does is malformed, refused here rather than failing a query in the database."""
    if "\x00" in request.scope["path"] or b"%00" in request.scope["query_string"]:
        raise invalid_request("the URL contains a NUL character (%00)")


def wire_of(request: Request) -> ErrorWire:
    """The error wire of the door a path belongs to: the Anthropic door's routes answer
    Anthropic's error object whatever went wrong (a 405 included)."""
    path = request.scope["path"]
    if path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/"):
        return messages_error
    return chat_error


def failure_response(request: Request, error: Exception, wire: ErrorWire = chat_error) -> Response:
    """The answer to an exception a handler raised, on the door's ``wire``: its own for a
    :class:`GatewayError`, 503 when the ledger's database could not do the work now
    (``ledger.store.db.is_unavailable``), else a bare 500 (logged, never shown): a
    constraint violated is a bug, not an outage."""
    if isinstance(error, GatewayError):
        if error.code is ErrorCode.LEDGER_UNAVAILABLE:
            _refused_in_outage(request, error)
        return error_response(error, request_id_of(request), wire)
    if isinstance(error, ClientDisconnect):
        # The client left before its body arrived: nobody reads the answer, nothing to log.
        return error_response(client_canceled(), request_id_of(request), wire)
    if is_unavailable(error):
        _refused_in_outage(request, error)
        return error_response(ledger_unavailable(), request_id_of(request), wire)
    log.exception("unexpected error serving %s", request.url.path, exc_info=error)
    return error_response(internal_error(), request_id_of(request), wire)


def _refused_in_outage(request: Request, error: Exception) -> None:
    """Counted, not logged: the outage is said once, with its count (ledger.store.outage)."""
    store: EventStore | None = getattr(request.app.state, "store", None)
    if store is not None:
        store.outage.refused(error)


def request_id_of(request: Request) -> str:
    return str(request.scope.get("state", {}).get("request_id") or new_id("req"))
