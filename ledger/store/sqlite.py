"""SQLite's hot path: the process's connections, each used by a thread of its own, and the
committer that decides and writes a batch in one transaction on the writing one.

SQLite has one writer at a time: every writing transaction is ``BEGIN IMMEDIATE``
(``ledger.store.db``), which takes the database's write lock before the first read. That is
the serialization PostgreSQL gets from its head row's lock (THE LOCK, in
``ledger.store.postgres``), so a batch is simply read and decided under it: there is no race
to lose, and nothing is guessed.

Why threads of our own rather than the async engine (aiosqlite): through it, every statement
is several hops between the event loop and the connection's thread (a cursor, the execute,
the fetch, the close), each a wake-up of both; a batch's commit was some twenty of them while
it held the write lock. And the read models' runner, on the same file in the same process,
held the write lock across its own hops and the folding between them, so the appender met a
locked file and slept in SQLite's busy handler (1, 2, 5, 10 ms ...) rather than queueing.
Here the whole of a transaction is one function run on the writer thread: one hop per batch
(or per page of the read models, ``ledger.views.projection``), and the process's writing
transactions queue on that thread instead of meeting in the busy handler. Another process
(a CLI command, a second gateway on the same file) still waits on busy_timeout, as before.
The figures: bench/README.md, "The embedded default".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import insert, select, text, update
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from ledger.books.balances import load_books, save_books
from ledger.store.append import Batch, decide, streams_of
from ledger.store.db import READ_ONLY, LedgerUnavailable, create_thread_engine, is_unavailable
from ledger.store.schema import appends, ledger_head

__all__ = ["SQLiteCommitter", "SQLiteConnections", "run_to_end"]

_T = TypeVar("_T")
_READERS = 2  # threads (and connections) for the request path's reads: a read is short


class SQLiteConnections:
    """The writer thread (one connection: every writing transaction of the process's hot
    path) and a few reader threads, each running a whole unit of work per hop."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = create_thread_engine(engine)
        # One thread, so one writing transaction at a time, in the order they were asked for.
        self._writer = concurrent.futures.ThreadPoolExecutor(1, "waybill-sqlite-writer")
        self._readers = concurrent.futures.ThreadPoolExecutor(_READERS, "waybill-sqlite-reader")

    async def write(self, work: Callable[[Connection], _T]) -> _T:
        """``work`` in one ``BEGIN IMMEDIATE`` transaction on the writer thread, committed
        when it returns, rolled back if it raises (what it raises is raised here)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._writer, functools.partial(self._write, work)
        )

    async def read(self, work: Callable[[Connection], _T]) -> _T:
        """``work`` on a reader thread's connection, in a transaction that does not take the
        write lock (in WAL mode a reader never waits for the writer, nor it for readers)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._readers, functools.partial(self._read, work)
        )

    def _write(self, work: Callable[[Connection], _T]) -> _T:
        with self._engine.begin() as conn:
            return work(conn)

    def _read(self, work: Callable[[Connection], _T]) -> _T:
        with self._engine.connect() as conn:
            return work(conn.execution_options(**{READ_ONLY: True}))

    async def close(self) -> None:
        """Let the work asked for finish, then close the connections."""
        loop = asyncio.get_running_loop()
        for pool in (self._writer, self._readers):
            await loop.run_in_executor(None, functools.partial(pool.shutdown, wait=True))
        self._engine.dispose()


class SQLiteCommitter:
    """Reads what a batch is decided on and writes what passed, in one transaction."""

    def __init__(self, connections: SQLiteConnections, clock: Callable[[], datetime]) -> None:
        self._connections = connections
        self._clock = clock

    async def commit(self, batch: Batch) -> None:
        try:
            await self._connections.write(functools.partial(self._commit, batch))
        except Exception as error:
            # The driver's errors end here: a database that could not commit now (locked
            # past busy_timeout, gone, full) is LedgerUnavailable (retryable); anything else
            # (a constraint the batch broke: a bug, which a retry would meet again) is raised
            # as itself.
            if not is_unavailable(error):
                raise
            raise LedgerUnavailable(f"the ledger could not commit: {error}") from error

    def _commit(self, batch: Batch, conn: Connection) -> None:
        # On the writer thread, inside BEGIN IMMEDIATE: the database's write lock, held to
        # the commit, so the head, versions and books read below are the ledger as the last
        # writer, in any process, left it, and nobody else writes until this transaction
        # ends. ``decide`` sets each append's result; the appender resolves the callers'
        # futures on the event loop once this returns.
        head = conn.execute(
            select(ledger_head.c.position, ledger_head.c.hash).where(ledger_head.c.id == 1)
        ).one()
        versions = _stream_versions(conn, streams_of(batch))
        books = None
        if any(p.effects for p in batch):
            books = load_books(conn, (e for p in batch for e in p.effects))
        written = decide(batch, int(head.position), str(head.hash), versions, books, self._clock())
        if written is None:
            return
        if books is not None:
            save_books(conn, books, written.recorded_at)
        conn.execute(insert(appends), written.rows)
        conn.execute(
            update(ledger_head)
            .where(ledger_head.c.id == 1)
            .values(position=written.head, hash=written.head_hash)
        )

    async def close(self) -> None:
        """Nothing to close: the connections are the store's (``SQLiteConnections``)."""


def _stream_versions(conn: Connection, stream_ids: set[str]) -> dict[str, int]:
    # A VALUES table of the ids (placeholders only; the ids are bound), one index probe per
    # stream.
    names = [f"s{i}" for i in range(len(stream_ids))]
    rows = ", ".join(f"(:{name})" for name in names)
    result = conn.execute(
        text(
            f"WITH s(id) AS (VALUES {rows}) SELECT s.id, "
            "coalesce((SELECT max(e.version + length(e.types) - 1) FROM appends e "
            "WHERE e.stream_id = s.id), (SELECT a.version FROM archived_streams a "
            "WHERE a.stream_id = s.id)) FROM s"
        ),
        dict(zip(names, sorted(stream_ids), strict=True)),
    )
    return {str(stream_id): int(version) for stream_id, version in result if version is not None}


def run_to_end(coroutine: Any) -> Any:
    """The result of ``coroutine``, run on this thread without an event loop: for code
    written against an async interface (a read model's ``apply``) whose every await, on the
    writer thread, completes at once (``ledger.views.projection``)."""
    with contextlib.closing(coroutine):
        try:
            coroutine.send(None)
        except StopIteration as done:
            return done.value
    raise RuntimeError("a coroutine run on the SQLite writer thread waited for something")
