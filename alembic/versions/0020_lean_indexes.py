"""Smaller indexes where the queries allow them (issue #44 item 4, bench/README.md "Ledger size").

- ``appends``: the stream's index is on ``stream_id`` alone, a hash index on PostgreSQL
  (entries of a 4-byte hash, not the ~40-character id and the version): every read of a
  stream is by stream id equality, and its few rows are sorted after the probe.
- ``spend_attempts.response_id``: a hash index on PostgreSQL (only equality lookups: the
  Responses door's affinity, reconciliation's matching).
- ``request_views (status, created_at)``: only the rows whose status is not ``succeeded``;
  a filter on ``succeeded``, nearly every row, is served by ``ix_request_views_created``.
- ``request_views``' page index (newest first) is on ``created_at`` alone: the request id
  (four times its size) only breaks ties of one microsecond, sorted after the probe.
- ``budget_holds.attempt_id`` is no unique key of its own: a hold's reservation id is derived
  from its attempt id (``ledger.books.accounting.reservation_id``), so the primary key
  already refuses a second hold of one attempt.

On SQLite the two hash indexes are B-trees (it has no other kind).

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

_NOT_SUCCEEDED = sa.text("status <> 'succeeded'")
# Names SQLite's unnamed UNIQUE of budget_holds.attempt_id (made inline by 0004) for batch mode.
_NAMING = {"uq": "uq_%(table_name)s_%(column_0_name)s"}


def upgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    op.drop_index("ix_appends_stream_version", table_name="appends")
    op.create_index("ix_appends_stream", "appends", ["stream_id"], postgresql_using="hash")
    op.drop_index("ix_spend_attempts_response", table_name="spend_attempts")
    op.create_index(
        "ix_spend_attempts_response", "spend_attempts", ["response_id"], postgresql_using="hash"
    )
    op.drop_index("ix_request_views_status_created", table_name="request_views")
    op.create_index(
        "ix_request_views_status_created",
        "request_views",
        ["status", "created_at"],
        postgresql_where=_NOT_SUCCEEDED,
        sqlite_where=_NOT_SUCCEEDED,
    )
    op.drop_index("ix_request_views_created", table_name="request_views")
    op.create_index("ix_request_views_created", "request_views", ["created_at"])
    if sqlite:
        with op.batch_alter_table("budget_holds", naming_convention=_NAMING) as batch:
            batch.drop_constraint("uq_budget_holds_attempt_id", type_="unique")
    else:
        op.drop_constraint("budget_holds_attempt_id_key", "budget_holds", type_="unique")


def downgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    if sqlite:
        with op.batch_alter_table("budget_holds") as batch:
            batch.create_unique_constraint("uq_budget_holds_attempt_id", ["attempt_id"])
    else:
        op.create_unique_constraint("budget_holds_attempt_id_key", "budget_holds", ["attempt_id"])
    op.drop_index("ix_request_views_created", table_name="request_views")
    op.create_index("ix_request_views_created", "request_views", ["created_at", "request_id"])
    op.drop_index("ix_request_views_status_created", table_name="request_views")
    op.create_index("ix_request_views_status_created", "request_views", ["status", "created_at"])
    op.drop_index("ix_spend_attempts_response", table_name="spend_attempts")
    op.create_index("ix_spend_attempts_response", "spend_attempts", ["response_id"])
    op.drop_index("ix_appends_stream", table_name="appends")
    op.create_index("ix_appends_stream_version", "appends", ["stream_id", "version"])
