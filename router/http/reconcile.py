"""Reconciliation over HTTP (contract §3): ``POST /v1/reconciliations`` imports a provider
usage export (CSV or JSONL body) or the pages of a provider report (JSON) and answers the
report; ``GET /v1/reconciliations/{id}`` reads a recorded one and
``GET /v1/reconciliations/{id}/buckets/{bucket}`` one bucket of it with its attempts.

Admin and finance keys only. A finance key reconciles its own workspace: lines naming
another workspace's attempts read as unmatched, and another workspace's reports (or an
admin's, which span every workspace) are 404, never 403. A provider report's buckets count
every workspace's traffic on an identity, so only an admin key imports one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Final, Literal

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from ledger.events import ReconciliationImported
from ledger.finance.bucket_reconcile import bucket_json, find_bucket, import_provider_report
from ledger.finance.provider_reports import REPORT_FORMATS, ReportFormat, detect_format
from ledger.finance.reconcile import (
    ExportError,
    ReconcileScope,
    find_reconciliation,
    import_reconciliation,
    report_json,
)
from ledger.finance.usage_export import ExportFormat
from ledger.store import EventStore
from router.adapters.provider_reports import identities_of, rates_of
from router.config import Config
from router.errors import (
    invalid_request,
    permission_denied,
    reconciliation_not_found,
)
from router.http import openapi as api_doc
from router.http.access import (
    can_import_provider_report,
    can_read_reconciliation,
    can_reconcile,
    read_scope,
)
from router.request.gateway import Caller

__all__ = [
    "MAX_EXPORT_BYTES",
    "import_as",
    "input_format_param",
    "readable_reconciliation",
    "reconcile_router",
]

Authenticate = Callable[[Request], Awaitable[Caller]]
InputFormat = ReportFormat | Literal["lines"]

MAX_EXPORT_BYTES: Final = 32 * 1024 * 1024
_JSON: Final = "application/json"
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
        params = request.query_params
        force = _force(params.get("force"))
        named = input_format_param(params.get("format"))
        data = await _read_export(request)
        report = await import_as(
            caller,
            _store(request),
            request.app.state.gateway.config,
            data,
            provider=params.get("provider") or None,
            named=named,
            content_type=request.headers.get("content-type"),
            force=force,
        )
        return Response(orjson.dumps(report_json(report)), media_type=_JSON)

    @router.get(
        "/v1/reconciliations/{reconciliation_id}", openapi_extra=api_doc.READ_RECONCILIATION
    )
    async def read(reconciliation_id: str, request: Request) -> Response:
        caller = _reconciler(await authenticate(request))
        report = await readable_reconciliation(caller, _store(request), reconciliation_id)
        return Response(orjson.dumps(report_json(report)), media_type=_JSON)

    @router.get(
        "/v1/reconciliations/{reconciliation_id}/buckets/{bucket}",
        openapi_extra=api_doc.READ_RECONCILIATION_BUCKET,
    )
    async def read_bucket(reconciliation_id: str, bucket: str, request: Request) -> Response:
        caller = _reconciler(await authenticate(request))
        report = await readable_reconciliation(caller, _store(request), reconciliation_id)
        workspace = read_scope(caller).workspace
        found = find_bucket(
            report,
            bucket,
            model=request.query_params.get("model") or None,
            endpoint=request.query_params.get("endpoint") or None,
        )
        if not found:
            raise reconciliation_not_found(reconciliation_id, bucket)
        detail = await bucket_json(_store(request), report.reconciliation_id, found, workspace)
        return Response(orjson.dumps(detail), media_type=_JSON)

    return router


async def import_as(
    caller: Caller,
    store: EventStore,
    config: Config,
    data: bytes,
    *,
    provider: str | None,
    named: InputFormat | None,
    content_type: str | None,
    force: bool,
) -> ReconciliationImported:
    """Import a usage export or a provider report's pages as ``caller`` (the API's route and
    the console's upload form): a finance key reconciles its own workspace, a provider
    report takes an admin key. ``named``: the format asked for; None: told from the
    content. A bad file is a 400 naming the line and the field."""
    _reconciler(caller)
    chosen = named or await asyncio.to_thread(detect_format, data)
    if chosen != "lines":
        as_named = None if named == "lines" else named
        return await _import_report(store, config, caller, data, as_named, provider, force)
    try:
        return await import_reconciliation(
            store,
            data,
            actor=caller.key_id,
            scope=ReconcileScope(workspace=read_scope(caller).workspace, provider=provider),
            export_format=_format(content_type),
            force=force,
        )
    except ExportError as error:
        raise invalid_request(str(error), param=error.field) from None


async def readable_reconciliation(
    caller: Caller, store: EventStore, reconciliation_id: str
) -> ReconciliationImported:
    """The recorded report, if ``caller`` may read it; the same 404 otherwise as for one that
    does not exist."""
    _reconciler(caller)
    report = await find_reconciliation(store, reconciliation_id)
    if report is None or not can_read_reconciliation(caller, report.workspace):
        raise reconciliation_not_found(reconciliation_id)
    return report


def input_format_param(value: str | None) -> InputFormat | None:
    if value is None or value == "":
        return None
    if value == "lines":
        return "lines"
    for known in REPORT_FORMATS:
        if value == known:
            return known
    names = ", ".join((*REPORT_FORMATS, "lines"))
    raise invalid_request(f"format must be one of {names}", param="format")


async def _import_report(
    store: EventStore,
    config: Config,
    caller: Caller,
    data: bytes,
    named: ReportFormat | None,
    provider: str | None,
    force: bool,
) -> ReconciliationImported:
    """A provider report's pages: its usage counts every workspace's traffic on an
    identity, so only an admin (who sees every workspace) imports one."""
    if not can_import_provider_report(caller):
        raise permission_denied(
            "a provider report counts every workspace's traffic: import it with an admin key"
        )
    try:
        return await import_provider_report(
            store,
            [(None, data)],
            actor=caller.key_id,
            identities=identities_of(config),
            rates=rates_of(config),
            scope=ReconcileScope(provider=provider),
            report_format=named,
            force=force,
        )
    except ExportError as error:
        raise invalid_request(str(error), param=error.field) from None


def _reconciler(caller: Caller) -> Caller:
    if not can_reconcile(caller):
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
