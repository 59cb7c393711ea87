"""Budgets: account balances, holds and their single resolution, gateway instances.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from ledger.types import MoneyColumn

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    account_checks = []
    if postgres:
        # The invariant of contract §6, enforced by the database itself: nothing can commit a
        # balance where settled + held exceeds the limit. (SQLite stores money as text and
        # serializes every writer; the append path checks the same rule in exact decimals.)
        account_checks = [
            sa.CheckConstraint(
                "held_usd >= 0 AND settled_usd >= 0 AND held_usd + settled_usd <= limit_usd",
                name="ck_budget_accounts_within_limit",
            )
        ]
    op.create_table(
        "budget_accounts",
        sa.Column("account_id", sa.String(300), primary_key=True),
        sa.Column("kind", sa.String(20), nullable=False),
        sa.Column("workspace", sa.String(200), nullable=False),
        sa.Column("key_id", sa.String(200)),
        sa.Column("window_start", sa.String(10)),
        sa.Column("limit_usd", MoneyColumn, nullable=False),
        sa.Column("held_usd", MoneyColumn, nullable=False),
        sa.Column("settled_usd", MoneyColumn, nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        *account_checks,
    )
    op.create_table(
        "budget_holds",
        sa.Column("reservation_id", sa.String(200), primary_key=True),
        sa.Column("request_id", sa.String(200), nullable=False),
        sa.Column("attempt_id", sa.String(200), nullable=False, unique=True),
        sa.Column("workspace", sa.String(200), nullable=False),
        sa.Column("key_id", sa.String(200), nullable=False),
        sa.Column("endpoint", sa.String(200), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("amount_usd", MoneyColumn, nullable=False),
        sa.Column("accounts", sa.Text, nullable=False),  # JSON list of account ids
        sa.Column("state", sa.String(20), nullable=False),
        sa.Column("owner", sa.String(100), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "state IN ('held', 'unknown', 'resolved')", name="ck_budget_holds_state"
        ),
    )
    op.create_index("ix_budget_holds_state_owner", "budget_holds", ["state", "owner"])
    # One row per hold, ever: the primary key makes "resolved exactly once" a constraint.
    op.create_table(
        "budget_resolutions",
        sa.Column(
            "reservation_id",
            sa.String(200),
            sa.ForeignKey("budget_holds.reservation_id"),
            primary_key=True,
        ),
        sa.Column("kind", sa.String(20), nullable=False),
        sa.Column("settled_usd", MoneyColumn, nullable=False),
        sa.Column("released_usd", MoneyColumn, nullable=False),
        sa.Column("resolved_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "kind IN ('settled', 'released', 'unknown_settled')",
            name="ck_budget_resolutions_kind",
        ),
    )
    op.create_table(
        "gateway_instances",
        sa.Column("instance_id", sa.String(100), primary_key=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("stopped_at", sa.DateTime(timezone=True)),
    )


def downgrade() -> None:
    op.drop_table("gateway_instances")
    op.drop_table("budget_resolutions")
    op.drop_index("ix_budget_holds_state_owner", "budget_holds")
    op.drop_table("budget_holds")
    op.drop_table("budget_accounts")
