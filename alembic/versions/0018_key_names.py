"""Keys as people manage them: a name, an expiry, rate limits of their own, who made them.

``KeyCreated`` schema 2 (contract §7) calls the key's name ``name`` where schema 1 said
``label``, and adds ``expires_at`` and ``limits``; authentication reads a key from
``api_keys``, so they are kept there too, with ``created_by`` for the key listings. Every
existing key has no expiry and no limits of its own (the fields are new); ``label`` was never
set by any command, so renaming it keeps every row as it was.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.alter_column("label", new_column_name="name", existing_type=sa.String(200))
        batch.add_column(sa.Column("expires_at", sa.DateTime(timezone=True)))
        batch.add_column(sa.Column("requests_per_minute", sa.Integer()))
        batch.add_column(sa.Column("tokens_per_minute", sa.Integer()))
        batch.add_column(sa.Column("created_by", sa.String(200)))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("created_by")
        batch.drop_column("tokens_per_minute")
        batch.drop_column("requests_per_minute")
        batch.drop_column("expires_at")
        batch.alter_column("name", new_column_name="label", existing_type=sa.String(200))
