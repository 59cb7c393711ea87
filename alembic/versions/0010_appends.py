"""The ledger's events stored once: one row per append, its events' canonical bytes compressed.

``events`` kept each event as its hashed bytes and again as ``data`` and ``metadata`` JSON,
one row and three index entries per event. ``appends`` keeps one row per append (one
stream's consecutive events, recorded together): the first position and version, the
stream, the recorded time, a character per event type, the last event's chain hash as bytes
(the others follow from the previous row's) and the canonical bytes compressed
(``ledger.store.stored``). Each existing event keeps its position,
version, bytes and hash: consecutive events of one stream with one recorded time become one
row, as the append that wrote them. The type index gives way to a partial index of the rows
holding a ``PeriodAdjusted`` (the only type a query looks up by itself). The immutability
triggers move to the new table. Downgrading writes the events back one row each.

The spend read model's index of attempt ids goes: a hold's row is keyed by its attempt's
reservation id, which reconciliation looks up instead.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any

import orjson
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from ledger.store.stored import row_of, stored_events

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

_PAGE = 5000
_PERIOD_ADJUSTED = "types LIKE '%V%'"  # ledger.store.stored.TYPE_CHARS["PeriodAdjusted"]


def upgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    appends = op.create_table(
        "appends",
        sa.Column("position", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("stream_id", sa.String(200), nullable=False),
        sa.Column("types", sa.Text, nullable=False),
        sa.Column("hash", sa.LargeBinary, nullable=False),
        sa.Column("payloads", sa.LargeBinary, nullable=False),
        sa.UniqueConstraint("stream_id", "version", name="uq_appends_stream_version"),
        sa.CheckConstraint("version >= 1", name="ck_appends_version_positive"),
    )
    op.create_index(
        "ix_appends_period_adjusted",
        "appends",
        ["position"],
        postgresql_where=sa.text(_PERIOD_ADJUSTED),
        sqlite_where=sa.text(_PERIOD_ADJUSTED),
    )
    rows: list[dict[str, Any]] = []
    for run in _runs(op.get_bind()):
        rows.append(_row(run))
        if len(rows) >= _PAGE:
            op.bulk_insert(appends, rows)
            rows = []
    if rows:
        op.bulk_insert(appends, rows)
    _immutable("appends", postgres)
    if postgres:
        op.execute("DROP TRIGGER events_no_update_delete ON events")
        op.execute("DROP TRIGGER events_no_truncate ON events")
    op.drop_index("ix_events_type", "events")
    op.drop_table("events")
    # Reconciliation finds a hold's spend row by its primary key, the attempt's reservation id.
    op.drop_index("ix_spend_attempts_attempt", "spend_attempts")


def downgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    op.create_index("ix_spend_attempts_attempt", "spend_attempts", ["attempt_id"])
    json = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
    events = op.create_table(
        "events",
        sa.Column("position", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("stream_id", sa.String(200), nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("type", sa.String(100), nullable=False),
        sa.Column("schema_version", sa.Integer, nullable=False),
        sa.Column("data", json, nullable=False),
        sa.Column("metadata", json, nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("payload", sa.LargeBinary, nullable=False),
        sa.Column("hash", sa.String(64), nullable=False),
        sa.UniqueConstraint("stream_id", "version", name="uq_events_stream_version"),
        sa.CheckConstraint("version >= 1", name="ck_events_version_positive"),
    )
    op.create_index("ix_events_type", "events", ["type", "position"])
    bind = op.get_bind()
    after, previous = 0, None
    while True:
        page = bind.execute(
            sa.text(
                "SELECT position, hash, payloads FROM appends WHERE position > :after "
                "ORDER BY position LIMIT :page"
            ),
            {"after": after, "page": _PAGE},
        ).all()
        if not page:
            break
        rows = []
        for position, last_hash, payloads in page:
            for at, hash_, payload in stored_events(position, previous, bytes(payloads)):
                body = orjson.loads(payload)
                rows.append(
                    {
                        "position": at,
                        "stream_id": body["stream_id"],
                        "version": body["version"],
                        "type": body["type"],
                        "schema_version": body["schema_version"],
                        "data": body["data"],
                        "metadata": body["metadata"],
                        "recorded_at": datetime.fromisoformat(body["recorded_at"]),
                        "payload": payload,
                        "hash": hash_,
                    }
                )
            previous = bytes(last_hash)
        op.bulk_insert(events, rows)
        after = int(page[-1][0])
    if postgres:
        op.execute("DROP TRIGGER appends_no_update_delete ON appends")
        op.execute("DROP TRIGGER appends_no_truncate ON appends")
    op.drop_index("ix_appends_period_adjusted", "appends")
    op.drop_table("appends")
    _immutable("events", postgres)


def _runs(bind: sa.Connection) -> Iterator[list[tuple[int, dict[str, Any], bytes, str]]]:
    """The events in position order, in runs of one stream's consecutive versions recorded
    at one time (what one append wrote): each event as position, payload body, bytes, hash."""
    run: list[tuple[int, dict[str, Any], bytes, str]] = []
    after = 0
    while True:
        page = bind.execute(
            sa.text(
                "SELECT position, payload, hash FROM events WHERE position > :after "
                "ORDER BY position LIMIT :page"
            ),
            {"after": after, "page": _PAGE},
        ).all()
        for position, payload, hash_ in page:
            payload = bytes(payload)
            body = orjson.loads(payload)
            if run:
                last_position, last = run[-1][0], run[-1][1]
                if (
                    position != last_position + 1
                    or body["stream_id"] != last["stream_id"]
                    or body["version"] != last["version"] + 1
                    or body["recorded_at"] != last["recorded_at"]
                ):
                    yield run
                    run = []
            run.append((int(position), body, payload, str(hash_)))
        if len(page) < _PAGE:
            break
        after = int(page[-1][0])
    if run:
        yield run


def _row(run: list[tuple[int, dict[str, Any], bytes, str]]) -> dict[str, Any]:
    first = run[0][1]
    return row_of(
        run[0][0],
        first["stream_id"],
        first["version"],
        [body["type"] for _, body, _, _ in run],
        datetime.fromisoformat(first["recorded_at"]),
        bytes.fromhex(run[-1][3]),
        [payload for _, _, payload, _ in run],
    )


def _immutable(table: str, postgres: bool) -> None:
    """The triggers that refuse to change ``table``'s rows (contract §7); on PostgreSQL
    through 0001's function."""
    if postgres:
        op.execute(
            f"CREATE TRIGGER {table}_no_update_delete BEFORE UPDATE OR DELETE ON {table} "
            "FOR EACH ROW EXECUTE FUNCTION waybill_events_are_immutable()"
        )
        op.execute(
            f"CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table} "
            "FOR EACH STATEMENT EXECUTE FUNCTION waybill_events_are_immutable()"
        )
        return
    for operation in ("UPDATE", "DELETE"):
        op.execute(
            f"CREATE TRIGGER {table}_no_{operation.lower()} BEFORE {operation} ON {table} "
            f"BEGIN SELECT RAISE(ABORT, 'waybill ledger: events are append-only "
            f"({operation} refused)'); END"
        )
