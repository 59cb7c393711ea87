"""The spend read model found by the provider's response id.

A Responses request that continues a response (``previous_response_id``) is served only by
the endpoint that answered it (contract §4 ``response_affinity``): the gateway finds that
endpoint in ``spend_attempts`` by ``response_id``, which this index makes one probe.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-07
"""

from __future__ import annotations

from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_spend_attempts_response", "spend_attempts", ["response_id"])


def downgrade() -> None:
    op.drop_index("ix_spend_attempts_response", table_name="spend_attempts")
