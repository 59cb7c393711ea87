"""``EventStore``: the ledger as the rest of Waybill sees it, one instance per process and
event loop.

Appends go through the append path (``ledger.store.append``) to the backend's committer,
chosen here once by the engine's dialect: ``ledger.store.postgres`` or ``ledger.store.sqlite``
(and, in the workers of ``waybill serve --workers N`` but the first, through the first worker's
appender: ``forward_to``). Reads (``head``, ``read_all``, ``read_stream``, ``iterate``) are
below, on the engine; the request path's single-statement reads are ``hot``
(``ledger.store.reads``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ledger.books.accounting import Effect
from ledger.events import Event
from ledger.store.append import Appender, PendingAppend, prepare
from ledger.store.db import READ_ONLY, LedgerUnavailable, is_unavailable
from ledger.store.outage import Outage
from ledger.store.postgres import PostgresCommitter
from ledger.store.reads import HotReads
from ledger.store.recorded import RecordedEvent, decode_row
from ledger.store.schema import appends, ledger_head
from ledger.store.shared_appends import AppendClient, ForwardingCommitter
from ledger.store.sqlite import SQLiteCommitter, SQLiteConnections
from ledger.store.stored import from_position, previous_hash

__all__ = ["EventStore"]


def _utc_now() -> datetime:
    return datetime.now(UTC)


class EventStore:
    """Append to and read from the ledger. One instance per process and event loop."""

    def __init__(self, engine: AsyncEngine, *, clock: Callable[[], datetime] | None = None) -> None:
        """``clock``: the recorded time of each batch (UTC now; a test may set the month)."""
        self.engine = engine
        self.clock = clock or _utc_now
        # On SQLite, the connections the hot path's threads own (the appender's and the
        # read models' writes, the request path's reads: ``ledger.store.sqlite``).
        self.sqlite: SQLiteConnections | None = None
        self._backend: PostgresCommitter | SQLiteCommitter
        if engine.dialect.name == "postgresql":
            self._backend = PostgresCommitter(engine, self.clock)
        else:
            self.sqlite = SQLiteConnections(engine)
            self._backend = SQLiteCommitter(self.sqlite, self.clock)
        # What this process finds of the database's availability, told once per outage.
        self.outage = Outage()
        self._appender = Appender(self._backend, self.outage)
        # the request path's single-statement reads
        self.hot = HotReads(engine, self.outage, self.sqlite)

    def on_commit(self, listener: Callable[[Sequence[RecordedEvent]], None]) -> Callable[[], None]:
        """Call ``listener`` with the events of each batch this store commits, soon after
        the commit (this process's appends only, in position order): while the database
        works on the next batch, or within ``_TELL_WITHIN_S`` (``ledger.store.append``) if
        none comes. Never before the callers the commit woke have had their turn, so the
        listeners (the metrics) are off the request path. It must be quick and must not
        raise; what it raises is logged. Returns the way to unsubscribe."""
        return self._appender.on_commit(listener)

    def commit_signal(self) -> asyncio.Event:
        """An event this store sets after each commit (the caller clears it)."""
        return self._appender.commit_signal()

    # --- appends (ledger.store.append) ---

    async def append(
        self,
        stream_id: str,
        expected_version: int | None,
        new_events: Sequence[Event],
        *,
        metadata: Mapping[str, Any] | None = None,
        effects: Sequence[Effect] = (),
        requires: Mapping[str, int] | None = None,
    ) -> list[RecordedEvent]:
        """Append ``new_events`` and wait for the commit: ``await submit(...)``."""
        return await self.submit(
            stream_id,
            expected_version,
            new_events,
            metadata=metadata,
            effects=effects,
            requires=requires,
        )

    def submit(
        self,
        stream_id: str,
        expected_version: int | None,
        new_events: Sequence[Event],
        *,
        metadata: Mapping[str, Any] | None = None,
        effects: Sequence[Effect] = (),
        requires: Mapping[str, int] | None = None,
    ) -> asyncio.Future[list[RecordedEvent]]:
        """Append ``new_events`` to ``stream_id`` atomically.

        ``effects`` are the budget changes these events record (``ledger.books.accounting``):
        they are applied to the books in the same transaction, or the append fails with
        ``BudgetDenied`` / ``HoldStateError`` and writes nothing.

        ``requires`` names other streams and the versions they must be at when the events
        are committed (nothing is written to them): the append is accepted only if none of
        them has moved, else it fails with ``WrongExpectedVersion`` for the first that did
        and writes nothing. (A request's first append requires its API key's stream to be
        where the key was read unrevoked: ``ledger.apikeys``.)

        ``expected_version`` is the stream's current version (``NO_STREAM`` for a new
        stream) or ``ANY_VERSION``. Raises ``WrongExpectedVersion`` if another writer got
        there first, ``EventValidationError`` for an event the catalogue refuses (both
        before anything is written) and ``LedgerUnavailable`` if the commit failed.

        Returns at once (validation errors are raised here) with the future of the commit:
        its result is the recorded events, once they are durable; the refusals above are
        its exception. What the caller does before awaiting it overlaps the commit.
        """
        pending = prepare(stream_id, expected_version, new_events, metadata, effects, requires)
        self._appender.submit(pending)
        # A cancelled caller cancels only its wait: the append stays queued and is committed
        # all the same (an answered request must never be missing from the ledger).
        return pending.future

    def forward_to(self, client: AppendClient) -> None:
        """Commit each batch through the first worker's appender (``client``) when it takes
        it; through this store's own backend when it does not (``ledger.store.shared_appends``)."""
        self._appender.committer = ForwardingCommitter(client, self._backend)

    def take_forwarded(self, pendings: Sequence[PendingAppend]) -> bool:
        """Queue appends another worker prepared (``submit``'s checks done there); each
        one's future is done once its commit is. False while closing: the sender commits
        them itself."""
        return self._appender.take(pendings)

    async def close(self) -> None:
        """Commit what is queued, then stop the appender."""
        await self._appender.close()
        await self._backend.close()
        await self.hot.close()
        if self.sqlite is not None:
            await self.sqlite.close()

    @property
    def stats(self) -> dict[str, int]:
        backend = {  # PostgreSQL's ways of deciding a batch (0 on SQLite)
            name: getattr(self._backend, name, 0)
            for name in ("lost_races", "unread_batches", "wrong_guesses")
        }
        return {"batches": self._appender.batches, "queued": self._appender.queued, **backend}

    # --- reads ---

    async def head(self) -> tuple[int, str]:
        """The last committed position and its hash (0 and the genesis hash when empty)."""
        async with self._read() as conn:
            row = (
                await conn.execute(
                    select(ledger_head.c.position, ledger_head.c.hash).where(ledger_head.c.id == 1)
                )
            ).one()
        return int(row.position), str(row.hash)

    async def read_all(self, after: int = 0, limit: int = 1000) -> list[RecordedEvent]:
        """At most ``limit`` events with position > ``after``, in position order (fewer only
        at the head)."""
        a = appends.c
        async with self._read() as conn:
            result = await conn.execute(
                select(a.position, previous_hash(), a.payloads)
                .where(from_position(after))
                .order_by(a.position)
                .limit(limit)  # rows: each holds at least one event
            )
            found: list[RecordedEvent] = []
            for row in result:
                found += decode_row(row.position, row.previous, row.payloads, after=after)
            return found[:limit]

    async def read_stream(self, stream_id: str, after_version: int = 0) -> list[RecordedEvent]:
        a = appends.c
        async with self._read() as conn:
            result = await conn.execute(
                select(a.position, a.version, previous_hash(), a.payloads)
                .where(
                    a.stream_id == stream_id, a.version + func.length(a.types) > after_version + 1
                )
                .order_by(a.version)
            )
            found: list[RecordedEvent] = []
            for row in result:
                skip = max(0, after_version + 1 - row.version)
                found += decode_row(row.position, row.previous, row.payloads)[skip:]
            return found

    async def iterate(self, after: int = 0, page: int = 2000) -> AsyncIterator[RecordedEvent]:
        while True:
            batch = await self.read_all(after, page)
            for recorded in batch:
                yield recorded
            if len(batch) < page:
                return
            after = batch[-1].position

    def _read(self) -> _ReadConnection:
        return _ReadConnection(self.engine, self.outage)


class _ReadConnection:
    """A connection for reads: on SQLite it does not take the write lock; on PostgreSQL it
    runs in autocommit (no BEGIN/ROLLBACK round trips). A database that cannot do the read
    now raises ``LedgerUnavailable``, as an append does (a caller retrying while the ledger
    is away, ``router.request.journal``, waits for that one exception)."""

    def __init__(self, engine: AsyncEngine, outage: Outage) -> None:
        self._engine = engine
        self._outage = outage
        self._conn: AsyncConnection | None = None

    async def __aenter__(self) -> AsyncConnection:
        try:
            self._conn = await self._engine.connect()
            if self._engine.dialect.name == "postgresql":
                return await self._conn.execution_options(isolation_level="AUTOCOMMIT")
            return await self._conn.execution_options(**{READ_ONLY: True})
        except Exception as error:
            if self._conn is not None:
                with contextlib.suppress(Exception):
                    await self._conn.close()
            self._unavailable(error)
            raise

    async def __aexit__(
        self, exc_type: type[BaseException] | None, error: BaseException | None, tb: object
    ) -> None:
        assert self._conn is not None
        try:
            await self._conn.close()
        except Exception as closing:
            if error is None:
                self._unavailable(closing)
                raise
        if error is None:
            self._outage.succeeded()
        elif isinstance(error, Exception):
            self._unavailable(error)

    def _unavailable(self, error: Exception) -> None:
        """Raise ``LedgerUnavailable`` for ``error`` if it is the database being away."""
        if isinstance(error, LedgerUnavailable) or not is_unavailable(error):
            return
        self._outage.failed(error)
        raise LedgerUnavailable(f"the ledger database failed: {type(error).__name__}") from None
