"""Read models: API keys and the request view.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from ledger.types import MoneyColumn

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("key_id", sa.String(200), primary_key=True),
        sa.Column("workspace", sa.String(200), nullable=False),
        sa.Column("role", sa.String(20), nullable=False),
        sa.Column("secret_sha256", sa.String(64), nullable=False, unique=True),
        sa.Column("label", sa.String(200)),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True)),
    )
    op.create_table(
        "request_views",
        sa.Column("request_id", sa.String(200), primary_key=True),
        sa.Column("workspace", sa.String(200), nullable=False),
        sa.Column("key_id", sa.String(200), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("endpoint", sa.String(200)),
        sa.Column("upstream_model", sa.String(200)),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("reserved_usd", MoneyColumn, nullable=False),
        sa.Column("settled_usd", MoneyColumn, nullable=False),
        sa.Column("held_unknown_usd", MoneyColumn, nullable=False),
        sa.Column("http_status", sa.Integer),
        sa.Column("error_code", sa.String(100)),
        sa.Column("input_tokens", sa.BigInteger),
        sa.Column("output_tokens", sa.BigInteger),
        sa.Column("duration_ms", sa.BigInteger),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("completed_at", sa.DateTime(timezone=True)),
        sa.Column("last_position", sa.BigInteger, nullable=False),
    )
    op.create_index(
        "ix_request_views_workspace_created", "request_views", ["workspace", "created_at"]
    )


def downgrade() -> None:
    op.drop_index("ix_request_views_workspace_created", "request_views")
    op.drop_table("request_views")
    op.drop_table("api_keys")
