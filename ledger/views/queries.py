"""Ledger queries (contract §3): a request's events, its view, and the search over request views.

A request's events are read from the live ledger and, for a request recorded in an archived
month, from the archive's files (``request_trail``, through ``ledger.store.archived``).

The read side's SQL, and nothing of HTTP: callers pass plain values (a :class:`RequestSearch`
already narrowed to what the caller may see, a limit, a keyset position) and get plain
values back. Pagination is by keyset, never by offset, so a page boundary stays put while
new requests arrive: request views are listed newest first by ``(created_at, request_id)``,
a request's events by their version in its stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from sqlalchemy import func, or_, select, tuple_
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ledger.store import RecordedEvent, decode_payload, decode_row
from ledger.store.archived import archived_segments, archived_stream
from ledger.store.db import READ_ONLY
from ledger.store.schema import all_request_views, appends, archived_streams
from ledger.store.stored import holding, previous_hash
from ledger.types import money_str

__all__ = [
    "REQUEST_STATUSES",
    "RecentFailures",
    "RequestArchived",
    "RequestKey",
    "RequestSearch",
    "find_request_view",
    "read_request_events",
    "read_request_trails",
    "recent_failures",
    "request_stream_id",
    "request_trail",
    "request_view_json",
    "search_request_views",
]

REQUEST_STATUSES: Final = ("in_progress", "succeeded", "failed", "partial_failure")

RequestKey = tuple[datetime, str]
"""A request view's place in the search order: (created_at, request_id)."""

_MONEY_FIELDS: Final = ("reserved_usd", "settled_usd", "held_unknown_usd")
_VIEW_FIELDS: Final = (
    "request_id",
    "workspace",
    "key_id",
    "model",
    "status",
    "endpoint",
    "upstream_model",
    "attempts",
    *_MONEY_FIELDS,
    "http_status",
    "error_code",
    "input_tokens",
    "output_tokens",
    "duration_ms",
    "created_at",
    "completed_at",
)


class RequestArchived(Exception):
    """A request recorded in an archived month, and no archive directory to read it from."""

    def __init__(self, request_id: str) -> None:
        super().__init__(
            f"request {request_id!r} was recorded in an archived month: its events are in the "
            "archive files (give their directory: WAYBILL_ARCHIVE_DIR)"
        )
        self.request_id = request_id


def request_stream_id(request_id: str) -> str:
    """The stream that holds a request's events."""
    return f"request-{request_id}"


@dataclass(frozen=True, slots=True)
class RequestSearch:
    """Which request views to list. ``workspace``/``key_id`` None: any."""

    workspace: str | None = None
    key_id: str | None = None
    status: str | None = None
    model: str | None = None
    endpoint: str | None = None
    since: datetime | None = None  # created at or after
    until: datetime | None = None  # created before


@asynccontextmanager
async def _reading(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    async with engine.connect() as conn:
        yield await conn.execution_options(**{READ_ONLY: True})


def _utc(moment: datetime) -> datetime:
    # SQLite hands back naive UTC, PostgreSQL the session's zone: one form for both.
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def request_view_json(row: Mapping[str, Any]) -> dict[str, Any]:
    """A request view in the query API's stable shape (contract §3); money as decimal strings."""
    view = {name: row[name] for name in _VIEW_FIELDS}
    for name in _MONEY_FIELDS:
        view[name] = money_str(row[name])
    for name in ("created_at", "completed_at"):
        moment = row[name]
        view[name] = _utc(moment).isoformat() if moment is not None else None
    return view


async def find_request_view(engine: AsyncEngine, request_id: str) -> dict[str, Any] | None:
    """The request view of ``request_id`` (as stored), or None if the read model has none."""
    async with _reading(engine) as conn:
        row = (
            await conn.execute(
                select(all_request_views).where(all_request_views.c.request_id == request_id)
            )
        ).first()
    return dict(row._mapping) if row is not None else None


async def search_request_views(
    engine: AsyncEngine, search: RequestSearch, *, limit: int, after: RequestKey | None = None
) -> tuple[list[dict[str, Any]], RequestKey | None]:
    """Up to ``limit`` views matching ``search``, newest first, starting after ``after``;
    and the key to continue from, or None when this was the last page."""
    t = all_request_views.c
    conditions = []
    for column, value in (
        (t.workspace, search.workspace),
        (t.key_id, search.key_id),
        (t.status, search.status),
        (t.model, search.model),
        (t.endpoint, search.endpoint),
    ):
        if value is not None:
            conditions.append(column == value)
    if search.status is not None and search.status != "succeeded":
        # The partial index of the rare statuses (ix_request_views_status_created) is used
        # by SQLite only when the query states its predicate; PostgreSQL infers it.
        conditions.append(t.status != "succeeded")
    if search.since is not None:
        conditions.append(t.created_at >= _utc(search.since))
    if search.until is not None:
        conditions.append(t.created_at < _utc(search.until))
    if after is not None:
        # The cursor's instant bounds the scan of the index on created_at (both backends
        # start there instead of filtering every row above it); the row comparison then
        # decides among the rows of that very instant.
        conditions.append(t.created_at <= _utc(after[0]))
        conditions.append(tuple_(t.created_at, t.request_id) < tuple_(_utc(after[0]), after[1]))
    query = (
        select(all_request_views)
        .where(*conditions)
        .order_by(t.created_at.desc(), t.request_id.desc())
        .limit(limit + 1)
    )
    async with _reading(engine) as conn:
        rows = [dict(r._mapping) for r in await conn.execute(query)]
    if len(rows) <= limit:
        return rows, None
    rows = rows[:limit]
    last = rows[-1]
    return rows, (_utc(last["created_at"]), str(last["request_id"]))


async def read_request_events(
    engine: AsyncEngine, request_id: str, *, after_version: int = 0, limit: int | None = None
) -> list[RecordedEvent]:
    """The events of ``request_id``'s stream after ``after_version``, in order."""
    a = appends.c
    query = (
        select(a.position, a.version, previous_hash(), a.payloads)
        .where(
            a.stream_id == request_stream_id(request_id),
            a.version + func.length(a.types) > after_version + 1,  # its last is past it
        )
        .order_by(a.version)
    )
    if limit is not None:
        query = query.limit(limit)  # rows, each of at least one event
    found: list[RecordedEvent] = []
    async with _reading(engine) as conn:
        for row in await conn.execute(query):
            skip = max(0, after_version + 1 - row.version)
            found += decode_row(row.position, row.previous, row.payloads)[skip:]
    return found if limit is None else found[:limit]


async def request_trail(
    engine: AsyncEngine, request_id: str, archive: Path | None
) -> list[RecordedEvent]:
    """All of ``request_id``'s events, in order: those of archived months read from the
    files in ``archive`` (``RequestArchived`` without it; ``ArchiveError`` for a file that
    is missing or not the ledger's), then the live ledger's. Only a stream the database
    lists as archived (``archived_streams``) is looked for in the files, a pass over each."""
    trail = await read_request_events(engine, request_id)
    if trail and trail[0].version == 1:
        return trail
    stream = request_stream_id(request_id)
    async with engine.connect() as conn:
        archived = await conn.execute(
            select(archived_streams.c.version).where(archived_streams.c.stream_id == stream)
        )
        if archived.first() is None:
            return trail
    if archive is None:
        raise RequestArchived(request_id)
    segments = await archived_segments(engine)
    found = await asyncio.to_thread(archived_stream, archive, segments, stream)
    return [decode_payload(*event) for event in found] + trail


async def read_request_trails(
    engine: AsyncEngine, request_ids: Sequence[str]
) -> dict[str, list[RecordedEvent]]:
    """The whole event streams of several requests at once (by the stream index), each in
    order: a page of unknown-usage settlements tells each attempt's story from them."""
    if not request_ids:
        return {}
    streams = {request_stream_id(r): r for r in request_ids}
    a = appends.c
    query = (
        select(a.stream_id, a.position, previous_hash(), a.payloads)
        .where(a.stream_id.in_(list(streams)))
        .order_by(a.stream_id, a.version)
    )
    trails: dict[str, list[RecordedEvent]] = {r: [] for r in request_ids}
    async with _reading(engine) as conn:
        for row in await conn.execute(query):
            trails[streams[row.stream_id]] += decode_row(row.position, row.previous, row.payloads)
    return trails


@dataclass(frozen=True, slots=True)
class RecentFailures:
    """Failed attempts among the ledger's latest attempt outcomes, by endpoint and failure
    class; ``since``: when the oldest outcome looked at was recorded (None: no outcome)."""

    counts: dict[tuple[str, str], int]
    outcomes: int
    since: datetime | None


async def recent_failures(
    engine: AsyncEngine, *, workspace: str | None, window: int = 2000
) -> RecentFailures:
    """The failure classes of the latest ``window`` attempt outcomes of the ledger, those of
    ``workspace``'s requests only unless None (every workspace). A bounded read however long
    the ledger: the newest appends that hold an attempt's start or end (the primary key read
    backwards), each outcome's endpoint from its attempt's start among them (an outcome whose
    start is older than the rows read is not counted), the workspace from the request views."""
    a = appends.c
    query = (
        select(a.position, previous_hash(), a.payloads)
        .where(or_(holding("AttemptFinished"), holding("AttemptStarted")))
        .order_by(a.position.desc())
        .limit(window * 2)
    )
    endpoints: dict[str, str] = {}
    finished: list[tuple[RecordedEvent, Any]] = []
    async with _reading(engine) as conn:
        for row in await conn.execute(query):
            for recorded in decode_row(row.position, row.previous, row.payloads):
                if recorded.type == "AttemptStarted":
                    endpoints[recorded.data["attempt_id"]] = recorded.data["endpoint"]
                elif recorded.type == "AttemptFinished" and len(finished) < window:
                    finished.append((recorded, recorded.data))
        owners: dict[str, str] = {}
        if workspace is not None and finished:
            wanted = list({data["request_id"] for _, data in finished})
            views = select(all_request_views.c.request_id, all_request_views.c.workspace).where(
                all_request_views.c.request_id.in_(wanted)
            )
            owners = {r.request_id: r.workspace for r in await conn.execute(views)}
    counts: dict[tuple[str, str], int] = {}
    outcomes, since = 0, None
    for recorded, data in finished:
        endpoint = endpoints.get(data["attempt_id"])
        if endpoint is None:
            continue
        moment = _utc(recorded.recorded_at)
        since = moment if since is None else min(since, moment)
        if workspace is not None and owners.get(data["request_id"]) != workspace:
            continue
        outcomes += 1
        if data["status"] == "failed":
            key = (str(endpoint), str(data.get("failure_class") or "unclassified"))
            counts[key] = counts.get(key, 0) + 1
    return RecentFailures(counts, outcomes, since)
