"""Span export: from ledger events to an OTLP collector, live and for past windows.

- :func:`to_readable_spans` turns :class:`otel.spans.SpanData` into SDK ``ReadableSpan``
  objects carrying the ledger's timestamps and the deterministic ids, so any
  ``SpanExporter`` can send them.
- :func:`trace_exporter_from_env` builds the standard OTLP exporter from the ``OTEL_*``
  variables, over ``http/protobuf`` (the default) or ``grpc`` as :func:`otlp_protocol` says.
- :class:`TraceFollower` is the live exporter: it follows the ledger from a checkpoint (row
  ``otel_traces`` of ``projection_checkpoints``) and sends a request's spans once its
  terminal event is in the ledger. The checkpoint moves only after the collector accepted
  the page, so a restart neither loses nor repeats spans, and while the collector is down
  the spans simply wait in the ledger.
- :func:`export_window` re-exports the requests received in a past window, with the same
  ids and timestamps as the live export gave them.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final, Literal

from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger import events as ev
from ledger.store import EventStore, RecordedEvent, decode_row
from ledger.store.db import READ_ONLY, dialect_insert
from ledger.store.schema import appends, projection_checkpoints
from ledger.store.stored import holding, previous_hash
from otel import semconv as sc
from otel.spans import TERMINAL_TYPES, SpanData, request_spans

__all__ = [
    "CHECKPOINT",
    "ExportFailed",
    "OtelConfigError",
    "TraceFollower",
    "WindowResult",
    "export_window",
    "otlp_protocol",
    "read_request_streams",
    "resource_from_env",
    "to_readable_spans",
    "trace_exporter_from_env",
    "traces_endpoint",
]

CHECKPOINT: Final = "otel_traces"
"""The live exporter's row in ``projection_checkpoints``."""

_log = logging.getLogger("waybill.otel")
_SCOPE: Final = InstrumentationScope("waybill", None, sc.SCHEMA_URL)
_KINDS: Final = {"server": SpanKind.SERVER, "client": SpanKind.CLIENT}
_STREAMS_PER_QUERY: Final = 200


class OtelConfigError(ValueError):
    """An ``OTEL_*`` setting Waybill cannot honour (said in one line)."""


class ExportFailed(Exception):
    """The exporter did not accept a batch; nothing was marked as exported."""


# --- configuration (the standard OTEL_* variables) ---


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


OtlpProtocol = Literal["http/protobuf", "grpc"]


def otlp_protocol(signal: Literal["TRACES", "METRICS"]) -> OtlpProtocol:
    """The OTLP transport of one signal: ``OTEL_EXPORTER_OTLP_{signal}_PROTOCOL``, else
    ``OTEL_EXPORTER_OTLP_PROTOCOL``, else ``http/protobuf``."""
    protocol = _env(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL") or _env("OTEL_EXPORTER_OTLP_PROTOCOL")
    if not protocol or protocol == "http/protobuf":
        return "http/protobuf"
    if protocol == "grpc":
        return "grpc"
    raise OtelConfigError(
        f"OTLP protocol {protocol!r} is not supported: Waybill exports OTLP over "
        "http/protobuf (port 4318) or grpc (port 4317); set OTEL_EXPORTER_OTLP_PROTOCOL"
    )


def traces_endpoint() -> str:
    """Where spans go, resolved as the chosen OTLP exporter resolves it (OTLP/HTTP appends
    ``/v1/traces`` to the base endpoint; gRPC does not)."""
    specific = _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if specific:
        return specific
    if otlp_protocol("TRACES") == "grpc":
        return _env("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://localhost:4317"
    base = _env("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://localhost:4318"
    return base.rstrip("/") + "/v1/traces"


def trace_exporter_from_env(*, explicit: bool = False) -> SpanExporter | None:
    """The OTLP span exporter the ``OTEL_*`` variables describe, or None when trace export
    is off.

    ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` turn it off. Otherwise the
    live exporter (``explicit=False``) runs only when it was asked for, by an OTLP endpoint
    variable or ``OTEL_TRACES_EXPORTER=otlp``: a gateway nobody pointed at a collector does
    not knock at a collector's default port forever. ``waybill otel export``
    (``explicit=True``) uses the OTLP default endpoint when none is set.
    """
    if _env("OTEL_SDK_DISABLED").lower() == "true":
        return None
    chosen = [v.strip() for v in _env("OTEL_TRACES_EXPORTER").lower().split(",") if v.strip()]
    if chosen == ["none"]:
        return None
    if chosen and "otlp" not in chosen:
        raise OtelConfigError(
            f"OTEL_TRACES_EXPORTER={','.join(chosen)} is not supported: use otlp or none"
        )
    configured = bool(
        chosen or _env("OTEL_EXPORTER_OTLP_ENDPOINT") or _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )
    if not (configured or explicit):
        return None
    if otlp_protocol("TRACES") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcSpanExporter,
        )

        return GrpcSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def resource_from_env() -> Resource:
    """The exported resource: ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME`` apply;
    the service is called ``waybill`` unless they name it."""
    resource = Resource.create()
    name = str(resource.attributes.get(SERVICE_NAME, ""))
    if not name or name.startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "waybill"}))
    return resource


# --- span data → SDK spans ---


def _nanos(instant: datetime) -> int:
    # Exact integer arithmetic: a float timestamp would lose the microseconds.
    delta = instant - datetime(1970, 1, 1, tzinfo=instant.tzinfo)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1000


def to_readable_spans(spans: Iterable[SpanData], resource: Resource) -> list[ReadableSpan]:
    """SDK spans with the ledger's timestamps and the deterministic ids."""
    flags = TraceFlags(TraceFlags.SAMPLED)
    readable = []
    for span in spans:
        trace_id = int(span.trace_id, 16)
        context = SpanContext(trace_id, int(span.span_id, 16), is_remote=False, trace_flags=flags)
        parent = None
        if span.parent_span_id is not None:
            parent = SpanContext(
                trace_id,
                int(span.parent_span_id, 16),
                is_remote=span.remote_parent,
                trace_flags=flags,
            )
        status = (
            Status(StatusCode.ERROR, span.error)
            if span.error is not None
            else Status(StatusCode.UNSET)
        )
        readable.append(
            ReadableSpan(
                name=span.name,
                context=context,
                parent=parent,
                resource=resource,
                attributes=dict(span.attributes),
                events=[
                    Event(e.name, dict(e.attributes), timestamp=_nanos(e.time)) for e in span.events
                ],
                kind=_KINDS[span.kind],
                status=status,
                start_time=_nanos(span.start),
                end_time=_nanos(span.end),
                instrumentation_scope=_SCOPE,
            )
        )
    return readable


async def _send(exporter: SpanExporter, spans: list[ReadableSpan]) -> None:
    if not spans:
        return
    # The SDK exporters block (a network call with retries): run them off the event loop.
    result = await asyncio.to_thread(exporter.export, spans)
    if result is not SpanExportResult.SUCCESS:
        raise ExportFailed(f"the collector did not accept {len(spans)} spans")


# --- reading requests from the ledger ---


async def read_request_streams(
    store: EventStore, request_ids: Sequence[str]
) -> dict[str, list[RecordedEvent]]:
    """The events of several requests' streams, each in version order (few queries)."""
    streams: dict[str, list[RecordedEvent]] = {r: [] for r in request_ids}
    ids = list(streams)
    for offset in range(0, len(ids), _STREAMS_PER_QUERY):
        chunk = [f"request-{r}" for r in ids[offset : offset + _STREAMS_PER_QUERY]]
        async with store.engine.connect() as conn:
            conn = await conn.execution_options(**{READ_ONLY: True})
            rows = await conn.execute(
                select(appends.c.position, previous_hash(), appends.c.payloads)
                .where(appends.c.stream_id.in_(chunk))
                .order_by(appends.c.stream_id, appends.c.version)
            )
            for row in rows:
                for recorded in decode_row(row.position, row.previous, row.payloads):
                    streams[recorded.stream_id.removeprefix("request-")].append(recorded)
    return streams


def _spans_of(
    streams: dict[str, list[RecordedEvent]], tenant_key: bytes | None
) -> tuple[list[SpanData], int]:
    """Every finished request's spans, and how many requests that was."""
    spans: list[SpanData] = []
    requests = 0
    for request_id, stream in streams.items():
        try:
            folded = request_spans(stream, tenant_key=tenant_key)
        except Exception:
            # One request this code cannot fold (an event it cannot read, a bug) must not
            # stall every later trace: skip it, loudly.
            _log.exception("cannot build the spans of request %s; skipped", request_id)
            continue
        if folded:
            requests += 1
            spans.extend(folded)
    return spans, requests


# --- the live exporter ---


class TraceFollower:
    """Follows the ledger and exports each request's spans once its terminal event is in.

    On PostgreSQL the checkpoint row is locked (``FOR UPDATE SKIP LOCKED``) from reading a
    page until its checkpoint is written, so of several gateway replicas exactly one exports
    a page; the others skip their turn. On SQLite (one process; its write lock must not be
    held across a network call) the checkpoint is moved by compare-and-set after the export.
    """

    def __init__(
        self,
        store: EventStore,
        exporter: SpanExporter,
        resource: Resource | None = None,
        *,
        page_size: int = 500,
        tenant_key: bytes | None = None,
    ) -> None:
        self.store = store
        self.tenant_key = tenant_key  # spans name tenants by pseudonym (config otel)
        self.exporter = exporter
        self.resource = resource or resource_from_env()
        self.page_size = page_size
        self.exported_spans = 0
        self._postgres = store.engine.dialect.name == "postgresql"

    async def step(self) -> int:
        """Export the next page; returns the events it consumed (0: up to date, or another
        replica holds the turn). Raises :class:`ExportFailed` if the collector refused."""
        if self._postgres:
            async with self.store.engine.begin() as conn:
                checkpoint = await _lock_checkpoint(conn)
                if checkpoint is None:
                    return 0
                position, consumed = await self._export_after(checkpoint)
                if consumed:
                    await _write_checkpoint(conn, position)
                return consumed
        checkpoint = await self.checkpoint()
        position, consumed = await self._export_after(checkpoint)
        if consumed:
            async with self.store.engine.begin() as conn:
                await _write_checkpoint(conn, position, expected=checkpoint)
        return consumed

    async def catch_up(self) -> int:
        done = 0
        while consumed := await self.step():
            done += consumed
        return done

    async def checkpoint(self) -> int:
        query = select(projection_checkpoints.c.position).where(
            projection_checkpoints.c.name == CHECKPOINT
        )
        # A plain read (on SQLite, no write lock); the row is created only the first time.
        async with self.store.engine.connect() as conn:
            conn = await conn.execution_options(**{READ_ONLY: True})
            position = await conn.scalar(query)
        if position is None:
            async with self.store.engine.begin() as conn:
                await _ensure_checkpoint(conn)
                position = await conn.scalar(query)
        return int(position or 0)

    async def _export_after(self, checkpoint: int) -> tuple[int, int]:
        page = await self.store.read_all(checkpoint, self.page_size)
        if not page:
            return checkpoint, 0
        finished = [str(e.data["request_id"]) for e in page if e.type in TERMINAL_TYPES]
        if finished:
            streams = await read_request_streams(self.store, finished)
            spans, _ = _spans_of(streams, self.tenant_key)
            await _send(self.exporter, to_readable_spans(spans, self.resource))
            self.exported_spans += len(spans)
        return page[-1].position, len(page)


async def _ensure_checkpoint(conn: AsyncConnection) -> None:
    await conn.execute(
        dialect_insert(conn, projection_checkpoints)
        .values(name=CHECKPOINT, position=0, updated_at=datetime.now(UTC))
        .on_conflict_do_nothing(index_elements=["name"])
    )


async def _lock_checkpoint(conn: AsyncConnection) -> int | None:
    await _ensure_checkpoint(conn)
    position = await conn.scalar(
        select(projection_checkpoints.c.position)
        .where(projection_checkpoints.c.name == CHECKPOINT)
        .with_for_update(skip_locked=True)
    )
    return None if position is None else int(position)


async def _write_checkpoint(
    conn: AsyncConnection, position: int, *, expected: int | None = None
) -> None:
    statement = update(projection_checkpoints).where(projection_checkpoints.c.name == CHECKPOINT)
    if expected is not None:
        statement = statement.where(projection_checkpoints.c.position == expected)
    await conn.execute(statement.values(position=position, updated_at=datetime.now(UTC)))


# --- re-export of a past window ---


@dataclass(frozen=True, slots=True)
class WindowResult:
    requests: int  # requests received in the window and finished: exported
    unfinished: int  # received in the window, no terminal event yet: not exported
    spans: int


async def export_window(
    store: EventStore,
    since: datetime | None,
    until: datetime | None,
    exporter: SpanExporter,
    *,
    resource: Resource | None = None,
    progress: Callable[[int, int], None] | None = None,
    batch_requests: int = 200,
    tenant_key: bytes | None = None,
) -> WindowResult:
    """Re-export the spans of the requests received in ``[since, until)`` (by the
    ``recorded_at`` of ``RequestReceived``), with their original timestamps and ids."""
    resource = resource or resource_from_env()
    request_ids = await _received_between(store, _aware(since), _aware(until))
    total = len(request_ids)
    if progress is not None:
        progress(0, total)
    exported = spans_sent = 0
    for offset in range(0, total, batch_requests):
        chunk = request_ids[offset : offset + batch_requests]
        streams = await read_request_streams(store, chunk)
        spans, finished = _spans_of(streams, tenant_key)
        await _send(exporter, to_readable_spans(spans, resource))
        exported += finished
        spans_sent += len(spans)
        if progress is not None:
            progress(min(offset + batch_requests, total), total)
    return WindowResult(exported, total - exported, spans_sent)


def _aware(instant: datetime | None) -> datetime | None:
    # The ledger's instants are UTC; a naive bound is read as UTC too.
    if instant is None or instant.tzinfo is not None:
        return instant
    return instant.replace(tzinfo=UTC)


async def _received_between(
    store: EventStore, since: datetime | None, until: datetime | None, page: int = 5000
) -> list[str]:
    found: list[str] = []
    after = 0
    while True:
        async with store.engine.connect() as conn:
            conn = await conn.execution_options(**{READ_ONLY: True})
            rows = (
                await conn.execute(
                    select(appends.c.position, previous_hash(), appends.c.payloads)
                    .where(holding(ev.RequestReceived.type), appends.c.position > after)
                    .order_by(appends.c.position)
                    .limit(page)
                )
            ).all()
        for row in rows:
            for recorded in decode_row(row.position, row.previous, row.payloads):
                # The canonical payload's timestamp, not the column: SQLite keeps no zone.
                at = recorded.recorded_at
                if recorded.type != ev.RequestReceived.type:
                    continue
                if (since is None or at >= since) and (until is None or at < until):
                    found.append(str(recorded.data["request_id"]))
        if len(rows) < page:
            return found
        after = rows[-1].position
