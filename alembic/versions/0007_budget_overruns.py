"""Overruns: usage above a hold is settled in full and its excess counted apart.

Budget accounts and resolutions gain ``overrun_usd`` (the part of what was settled beyond
the holds), the spend read model too. On PostgreSQL the accounts' CHECK becomes the
invariant with overruns: ``held + settled - overrun <= limit`` — reservations never exceed
the limit, and whatever was settled beyond them is exactly the recorded overruns. Existing
rows have no overrun: settlements were capped at their holds until now.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from ledger.types import MoneyColumn

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

_CHECK = "ck_budget_accounts_within_limit"


def upgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    for table in ("budget_accounts", "budget_resolutions", "spend_attempts"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(
                sa.Column("overrun_usd", MoneyColumn, nullable=False, server_default="0")
            )
    if postgres:
        op.drop_constraint(_CHECK, "budget_accounts", type_="check")
        op.create_check_constraint(
            _CHECK,
            "budget_accounts",
            "held_usd >= 0 AND settled_usd >= 0 AND overrun_usd >= 0 "
            "AND overrun_usd <= settled_usd "
            "AND held_usd + settled_usd - overrun_usd <= limit_usd",
        )


def downgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    if postgres:
        op.drop_constraint(_CHECK, "budget_accounts", type_="check")
        op.create_check_constraint(
            _CHECK,
            "budget_accounts",
            "held_usd >= 0 AND settled_usd >= 0 AND held_usd + settled_usd <= limit_usd",
        )
    for table in ("spend_attempts", "budget_resolutions", "budget_accounts"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("overrun_usd")
