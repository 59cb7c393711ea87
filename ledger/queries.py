"""Ledger queries (contract §3): a request's events, its view, and the search over request views.

The read side's SQL, and nothing of HTTP: callers pass plain values (a :class:`RequestSearch`
already narrowed to what the caller may see, a limit, a keyset position) and get plain
values back. Pagination is by keyset, never by offset, so a page boundary stays put while
new requests arrive: request views are listed newest first by ``(created_at, request_id)``,
a request's events by their version in its stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from sqlalchemy import and_, func, or_, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ledger.db import READ_ONLY
from ledger.schema import appends, request_views
from ledger.store import RecordedEvent, decode_row
from ledger.stored import previous_hash
from ledger.types import money_str

__all__ = [
    "REQUEST_STATUSES",
    "RequestKey",
    "RequestSearch",
    "find_request_view",
    "read_request_events",
    "request_stream_id",
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
                select(request_views).where(request_views.c.request_id == request_id)
            )
        ).first()
    return dict(row._mapping) if row is not None else None


async def search_request_views(
    engine: AsyncEngine, search: RequestSearch, *, limit: int, after: RequestKey | None = None
) -> tuple[list[dict[str, Any]], RequestKey | None]:
    """Up to ``limit`` views matching ``search``, newest first, starting after ``after``;
    and the key to continue from, or None when this was the last page."""
    t = request_views.c
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
    if search.since is not None:
        conditions.append(t.created_at >= _utc(search.since))
    if search.until is not None:
        conditions.append(t.created_at < _utc(search.until))
    if after is not None:
        created, request_id = _utc(after[0]), after[1]
        conditions.append(
            or_(t.created_at < created, and_(t.created_at == created, t.request_id < request_id))
        )
    query = (
        select(request_views)
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
