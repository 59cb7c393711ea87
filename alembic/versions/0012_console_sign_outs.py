"""The console's signed-out sessions, shared by every gateway process on the ledger.

A console session is a signed cookie (router.http.console.sessions); signing out used to be
remembered only by the process that served it, so a copy of the cookie still opened the
console through another worker or replica until it expired. Each sign-out is now a row
here, which every process reads before taking a session.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "console_sign_outs",
        sa.Column("session_id", sa.String(64), primary_key=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("console_sign_outs")
