"""Projections: read models kept in step with the ledger, checkpointed and rebuildable.

A projection consumes events in position order, in pages. Each page is applied in ONE
transaction that also moves the projection's checkpoint, so a read model and its checkpoint
can never disagree: a crash between pages loses nothing and applies nothing twice. The
checkpoint row is locked for the page's duration, so two runners (two gateway processes, or
a replay beside a live gateway) take turns instead of applying the same page twice.
Handlers are written as upserts from the page's final state, so re-applying a page would
change nothing either.

``ProjectionRunner.run`` catches up, then tails: on PostgreSQL it wakes on the appender's
NOTIFY (``ledger.tail``), in-process on the store's commit signal, and otherwise polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import Table, delete, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger.db import dialect_insert
from ledger.schema import events, ledger_head, projection_checkpoints
from ledger.store import EventStore, RecordedEvent, decode_payload
from ledger.tail import Wakeup

__all__ = ["Projection", "ProjectionRunner", "fold_into"]

_log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]
"""Called with (events applied so far, events to apply in all)."""


class Projection(ABC):
    """A named read model built from ledger events."""

    name: ClassVar[str]
    tables: ClassVar[tuple[Table, ...]]
    """The tables this projection owns; cleared when it is replayed."""
    event_types: ClassVar[frozenset[str] | None] = None
    """The event types it reads; None for all."""

    @abstractmethod
    async def apply(self, conn: AsyncConnection, batch: Sequence[RecordedEvent]) -> None:
        """Apply a page of events (already filtered to ``event_types``) inside ``conn``'s
        transaction. Must be idempotent and must not commit."""


class ProjectionRunner:
    def __init__(
        self,
        store: EventStore,
        projections: Sequence[Projection],
        *,
        page_size: int = 2000,
        poll_interval_s: float = 1.0,
    ) -> None:
        self.store = store
        self.projections = {p.name: p for p in projections}
        self.page_size = page_size
        self.poll_interval_s = poll_interval_s

    def get(self, name: str) -> Projection:
        try:
            return self.projections[name]
        except KeyError:
            known = ", ".join(sorted(self.projections))
            raise KeyError(f"unknown projection {name!r} (known: {known})") from None

    async def step(self, *projections: Projection) -> int:
        """Apply the next page to ``projections`` (all of them when none is named); returns
        how many events the page held (0: all are up to date).

        One transaction, one read of the page, each event decoded once, however many
        projections take part: each gets the events past its own checkpoint, and every
        checkpoint moves with its read model's writes."""
        chosen = sorted(projections or self.projections.values(), key=lambda p: p.name)
        async with self.store.engine.begin() as conn:
            checkpoints = [await _lock_checkpoint(conn, p.name) for p in chosen]
            rows = (
                await conn.execute(
                    select(events.c.position, events.c.hash, events.c.payload)
                    .where(events.c.position > min(checkpoints))
                    .order_by(events.c.position)
                    .limit(self.page_size)
                )
            ).all()
            if not rows:
                return 0
            page = [decode_payload(r.position, r.hash, r.payload) for r in rows]
            for projection, checkpoint in zip(chosen, checkpoints, strict=True):
                wanted = projection.event_types
                batch = [
                    e
                    for e in page
                    if e.position > checkpoint and (wanted is None or e.type in wanted)
                ]
                if batch:
                    await projection.apply(conn, batch)
            last = rows[-1].position
            behind = [p.name for p, c in zip(chosen, checkpoints, strict=True) if c < last]
            await conn.execute(
                update(projection_checkpoints)
                .where(projection_checkpoints.c.name.in_(behind))
                .values(position=last, updated_at=datetime.now(UTC))
            )
            return len(rows)

    async def catch_up(self, *projections: Projection, progress: Progress | None = None) -> int:
        """Bring ``projections`` (all when none is named) up to the head, the pages read
        once for all of them; returns the events read."""
        # The lag is only worth its queries when someone shows progress; and a page shorter
        # than page_size was the last one (no extra empty round trip per catch-up).
        lag = 0
        if progress is not None:
            lags = await self.lag()
            lag = max(lags[p.name] for p in projections or self.projections.values())
        done = 0
        while True:
            consumed = await self.step(*projections)
            done += consumed
            if progress is not None:
                progress(done, max(lag, done))
            if consumed < self.page_size:
                return done

    async def catch_up_all(self) -> int:
        return await self.catch_up()

    async def replay(self, *projections: Projection, progress: Progress | None = None) -> int:
        """Clear the tables of ``projections`` (all when none is named) and rebuild them from
        position 0, in one pass over the ledger."""
        chosen = sorted(projections or self.projections.values(), key=lambda p: p.name)
        async with self.store.engine.begin() as conn:
            for projection in chosen:
                await _lock_checkpoint(conn, projection.name)
            for projection in chosen:
                for table in reversed(projection.tables):
                    await conn.execute(delete(table))
            await conn.execute(
                update(projection_checkpoints)
                .where(projection_checkpoints.c.name.in_([p.name for p in chosen]))
                .values(position=0, updated_at=datetime.now(UTC))
            )
        return await self.catch_up(*chosen, progress=progress)

    async def lag(self) -> dict[str, int]:
        """Head position minus checkpoint, per projection: how far each read model trails."""
        async with self.store.engine.connect() as conn:
            head = (await conn.execute(select(ledger_head.c.position))).scalar_one()
            rows = (
                await conn.execute(
                    select(projection_checkpoints.c.name, projection_checkpoints.c.position)
                )
            ).all()
        checkpoints = {str(name): int(position) for name, position in rows}
        return {name: int(head) - checkpoints.get(name, 0) for name in self.projections}

    async def run(
        self, stop: asyncio.Event, wakeup: Wakeup | None = None, *, settle_s: float = 0.0
    ) -> None:
        """Catch up, then follow the ledger until ``stop`` is set.

        ``settle_s``: after a wake-up, let that long pass first, so that under load one
        catch-up folds the commits of many requests instead of a few events each (the read
        models then trail by about that much; the request path never waits for them)."""
        wakeup = wakeup or Wakeup(self.store, poll_interval_s=self.poll_interval_s)
        async with wakeup:
            while not stop.is_set():
                try:
                    await self.catch_up_all()
                except Exception:
                    # A read model must not take the gateway down; it retries on the next
                    # wake-up and its lag shows that it is behind.
                    _log.exception("projection runner failed; retrying")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.poll_interval_s):
                        await wakeup.wait(stop)
                if settle_s > 0 and not stop.is_set():
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(settle_s):
                            await stop.wait()


async def _lock_checkpoint(conn: AsyncConnection, name: str) -> int:
    lock = (
        select(projection_checkpoints.c.position)
        .where(projection_checkpoints.c.name == name)
        .with_for_update()
    )
    position = (await conn.execute(lock)).scalar_one_or_none()
    if position is None:  # the first run of this projection: create its checkpoint
        await conn.execute(
            dialect_insert(conn, projection_checkpoints)
            .values(name=name, position=0, updated_at=datetime.now(UTC))
            .on_conflict_do_nothing(index_elements=["name"])
        )
        position = (await conn.execute(lock)).scalar_one()
    return int(position)


async def fold_into(
    conn: AsyncConnection,
    table: Table,
    key: str,
    batch: Sequence[RecordedEvent],
    fold: Callable[[Any, RecordedEvent], Any],
    *,
    key_of: Callable[[RecordedEvent], str] | None = None,
) -> None:
    """Fold ``batch`` into the rows of ``table`` it touches (keyed by the events' ``key``
    field) and upsert each touched row once: the shape every read model here takes."""

    def row_id_of(recorded: RecordedEvent) -> str:
        return key_of(recorded) if key_of is not None else str(recorded.data[key])

    ids = {row_id_of(e) for e in batch}
    result = await conn.execute(select(table).where(table.c[key].in_(sorted(ids))))
    rows: dict[str, dict[str, Any] | None] = {getattr(r, key): dict(r._mapping) for r in result}
    touched: set[str] = set()
    for recorded in batch:
        row_id = row_id_of(recorded)
        before = rows.get(row_id)
        after = fold(before, recorded)
        if after is not before:
            rows[row_id] = after
            touched.add(row_id)
    values = [row for i in sorted(touched) if (row := rows[i]) is not None]
    if not values:
        return
    statement = dialect_insert(conn, table)
    columns = [c.name for c in table.columns if c.name != key]
    await conn.execute(
        statement.on_conflict_do_update(
            index_elements=[key], set_={name: statement.excluded[name] for name in columns}
        ),
        values,
    )
