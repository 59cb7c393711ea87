"""Idempotency records per API key: keyed by workspace, API key and Idempotency-Key (contract §9).

Existing records (an answer is replayed for 24 hours) are kept for the API key that made
them, so that a client retrying across the upgrade still gets its recorded answer rather
than a second upstream call: a record's request id names its request stream, whose
``RequestReceived`` says which key sent it. A record whose request has no
``RequestReceived`` never reached an upstream (that event is in the request's first append,
before any call) and is dropped: its retry runs as a new request and no call is made twice.
None is kept under a placeholder key id: such a row could never be replayed, only take
space.

Downgrading drops the records of an Idempotency-Key that more than one key used (the old
key cannot hold both, and keeping either would give one key another's answer).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# PostgreSQL's name for the primary key 0003 created unnamed; the new one keeps it.
_PRIMARY_KEY = "idempotency_records_pkey"

_ATTRIBUTE = {
    "postgresql": (
        "UPDATE idempotency_records AS r SET key_id = e.data ->> 'key_id' FROM events AS e"
        " WHERE e.stream_id = 'request-' || r.request_id AND e.type = 'RequestReceived'"
    ),
    "sqlite": (
        "UPDATE idempotency_records SET key_id = ("
        "SELECT json_extract(e.data, '$.key_id') FROM events AS e"
        " WHERE e.stream_id = 'request-' || idempotency_records.request_id"
        " AND e.type = 'RequestReceived')"
    ),
}


def upgrade() -> None:
    with op.batch_alter_table("idempotency_records") as batch:
        batch.add_column(sa.Column("key_id", sa.String(200)))
    op.execute(_ATTRIBUTE[op.get_bind().dialect.name])
    op.execute("DELETE FROM idempotency_records WHERE key_id IS NULL")
    _primary_key(["workspace", "key_id", "key_sha256"], key_id_nullable=False)


def downgrade() -> None:
    op.execute(
        "DELETE FROM idempotency_records WHERE EXISTS (SELECT 1 FROM idempotency_records AS o"
        " WHERE o.workspace = idempotency_records.workspace"
        " AND o.key_sha256 = idempotency_records.key_sha256"
        " AND o.key_id <> idempotency_records.key_id)"
    )
    _primary_key(["workspace", "key_sha256"], key_id_nullable=True)
    with op.batch_alter_table("idempotency_records") as batch:
        batch.drop_column("key_id")


def _primary_key(columns: list[str], *, key_id_nullable: bool) -> None:
    """Replace the primary key: PostgreSQL alters it in place, SQLite copies the table. The
    naming convention gives SQLite's reflected, unnamed primary key PostgreSQL's name for
    it, so that one ``drop_constraint`` drops it on both."""
    with op.batch_alter_table(
        "idempotency_records", naming_convention={"pk": "%(table_name)s_pkey"}
    ) as batch:
        batch.drop_constraint(_PRIMARY_KEY, type_="primary")
        batch.alter_column("key_id", existing_type=sa.String(200), nullable=key_id_nullable)
        batch.create_primary_key(_PRIMARY_KEY, columns)
