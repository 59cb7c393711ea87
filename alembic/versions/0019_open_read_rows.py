"""A request's view row and its attempts' spend rows written once, at their end.

While a request is in flight its view row is in ``open_request_views``, and an attempt's
spend row in ``open_spend_attempts`` while its hold is held: the same columns as
``request_views`` and ``spend_attempts``, the primary key their only index. At the end the
open row is deleted and the row written once to the indexed table; the readers query both
(``ledger.store.schema.all_request_views``, ``all_spend_attempts``). Rows in flight when
this runs are moved to the open tables.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from ledger.types import MoneyColumn

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "open_request_views",
        sa.Column("request_id", sa.String(200), primary_key=True),
        sa.Column("workspace", sa.String(200), nullable=False),
        sa.Column("key_id", sa.String(200), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("endpoint", sa.String(200)),
        sa.Column("upstream_model", sa.String(200)),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("reserved_usd", MoneyColumn, nullable=False),
        sa.Column("settled_usd", MoneyColumn, nullable=False),
        sa.Column("held_unknown_usd", MoneyColumn, nullable=False),
        sa.Column("http_status", sa.Integer()),
        sa.Column("error_code", sa.String(100)),
        sa.Column("input_tokens", sa.BigInteger()),
        sa.Column("output_tokens", sa.BigInteger()),
        sa.Column("duration_ms", sa.BigInteger()),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("completed_at", sa.DateTime(timezone=True)),
        sa.Column("last_position", sa.BigInteger(), nullable=False),
    )
    op.create_table(
        "open_spend_attempts",
        sa.Column("reservation_id", sa.String(200), primary_key=True),
        sa.Column("request_id", sa.String(200), nullable=False),
        sa.Column("attempt_id", sa.String(200), nullable=False),
        sa.Column("workspace", sa.String(200), nullable=False),
        sa.Column("key_id", sa.String(200), nullable=False),
        sa.Column("model_group", sa.String(200), nullable=False),
        sa.Column("endpoint", sa.String(200), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("api", sa.String(40), nullable=False, server_default="openai.chat_completions"),
        sa.Column("day", sa.String(10), nullable=False),
        sa.Column("state", sa.String(20), nullable=False),
        sa.Column("reserved_usd", MoneyColumn, nullable=False),
        sa.Column("settled_usd", MoneyColumn, nullable=False),
        sa.Column("held_unknown_usd", MoneyColumn, nullable=False),
        sa.Column("overrun_usd", MoneyColumn, nullable=False),
        sa.Column("adjustment_settled_usd", MoneyColumn),
        sa.Column("adjustment_held_unknown_usd", MoneyColumn),
        sa.Column("adjustment_overrun_usd", MoneyColumn),
        sa.Column("reserved_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("upstream_request_id", sa.String(200)),
        sa.Column("response_id", sa.String(200)),
        sa.Column("input_tokens", sa.BigInteger()),
        sa.Column("output_tokens", sa.BigInteger()),
        sa.Column("cached_input_tokens", sa.BigInteger()),
        sa.Column("last_position", sa.BigInteger(), nullable=False),
    )
    _move("request_views", "open_request_views", "status = 'in_progress'")
    _move("spend_attempts", "open_spend_attempts", "state = 'held'")


def downgrade() -> None:
    _move("open_request_views", "request_views", "1 = 1")
    _move("open_spend_attempts", "spend_attempts", "1 = 1")
    op.drop_table("open_spend_attempts")
    op.drop_table("open_request_views")


def _move(source: str, target: str, where: str) -> None:
    # Named columns: a column added by a later migration is last in the old table.
    columns = ", ".join(
        c["name"] for c in sa.inspect(op.get_bind()).get_columns(target.removeprefix("open_"))
    )
    op.execute(f"INSERT INTO {target} ({columns}) SELECT {columns} FROM {source} WHERE {where}")
    op.execute(f"DELETE FROM {source} WHERE {where}")
