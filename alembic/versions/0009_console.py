"""The console's reads: the record of each ledger verification, and the indexes its pages
page through on a large ledger.

``ledger_verifications`` is not a projection and not part of the hash chain: recording a
check of the chain inside the chain would change what the next check reads (and what a
checkpoint signs). Each row is one run of ``waybill verify`` or ``GET /v1/ledger/verify``.

The indexes: request views newest first across every workspace, by status and by key
(``ledger.views.queries``); spend rows by day across every workspace
(``ledger.views.spend_queries``); open
unknown-usage settlements oldest first; key and workspace budget accounts newest window
first (request accounts, one per request with a budget, are left out).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

_ACCOUNTS_LISTED = "kind IN ('key', 'workspace')"


def upgrade() -> None:
    op.create_table(
        "ledger_verifications",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("verified_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("verified_by", sa.String(200), nullable=False),
        sa.Column("ok", sa.Boolean, nullable=False),
        sa.Column("checked", sa.BigInteger, nullable=False),
        sa.Column("head_position", sa.BigInteger, nullable=False),
        sa.Column("first_bad_position", sa.BigInteger),
        sa.Column("problem", sa.Text),
        sa.Column("books_ok", sa.Boolean),
        sa.Column("checkpoints_ok", sa.Boolean),
    )
    op.create_index("ix_request_views_created", "request_views", ["created_at", "request_id"])
    op.create_index("ix_request_views_status_created", "request_views", ["status", "created_at"])
    op.create_index("ix_request_views_key_created", "request_views", ["key_id", "created_at"])
    op.create_index("ix_spend_attempts_day", "spend_attempts", ["day"])
    op.create_index(
        "ix_unknown_settlements_state_opened",
        "unknown_settlements",
        ["state", "opened_at", "settlement_id"],
    )
    op.create_index(
        "ix_budget_accounts_listed",
        "budget_accounts",
        [sa.text("window_start DESC"), "account_id"],
        postgresql_where=sa.text(_ACCOUNTS_LISTED),
        sqlite_where=sa.text(_ACCOUNTS_LISTED),
    )


def downgrade() -> None:
    op.drop_index("ix_budget_accounts_listed", "budget_accounts")
    op.drop_index("ix_unknown_settlements_state_opened", "unknown_settlements")
    op.drop_index("ix_spend_attempts_day", "spend_attempts")
    op.drop_index("ix_request_views_key_created", "request_views")
    op.drop_index("ix_request_views_status_created", "request_views")
    op.drop_index("ix_request_views_created", "request_views")
    op.drop_table("ledger_verifications")
