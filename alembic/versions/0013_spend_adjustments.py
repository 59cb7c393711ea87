"""Period adjustments in the spend read model, so that months holding them can be archived.

The spend report read every ``PeriodAdjusted`` event from the ledger, through a partial
index of the rows holding one, and so a month holding one could not leave for the archive.
``spend_attempts`` now keeps what the adjustments moved each attempt by
(``adjustment_settled_usd``, ``adjustment_held_unknown_usd``, ``adjustment_overrun_usd``),
folded by the spend projection, NULL for the attempts no adjustment moved (nearly all: no
bytes on disk). Existing rows get the sums of the adjustments the projection had already
passed (those after its checkpoint it folds itself); the ledger's index is dropped, nothing
reads it any more; the adjusted rows get a partial index of their own.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-02
"""

from __future__ import annotations

from decimal import Decimal

import orjson
import sqlalchemy as sa
from alembic import op

from ledger.store.stored import payloads_of
from ledger.types import MoneyColumn

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

_COLUMNS = ("adjustment_settled_usd", "adjustment_held_unknown_usd", "adjustment_overrun_usd")
_FIELDS = ("settled_usd", "held_unknown_usd", "overrun_usd")  # PeriodAdjusted's deltas
_ADJUSTED = "adjustment_settled_usd IS NOT NULL"
_PERIOD_ADJUSTED = "types LIKE '%V%'"  # ledger.store.stored.TYPE_CHARS["PeriodAdjusted"]


def upgrade() -> None:
    bind = op.get_bind()
    with op.batch_alter_table("spend_attempts") as batch:
        for column in _COLUMNS:
            batch.add_column(sa.Column(column, MoneyColumn))
    folded = bind.execute(
        sa.text("SELECT position FROM projection_checkpoints WHERE name = 'spend'")
    ).scalar()
    moved: dict[str, list[Decimal]] = {}
    rows = bind.execute(sa.text(f"SELECT position, payloads FROM appends WHERE {_PERIOD_ADJUSTED}"))
    for first, payloads in rows:
        for offset, payload in enumerate(payloads_of(bytes(payloads))):
            event = orjson.loads(payload)
            if event["type"] != "PeriodAdjusted" or first + offset > (folded or 0):
                continue
            sums = moved.setdefault(event["data"]["reservation_id"], [Decimal(0)] * 3)
            for i, field in enumerate(_FIELDS):
                sums[i] += Decimal(event["data"][field])
    table = sa.table(
        "spend_attempts",
        sa.column("reservation_id", sa.String),
        *(sa.column(column, MoneyColumn) for column in _COLUMNS),
    )
    for reservation, sums in moved.items():
        bind.execute(
            table.update()
            .where(table.c.reservation_id == reservation)
            .values(dict(zip(_COLUMNS, sums, strict=True)))
        )
    op.drop_index("ix_appends_period_adjusted", "appends")
    op.create_index(
        "ix_spend_attempts_adjusted",
        "spend_attempts",
        ["reservation_id"],
        postgresql_where=sa.text(_ADJUSTED),
        sqlite_where=sa.text(_ADJUSTED),
    )


def downgrade() -> None:
    op.drop_index("ix_spend_attempts_adjusted", "spend_attempts")
    op.create_index(
        "ix_appends_period_adjusted",
        "appends",
        ["position"],
        postgresql_where=sa.text(_PERIOD_ADJUSTED),
        sqlite_where=sa.text(_PERIOD_ADJUSTED),
    )
    with op.batch_alter_table("spend_attempts") as batch:
        for column in reversed(_COLUMNS):
            batch.drop_column(column)
