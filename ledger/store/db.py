"""Database URLs, engines and migrations for the two supported backends.

PostgreSQL (``postgresql+psycopg://``) is the production store; SQLite is the embedded
default. Both are reached through SQLAlchemy's async engine (psycopg 3 and aiosqlite), and
both are migrated by the same Alembic scripts in the checkout's top-level ``alembic/``, which
the wheel carries as ``ledger/migrations/`` (pyproject.toml) so that an installed Waybill
migrates exactly as a checkout does.
"""

from __future__ import annotations

import os
import re
import sqlite3
from pathlib import Path
from typing import Any, Final

import asyncpg
import orjson
from sqlalchemy import create_engine as sa_create_engine
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

__all__ = [
    "DEFAULT_DATABASE_URL",
    "READ_ONLY",
    "UNAVAILABLE",
    "LedgerUnavailable",
    "absolute_url",
    "async_url",
    "asyncpg_dsn",
    "create_engine",
    "create_thread_engine",
    "current_revision",
    "head_revision",
    "is_postgres",
    "is_unavailable",
    "migrate",
    "redacted_url",
    "resolve_database_url",
    "sqlite_path",
    "sync_url",
]

DEFAULT_DATABASE_URL = "sqlite:///waybill.db"
READ_ONLY = "waybill_read_only"
"""Execution option for a connection that only reads: on SQLite it need not take the write lock."""


def _alembic_dir() -> Path:
    """The Alembic script directory: an installed wheel's ``ledger/migrations`` (where
    pyproject.toml packs the checkout's ``alembic/``), else the checkout's ``alembic/``.

    The folder has no ``__init__.py``, so a checkout's ``alembic/`` on ``sys.path`` is at most
    a namespace portion and never shadows the Alembic library (a regular package wins)."""
    package = Path(__file__).resolve().parents[1]  # ledger/
    installed = package / "migrations"
    return installed if (installed / "env.py").is_file() else package.parent / "alembic"


ALEMBIC_DIR: Final = _alembic_dir()


class DatabaseUrlError(ValueError):
    pass


class LedgerUnavailable(Exception):
    """The database could not be reached or could not durably record an append (nothing
    was acknowledged). The gateway answers 503 ``ledger_unavailable``."""


UNAVAILABLE: tuple[type[BaseException], ...] = (
    LedgerUnavailable,
    OSError,
    TimeoutError,
    # asyncpg: the connection is closed, broken or refused; the server is shutting down or
    # cancelled the statement; it is out of connections, memory or disk; a lock or
    # serialization conflict (a retry may succeed).
    asyncpg.InterfaceError,
    asyncpg.PostgresConnectionError,
    asyncpg.OperatorInterventionError,
    asyncpg.InsufficientResourcesError,
    asyncpg.TransactionRollbackError,
    asyncpg.LockNotAvailableError,
    # SQLAlchemy (psycopg, aiosqlite): the same classes of trouble, and its pool's timeout.
    sa_exc.OperationalError,
    sa_exc.InterfaceError,
    sa_exc.TimeoutError,
)
"""The database failures that say "not now" rather than "never": the ledger is unavailable,
and a retry may succeed."""


_BROKEN_PROTOCOL: Final = re.compile(r"not connected|\"failed\" state|another operation \(2\)")

_UNAVAILABLE_SQLSTATE_CLASSES: Final = frozenset(
    {
        "08",  # connection exception
        "28",  # invalid authorization (a role or password changed under the gateway)
        "3D",  # no such database (dropped, or not created yet)
        "40",  # transaction rollback: serialization failure, deadlock
        "53",  # insufficient resources: disk, memory, connections
        "55",  # object not in prerequisite state: a database not accepting connections,
        #        a lock not available
        "57",  # operator intervention: shutdown, cancelled statement, cannot connect now
        "58",  # system error: I/O
    }
)


def is_unavailable(error: BaseException) -> bool:
    """Whether ``error`` means the database could not do the work now (answered 503
    ``ledger_unavailable``, retryable). Anything else a database raises (a constraint
    violated, a statement refused, a value out of range) is a bug in Waybill, and retrying
    would fail the same way: it is answered 500 and logged. PostgreSQL's errors are judged
    by their SQLSTATE class, whichever driver raised them."""
    if isinstance(error, sa_exc.DBAPIError) and error.connection_invalidated:
        return True
    if isinstance(error, UNAVAILABLE):
        return True
    original = error.orig if isinstance(error, sa_exc.DBAPIError) else error
    if isinstance(original, asyncpg.InternalClientError):
        # asyncpg's protocol after its connection broke (a server that terminated the
        # backend): "not connected", "protocol is in the 'failed' state", or a new statement
        # meeting the protocol still consuming the error the server sent unasked (state 2,
        # PROTOCOL_ERROR_CONSUME). Any other internal client error is a bug.
        return _BROKEN_PROTOCOL.search(str(original)) is not None
    sqlstate = getattr(original, "sqlstate", None)
    return isinstance(sqlstate, str) and sqlstate[:2] in _UNAVAILABLE_SQLSTATE_CLASSES


def resolve_database_url(url: str | None) -> str:
    """The URL to use: the argument, else ``WAYBILL_DATABASE_URL``, else a local SQLite file."""
    return url or os.environ.get("WAYBILL_DATABASE_URL") or DEFAULT_DATABASE_URL


def _parse(url: str) -> URL:
    try:
        parsed = make_url(url)
    except ArgumentError as error:
        raise DatabaseUrlError(f"not a database URL: {url!r}") from error
    if parsed.get_backend_name() not in ("postgresql", "sqlite"):
        raise DatabaseUrlError(
            f"unsupported database {parsed.get_backend_name()!r}: use postgresql or sqlite"
        )
    return parsed


def sqlite_path(url: str) -> Path | None:
    """The file a SQLite URL names; None for PostgreSQL and in-memory SQLite."""
    parsed = _parse(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database)


def absolute_url(url: str) -> str:
    """The URL with a SQLite file's path made absolute, so it names the same ledger from any
    folder; any other URL as it is."""
    path = sqlite_path(url)
    if path is None or path.is_absolute():
        return url
    return _parse(url).set(database=str(path.resolve())).render_as_string(hide_password=False)


def redacted_url(url: str) -> str:
    """The URL as it may be shown: any password masked."""
    return _parse(url).render_as_string(hide_password=True)


def is_postgres(url: str) -> bool:
    return _parse(url).get_backend_name() == "postgresql"


def async_url(url: str) -> URL:
    parsed = _parse(url)
    if parsed.get_backend_name() == "postgresql":
        return parsed.set(drivername="postgresql+psycopg")
    return parsed.set(drivername="sqlite+aiosqlite")


def asyncpg_dsn(engine: AsyncEngine) -> str:
    """The engine's PostgreSQL URL as asyncpg takes it (for the raw connections of the hot
    path: the appender's and the request path's reads; ``ledger.store.reads``)."""
    return engine.url.set(drivername="postgresql").render_as_string(hide_password=False)


def sync_url(url: str) -> URL:
    parsed = _parse(url)
    if parsed.get_backend_name() == "postgresql":
        return parsed.set(drivername="postgresql+psycopg")
    return parsed.set(drivername="sqlite+pysqlite")


def _json_serializer(value: Any) -> str:
    return orjson.dumps(value).decode()


def create_engine(url: str, *, pool_size: int = 10) -> AsyncEngine:
    """An async engine configured for the ledger's needs on either backend."""
    target = async_url(url)
    if target.get_backend_name() == "postgresql":
        return create_async_engine(
            target,
            pool_size=pool_size,
            max_overflow=pool_size,
            # No pre-ping (a round trip before every transaction): a connection that died
            # fails its one transaction, is discarded, and the next checkout is fresh.
            # An unreachable server must fail a request fast, not hang it.
            # Every statement planned for its own parameters: psycopg prepares a statement
            # after five uses, and PostgreSQL may then keep one generic plan, made while a
            # read model's table was still small (a sequential scan), for good — a replay or
            # a projection that slows down as its tables grow.
            connect_args={"connect_timeout": 5, "options": "-c plan_cache_mode=force_custom_plan"},
            json_serializer=_json_serializer,
            json_deserializer=orjson.loads,
        )
    engine = create_async_engine(
        target,
        json_serializer=_json_serializer,
        json_deserializer=orjson.loads,
        connect_args={"timeout": 30},
    )
    _configure_sqlite(engine.sync_engine)
    return engine


def create_thread_engine(engine: AsyncEngine) -> Engine:
    """A synchronous engine on the same SQLite file as ``engine``, configured as it is, for
    connections that threads of their own use (``ledger.store.sqlite``): the same types, the
    same pragmas, the same BEGIN IMMEDIATE."""
    sync = sa_create_engine(
        engine.url.set(drivername="sqlite+pysqlite"),
        json_serializer=_json_serializer,
        json_deserializer=orjson.loads,
        # A reader's connection may be taken by any thread of its pool.
        connect_args={"timeout": 30, "check_same_thread": False},
    )
    _configure_sqlite(sync)
    return sync


def _configure_sqlite(engine: Engine) -> None:
    # pysqlite's own transaction handling defers BEGIN until the first write, which lets two
    # writers both read the head row and then collide. We take over: every transaction is
    # BEGIN IMMEDIATE (one writer at a time, waiting on busy_timeout), in WAL mode so readers
    # never block the writer. synchronous=FULL: an acknowledged append survives power loss
    # (in WAL mode, NORMAL would only fsync at checkpoints: a commit acknowledged before a
    # power cut could be lost, which docs/contract.md, "Durability of answers", does not
    # allow; see bench/README.md, "The embedded default").
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        if connection.get_execution_options().get(READ_ONLY):
            connection.exec_driver_sql("BEGIN")
        else:
            connection.exec_driver_sql("BEGIN IMMEDIATE")


def _alembic_config(url: str) -> Any:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(ALEMBIC_DIR))
    # ConfigParser interpolation would eat '%' in passwords.
    config.set_main_option(
        "sqlalchemy.url", sync_url(url).render_as_string(hide_password=False).replace("%", "%%")
    )
    return config


def migrate(url: str, revision: str = "head") -> None:
    """Upgrade the database at ``url`` to ``revision`` (Alembic is the only schema path)."""
    from alembic import command

    command.upgrade(_alembic_config(url), revision)
    target = make_url(url)
    if target.get_backend_name() == "sqlite" and target.database not in (None, "", ":memory:"):
        # WAL is a property of the file: set it here, on the one connection, rather than
        # first by whichever of a gateway's connections opens first. The switch takes an
        # exclusive lock, and two engines opening a fresh rollback-journal file at once
        # had one of them told "database is locked".
        conn = sqlite3.connect(target.database, timeout=30)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
        finally:
            conn.close()


def head_revision() -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(_alembic_config("sqlite://")).get_current_head()


async def current_revision(engine: AsyncEngine) -> str | None:
    """The revision the database is at, or None if it was never migrated."""
    from sqlalchemy import inspect, text

    async with engine.connect() as conn:
        has_table = await conn.run_sync(
            lambda sync_conn: inspect(sync_conn).has_table("alembic_version")
        )
        if not has_table:
            return None
        row = (await conn.execute(text("SELECT version_num FROM alembic_version"))).first()
        return None if row is None else str(row[0])


def dialect_insert(engine_or_conn: Any, table: Any) -> Any:
    """An INSERT that supports ``on_conflict_do_*`` on the connection's backend."""
    if engine_or_conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        return pg_insert(table)
    from sqlalchemy.dialects.sqlite import insert as sqlite_insert

    return sqlite_insert(table)
