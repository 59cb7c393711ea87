"""Archiving: ``waybill archive --before DATE --to DIR`` (PostgreSQL, contract §7 "Retention").

Each whole closed month before DATE, oldest first, is written to its file
(``ledger.store.archived``: the format, and the record in ``ledger_archives``), read back and
checked, recorded, then its table detached and dropped (``ledger.store.partitions``). A month
leaves only once the read models have folded it (``ledger.views``): events that left before
they were folded would be missing from them for good.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any, Final

from ledger.store import EventStore
from ledger.store.archived import ArchiveError, Segment, SegmentWriter, check_segment, live_start
from ledger.store.partitions import month_bounds, month_of, partition_name
from ledger.store.stored import stored_events
from ledger.views import all_projections

__all__ = ["ArchiveRefused", "archive_months"]


class ArchiveRefused(Exception):
    """Nothing was archived, and why (one line for the user)."""


async def archive_months(
    store: EventStore,
    before: date,
    directory: Path,
    progress: Callable[[int, int], None] | None = None,
) -> list[Segment]:
    """Archive every whole month that ended by ``before`` (and before this month): write
    its file, check it, record it, detach and drop its table. Oldest first; each must
    follow the live ledger's start, and no later month may hold a position it holds."""
    if store.engine.dialect.name != "postgresql":
        raise ArchiveRefused(
            "archiving needs PostgreSQL: on SQLite the ledger is one table, kept whole "
            "(copy the database file to keep an old ledger apart)"
        )
    # The months that ended by `before`, and before this one: those before both months.
    until = min(month_of(datetime.now(UTC)), f"{before.year:04d}-{before.month:02d}")
    done: list[Segment] = []
    async with store.hot.connection() as conn:
        names = await conn.fetch(_PARTITIONS)
        months = sorted(
            f"{name[8:12]}-{name[13:15]}" for (name,) in names if _PARTITION.fullmatch(name)
        )
        start, start_hash = await live_start(store.engine)
        for month in (m for m in months if m < until):
            segment = await _archive_month(conn, month, start, start_hash, directory, progress)
            if segment is not None:
                done.append(segment)
                start, start_hash = segment.last_position, segment.end_hash
    return done


async def _archive_month(
    conn: Any,
    month: str,
    start: int,
    start_hash: str,
    directory: Path,
    progress: Callable[[int, int], None] | None,
) -> Segment | None:
    name = partition_name(month)
    first, rows = await conn.fetchrow(f"SELECT min(position), count(*) FROM {name}")
    if rows == 0:
        async with conn.transaction():
            await conn.execute(f"ALTER TABLE appends DETACH PARTITION {name}")
            await conn.execute(f"DROP TABLE {name}")
        return None
    if first != start + 1:
        raise ArchiveRefused(
            f"{month} starts at position {first}, not at {start + 1} where the live ledger "
            "starts: months are archived oldest first, whole"
        )
    events = int(await conn.fetchval(f"SELECT sum(length(types)) FROM {name}"))
    last = start + events

    folded = dict(await conn.fetch("SELECT name, position FROM projection_checkpoints"))
    behind = sorted(p.name for p in all_projections() if folded.get(p.name, 0) < last)
    if behind:
        # The read models fold what the ledger holds: events that left before they were
        # folded would be missing from them for good (replay refuses an archived ledger).
        raise ArchiveRefused(
            f"the read models ({', '.join(behind)}) have not yet folded {month}: let a "
            "gateway run (its follower catches them up) and archive again"
        )
    later = await conn.fetchval(
        "SELECT min(position) FROM appends WHERE recorded_at >= $1", month_bounds(month)[1]
    )
    if later is not None and later <= last:
        raise ArchiveRefused(
            f"position {later} was recorded after {month} and before its last event "
            f"{last} (clocks apart): {month} cannot leave the ledger alone"
        )
    writer = SegmentWriter(directory, month, start_hash)
    try:
        after, previous = start, start_hash
        while after < last:
            page = await conn.fetch(
                f"SELECT position, hash, payloads FROM {name} WHERE position > $1 "
                "ORDER BY position LIMIT 1000",
                after,
            )
            for position, row_hash, payloads in page:
                found = stored_events(position, bytes.fromhex(previous), bytes(payloads))
                if not found or found[-1][1] != bytes(row_hash).hex():
                    raise ArchiveRefused(
                        f"the append at position {position} does not verify: run `waybill verify`"
                    )
                for event in found:
                    writer.write(*event)
                previous, after = found[-1][1], found[-1][0]
            if progress is not None:
                progress(after - start, events)
    except BaseException:
        writer.abandon()
        raise
    segment = writer.close()
    if check_segment(directory / segment.file, previous_hash=start_hash) != segment:
        raise ArchiveError(f"{segment.file}: reads back other than it was written")
    async with conn.transaction():
        await conn.execute(
            "INSERT INTO ledger_archives (month, first_position, last_position, previous_hash, "
            "end_hash, events, file, sha256, archived_at) "
            "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, now())",
            month,
            segment.first_position,
            segment.last_position,
            bytes.fromhex(segment.previous_hash),
            bytes.fromhex(segment.end_hash),
            segment.events,
            segment.file,
            segment.sha256,
        )
        # The streams go on from the versions they reached (ledger.store reads them).
        await conn.execute(
            "INSERT INTO archived_streams (stream_id, version) "
            f"SELECT stream_id, max(version + length(types) - 1) FROM {name} GROUP BY stream_id "
            "ON CONFLICT (stream_id) DO UPDATE SET version = "
            "greatest(archived_streams.version, excluded.version)"
        )
        await conn.execute(f"ALTER TABLE appends DETACH PARTITION {name}")
        await conn.execute(f"DROP TABLE {name}")
    return segment


_PARTITIONS: Final = (
    "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
    "WHERE i.inhparent = 'appends'::regclass"
)
_PARTITION: Final = re.compile(r"appends_\d{4}_\d{2}")
