"""Single-statement reads on the request path, without the ORM's per-statement cost.

A key lookup through SQLAlchemy's async engine costs about 370 µs of CPU (statement
compilation and caching, the greenlet bridge, result processing); the same statement on a
raw psycopg connection about 90 µs. The request path reads a few rows per request, so on
PostgreSQL those reads go through :class:`HotReads`: a small pool (at most four) of autocommit
psycopg connections, statements prepared by psycopg after their first few uses. On SQLite they go
through the engine as before (its cost is the database file's, not the ORM's).

Statements are written once, with ``:name`` parameters, and run unchanged on both backends.
Rows come back with attribute access. Values are the driver's: on SQLite a money column is
text and a timestamp is text, so callers convert (``Decimal(str(value))``).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections import deque
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import psycopg
from psycopg.rows import namedtuple_row
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from ledger.db import READ_ONLY, LedgerUnavailable, psycopg_conninfo

__all__ = ["HotReads", "close_quietly"]

_CONNECTIONS = 4  # at most, per process: requests beyond that wait their turn (a read is short)
_PARAMETER = re.compile(r"(?<![:\w]):(\w+)")


class HotReads:
    """Run one read statement and return its rows (a list of named tuples or Rows)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._postgres = engine.dialect.name == "postgresql"
        self._conninfo = psycopg_conninfo(engine)
        self._idle: deque[psycopg.AsyncConnection[Any]] = deque()
        self._turns = asyncio.Semaphore(_CONNECTIONS)
        self._closed = False

    async def rows(self, statement: str, params: Mapping[str, Any]) -> Sequence[Any]:
        if not self._postgres:
            async with self._engine.connect() as connection:
                reading = await connection.execution_options(**{READ_ONLY: True})
                return (await reading.execute(text(statement), dict(params))).all()
        async with self._turns:
            try:
                conn = self._idle.pop() if self._idle else await self._connect()
            except psycopg.OperationalError as error:
                raise LedgerUnavailable(f"the ledger database is unreachable: {error}") from None
            try:
                cursor = await conn.execute(_psycopg_statement(statement), params)
                rows: list[Any] = await cursor.fetchall()
            except BaseException as error:
                await close_quietly(conn)  # a failed or cancelled read leaves nothing to reuse
                if isinstance(error, psycopg.OperationalError):
                    raise LedgerUnavailable(f"the ledger database failed: {error}") from None
                raise
            if self._closed:
                await close_quietly(conn)
            else:
                self._idle.append(conn)
            return rows

    async def first(self, statement: str, params: Mapping[str, Any]) -> Any | None:
        rows = await self.rows(statement, params)
        return rows[0] if rows else None

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        return await psycopg.AsyncConnection.connect(
            self._conninfo, autocommit=True, row_factory=namedtuple_row, connect_timeout=10
        )

    async def close(self) -> None:
        self._closed = True
        while self._idle:
            await close_quietly(self._idle.pop())


@lru_cache(maxsize=256)
def _psycopg_statement(statement: str) -> str:
    """``:name`` parameters as psycopg's ``%(name)s`` (and a literal ``%`` doubled)."""
    return _PARAMETER.sub(r"%(\1)s", statement.replace("%", "%%"))


async def close_quietly(conn: psycopg.AsyncConnection[Any]) -> None:
    with contextlib.suppress(Exception):
        await conn.close()
