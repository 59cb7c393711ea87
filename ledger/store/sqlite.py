"""The SQLite committer: a batch decided and written in one transaction through the store's
SQLAlchemy engine (aiosqlite).

SQLite has one writer at a time: every transaction of the ledger's engine is ``BEGIN
IMMEDIATE`` (``ledger.store.db``), which takes the database's write lock before the first
read. That is the serialization PostgreSQL gets from its head row's lock (THE LOCK, in
``ledger.store.postgres``), so the batch is simply read and decided under it: there is no
race to lose, and nothing is guessed.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from sqlalchemy import insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ledger.books.balances import load_books, save_books
from ledger.store.append import Batch, decide, streams_of
from ledger.store.db import LedgerUnavailable, is_unavailable
from ledger.store.schema import appends, ledger_head

__all__ = ["SQLiteCommitter"]


class SQLiteCommitter:
    """Reads what a batch is decided on and writes what passed, in one transaction."""

    def __init__(self, engine: AsyncEngine, clock: Callable[[], datetime]) -> None:
        self._engine = engine
        self._clock = clock

    async def commit(self, batch: Batch) -> None:
        try:
            # BEGIN IMMEDIATE: the database's write lock, held from here to the commit, so
            # the head, versions and books read below are the ledger as the last writer, in
            # any process, left it, and nobody else writes until this transaction ends.
            async with self._engine.begin() as conn:
                head = (
                    await conn.execute(
                        select(ledger_head.c.position, ledger_head.c.hash).where(
                            ledger_head.c.id == 1
                        )
                    )
                ).one()
                versions = await _stream_versions(conn, streams_of(batch))
                books = None
                if any(p.effects for p in batch):
                    books = await load_books(conn, (e for p in batch for e in p.effects))
                written = decide(
                    batch, int(head.position), str(head.hash), versions, books, self._clock()
                )
                if written is None:
                    return
                if books is not None:
                    await save_books(conn, books, written.recorded_at)
                await conn.execute(insert(appends), written.rows)
                await conn.execute(
                    update(ledger_head)
                    .where(ledger_head.c.id == 1)
                    .values(position=written.head, hash=written.head_hash)
                )
        except Exception as error:
            # The driver's errors end here: a database that could not commit now (locked
            # past busy_timeout, gone, full) is LedgerUnavailable (retryable); anything else
            # (a constraint the batch broke: a bug, which a retry would meet again) is raised
            # as itself.
            if not is_unavailable(error):
                raise
            raise LedgerUnavailable(f"the ledger could not commit: {error}") from error

    async def close(self) -> None:
        """Nothing to close: the connections are the store's engine's."""


async def _stream_versions(conn: AsyncConnection, stream_ids: set[str]) -> dict[str, int]:
    # A VALUES table of the ids (placeholders only; the ids are bound), one index probe per
    # stream.
    names = [f"s{i}" for i in range(len(stream_ids))]
    rows = ", ".join(f"(:{name})" for name in names)
    result = await conn.execute(
        text(
            f"WITH s(id) AS (VALUES {rows}) SELECT s.id, "
            "coalesce((SELECT max(e.version + length(e.types) - 1) FROM appends e "
            "WHERE e.stream_id = s.id), (SELECT a.version FROM archived_streams a "
            "WHERE a.stream_id = s.id)) FROM s"
        ),
        dict(zip(names, sorted(stream_ids), strict=True)),
    )
    return {str(stream_id): int(version) for stream_id, version in result if version is not None}
