"""A key's standing endpoint scope in the keys read model.

``KeyCreated.endpoints`` (``waybill keys create --endpoints``) names the endpoint ids and
``provider:NAME`` labels every request of the key is narrowed to (contract §4 "Endpoint
scope"); authentication reads the key from ``api_keys``, so the scope is kept there too, as
a JSON array. NULL: the key is not narrowed, which every existing key is (the field is new).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("endpoints", sa.Text()))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("endpoints")
