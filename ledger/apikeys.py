"""API keys: creation, revocation and lookup. A key's secret is shown once and stored nowhere;
the ledger and the read model keep only its SHA-256."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Literal, TypeGuard

import orjson

from ledger.events import KeyCreated, KeyLimits, KeyRevoked
from ledger.store import NO_STREAM, EventStore, WrongExpectedVersion
from ledger.store.stored import TYPE_CHARS
from ledger.types import money_of
from ledger.views.keys import KeysProjection
from ledger.views.projection import ProjectionRunner

__all__ = [
    "ApiKey",
    "KeyCache",
    "KeyListing",
    "NewKey",
    "UnknownKey",
    "create_key",
    "find_key",
    "find_key_by_id",
    "key_listing",
    "key_name_of",
    "key_names",
    "key_stream",
    "list_keys",
    "parse_expiry",
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
    name: str | None = None
    expires_at: datetime | None = None  # None: never
    limits: KeyLimits | None = None  # its own rate limits, over the workspace's key_limits

    def refused(self, now: datetime) -> bool:
        """Whether a request now is refused as by an unknown key: the key is revoked, or
        it has expired (an expired key is refused exactly as a revoked one, contract §3)."""
        return self.revoked or expired(self.expires_at, now)


def expired(expires_at: datetime | None, now: datetime) -> bool:
    """Whether a key that expires at ``expires_at`` is expired at ``now``: from that instant
    on, not after it."""
    return expires_at is not None and now >= expires_at


def key_name_of(text: str) -> str:
    """A key's name as given: trimmed, one line of printable text of 1 to 200 characters.
    ValueError says what is wrong."""
    name = text.strip()
    if not name:
        raise ValueError("a key's name must not be empty")
    if len(name) > 200:
        raise ValueError("a key's name is at most 200 characters")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise ValueError("a key's name is one line of printable text")
    return name


def parse_expiry(text: str, now: datetime) -> datetime:
    """A key's ``expires_at`` as given to ``keys create`` or the key API: an ISO 8601 date
    (midnight UTC) or date and time (UTC unless it carries an offset), later than ``now``.
    ValueError says what is wrong."""
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"{text!r} is not an ISO 8601 date or date and time (e.g. 2027-01-31 or "
            "2027-01-31T18:00:00Z)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    if moment <= now:
        # A key born expired could never be used: surely a mistake in the date.
        raise ValueError(f"{text!r} is not in the future")
    return moment.astimezone(UTC)


@dataclass(frozen=True, slots=True)
class NewKey:
    key_id: str
    secret: str
    workspace: str
    role: Role
    endpoints: tuple[str, ...] | None = None
    name: str | None = None
    expires_at: datetime | None = None
    limits: KeyLimits | None = None


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
    name: str | None = None,
    expires_at: datetime | None = None,
    limits: KeyLimits | None = None,
) -> NewKey:
    """A new key of ``workspace``; ``endpoints``, its standing endpoint scope (endpoint ids
    and ``provider:NAME`` labels, contract §4 "Endpoint scope"), None for none. ``created_by``
    is the actor recorded with it (an admin key's id, or "cli")."""
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
        name=name,
        expires_at=expires_at,
        limits=limits,
    )
    await store.append(key_stream(key_id), NO_STREAM, [event])
    await _project(store)
    return NewKey(key_id, secret, workspace, role, endpoints, name, expires_at, limits)


async def revoke_key(
    store: EventStore, key_id: str, *, revoked_by: str | None = None, reason: str | None = None
) -> None:
    while True:
        history = await store.read_stream(key_stream(key_id))
        if not history:  # before the event is built: no key has an id it would refuse
            raise UnknownKey(f"no key {key_id!r}")
        event = KeyRevoked(key_id=key_id, revoked_by=revoked_by, reason=reason)
        if any(e.type == KeyRevoked.type for e in history):
            break  # already revoked: revoking again records nothing new
        try:
            await store.append(key_stream(key_id), history[-1].version, [event])
            break
        except WrongExpectedVersion:
            continue  # another revocation got there first: read again, and find it
    await _project(store)


# The key's row in the read model, and its stream in the ledger read in the same snapshot:
# the stream's version (what an append can require) and whether it records a revocation
# (which the read model may not show yet if the revoking command died before projecting).
_SELECT_KEY = (
    "SELECT k.key_id, k.workspace, k.role, k.revoked_at, k.budget_limit_usd, "
    "k.budget_window, k.endpoints, k.name, k.expires_at, k.requests_per_minute, "
    "k.tokens_per_minute, "
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
    """A key as ``waybill keys list`` and ``GET /v1/admin/keys`` show it: never its secret,
    nor its hash."""

    key_id: str
    workspace: str
    role: str
    created_at: datetime
    revoked: bool
    budget: tuple[Decimal, str] | None
    endpoints: tuple[str, ...] | None  # its standing endpoint scope; None: unrestricted
    name: str | None = None
    expires_at: datetime | None = None
    limits: KeyLimits | None = None
    created_by: str | None = None
    revoked_at: datetime | None = None

    def state(self, now: datetime) -> Literal["active", "revoked", "expired"]:
        if self.revoked:
            return "revoked"
        return "expired" if expired(self.expires_at, now) else "active"


_LIST_KEYS = (
    "SELECT key_id, workspace, role, created_at, revoked_at, budget_limit_usd, budget_window, "
    "endpoints, name, expires_at, requests_per_minute, tokens_per_minute, created_by "
    "FROM api_keys "
)


async def list_keys(store: EventStore, workspace: str | None = None) -> list[KeyListing]:
    """Every key (of ``workspace``), oldest first, from the keys read model."""
    where = "" if workspace is None else "WHERE workspace = :workspace "
    rows = await store.hot.rows(
        f"{_LIST_KEYS}{where}ORDER BY created_at, key_id",
        {} if workspace is None else {"workspace": workspace},
    )
    return [_listing(row) for row in rows]


async def key_listing(store: EventStore, key_id: str) -> KeyListing | None:
    """The key ``key_id`` as :func:`list_keys` shows it; None if there is none."""
    row = await store.hot.first(f"{_LIST_KEYS}WHERE key_id = :key_id", {"key_id": key_id})
    return None if row is None else _listing(row)


async def key_names(store: EventStore, key_ids: Iterable[str]) -> dict[str, str]:
    """The names of those of ``key_ids`` that have one: what the console shows beside (or
    instead of) a key's id."""
    wanted = sorted(set(key_ids))
    if not wanted:
        return {}
    marks = ", ".join(f":k{i}" for i in range(len(wanted)))
    rows = await store.hot.rows(
        f"SELECT key_id, name FROM api_keys WHERE key_id IN ({marks}) AND name IS NOT NULL",
        {f"k{i}": key_id for i, key_id in enumerate(wanted)},
    )
    return {row.key_id: row.name for row in rows}


def _listing(row: Any) -> KeyListing:
    return KeyListing(
        row.key_id,
        row.workspace,
        row.role,
        _utc(row.created_at),
        row.revoked_at is not None,
        None
        if row.budget_limit_usd is None
        else (money_of(row.budget_limit_usd), str(row.budget_window)),
        None if row.endpoints is None else tuple(orjson.loads(row.endpoints)),
        row.name,
        None if row.expires_at is None else _utc(row.expires_at),
        _limits(row),
        row.created_by,
        None if row.revoked_at is None else _utc(row.revoked_at),
    )


def _limits(row: Any) -> KeyLimits | None:
    if row.requests_per_minute is None and row.tokens_per_minute is None:
        return None
    return KeyLimits(
        requests_per_minute=row.requests_per_minute, tokens_per_minute=row.tokens_per_minute
    )


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
        row.key_id,
        row.workspace,
        row.role,
        revoked,
        budget,
        int(row.version or 0),
        endpoints,
        row.name,
        None if row.expires_at is None else _utc(row.expires_at),
        _limits(row),
    )


class KeyCache:
    """Unrevoked keys by their secret's digest, for the chat path: a key read once is not
    read again on every request.

    What keeps this as strict as a read on every request: a request served on a key from
    here is accepted only by its first append, which requires the key's stream at the
    version the key was read at (``key_stream``). A revocation moves that stream, so the
    append is refused and writes nothing, no upstream call is made, and the caller evicts
    the key and reads it again (``router.http.app``). An expiry moves no stream: a cached key
    is held to its ``expires_at`` on every request (``ApiKey.refused``). Bounded: the least
    recently used keys are dropped first."""

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
