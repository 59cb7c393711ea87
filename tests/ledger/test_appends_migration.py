"""Migration 0010 converts a ledger of one row per event into one row per append, in place,
on both backends: every event keeps its position, bytes and hash, the chain verifies, the
read models replay to the same rows; and back."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import pytest
import sqlalchemy as sa
from alembic import command

from ledger.audit.verify import verify_chain
from ledger.events import Event, encode_event
from ledger.store import GENESIS_HASH, EventStore, canonical_payload, chain_hash
from ledger.store.db import _alembic_config, create_engine, migrate, sync_url
from ledger.views import all_projections
from ledger.views.projection import ProjectionRunner
from tests.ledger.factories import key_created, succeeded_trail, unknown_then_failed_trail

# The events table as migration 0001 made it.
_EVENTS = sa.table(
    "events",
    *(sa.column(name) for name in ("position", "stream_id", "version", "type")),
    *(sa.column(name) for name in ("schema_version", "payload", "hash", "recorded_at")),
    sa.column("data", sa.JSON()),
    sa.column("metadata", sa.JSON()),
)
_T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


@pytest.fixture
def engine(empty_database_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(sync_url(empty_database_url))
    yield engine
    engine.dispose()


def _old_ledger(conn: sa.Connection) -> list[dict[str, Any]]:
    """Events as the store wrote them before 0010: four appends, one per stream, the last
    two at the same instant (one batch), and a second append to the first stream."""
    appends: list[tuple[str, list[Event], datetime]] = [
        ("key-k_1", [key_created("k_1")], _T0),
        ("request-r1", succeeded_trail("r1")[:4], _T0 + timedelta(seconds=1)),
        ("request-r2", unknown_then_failed_trail("r2"), _T0 + timedelta(seconds=2)),
        ("request-r3", succeeded_trail("r3"), _T0 + timedelta(seconds=2)),
        ("request-r1", succeeded_trail("r1")[4:], _T0 + timedelta(seconds=3)),
    ]
    rows: list[dict[str, Any]] = []
    versions: dict[str, int] = {}
    previous = GENESIS_HASH
    for stream_id, events, at in appends:
        for event in events:
            versions[stream_id] = version = versions.get(stream_id, 0) + 1
            data = encode_event(event)
            metadata = {"config_generation": "g1"}
            payload = canonical_payload(
                stream_id=stream_id,
                version=version,
                event_type=event.type,
                schema_version=type(event).schema_version,
                data=data,
                metadata=metadata,
                recorded_at=at.isoformat(),
            )
            position = len(rows) + 1
            previous = chain_hash(previous, position, payload)
            rows.append(
                {
                    "position": position,
                    "stream_id": stream_id,
                    "version": version,
                    "type": event.type,
                    "schema_version": type(event).schema_version,
                    "data": data,
                    "metadata": metadata,
                    "recorded_at": at,
                    "payload": payload,
                    "hash": previous,
                }
            )
    conn.execute(_EVENTS.insert(), rows)
    conn.execute(
        sa.text("UPDATE ledger_head SET position = :p, hash = :h"),
        {"p": len(rows), "h": previous},
    )
    return rows


async def _ledger(url: str) -> tuple[list[Any], Any, int]:
    engine = create_engine(url)
    store = EventStore(engine)
    try:
        recorded = [e async for e in store.iterate()]
        result = await verify_chain(store)
        runner = ProjectionRunner(store, all_projections())
        await runner.replay()
        async with engine.connect() as conn:
            query = sa.text("SELECT count(*) FROM request_views")
            views = (await conn.execute(query)).scalar_one()
        return recorded, result, views
    finally:
        await store.close()
        await engine.dispose()


async def test_an_existing_ledger_is_converted_in_place_and_back(
    empty_database_url: str, engine: sa.Engine
) -> None:
    migrate(empty_database_url, "0008")
    with engine.begin() as conn:
        old = _old_ledger(conn)
    migrate(empty_database_url)

    recorded, result, views = await _ledger(empty_database_url)
    assert result.ok and result.checked == len(old), result
    assert [(e.position, e.hash, e.payload) for e in recorded] == [
        (r["position"], r["hash"], r["payload"]) for r in old
    ]
    assert [e.data for e in recorded] == [r["data"] for r in old]
    assert views == 3  # the read models replay from the converted rows
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT position, stream_id, version, types FROM appends ORDER BY position")
        ).all()
    # One row per append: the batch's two appends to two streams stay two rows.
    assert [tuple(r) for r in rows] == [
        (1, "key-k_1", 1, "R"),
        (2, "request-r1", 1, "ABCE"),
        (6, "request-r2", 1, "ACEGLHO"),
        (13, "request-r3", 1, "ABCEGIN"),
        (20, "request-r1", 5, "GIN"),
    ]

    command.downgrade(_alembic_config(empty_database_url), "0008")
    with engine.connect() as conn:
        back = conn.execute(sa.select(_EVENTS).order_by(sa.text("position"))).mappings().all()
    assert [(r["position"], r["stream_id"], r["version"], r["type"]) for r in back] == [
        (r["position"], r["stream_id"], r["version"], r["type"]) for r in old
    ]
    assert [bytes(r["payload"]) for r in back] == [r["payload"] for r in old]
    assert [r["hash"] for r in back] == [r["hash"] for r in old]
    assert [_json(r["data"]) for r in back] == [r["data"] for r in old]


def _json(value: Any) -> Any:
    return orjson.loads(value) if isinstance(value, str | bytes) else value
