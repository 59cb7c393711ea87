"""The appends that hold a recorded reconciliation get a partial index of their own.

The reconciliations list (``ledger.finance.reconcile.list_reconciliations``) reads the appends
holding a ``ReconciliationImported`` newest first; without an index it scanned every month of
the ledger (bench/README.md "The console's pages"). The index holds those few rows only.

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

# ledger.store.stored.TYPE_CHARS["ReconciliationImported"], written as holding() writes it.
_HOLDS_A_REPORT = "types LIKE '%Q%'"


def upgrade() -> None:
    op.create_index(
        "ix_appends_reports",
        "appends",
        ["position"],
        postgresql_where=sa.text(_HOLDS_A_REPORT),
        sqlite_where=sa.text(_HOLDS_A_REPORT),
    )


def downgrade() -> None:
    op.drop_index("ix_appends_reports", "appends")
