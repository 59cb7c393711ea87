"""API keys: creation, revocation and lookup. A key's secret is shown once and stored nowhere;
the ledger and the read model keep only its SHA-256."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Literal, TypeGuard

import orjson

from ledger.events import KeyCreated, KeyRevoked
from ledger.store import NO_STREAM, EventStore
from ledger.store.stored import TYPE_CHARS
from ledger.types import money_of
from ledger.views.keys import KeysProjection
from ledger.views.projection import ProjectionRunner

__all__ = [
    "ApiKey",
    "KeyCache",
    "UnknownKey",
    "create_key",
    "find_key",
    "find_key_by_id",
    "key_stream",
    "list_keys",
    "revoke_key",
    "secret_digest",
]

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
    version: int = 0  # its ledger stream's version when read (see key_stream)
    endpoints: tuple[str, ...] | None = None  # its standing endpoint scope; None: unrestricted


@dataclass(frozen=True, slots=True)
class NewKey:
    key_id: str
    secret: str
    workspace: str
    role: Role
    endpoints: tuple[str, ...] | None = None


def secret_digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def key_stream(key_id: str) -> str:
    """The ledger stream of a key's life: created, then perhaps revoked. An append that
    requires it at the version an unrevoked key was read at (``EventStore.append``'s
    ``requires``) is refused once the key is revoked."""
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
    endpoints: tuple[str, ...] | None = None,
) -> NewKey:
    """A new key of ``workspace``; ``endpoints``, its standing endpoint scope (endpoint ids
    and ``provider:NAME`` labels, contract §4 "Endpoint scope"), None for none."""
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
        endpoints=endpoints,
    )
    await store.append(key_stream(key_id), NO_STREAM, [event])
    await _project(store)
    return NewKey(key_id, secret, workspace, role, endpoints)


async def revoke_key(
    store: EventStore, key_id: str, *, revoked_by: str | None = None, reason: str | None = None
) -> None:
    history = await store.read_stream(key_stream(key_id))
    if not history:
        raise UnknownKey(f"no key {key_id!r}")
    if any(e.type == KeyRevoked.type for e in history):
        return  # already revoked: revoking again records nothing new
    event = KeyRevoked(key_id=key_id, revoked_by=revoked_by, reason=reason)
    await store.append(key_stream(key_id), history[-1].version, [event])
    await _project(store)


# The key's row in the read model, and its stream in the ledger read in the same snapshot:
# the stream's version (what an append can require) and whether it records a revocation
# (which the read model may not show yet if the revoking command died before projecting).
_SELECT_KEY = (
    "SELECT k.key_id, k.workspace, k.role, k.revoked_at, k.budget_limit_usd, "
    "k.budget_window, k.endpoints, "
    "coalesce((SELECT max(e.version + length(e.types) - 1) FROM appends e "
    "WHERE e.stream_id = 'key-' || k.key_id), (SELECT a.version FROM archived_streams a "
    "WHERE a.stream_id = 'key-' || k.key_id)) AS version, "
    "EXISTS (SELECT 1 FROM appends e WHERE e.stream_id = 'key-' || k.key_id "
    f"AND e.types LIKE '%{TYPE_CHARS[KeyRevoked.type]}%') AS revoked_in_ledger "
    "FROM api_keys k "
)
_FIND_KEY = _SELECT_KEY + "WHERE k.secret_sha256 = :digest"
_FIND_KEY_BY_ID = _SELECT_KEY + "WHERE k.key_id = :key_id"


async def find_key(store: EventStore, secret: str) -> ApiKey | None:
    """The key with this secret, read from the keys read model and its ledger stream."""
    return await _find_key(store, secret_digest(secret))


async def find_key_by_id(store: EventStore, key_id: str) -> ApiKey | None:
    """The key ``key_id``, read as :func:`find_key` reads one: for a session that holds the
    key's id and never its secret (the console), checked again on every request."""
    return _key_of(await store.hot.first(_FIND_KEY_BY_ID, {"key_id": key_id}))


async def _find_key(store: EventStore, digest: str) -> ApiKey | None:
    return _key_of(await store.hot.first(_FIND_KEY, {"digest": digest}))


@dataclass(frozen=True, slots=True)
class KeyListing:
    """A key as ``waybill keys list`` shows it: never its secret, nor its hash."""

    key_id: str
    workspace: str
    role: str
    created_at: datetime
    revoked: bool
    budget: tuple[Decimal, str] | None
    endpoints: tuple[str, ...] | None  # its standing endpoint scope; None: unrestricted


async def list_keys(store: EventStore, workspace: str | None = None) -> list[KeyListing]:
    """Every key (of ``workspace``), oldest first, from the keys read model."""
    where = "" if workspace is None else "WHERE workspace = :workspace "
    rows = await store.hot.rows(
        "SELECT key_id, workspace, role, created_at, revoked_at, budget_limit_usd, "
        f"budget_window, endpoints FROM api_keys {where}ORDER BY created_at, key_id",
        {} if workspace is None else {"workspace": workspace},
    )
    return [
        KeyListing(
            row.key_id,
            row.workspace,
            row.role,
            _utc(row.created_at),
            row.revoked_at is not None,
            None
            if row.budget_limit_usd is None
            else (money_of(row.budget_limit_usd), str(row.budget_window)),
            None if row.endpoints is None else tuple(orjson.loads(row.endpoints)),
        )
        for row in rows
    ]


def _utc(value: Any) -> datetime:
    # A raw read: PostgreSQL gives a datetime, SQLite the text it stored (UTC).
    moment = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _key_of(row: Any) -> ApiKey | None:
    if row is None:
        return None
    budget = None
    if row.budget_limit_usd is not None and row.budget_window in ("day", "month", "total"):
        budget = (money_of(row.budget_limit_usd), row.budget_window)
    revoked = row.revoked_at is not None or bool(row.revoked_in_ledger)
    endpoints = None if row.endpoints is None else tuple(orjson.loads(row.endpoints))
    return ApiKey(
        row.key_id, row.workspace, row.role, revoked, budget, int(row.version or 0), endpoints
    )


class KeyCache:
    """Unrevoked keys by their secret's digest, for the chat path: a key read once is not
    read again on every request.

    What keeps this as strict as a read on every request: a request served on a key from
    here is accepted only by its first append, which requires the key's stream at the
    version the key was read at (``key_stream``). A revocation moves that stream, so the
    append is refused and writes nothing, no upstream call is made, and the caller evicts
    the key and reads it again (``router.http.app``). Bounded: the least recently used keys are
    dropped first."""

    LIMIT = 10_000

    def __init__(self, store: EventStore) -> None:
        self._store = store
        self._keys: dict[str, ApiKey] = {}

    async def find(self, secret: str) -> tuple[ApiKey | None, bool]:
        """The key with this secret and whether it came from the cache (so is not yet
        confirmed by a read in this request); None for an unknown key."""
        digest = secret_digest(secret)
        key = self._keys.pop(digest, None)
        if key is not None:
            self._keys[digest] = key  # to the end: the most recently used
            return key, True
        key = await _find_key(self._store, digest)
        if key is not None and not key.revoked:
            self._keys[digest] = key
            if len(self._keys) > self.LIMIT:
                del self._keys[next(iter(self._keys))]
        return key, False

    def evict(self, secret: str) -> None:
        self._keys.pop(secret_digest(secret), None)
