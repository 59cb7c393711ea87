"""API keys: creation, revocation and lookup. A key's secret is shown once and stored nowhere;
the ledger and the read model keep only its SHA-256."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from decimal import Decimal
from typing import Literal, TypeGuard

from ledger.events import KeyCreated, KeyRevoked
from ledger.projection import ProjectionRunner
from ledger.store import NO_STREAM, EventStore
from ledger.types import money_of
from ledger.views.keys import KeysProjection

__all__ = ["ApiKey", "UnknownKey", "create_key", "find_key", "revoke_key", "secret_digest"]

Role = Literal["client", "admin", "finance", "auditor"]
Window = Literal["day", "month", "total"]
ROLES: tuple[Role, ...] = ("client", "admin", "finance", "auditor")


def is_role(value: str) -> TypeGuard[Role]:
    return value in ROLES


class UnknownKey(LookupError):
    pass


@dataclass(frozen=True, slots=True)
class ApiKey:
    key_id: str
    workspace: str
    role: Role
    revoked: bool
    budget: tuple[Decimal, Window] | None = None  # overrides the workspace's key_budget


@dataclass(frozen=True, slots=True)
class NewKey:
    key_id: str
    secret: str
    workspace: str
    role: Role


def secret_digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _stream(key_id: str) -> str:
    return f"key-{key_id}"


async def _project(store: EventStore) -> None:
    # The keys read model is what authentication reads; bring it up to date at once so a
    # new key works, and a revoked key is refused, as soon as the command returns.
    runner = ProjectionRunner(store, [KeysProjection()])
    await runner.catch_up(runner.get("keys"))


async def create_key(
    store: EventStore,
    workspace: str,
    role: Role = "client",
    *,
    created_by: str | None = None,
    budget: tuple[Decimal, Window] | None = None,
) -> NewKey:
    key_id = f"key_{secrets.token_hex(8)}"
    secret = f"wb_{secrets.token_urlsafe(32)}"
    event = KeyCreated(
        key_id=key_id,
        workspace=workspace,
        role=role,
        secret_sha256=secret_digest(secret),
        created_by=created_by,
        budget_limit_usd=budget[0] if budget else None,
        budget_window=budget[1] if budget else None,
    )
    await store.append(_stream(key_id), NO_STREAM, [event])
    await _project(store)
    return NewKey(key_id, secret, workspace, role)


async def revoke_key(
    store: EventStore, key_id: str, *, revoked_by: str | None = None, reason: str | None = None
) -> None:
    history = await store.read_stream(_stream(key_id))
    if not history:
        raise UnknownKey(f"no key {key_id!r}")
    if any(e.type == KeyRevoked.type for e in history):
        return  # already revoked: revoking again records nothing new
    event = KeyRevoked(key_id=key_id, revoked_by=revoked_by, reason=reason)
    await store.append(_stream(key_id), history[-1].version, [event])
    await _project(store)


_FIND_KEY = (
    "SELECT key_id, workspace, role, revoked_at, budget_limit_usd, budget_window "
    "FROM api_keys WHERE secret_sha256 = :digest"
)


async def find_key(store: EventStore, secret: str) -> ApiKey | None:
    """The key with this secret, from the keys read model (on every request: a revoked key
    is refused as soon as the revocation is recorded)."""
    row = await store.hot.first(_FIND_KEY, {"digest": secret_digest(secret)})
    if row is None:
        return None
    budget = None
    if row.budget_limit_usd is not None and row.budget_window in ("day", "month", "total"):
        budget = (money_of(row.budget_limit_usd), row.budget_window)
    return ApiKey(row.key_id, row.workspace, row.role, row.revoked_at is not None, budget)
