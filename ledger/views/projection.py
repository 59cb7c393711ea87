"""Projections: read models kept in step with the ledger, checkpointed and rebuildable.

A projection consumes events in position order, in pages. Each page is applied in ONE
transaction that also moves the projection's checkpoint, so a read model and its checkpoint
can never disagree: a crash between pages loses nothing and applies nothing twice. The
checkpoint row is locked for the page's duration, so two runners (two gateway processes, or
a replay beside a live gateway) take turns instead of applying the same page twice; on SQLite
a page is folded without the lock and written under it only if its checkpoints have not moved
(``ProjectionRunner._step_sqlite``), to the same effect.
Handlers are written as upserts from the page's final state, so re-applying a page would
change nothing either.

``ProjectionRunner.run`` catches up, then tails: on PostgreSQL it wakes on the appender's
NOTIFY (``ledger.store.tail``), in-process on the store's commit signal, and otherwise polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any, ClassVar

import orjson
from sqlalchemy import Table, delete, select, text, update
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger.store import EventStore
from ledger.store.archived import archived_history, archived_pages
from ledger.store.db import dialect_insert, is_unavailable
from ledger.store.schema import appends, ledger_head, projection_checkpoints
from ledger.store.sqlite import run_to_end
from ledger.store.stored import FROM_POSITION_SQL, StoredEvent, from_position, type_char
from ledger.store.tail import Wakeup
from ledger.views.page import DecodedEvent, PageEvent, decode, decode_row

__all__ = ["ModelWriter", "Projection", "ProjectionRunner", "SqlAlchemyWriter", "fold_into"]

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
    async def apply(self, writer: ModelWriter, batch: Sequence[PageEvent]) -> None:
        """Apply a page of events (already filtered to ``event_types``) through ``writer``,
        inside the page's transaction. Must be idempotent and must not commit."""


class ModelWriter(ABC):
    """What a projection may do to its tables inside the page's transaction: read rows by
    key, and upsert whole rows. One implementation per backend: SQLAlchemy (SQLite), and
    asyncpg on PostgreSQL, where SQLAlchemy's per-statement and per-row costs made the
    read models a large part of the gateway's CPU (bench/README.md, "Decisions")."""

    @abstractmethod
    async def rows(self, table: Table, key: str, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The rows of ``table`` whose ``key`` is one of ``ids``, as column dicts."""

    @abstractmethod
    async def upsert(self, table: Table, key: str, rows: Sequence[dict[str, Any]]) -> None:
        """Insert ``rows`` (every column), or overwrite the rows with the same ``key``."""

    @abstractmethod
    async def delete(self, table: Table, key: str, ids: Sequence[str]) -> None:
        """Delete the rows of ``table`` whose ``key`` is one of ``ids``."""


class SqlAlchemyWriter(ModelWriter):
    def __init__(self, conn: AsyncConnection) -> None:
        self.conn = conn

    async def rows(self, table: Table, key: str, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        result = await self.conn.execute(_rows_query(table, key, ids))
        return {getattr(r, key): dict(r._mapping) for r in result}

    async def upsert(self, table: Table, key: str, rows: Sequence[dict[str, Any]]) -> None:
        await self.conn.execute(_upsert_statement(self.conn, table, key), list(rows))

    async def delete(self, table: Table, key: str, ids: Sequence[str]) -> None:
        await self.conn.execute(_delete_statement(table, key, ids))


_Write = tuple[str, Table, str, list[Any]]
"""A kept write: ``("upsert", table, key, rows)`` or ``("delete", table, key, ids)``."""


class _DeferredWriter(ModelWriter):
    """SQLite's page (``ProjectionRunner._step_sqlite``): rows are read in the page's read
    transaction, and the upserts and deletes are kept, in order, for the write that follows,
    not done. A row the page upserted or deleted earlier is read back as it left it. Its
    methods never wait, so a page's ``apply`` runs to its end on the thread that reads
    (``run_to_end``)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.writes: list[_Write] = []
        self._written: dict[tuple[str, str], dict[str, dict[str, Any] | None]] = {}

    async def rows(self, table: Table, key: str, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        result = self.conn.execute(_rows_query(table, key, ids))
        found = {getattr(r, key): dict(r._mapping) for r in result}
        written = self._written.get((table.name, key), {})
        for i in ids:
            if i in written:
                row = written[i]
                if row is None:
                    found.pop(i, None)
                else:
                    found[i] = row
        return found

    async def upsert(self, table: Table, key: str, rows: Sequence[dict[str, Any]]) -> None:
        self.writes.append(("upsert", table, key, list(rows)))
        self._written.setdefault((table.name, key), {}).update((r[key], r) for r in rows)

    async def delete(self, table: Table, key: str, ids: Sequence[str]) -> None:
        self.writes.append(("delete", table, key, list(ids)))
        self._written.setdefault((table.name, key), {}).update((i, None) for i in ids)


@dataclass(frozen=True, slots=True)
class _Folded:
    """A SQLite page folded in a read transaction: the checkpoints it was folded from, the
    events it held, the last one's position, and the writes to make."""

    checkpoints: list[int]
    count: int
    last: int
    writes: list[_Write]


def _checkpoints(conn: Connection, chosen: Sequence[Projection]) -> list[int]:
    c = projection_checkpoints.c
    rows = conn.execute(select(c.name, c.position).where(c.name.in_([p.name for p in chosen])))
    found = {str(name): int(position) for name, position in rows}
    return [found[p.name] for p in chosen]


def _make_checkpoints(names: Sequence[str], conn: Connection) -> None:
    for name in names:
        _checkpoint_locked(conn, name)


def _write_folded(chosen: Sequence[Projection], folded: _Folded, conn: Connection) -> bool:
    """On the writer thread, under the write lock: ``folded``'s writes and checkpoints, if
    the checkpoints are still those it was folded from (False: nothing written)."""
    if _checkpoints(conn, chosen) != folded.checkpoints:
        return False
    for kind, table, key, values in folded.writes:
        if kind == "upsert":
            conn.execute(_upsert_statement(conn, table, key), values)
        else:
            conn.execute(_delete_statement(table, key, values))
    behind = [p.name for p, c in zip(chosen, folded.checkpoints, strict=True) if c < folded.last]
    conn.execute(
        update(projection_checkpoints)
        .where(projection_checkpoints.c.name.in_(behind))
        .values(position=folded.last, updated_at=datetime.now(UTC))
    )
    return True


def _rows_query(table: Table, key: str, ids: Sequence[str]) -> Any:
    return select(table).where(table.c[key].in_(sorted(ids)))


def _upsert_statement(conn: Connection | AsyncConnection, table: Table, key: str) -> Any:
    statement = dialect_insert(conn, table)
    columns = [c.name for c in table.columns if c.name != key]
    return statement.on_conflict_do_update(
        index_elements=[key], set_={name: statement.excluded[name] for name in columns}
    )


def _delete_statement(table: Table, key: str, ids: Sequence[str]) -> Any:
    return table.delete().where(table.c[key].in_(sorted(ids)))


class _AsyncpgWriter(ModelWriter):
    def __init__(self, conn: Any) -> None:
        self.conn = conn

    async def rows(self, table: Table, key: str, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        records = await self.conn.fetch(_select_sql(table, key), sorted(ids))
        return {record[key]: dict(record) for record in records}

    async def upsert(self, table: Table, key: str, rows: Sequence[dict[str, Any]]) -> None:
        # Every datetime here is aware (recorded times, ``AwareDatetime`` fields), so its
        # JSON names its offset; amounts go as their decimal strings.
        document = orjson.dumps(rows, default=_decimal_text).decode()
        await self.conn.execute(_upsert_sql(table, key), document)

    async def delete(self, table: Table, key: str, ids: Sequence[str]) -> None:
        await self.conn.execute(
            f"DELETE FROM {table.name} WHERE {key} = ANY($1::text[])", sorted(ids)
        )


@functools.cache
def _select_sql(table: Table, key: str) -> str:
    return f"SELECT * FROM {table.name} WHERE {key} = ANY($1::text[])"


def _decimal_text(value: Any) -> str:
    if isinstance(value, Decimal):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


@functools.cache
def _upsert_sql(table: Table, key: str) -> str:
    # All rows in one statement, as one JSON document: asyncpg encodes an array parameter
    # element by element, asking of each whether it is itself an array, which cost the
    # follower three times what encoding the document does, for a little more of the
    # server's (bench/README.md, "Issue 44's levers": the read models' page). Each column is
    # read untyped and cast to its type, as the arrays' parameters were: a string too long
    # for its column is cut, an amount rounded to its scale.
    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    names = [c.name for c in table.columns]
    typed = [c.type.compile(dialect=dialect) for c in table.columns]
    read = ", ".join(f"{n} {t.partition('(')[0]}" for n, t in zip(names, typed, strict=True))
    casts = ", ".join(f"r.{n}::{t}" for n, t in zip(names, typed, strict=True))
    updates = ", ".join(f"{n} = EXCLUDED.{n}" for n in names if n != key)
    return (
        f"INSERT INTO {table.name} ({', '.join(names)}) SELECT {casts} "
        f"FROM json_to_recordset($1::json) AS r({read}) "
        f"ON CONFLICT ({key}) DO UPDATE SET {updates}"
    )


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
        self._checkpoints_made: set[str] = set()  # SQLite: checkpoint rows known to exist

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
        if self.store.sqlite is None:
            return (await self._step_postgres(chosen, None, read_ahead=False))[0]
        return await self._step_sqlite(chosen)

    async def _step_sqlite(self, chosen: list[Projection]) -> int:
        # SQLite has one writer at a time, and a page's reading, decoding and folding is most
        # of its work: done under the write lock, it kept the gateway's appender (in this
        # process or another) waiting. So the page is folded in a read transaction, which
        # takes no lock (WAL), and only its writes are done under the lock, on the writer
        # thread, if the checkpoints are still where the page was read from: a read model
        # changes only with its checkpoint, so the rows the page was folded onto are then
        # still the rows there. If another runner moved one meanwhile, the page is folded
        # again from where it left them (ledger.store.sqlite; bench/README.md, "The
        # embedded default").
        sqlite = self.store.sqlite
        assert sqlite is not None
        missing = [p.name for p in chosen if p.name not in self._checkpoints_made]
        if missing:
            await sqlite.write(functools.partial(_make_checkpoints, missing))
            self._checkpoints_made.update(missing)
        while True:
            folded = await sqlite.read(functools.partial(self._fold_sqlite, chosen))
            if folded.count == 0:
                return 0
            if await sqlite.write(functools.partial(_write_folded, chosen, folded)):
                return folded.count

    def _fold_sqlite(self, chosen: list[Projection], conn: Connection) -> _Folded:
        checkpoints = _checkpoints(conn, chosen)
        start = min(checkpoints)
        a = appends.c
        rows = conn.execute(
            select(a.position, a.types, a.payloads)
            .where(from_position(start), a.position <= start + self.page_size)
            .order_by(a.position)
            .limit(self.page_size)
        ).all()
        count, last, page = _decode_wanted(chosen, rows, start, self.page_size)
        writer = _DeferredWriter(conn)
        if count:
            run_to_end(_apply_page(writer, chosen, checkpoints, page))
        return _Folded(checkpoints, count, last, writer.writes)

    async def _step_postgres(
        self, chosen: list[Projection], ahead: _Ahead | None, *, read_ahead: bool
    ) -> tuple[int, _Ahead | None]:
        # The same page on one of the store's asyncpg connections (ledger.store.reads). With
        # ``read_ahead``, as soon as this page is known the next one is read and decoded on
        # a second connection while this page's writes wait for PostgreSQL (the events past
        # a position never change, so it is the next page unless another runner moved the
        # checkpoints meanwhile; then it is dropped). Returns the events this page held and
        # the page being read ahead.
        names = [p.name for p in chosen]
        async with self.store.hot.connection() as conn, conn.transaction():
            positions = dict(await conn.fetch(_PG_LOCK_CHECKPOINTS, names))
            if len(positions) < len(names):  # a projection's first run: create its checkpoint
                await conn.execute(_PG_NEW_CHECKPOINTS, names)
                positions = dict(await conn.fetch(_PG_LOCK_CHECKPOINTS, names))
            checkpoints = [int(positions[name]) for name in names]
            start = min(checkpoints)
            if ahead is not None and ahead.start == start:
                count, last, page = await ahead.task
            else:
                if ahead is not None:
                    await ahead.drop()
                count, last, page = await self._read_page(conn, chosen, start)
            if count == 0:
                return 0, None
            following = None
            if read_ahead and count == self.page_size:
                following = _Ahead(last, asyncio.create_task(self._read_page(None, chosen, last)))
            try:
                await _apply_page(_AsyncpgWriter(conn), chosen, checkpoints, page)
                behind = [name for name, c in zip(names, checkpoints, strict=True) if c < last]
                await conn.execute(_PG_MOVE_CHECKPOINTS, last, behind)
            except BaseException:
                if following is not None:
                    await following.drop()
                raise
            return count, following

    async def _read_page(
        self, conn: Any, chosen: Sequence[Projection], start: int
    ) -> tuple[int, int, list[DecodedEvent]]:
        """The page after ``start`` (on ``conn``, or on a connection of its own): how many
        events it holds, its last position, and the events ``chosen`` read, decoded."""
        if conn is None:
            async with self.store.hot.connection() as own:
                rows = await own.fetch(_PG_PAGE, start, self.page_size)
        else:
            rows = await conn.fetch(_PG_PAGE, start, self.page_size)
        return _decode_wanted(chosen, rows, start, self.page_size)

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
        if self.store.engine.dialect.name == "postgresql":
            chosen = sorted(projections or self.projections.values(), key=lambda p: p.name)
            ahead: _Ahead | None = None
            try:
                while True:
                    consumed, ahead = await self._step_postgres(chosen, ahead, read_ahead=True)
                    done += consumed
                    if progress is not None:
                        progress(done, max(lag, done))
                    if consumed < self.page_size:
                        return done
            finally:
                if ahead is not None:
                    await ahead.drop()
        while True:
            consumed = await self.step(*projections)
            done += consumed
            if progress is not None:
                progress(done, max(lag, done))
            if consumed < self.page_size:
                return done

    async def replay(
        self,
        *projections: Projection,
        progress: Progress | None = None,
        archive: Path | None = None,
    ) -> int:
        """Clear the tables of ``projections`` (all when none is named) and rebuild them from
        position 0, in one pass over the ledger: over the archived months' files in
        ``archive`` first, if months are archived (``ledger.store.archived.archived_history``)."""
        chosen = sorted(projections or self.projections.values(), key=lambda p: p.name)
        segments = await archived_history(self.store.engine, "a replay", archive)
        async with self.store.engine.begin() as conn:
            for projection in chosen:
                await _lock_checkpoint(conn, projection.name)
            tables = [table for p in chosen for table in reversed(p.tables)]
            if conn.dialect.name == "postgresql":
                # TRUNCATE, not DELETE: a DELETE leaves every old row dead in the table until
                # a vacuum gets to it, and each rebuild would then write past the last one's
                # corpses. Transactional like the DELETE; readers wait for the commit.
                await conn.execute(text(f"TRUNCATE {', '.join(t.name for t in tables)}"))
            else:
                for table in tables:
                    await conn.execute(delete(table))
            await conn.execute(
                update(projection_checkpoints)
                .where(projection_checkpoints.c.name.in_([p.name for p in chosen]))
                .values(position=0, updated_at=datetime.now(UTC))
            )
        if not segments:
            return await self.catch_up(*chosen, progress=progress)
        assert archive is not None
        lags = await self.lag()
        head = max(lags[p.name] for p in chosen)
        done = 0
        async for page in archived_pages(archive, segments, self.page_size):
            await self._apply_archived(chosen, page)
            done += len(page)
            if progress is not None:
                progress(done, head)

        def live(applied: int, total: int) -> None:
            assert progress is not None
            progress(done + applied, done + total)

        return done + await self.catch_up(*chosen, progress=live if progress else None)

    async def _apply_archived(self, chosen: list[Projection], page: list[StoredEvent]) -> None:
        """A page of archived events (in position order, past every checkpoint), as
        ``step`` applies a page of the live ledger's."""
        events = [decode(position, payload) for position, _, payload in page]
        async with self.store.engine.begin() as conn:
            checkpoints = [await _lock_checkpoint(conn, p.name) for p in chosen]
            await _apply_page(SqlAlchemyWriter(conn), chosen, checkpoints, events)
            await conn.execute(
                update(projection_checkpoints)
                .where(projection_checkpoints.c.name.in_([p.name for p in chosen]))
                .values(position=page[-1][0], updated_at=datetime.now(UTC))
            )

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
        backoff = 0.0  # while the database is unavailable: seconds until the next try
        async with wakeup:
            while not stop.is_set():
                try:
                    await self.catch_up()
                    if backoff:
                        _log.warning("projection runner: the database is back; caught up")
                    backoff = 0.0
                except Exception as error:
                    # A read model must not take the gateway down; it retries, and its lag
                    # shows that it is behind. An unavailable database is one line per
                    # back-off step, not a traceback per poll.
                    if not is_unavailable(error):
                        _log.exception("projection runner failed; retrying")
                    else:
                        backoff = min(max(backoff * 2, self.poll_interval_s, 0.5), 30.0)
                        _log.warning(
                            "projection runner: the database is unavailable (%s); "
                            "retrying in %.1f s",
                            _first_line(error),
                            backoff,
                        )
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(backoff):
                                await stop.wait()
                        continue
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.poll_interval_s):
                        await wakeup.wait(stop)
                if settle_s > 0 and not stop.is_set():
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(settle_s):
                            await stop.wait()


@dataclass(frozen=True, slots=True)
class _Ahead:
    """The page after ``start``, being read on a connection of its own."""

    start: int
    task: asyncio.Task[tuple[int, int, list[DecodedEvent]]]

    async def drop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


def _decode_wanted(
    chosen: Sequence[Projection], rows: Sequence[Sequence[Any]], start: int, limit: int
) -> tuple[int, int, list[DecodedEvent]]:
    """A page of ``appends`` rows (position, types, payloads): how many events past
    ``start`` it holds (at most ``limit``: the page ends inside a row if it must), the last
    one's position, and those that some projection reads, decoded. The others (route
    evaluations, the largest events, are read by none) are skipped unparsed, and a row
    holding none of them is not even decompressed."""
    wanted = _wanted(chosen)
    characters = None if wanted is None else {type_char(t) for t in wanted}
    last, page = start, []
    for position, types, payloads in rows:
        first = max(0, last + 1 - position)  # the row's events up to the page's last so far
        end = min(len(types), first + start + limit - last)
        if end <= first:
            break
        if characters is None:
            page += decode_row(position, payloads, range(first, end))
        else:
            offsets = [i for i in range(first, end) if types[i] in characters]
            if offsets:
                page += decode_row(position, payloads, offsets)
        last = position + end - 1
    return last - start, last, page


def _wanted(chosen: Sequence[Projection]) -> set[str] | None:
    """The event types some projection of ``chosen`` reads; None: all of them."""
    wanted: set[str] = set()
    for projection in chosen:
        if projection.event_types is None:
            return None
        wanted |= projection.event_types
    return wanted


async def _apply_page(
    writer: ModelWriter,
    chosen: Sequence[Projection],
    checkpoints: Sequence[int],
    page: Sequence[PageEvent],
) -> None:
    """Give each projection the page's events past its own checkpoint."""
    for projection, checkpoint in zip(chosen, checkpoints, strict=True):
        wanted = projection.event_types
        batch = [
            e for e in page if e.position > checkpoint and (wanted is None or e.type in wanted)
        ]
        if batch:
            await projection.apply(writer, batch)


# Locked in name order by every runner, in every process: two runners take turns.
_PG_LOCK_CHECKPOINTS = (
    "SELECT name, position FROM projection_checkpoints WHERE name = ANY($1::text[]) "
    "ORDER BY name FOR UPDATE"
)
_PG_NEW_CHECKPOINTS = (
    "INSERT INTO projection_checkpoints (name, position, updated_at) "
    "SELECT unnest($1::text[]), 0, now() ON CONFLICT (name) DO NOTHING"
)
# A page's rows: from the one holding the event after $1, up to the last that may hold one
# of its $2 events. The upper bound makes it a range: with only the lower one, which comes
# from a subquery, the planner of a ledger never analysed guessed a third of the month's
# partition and read all of it, then sorted (bench/README.md, "Issue 44's levers": the read
# models' page). No chain hashes: no read model reads them.
_PG_PAGE = (
    "SELECT position, types, payloads FROM appends WHERE "
    + FROM_POSITION_SQL.format(after="$1")
    + " AND position <= $1 + $2 ORDER BY position LIMIT $2"
)
_PG_MOVE_CHECKPOINTS = (
    "UPDATE projection_checkpoints SET position = $1, updated_at = now() "
    "WHERE name = ANY($2::text[])"
)


async def _lock_checkpoint(conn: AsyncConnection, name: str) -> int:
    return await conn.run_sync(_checkpoint_locked, name)


def _checkpoint_locked(conn: Connection, name: str) -> int:
    lock = (
        select(projection_checkpoints.c.position)
        .where(projection_checkpoints.c.name == name)
        .with_for_update()
    )
    position = conn.execute(lock).scalar_one_or_none()
    if position is None:  # the first run of this projection: create its checkpoint
        conn.execute(
            dialect_insert(conn, projection_checkpoints)
            .values(name=name, position=0, updated_at=datetime.now(UTC))
            .on_conflict_do_nothing(index_elements=["name"])
        )
        position = conn.execute(lock).scalar_one()
    return int(position)


async def fold_into(
    writer: ModelWriter,
    table: Table,
    key: str,
    batch: Sequence[PageEvent],
    fold: Callable[[Any, PageEvent], Any],
    *,
    key_of: Callable[[PageEvent], str] | None = None,
    open_table: Table | None = None,
    is_open: Callable[[dict[str, Any]], bool] | None = None,
) -> None:
    """Fold ``batch`` into the rows of ``table`` it touches (keyed by the events' ``key``
    field) and upsert each touched row once: the shape every read model here takes.

    With ``open_table``, a row for which ``is_open`` holds is kept there instead, and moved
    to ``table`` (deleted from ``open_table``) once it no longer holds: ``table`` gets each
    row written once, at its end, rather than again when columns it indexes change."""

    def row_id_of(recorded: PageEvent) -> str:
        return key_of(recorded) if key_of is not None else str(recorded.data[key])

    ids = sorted({row_id_of(e) for e in batch})
    rows: dict[str, dict[str, Any] | None] = dict(await writer.rows(table, key, ids))
    # A row already in ``table`` stays there (one written before ``open_table`` existed).
    settled = set(rows)
    opened: set[str] = set()
    if open_table is not None:
        missing = [i for i in ids if i not in rows]
        if missing:
            open_rows = await writer.rows(open_table, key, missing)
            rows.update(open_rows)
            opened = set(open_rows)
    touched: set[str] = set()
    for recorded in batch:
        row_id = row_id_of(recorded)
        before = rows.get(row_id)
        after = fold(before, recorded)
        if after is not before:
            rows[row_id] = after
            touched.add(row_id)
    ended: list[dict[str, Any]] = []
    still_open: list[dict[str, Any]] = []
    for row_id in sorted(touched):
        row = rows[row_id]
        if row is None:
            continue
        if (
            open_table is not None
            and is_open is not None
            and row_id not in settled
            and is_open(row)
        ):
            still_open.append(row)
        else:
            ended.append(row)
    if open_table is not None:
        closed = sorted(opened.intersection(r[key] for r in ended))
        if closed:
            await writer.delete(open_table, key, closed)
        if still_open:
            await writer.upsert(open_table, key, still_open)
    if ended:
        await writer.upsert(table, key, ended)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
