"""The benchmarks' PostgreSQL: where it is, and a database of their own, fresh each run."""

from __future__ import annotations

import os

import psycopg
from sqlalchemy.engine import make_url

__all__ = ["PG_ADMIN", "fresh_postgres", "postgres_url"]

PG_ADMIN = os.environ.get(
    "WAYBILL_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
"""An admin URL of the server (as for the tests); the benchmarks create their databases there."""


def postgres_url(database: str) -> str:
    """The URL of ``database`` on the benchmarks' server."""
    url = make_url(PG_ADMIN).set(drivername="postgresql", database=database)
    return url.render_as_string(hide_password=False)


def fresh_postgres(database: str) -> str:
    """Drop ``database`` if it exists, create it empty, and return its URL (unmigrated)."""
    admin = make_url(PG_ADMIN).set(drivername="postgresql").render_as_string(False)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {database}")
    return postgres_url(database)
