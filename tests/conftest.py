"""Shared fixtures: a fresh, migrated database per test on SQLite and on PostgreSQL.

PostgreSQL is the real server (no mocks of the database). Each test gets its own
database cloned from a template migrated once per session, so tests are isolated and fast.
``WAYBILL_TEST_POSTGRES_URL`` names the server (an admin URL; default: local trust auth).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from hypothesis import settings
from sqlalchemy.engine import make_url

from ledger.store import EventStore
from ledger.store.db import create_engine, migrate
from tests.trusted import checked_trusted

# The gateways the tests start as processes of their own check their trusted records too
# (ledger.values.CHECK_TRUSTED); in this process the fixture below does, more strictly.
os.environ["WAYBILL_CHECK_TRUSTED"] = "1"

# No per-example deadline: the machines that run the suite are shared and noisy, and a
# property test's examples are judged by what they assert, never by how long they took.
settings.register_profile("waybill", deadline=None)
settings.load_profile("waybill")


@pytest.fixture(autouse=True, scope="session")
def _trusted_records_checked() -> Iterator[None]:
    """Every record the code under test builds trusted (``Record.trusted``) is built
    validated as well and must be the same, to its JSON's bytes (tests/trusted.py)."""
    with checked_trusted():
        yield


PG_ADMIN_URL = os.environ.get(
    "WAYBILL_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
BACKENDS = ("sqlite", "postgres")


def _pg_url(database: str) -> str:
    url = make_url(PG_ADMIN_URL).set(drivername="postgresql+psycopg", database=database)
    return url.render_as_string(hide_password=False)


def _admin() -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(
        make_url(PG_ADMIN_URL).set(drivername="postgresql").render_as_string(False),
        autocommit=True,
    )


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str]:
    name = f"waybill_tpl_{os.getpid()}"
    with _admin() as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    migrate(_pg_url(name))
    yield name
    with _admin() as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "template.db"
    migrate(f"sqlite:///{path}")
    return path


@contextmanager
def cloned_postgres(template: str) -> Iterator[str]:
    """The URL of a fresh database cloned from ``template``, dropped afterwards."""
    name = f"waybill_t_{uuid.uuid4().hex[:12]}"
    with _admin() as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {template}")
    yield _pg_url(name)
    with _admin() as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def postgres_url(pg_template: str) -> Iterator[str]:
    with cloned_postgres(pg_template) as url:
        yield url


@pytest.fixture
def sqlite_url(sqlite_template: Path, tmp_path: Path) -> str:
    path = tmp_path / "ledger.db"
    shutil.copyfile(sqlite_template, path)
    return f"sqlite:///{path}"


@pytest.fixture(params=BACKENDS)
def database_url(request: pytest.FixtureRequest) -> str:
    """A migrated, empty ledger database; the test runs once per backend."""
    fixture = "sqlite_url" if request.param == "sqlite" else "postgres_url"
    return str(request.getfixturevalue(fixture))


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[EventStore]:
    engine = create_engine(database_url)
    store = EventStore(engine)
    yield store
    await store.close()
    await engine.dispose()


@pytest.fixture(params=BACKENDS)
def empty_database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database with no schema at all, on each backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    name = f"waybill_e_{uuid.uuid4().hex[:12]}"
    with _admin() as conn:
        conn.execute(f"CREATE DATABASE {name}")
    yield _pg_url(name)
    with _admin() as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
