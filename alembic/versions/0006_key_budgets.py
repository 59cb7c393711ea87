"""Per-key budget overrides on the keys read model.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from ledger.types import MoneyColumn

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("budget_limit_usd", MoneyColumn))
        batch.add_column(sa.Column("budget_window", sa.String(10)))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("budget_window")
        batch.drop_column("budget_limit_usd")
