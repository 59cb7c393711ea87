"""API keys read model: who may call, in which workspace, with which role.

Only the SHA-256 of a key's secret is ever stored (in the event and here).
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger.db import dialect_insert
from ledger.events import KeyCreated, KeyRevoked
from ledger.projection import Projection
from ledger.schema import api_keys
from ledger.store import RecordedEvent

__all__ = ["KeysProjection"]


class KeysProjection(Projection):
    name = "keys"
    tables = (api_keys,)
    event_types = frozenset({KeyCreated.type, KeyRevoked.type})

    async def apply(self, conn: AsyncConnection, batch: Sequence[RecordedEvent]) -> None:
        for recorded in batch:
            event = recorded.event()
            if isinstance(event, KeyCreated):
                await conn.execute(
                    dialect_insert(conn, api_keys)
                    .values(
                        key_id=event.key_id,
                        workspace=event.workspace,
                        role=event.role,
                        secret_sha256=event.secret_sha256,
                        label=event.label,
                        created_at=recorded.recorded_at,
                        budget_limit_usd=event.budget_limit_usd,
                        budget_window=event.budget_window,
                    )
                    .on_conflict_do_nothing(index_elements=["key_id"])
                )
            elif isinstance(event, KeyRevoked):
                await conn.execute(
                    update(api_keys)
                    .where(api_keys.c.key_id == event.key_id, api_keys.c.revoked_at.is_(None))
                    .values(revoked_at=recorded.recorded_at)
                )
