"""The raw PostgreSQL edge of the hot path: the request path's reads and the appender's
connection, on asyncpg rather than through SQLAlchemy; on SQLite, on a reader thread's connection.

Through SQLAlchemy's async engine a key lookup costs many times its CPU through asyncpg
(statement compilation and caching, the greenlet bridge, result processing), and through
psycopg's async connection still several times (its per-wait selector bookkeeping): see
bench/README.md, Decisions: the event store. The request path reads a few rows per request
and the appender one or two statements per batch, so on PostgreSQL both go through asyncpg
(statements prepared once per connection). On SQLite a read is one hop to a thread that owns
its connection (``ledger.store.sqlite``), not the async engine's several.

Statements are written once, with ``:name`` parameters, and run unchanged on both backends
(:func:`positional` turns them into asyncpg's ``$n``). Rows come back with attribute
access. Values are the driver's: on SQLite a money column is text and a timestamp is text,
so callers convert (``ledger.types.money_of``).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import asyncpg
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from ledger.store.db import READ_ONLY, LedgerUnavailable, asyncpg_dsn, is_unavailable
from ledger.store.outage import Outage

if TYPE_CHECKING:
    from ledger.store.sqlite import SQLiteConnections

__all__ = ["HotReads", "close_quietly", "connect", "positional"]

_CONNECTIONS = 4  # at most, per process: requests beyond that wait their turn (a read is short)
_PARAMETER = re.compile(r"(?<![:\w]):(\w+)")


class _Row:
    """An asyncpg record with attribute access, like SQLAlchemy's rows."""

    __slots__ = ("_record",)

    def __init__(self, record: asyncpg.Record) -> None:
        self._record = record

    def __getattr__(self, name: str) -> Any:
        try:
            return self._record[name]
        except KeyError:
            raise AttributeError(name) from None

    def __getitem__(self, index: int) -> Any:
        return self._record[index]


class HotReads:
    """Run one read statement and return its rows."""

    def __init__(
        self,
        engine: AsyncEngine,
        outage: Outage | None = None,
        sqlite: SQLiteConnections | None = None,
    ) -> None:
        self._engine = engine
        self._sqlite = sqlite
        self._outage = outage or Outage()
        self._postgres = engine.dialect.name == "postgresql"
        self._dsn = asyncpg_dsn(engine) if self._postgres else ""
        self._idle: deque[asyncpg.Connection] = deque()
        self._turns = asyncio.Semaphore(_CONNECTIONS)
        self._closed = False

    async def rows(self, statement: str, params: Mapping[str, Any]) -> Sequence[Any]:
        if not self._postgres:
            query = text(statement)
            if self._sqlite is not None:  # one hop to a reader thread (ledger.store.sqlite)
                return await self._sqlite.read(lambda conn: conn.execute(query, dict(params)).all())
            async with self._engine.connect() as connection:
                reading = await connection.execution_options(**{READ_ONLY: True})
                return (await reading.execute(query, dict(params))).all()
        sql, names = positional(statement)
        args = [params[name] for name in names]
        async with self._turns:
            for last_try in (False, True):
                reused = bool(self._idle)
                conn = await self._take()
                try:
                    records = await conn.fetch(sql, *args)
                except BaseException as error:
                    await self._lost(conn, error)
                    if not isinstance(error, Exception) or not is_unavailable(error):
                        raise
                    if reused and not last_try:
                        # A connection that sat idle may have died with the server's end of
                        # it (a restart, an outage no request saw): the read changes nothing,
                        # so it runs once more, on a new connection (the idle ones are gone).
                        continue
                    self._outage.failed(error)
                    raise LedgerUnavailable(f"the ledger database failed: {error}") from None
                await self._release(conn)
                break
        self._outage.succeeded()
        return [_Row(record) for record in records]

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[asyncpg.Connection]:
        """One of the pool's PostgreSQL connections, for this caller alone until it exits
        (a failure or a cancellation inside drops the connection instead of returning it)."""
        async with self._turns:
            conn = await self._take()
            try:
                yield conn
            except BaseException as error:
                await self._lost(conn, error)
                if isinstance(error, Exception) and is_unavailable(error):
                    self._outage.failed(error)
                raise
            await self._release(conn)

    async def _take(self) -> asyncpg.Connection:
        """An idle connection that is still open, else a new one. A connection the server
        ended while it was idle (an outage, a restart: asyncpg sees its socket close) is
        dropped here, so the first read after the database is back is served, not refused."""
        while self._idle:
            conn = self._idle.pop()
            if not conn.is_closed():
                return conn
            await close_quietly(conn)
        try:
            return await connect(self._dsn)
        except Exception as error:
            if not is_unavailable(error):
                raise
            self._outage.failed(error)
            raise LedgerUnavailable(f"the ledger database is unreachable: {error}") from None

    async def _lost(self, conn: asyncpg.Connection, error: BaseException) -> None:
        """``conn`` failed (or its caller was cancelled) with ``error``: drop it, and if the
        database is the cause, the idle ones too (the server likely ended them all: the next
        reads connect afresh rather than each fail on one)."""
        await close_quietly(conn)
        if isinstance(error, Exception) and is_unavailable(error):
            while self._idle:
                await close_quietly(self._idle.pop())

    async def _release(self, conn: asyncpg.Connection) -> None:
        if self._closed:
            await close_quietly(conn)
        else:
            self._idle.append(conn)

    async def first(self, statement: str, params: Mapping[str, Any]) -> Any | None:
        rows = await self.rows(statement, params)
        return rows[0] if rows else None

    async def close(self) -> None:
        self._closed = True
        while self._idle:
            await close_quietly(self._idle.pop())


async def connect(dsn: str, *, appender: bool = False) -> asyncpg.Connection:
    """A raw connection, planned so that no plan made while a table was small (a sequential
    scan) can stay for the connection's life: these servers never re-analyse (autovacuum is
    off), and asyncpg prepares every statement.

    - Reads (the request path's, the read models'): every statement is planned for its own
      parameters (``force_custom_plan``).
    - The appender's: its few statements are key lookups and inserts, run thousands of times
      a second, so they always run PostgreSQL's cached generic plan (``force_generic_plan``:
      no planning per append), with sequential scans off so that plan always probes the
      keys: with scans allowed, the generic plan made on a fresh ledger stayed a scan, and
      the append's read grew with the ledger. Left to choose (``auto``), PostgreSQL plans
      each statement five times first, and keeps planning one whose generic plan it
      estimates dearer than its custom ones (an array of unknown length can do that: seen in
      a harness replaying the settlement's write; in the gateway both writes went generic).
      The figures: bench/README.md, Decisions (the appender's connection; the event store).
    """
    settings = (
        {"enable_seqscan": "off", "plan_cache_mode": "force_generic_plan"}
        if appender
        else {"plan_cache_mode": "force_custom_plan"}
    )
    return await asyncpg.connect(dsn, timeout=10, server_settings=settings)


@lru_cache(maxsize=256)
def positional(statement: str) -> tuple[str, tuple[str, ...]]:
    """``statement`` with its ``:name`` parameters as ``$1, $2, ...``, and the names in
    that order (a name used twice is one parameter)."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in names:
            names.append(name)
        return f"${names.index(name) + 1}"

    return _PARAMETER.sub(number, statement), tuple(names)


async def close_quietly(conn: asyncpg.Connection) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(conn.close(), timeout=2)
    if not conn.is_closed():
        conn.terminate()
