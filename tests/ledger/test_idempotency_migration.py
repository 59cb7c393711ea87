"""Migration 0008 moves idempotency records to (workspace, API key, Idempotency-Key) without
losing a recorded answer its key may still ask for, on both backends, and back."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.script import ScriptDirectory

from ledger.store import canonical_payload
from ledger.store.db import _alembic_config, migrate, sync_url

_NOW = datetime.now(UTC)


def _revision_before_0008() -> str:
    down = ScriptDirectory.from_config(_alembic_config("sqlite://")).get_revision("0008")
    assert down is not None and isinstance(down.down_revision, str)
    return down.down_revision


@pytest.fixture
def engine(empty_database_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(sync_url(empty_database_url))
    yield engine
    engine.dispose()


def _record(conn: sa.Connection, request_id: str, key_sha256: str, **key_id: str) -> None:
    columns = ", ".join(["workspace", *key_id, "key_sha256", "body_sha256", "request_id"])
    values = ", ".join([":workspace", *(f":{c}" for c in key_id), ":key", ":body", ":request"])
    conn.execute(
        sa.text(
            f"INSERT INTO idempotency_records ({columns}, state, status_code, body,"
            f" lease_until, expires_at) VALUES ({values}, 'done', 200, :answer, :now, :expires)"
        ),
        {
            "workspace": "acme",
            **key_id,
            "key": key_sha256,
            "body": "b" * 64,
            "request": request_id,
            "answer": request_id.encode(),
            "now": _NOW,
            "expires": _NOW + timedelta(hours=24),
        },
    )


# The events table as migration 0001 made it (0010 replaced it).
_EVENTS = sa.table(
    "events",
    *(sa.column(name) for name in ("position", "stream_id", "version", "type")),
    *(sa.column(name) for name in ("schema_version", "payload", "hash", "recorded_at")),
    sa.column("data", sa.JSON()),
    sa.column("metadata", sa.JSON()),
)


def _received(conn: sa.Connection, position: int, request_id: str, key_id: str) -> None:
    data = {"request_id": request_id, "workspace": "acme", "key_id": key_id}
    stream_id = f"request-{request_id}"
    payload = canonical_payload(
        stream_id=stream_id,
        version=1,
        event_type="RequestReceived",
        schema_version=1,
        data=data,
        metadata={},
        recorded_at=_NOW.isoformat(),
    )
    conn.execute(
        _EVENTS.insert().values(
            position=position,
            stream_id=stream_id,
            version=1,
            type="RequestReceived",
            schema_version=1,
            data=data,
            metadata={},
            recorded_at=_NOW,
            payload=payload,
            hash="0" * 64,
        )
    )


def _records(engine: sa.Engine, columns: str) -> set[tuple[str, ...]]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text(f"SELECT {columns} FROM idempotency_records"))
        return {tuple(row) for row in rows}


def test_existing_records_are_kept_for_the_key_whose_request_they_answer(
    empty_database_url: str, engine: sa.Engine
) -> None:
    migrate(empty_database_url, _revision_before_0008())
    with engine.begin() as conn:
        _record(conn, "req_a", "a" * 64)
        _received(conn, 1, "req_a", "key_one")
        _record(conn, "req_b", "b" * 64)
        _received(conn, 2, "req_b", "key_two")
        # Claimed, and the process died before the request's first append: no upstream
        # was called, so the record has nothing worth replaying and no key to belong to.
        _record(conn, "req_never_ran", "c" * 64)
    migrate(empty_database_url)
    assert _records(engine, "key_id, key_sha256, request_id") == {
        ("key_one", "a" * 64, "req_a"),
        ("key_two", "b" * 64, "req_b"),
    }
    with engine.begin() as conn:  # another key may now use the same Idempotency-Key
        _record(conn, "req_c", "a" * 64, key_id="key_two")


def test_downgrade_drops_only_idempotency_keys_that_several_keys_used(
    empty_database_url: str, engine: sa.Engine
) -> None:
    migrate(empty_database_url)
    with engine.begin() as conn:
        _record(conn, "req_a", "a" * 64, key_id="key_one")
        _record(conn, "req_b", "a" * 64, key_id="key_two")  # shared: neither may keep it
        _record(conn, "req_c", "c" * 64, key_id="key_one")
    command.downgrade(_alembic_config(empty_database_url), _revision_before_0008())
    assert _records(engine, "key_sha256, request_id") == {("c" * 64, "req_c")}
    migrate(empty_database_url)  # and up again: req_c has no RequestReceived here
    assert _records(engine, "key_id") == set()
