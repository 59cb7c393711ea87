"""Ledger core: the append-only events table, its head row and projection checkpoints.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

GENESIS_HASH = "0" * 64


def _json() -> sa.types.TypeEngine[Any]:
    return sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("position", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("stream_id", sa.String(200), nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("type", sa.String(100), nullable=False),
        sa.Column("schema_version", sa.Integer, nullable=False),
        sa.Column("data", _json(), nullable=False),
        sa.Column("metadata", _json(), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("payload", sa.LargeBinary, nullable=False),
        sa.Column("hash", sa.String(64), nullable=False),
        sa.UniqueConstraint("stream_id", "version", name="uq_events_stream_version"),
        sa.CheckConstraint("version >= 1", name="ck_events_version_positive"),
    )
    op.create_index("ix_events_type", "events", ["type", "position"])
    op.create_table(
        "ledger_head",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("position", sa.BigInteger, nullable=False),
        sa.Column("hash", sa.String(64), nullable=False),
        sa.CheckConstraint("id = 1", name="ck_ledger_head_single_row"),
    )
    op.execute(f"INSERT INTO ledger_head (id, position, hash) VALUES (1, 0, '{GENESIS_HASH}')")
    op.create_table(
        "projection_checkpoints",
        sa.Column("name", sa.String(100), primary_key=True),
        sa.Column("position", sa.BigInteger, nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )

    # Immutability is the database's job, not a convention (contract §7).
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            """
            CREATE FUNCTION waybill_events_are_immutable() RETURNS trigger
            LANGUAGE plpgsql AS $$
            BEGIN
                RAISE EXCEPTION 'waybill ledger: events are append-only (% refused)', TG_OP
                    USING ERRCODE = 'insufficient_privilege';
            END;
            $$
            """
        )
        op.execute(
            "CREATE TRIGGER events_no_update_delete BEFORE UPDATE OR DELETE ON events "
            "FOR EACH ROW EXECUTE FUNCTION waybill_events_are_immutable()"
        )
        op.execute(
            "CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON events "
            "FOR EACH STATEMENT EXECUTE FUNCTION waybill_events_are_immutable()"
        )
    else:
        for operation in ("UPDATE", "DELETE"):
            op.execute(
                f"CREATE TRIGGER events_no_{operation.lower()} BEFORE {operation} ON events "
                f"BEGIN SELECT RAISE(ABORT, 'waybill ledger: events are append-only "
                f"({operation} refused)'); END"
            )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS events_no_truncate ON events")
        op.execute("DROP TRIGGER IF EXISTS events_no_update_delete ON events")
        op.execute("DROP FUNCTION IF EXISTS waybill_events_are_immutable()")
    op.drop_table("projection_checkpoints")
    op.drop_table("ledger_head")
    op.drop_index("ix_events_type", "events")
    op.drop_table("events")
