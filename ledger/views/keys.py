"""API keys read model: who may call, in which workspace, with which role.

Only the SHA-256 of a key's secret is ever stored (in the event and here).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from ledger.events import KeyCreated, KeyRevoked
from ledger.store.schema import api_keys
from ledger.views.page import PageEvent
from ledger.views.projection import ModelWriter, Projection, fold_into

__all__ = ["KeysProjection"]


class KeysProjection(Projection):
    name = "keys"
    tables = (api_keys,)
    event_types = frozenset({KeyCreated.type, KeyRevoked.type})

    async def apply(self, writer: ModelWriter, batch: Sequence[PageEvent]) -> None:
        await fold_into(writer, api_keys, "key_id", batch, fold_key)


def fold_key(row: dict[str, Any] | None, recorded: PageEvent) -> dict[str, Any] | None:
    """The key's row after ``recorded``: created once, revoked once."""
    event = recorded.event()
    if isinstance(event, KeyCreated):
        if row is not None:
            return row
        limits = event.limits
        return {
            "key_id": event.key_id,
            "workspace": event.workspace,
            "role": event.role,
            "secret_sha256": event.secret_sha256,
            "name": event.name,
            "created_at": recorded.recorded_at,
            "revoked_at": None,
            "budget_limit_usd": event.budget_limit_usd,
            "budget_window": event.budget_window,
            "endpoints": _json(event.endpoints),
            "expires_at": event.expires_at,
            "requests_per_minute": limits.requests_per_minute if limits else None,
            "tokens_per_minute": limits.tokens_per_minute if limits else None,
            "created_by": event.created_by,
        }
    if isinstance(event, KeyRevoked) and row is not None and row["revoked_at"] is None:
        return {**row, "revoked_at": recorded.recorded_at}
    return row


def _json(endpoints: tuple[str, ...] | None) -> str | None:
    return None if endpoints is None else orjson.dumps(endpoints).decode()
