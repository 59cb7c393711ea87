"""Retention: the ledger by month, and the record of the months archived.

On PostgreSQL ``appends`` becomes a table partitioned by month of ``recorded_at``
(``appends_YYYY_MM``, each with its own primary key on ``position``): a closed month can
then leave the database whole (``waybill archive``), detached and dropped, never deleted
row by row. A partitioned table's unique keys must hold its partitioning column, so
``(stream_id, version)`` is an index, no longer a unique key there: the append's write
refuses a stream it took to be new if the stream has any row (``ledger.store``), which is
what the key guarded. SQLite keeps one table (``waybill archive`` refuses there).

``ledger_archives`` (both backends) records each archived month: its positions, the hash
before it and its end hash, its file and the file's SHA-256. The live ledger's chain starts
from the last one's end hash. ``archived_streams`` keeps the version each stream reached in
the archived months, so that a stream goes on from it (versions are read from both).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from ledger.store.partitions import partition_sql

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

_COLUMNS = "position, recorded_at, version, stream_id, types, hash, payloads"


def upgrade() -> None:
    op.create_table(
        "ledger_archives",
        sa.Column("month", sa.String(7), primary_key=True),
        sa.Column("first_position", sa.BigInteger, nullable=False),
        sa.Column("last_position", sa.BigInteger, nullable=False, unique=True),
        sa.Column("previous_hash", sa.LargeBinary, nullable=False),
        sa.Column("end_hash", sa.LargeBinary, nullable=False),
        sa.Column("events", sa.BigInteger, nullable=False),
        sa.Column("file", sa.String(200), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("archived_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "archived_streams",
        sa.Column("stream_id", sa.String(200), primary_key=True),
        sa.Column("version", sa.Integer, nullable=False),
    )
    if op.get_bind().dialect.name != "postgresql":
        # One table, and the same keys as PostgreSQL's: the stream's index is no unique key.
        with op.batch_alter_table("appends") as batch:
            batch.drop_constraint("uq_appends_stream_version", type_="unique")
            batch.create_index("ix_appends_stream_version", ["stream_id", "version"])
        _sqlite_triggers()  # the table was copied without them
        return
    op.execute("ALTER TABLE appends RENAME TO appends_unpartitioned")
    op.execute(
        "CREATE TABLE appends (position bigint NOT NULL, recorded_at timestamptz NOT NULL, "
        "version integer NOT NULL, stream_id varchar(200) NOT NULL, types text NOT NULL, "
        "hash bytea NOT NULL, payloads bytea NOT NULL, "
        "CONSTRAINT ck_appends_version_positive_p CHECK (version >= 1)) "
        "PARTITION BY RANGE (recorded_at)"
    )
    months = op.get_bind().execute(
        sa.text(
            "SELECT DISTINCT to_char(recorded_at AT TIME ZONE 'UTC', 'YYYY-MM') "
            "FROM appends_unpartitioned UNION SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM') "
            "UNION SELECT to_char((now() AT TIME ZONE 'UTC') + interval '1 month', 'YYYY-MM')"
        )
    )
    for (month,) in sorted(months):
        for statement in partition_sql(month):
            op.execute(statement)
    op.execute(f"INSERT INTO appends ({_COLUMNS}) SELECT {_COLUMNS} FROM appends_unpartitioned")
    op.execute("DROP TABLE appends_unpartitioned")
    op.execute(
        "ALTER TABLE appends RENAME CONSTRAINT ck_appends_version_positive_p "
        "TO ck_appends_version_positive"
    )
    op.create_index("ix_appends_stream_version", "appends", ["stream_id", "version"])
    _postgres_index_and_guards()


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        with op.batch_alter_table("appends") as batch:
            batch.drop_index("ix_appends_stream_version")
            batch.create_unique_constraint("uq_appends_stream_version", ["stream_id", "version"])
        _sqlite_triggers()
    else:
        archived = op.get_bind().execute(sa.text("SELECT count(*) FROM ledger_archives"))
        if archived.scalar_one():
            raise RuntimeError("months of this ledger are archived: it cannot go back to 0009")
        op.execute("ALTER TABLE appends RENAME TO appends_partitioned")
        op.execute(
            "CREATE TABLE appends (position bigint PRIMARY KEY, recorded_at timestamptz NOT "
            "NULL, version integer NOT NULL, stream_id varchar(200) NOT NULL, types text NOT "
            "NULL, hash bytea NOT NULL, payloads bytea NOT NULL)"
        )
        op.execute(f"INSERT INTO appends ({_COLUMNS}) SELECT {_COLUMNS} FROM appends_partitioned")
        op.execute("DROP TABLE appends_partitioned")
        op.create_unique_constraint(
            "uq_appends_stream_version", "appends", ["stream_id", "version"]
        )
        op.create_check_constraint("ck_appends_version_positive", "appends", "version >= 1")
        _postgres_index_and_guards()
    op.drop_table("archived_streams")
    op.drop_table("ledger_archives")


def _sqlite_triggers() -> None:
    for operation in ("UPDATE", "DELETE"):
        op.execute(
            f"CREATE TRIGGER IF NOT EXISTS appends_no_{operation.lower()} BEFORE {operation} "
            f"ON appends BEGIN SELECT RAISE(ABORT, 'waybill ledger: events are append-only "
            f"({operation} refused)'); END"
        )


def _postgres_index_and_guards() -> None:
    """On a new PostgreSQL ``appends``: the period-adjustment index and the triggers that
    refuse any change to what is written."""
    op.create_index(
        "ix_appends_period_adjusted",
        "appends",
        ["position"],
        postgresql_where=sa.text("types LIKE '%V%'"),
    )
    op.execute(
        "CREATE TRIGGER appends_no_update_delete BEFORE UPDATE OR DELETE ON appends "
        "FOR EACH ROW EXECUTE FUNCTION waybill_events_are_immutable()"
    )
    op.execute(
        "CREATE TRIGGER appends_no_truncate BEFORE TRUNCATE ON appends "
        "FOR EACH STATEMENT EXECUTE FUNCTION waybill_events_are_immutable()"
    )
