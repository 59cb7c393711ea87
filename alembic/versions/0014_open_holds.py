"""A hold is written once: its open state moves to ``budget_open_holds``.

A hold's row was written at the reservation and again when it was resolved: its ``state``
was indexed (with its ``owner``, for crash recovery), so every resolution left a second
version of the whole row and of its index entries behind, two thirds of the books' bytes on
disk per request. The hold's open state now lives in a short row of its own,
``budget_open_holds`` (reservation id, ``held`` or ``unknown``, the owner), written at the
reservation and deleted at the resolution; ``budget_holds`` keeps the hold as it was taken
and is never updated. Existing holds that are not resolved get their row; ``state``,
``owner`` and their index leave ``budget_holds``.

Downgrading puts them back; a resolved hold's owner is not kept, so it comes back as
``unknown``.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

_OWNER_UNKNOWN = "unknown"  # ledger.books.accounting.UNKNOWN_OWNER


def upgrade() -> None:
    op.create_table(
        "budget_open_holds",
        sa.Column(
            "reservation_id",
            sa.String(200),
            sa.ForeignKey("budget_holds.reservation_id"),
            primary_key=True,
        ),
        sa.Column("state", sa.String(20), nullable=False),
        sa.Column("owner", sa.String(100), nullable=False),
        sa.CheckConstraint("state IN ('held', 'unknown')", name="ck_budget_open_holds_state"),
    )
    op.create_index("ix_budget_open_holds_state_owner", "budget_open_holds", ["state", "owner"])
    op.execute(
        "INSERT INTO budget_open_holds (reservation_id, state, owner) "
        "SELECT reservation_id, state, owner FROM budget_holds WHERE state <> 'resolved'"
    )
    op.drop_index("ix_budget_holds_state_owner", "budget_holds")
    with op.batch_alter_table("budget_holds") as batch:
        batch.drop_constraint("ck_budget_holds_state", type_="check")
        batch.drop_column("owner")
        batch.drop_column("state")


def downgrade() -> None:
    with op.batch_alter_table("budget_holds") as batch:
        batch.add_column(
            sa.Column("state", sa.String(20), nullable=False, server_default="resolved")
        )
        batch.add_column(
            sa.Column("owner", sa.String(100), nullable=False, server_default=_OWNER_UNKNOWN)
        )
    op.execute(
        "UPDATE budget_holds SET state = o.state, owner = o.owner FROM budget_open_holds o "
        "WHERE o.reservation_id = budget_holds.reservation_id"
    )
    with op.batch_alter_table("budget_holds") as batch:
        batch.alter_column("state", server_default=None)
        batch.alter_column("owner", server_default=None)
        batch.create_check_constraint(
            "ck_budget_holds_state", "state IN ('held', 'unknown', 'resolved')"
        )
    op.create_index("ix_budget_holds_state_owner", "budget_holds", ["state", "owner"])
    op.drop_index("ix_budget_open_holds_state_owner", "budget_open_holds")
    op.drop_table("budget_open_holds")
