"""Spend read models: one row per attempt's hold, one per unknown-usage settlement.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from ledger.types import MoneyColumn

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "spend_attempts",
        sa.Column("reservation_id", sa.String(200), primary_key=True),
        sa.Column("request_id", sa.String(200), nullable=False),
        sa.Column("attempt_id", sa.String(200), nullable=False),
        sa.Column("workspace", sa.String(200), nullable=False),
        sa.Column("key_id", sa.String(200), nullable=False),
        sa.Column("model_group", sa.String(200), nullable=False),
        sa.Column("endpoint", sa.String(200), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("day", sa.String(10), nullable=False),
        sa.Column("state", sa.String(20), nullable=False),
        sa.Column("reserved_usd", MoneyColumn, nullable=False),
        sa.Column("settled_usd", MoneyColumn, nullable=False),
        sa.Column("held_unknown_usd", MoneyColumn, nullable=False),
        sa.Column("reserved_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("upstream_request_id", sa.String(200)),
        sa.Column("response_id", sa.String(200)),
        sa.Column("input_tokens", sa.BigInteger),
        sa.Column("output_tokens", sa.BigInteger),
        sa.Column("cached_input_tokens", sa.BigInteger),
        sa.Column("last_position", sa.BigInteger, nullable=False),
    )
    op.create_index("ix_spend_attempts_workspace_day", "spend_attempts", ["workspace", "day"])
    op.create_index("ix_spend_attempts_attempt", "spend_attempts", ["attempt_id"])
    op.create_index("ix_spend_attempts_upstream_request", "spend_attempts", ["upstream_request_id"])
    op.create_table(
        "unknown_settlements",
        sa.Column("settlement_id", sa.String(200), primary_key=True),
        sa.Column("request_id", sa.String(200), nullable=False),
        sa.Column("attempt_id", sa.String(200), nullable=False),
        sa.Column("reservation_id", sa.String(200), nullable=False),
        sa.Column("workspace", sa.String(200), nullable=False),
        sa.Column("key_id", sa.String(200), nullable=False),
        sa.Column("endpoint", sa.String(200), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("cause", sa.String(100), nullable=False),
        sa.Column("held_usd", MoneyColumn, nullable=False),
        sa.Column("state", sa.String(20), nullable=False),
        sa.Column("settled_usd", MoneyColumn),
        sa.Column("opened_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("settled_at", sa.DateTime(timezone=True)),
        sa.Column("last_position", sa.BigInteger, nullable=False),
    )
    op.create_index(
        "ix_unknown_settlements_workspace_state", "unknown_settlements", ["workspace", "state"]
    )


def downgrade() -> None:
    op.drop_index("ix_unknown_settlements_workspace_state", "unknown_settlements")
    op.drop_table("unknown_settlements")
    op.drop_index("ix_spend_attempts_upstream_request", "spend_attempts")
    op.drop_index("ix_spend_attempts_attempt", "spend_attempts")
    op.drop_index("ix_spend_attempts_workspace_day", "spend_attempts")
    op.drop_table("spend_attempts")
