"""Idempotency records: the recorded outcome of a request sent with an Idempotency-Key.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "idempotency_records",
        sa.Column("workspace", sa.String(200), primary_key=True),
        sa.Column("key_sha256", sa.String(64), primary_key=True),
        sa.Column("body_sha256", sa.String(64), nullable=False),
        sa.Column("request_id", sa.String(200), nullable=False),
        sa.Column("state", sa.String(20), nullable=False),
        sa.Column("status_code", sa.Integer),
        sa.Column("content_type", sa.String(200)),
        sa.Column("headers", sa.Text),
        sa.Column("body", sa.LargeBinary),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("state IN ('in_flight', 'done')", name="ck_idempotency_records_state"),
    )
    op.create_index("ix_idempotency_records_expires", "idempotency_records", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_idempotency_records_expires", "idempotency_records")
    op.drop_table("idempotency_records")
