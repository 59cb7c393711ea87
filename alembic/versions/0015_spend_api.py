"""The door in the spend read model, so that spend can be grouped by it (``group_by=api``).

``spend_attempts`` gains ``api``, the client API the attempt's request came through, folded
from ``BudgetReserved.api``. Every existing row is of chat completions, the only door there
was when it was folded (and what an older ``BudgetReserved`` reads as): the column's default.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("spend_attempts") as batch:
        batch.add_column(
            sa.Column(
                "api", sa.String(40), nullable=False, server_default="openai.chat_completions"
            )
        )


def downgrade() -> None:
    with op.batch_alter_table("spend_attempts") as batch:
        batch.drop_column("api")
