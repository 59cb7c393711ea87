"""Reconciliation over HTTP (contract §3): ``POST /v1/reconciliations`` imports a provider
usage export (CSV or JSONL body) and answers the report; ``GET /v1/reconciliations/{id}``
reads a recorded one.

Admin and finance keys only. A finance key reconciles its own workspace: lines naming
another workspace's attempts read as unmatched, and another workspace's reports (or an
admin's, which span every workspace) are 404, never 403.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from ledger.reconcile import (
    ExportError,
    ReconcileScope,
    find_reconciliation,
    import_reconciliation,
    report_json,
)
from ledger.store import EventStore
from ledger.usage_export import ExportFormat
from router import openapi as api_doc
from router.access import read_scope
from router.errors import (
    invalid_request,
    permission_denied,
    reconciliation_not_found,
)
from router.gateway import Caller

__all__ = ["MAX_EXPORT_BYTES", "reconcile_router"]

Authenticate = Callable[[Request], Awaitable[Caller]]

MAX_EXPORT_BYTES: Final = 32 * 1024 * 1024
_JSON: Final = "application/json"
_RECONCILERS: Final = frozenset({"admin", "finance"})
_FORMATS: Final[dict[str, ExportFormat]] = {
    "text/csv": "csv",
    "application/csv": "csv",
    "application/x-ndjson": "jsonl",
    "application/jsonl": "jsonl",
    "application/x-jsonlines": "jsonl",
    "application/jsonlines": "jsonl",
}


def _force(value: str | None) -> bool:
    if value in (None, "false"):
        return False
    if value == "true":
        return True
    raise invalid_request("force must be true or false", param="force")


def reconcile_router(authenticate: Authenticate) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/reconciliations", openapi_extra=api_doc.IMPORT_RECONCILIATION)
    async def import_export(request: Request) -> Response:
        caller = _reconciler(await authenticate(request))
        provider = request.query_params.get("provider") or None
        force = _force(request.query_params.get("force"))
        data = await _read_export(request)
        try:
            report = await import_reconciliation(
                _store(request),
                data,
                actor=caller.key_id,
                scope=ReconcileScope(workspace=read_scope(caller).workspace, provider=provider),
                export_format=_format(request.headers.get("content-type")),
                force=force,
            )
        except ExportError as error:
            raise invalid_request(str(error), param=error.field) from None
        return Response(orjson.dumps(report_json(report)), media_type=_JSON)

    @router.get(
        "/v1/reconciliations/{reconciliation_id}", openapi_extra=api_doc.READ_RECONCILIATION
    )
    async def read(reconciliation_id: str, request: Request) -> Response:
        caller = _reconciler(await authenticate(request))
        report = await find_reconciliation(_store(request), reconciliation_id)
        workspace = read_scope(caller).workspace
        if report is None or workspace not in (None, report.workspace):
            raise reconciliation_not_found(reconciliation_id)
        return Response(orjson.dumps(report_json(report)), media_type=_JSON)

    return router


def _reconciler(caller: Caller) -> Caller:
    if caller.role not in _RECONCILERS:
        raise permission_denied("reconciliation takes an admin or finance key")
    return caller


def _format(content_type: str | None) -> ExportFormat | None:
    """The format the Content-Type names; None: sniff the body."""
    media = (content_type or "").split(";")[0].strip().lower()
    return _FORMATS.get(media)


async def _read_export(request: Request) -> bytes:
    too_large = invalid_request(f"usage export over {MAX_EXPORT_BYTES} bytes", status=413)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_EXPORT_BYTES:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_EXPORT_BYTES:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _store(request: Request) -> EventStore:
    store: EventStore = request.app.state.store
    return store
