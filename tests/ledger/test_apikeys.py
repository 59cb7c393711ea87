"""API keys: the lookup reads the ledger's own record of a revocation, and the chat path's
cache of keys is only a cache (the append that accepts a request checks the key)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from ledger import apikeys
from ledger import events as ev
from ledger.apikeys import KeyCache, key_stream
from ledger.store import EventStore


async def test_a_key_is_read_with_its_stream_s_version(store: EventStore) -> None:
    new = await apikeys.create_key(store, "acme")
    key = await apikeys.find_key(store, new.secret)
    assert key is not None and not key.revoked and key.version == 1
    await apikeys.revoke_key(store, new.key_id)
    key = await apikeys.find_key(store, new.secret)
    assert key is not None and key.revoked and key.version == 2


async def test_a_revocation_on_the_ledger_counts_before_the_read_model_shows_it(
    store: EventStore,
) -> None:
    new = await apikeys.create_key(store, "acme")
    # As if `waybill keys revoke` died between its append and its projection.
    await store.append(key_stream(new.key_id), 1, [ev.KeyRevoked(key_id=new.key_id)])
    key = await apikeys.find_key(store, new.secret)
    assert key is not None and key.revoked


async def test_the_cache_keeps_unrevoked_keys_until_evicted(store: EventStore) -> None:
    keys = KeyCache(store)
    new = await apikeys.create_key(store, "acme")
    first, cached = await keys.find(new.secret)
    assert first is not None and not cached
    again, cached = await keys.find(new.secret)
    assert again == first and cached
    await apikeys.revoke_key(store, new.key_id)
    stale, cached = await keys.find(new.secret)
    assert stale == first and cached  # what the request's first append will refuse
    keys.evict(new.secret)
    current, cached = await keys.find(new.secret)
    assert current is not None and current.revoked and not cached
    _, cached = await keys.find(new.secret)
    assert not cached  # a revoked key is never kept


async def test_the_cache_drops_the_least_recently_used_key_first(
    store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(KeyCache, "LIMIT", 2)
    keys = KeyCache(store)
    a, b, c = [await apikeys.create_key(store, "acme") for _ in range(3)]
    for new in (a, b, a, c):  # a used again after b: b is the least recently used
        await keys.find(new.secret)
    assert [(await keys.find(new.secret))[1] for new in (a, c, b)] == [True, True, False]


async def test_an_unknown_secret_is_not_a_key(store: EventStore) -> None:
    assert await KeyCache(store).find("wb_nope") == (None, False)


async def test_a_keys_endpoint_scope_is_read_with_it_and_listed(store: EventStore) -> None:
    scoped = await apikeys.create_key(store, "acme", endpoints=("east", "provider:anthropic"))
    plain = await apikeys.create_key(store, "acme", "finance")
    key = await apikeys.find_key(store, scoped.secret)
    assert key is not None and key.endpoints == ("east", "provider:anthropic")
    unscoped = await apikeys.find_key(store, plain.secret)
    assert unscoped is not None and unscoped.endpoints is None
    listed = await apikeys.list_keys(store, "acme")
    assert {k.key_id: k.endpoints for k in listed} == {
        scoped.key_id: ("east", "provider:anthropic"),
        plain.key_id: None,
    }
    assert all(k.created_at.tzinfo is not None for k in listed)
    assert await apikeys.list_keys(store, "other") == []


async def test_a_keys_name_and_expiry_are_read_with_it_and_listed(store: EventStore) -> None:
    expiry = datetime(2031, 1, 31, 18, tzinfo=UTC)
    new = await apikeys.create_key(store, "acme", name="billing batch", expires_at=expiry)
    key = await apikeys.find_key(store, new.secret)
    assert key is not None and (key.name, key.expires_at) == ("billing batch", expiry)
    (listed,) = await apikeys.list_keys(store, "acme")
    assert (listed.name, listed.expires_at, listed.created_by) == ("billing batch", expiry, None)
    assert await apikeys.key_names(store, [new.key_id, "key_nope"]) == {new.key_id: "billing batch"}


def test_an_expired_key_is_refused_as_a_revoked_one_from_its_expiry_on() -> None:
    expiry = datetime(2031, 1, 31, tzinfo=UTC)
    key = apikeys.ApiKey("k", "acme", "client", revoked=False, expires_at=expiry)
    assert not key.refused(expiry - timedelta(microseconds=1))
    assert key.refused(expiry)
    assert not apikeys.ApiKey("k", "acme", "client", revoked=False).refused(expiry)
    assert apikeys.ApiKey("k", "acme", "client", revoked=True).refused(expiry)


def test_an_expiry_is_an_iso_date_or_instant_in_the_future() -> None:
    now = datetime(2030, 6, 1, 12, tzinfo=UTC)
    assert apikeys.parse_expiry("2031-01-31", now) == datetime(2031, 1, 31, tzinfo=UTC)
    assert apikeys.parse_expiry("2031-01-31T18:00:00+02:00", now) == datetime(
        2031, 1, 31, 16, tzinfo=UTC
    )
    assert apikeys.parse_expiry("2030-06-01T12:00:01Z", now) > now
    for wrong, why in (("2030-06-01T12:00:00Z", "not in the future"), ("soon", "ISO 8601")):
        with pytest.raises(ValueError, match=why):
            apikeys.parse_expiry(wrong, now)


def test_a_keys_name_is_one_line_of_printable_text() -> None:
    assert apikeys.key_name_of("  ci runner ") == "ci runner"
    for wrong in ("", "   ", "a\nb", "x" * 201):
        with pytest.raises(ValueError):
            apikeys.key_name_of(wrong)


def test_a_key_created_under_schema_1_keeps_its_label_as_its_name() -> None:
    recorded = {
        "key_id": "key_0123456789abcdef",
        "workspace": "acme",
        "role": "client",
        "secret_sha256": "0" * 64,
        "created_by": "cli",
        "label": "old name",
        "budget_limit_usd": None,
        "budget_window": None,
    }
    event = ev.decode_event("KeyCreated", 1, recorded)
    assert isinstance(event, ev.KeyCreated)
    assert (event.name, event.expires_at, event.limits) == ("old name", None, None)
    current = ev.encode_event(event)
    assert "label" not in current and current["name"] == "old name"
    assert "expires_at" not in current and "limits" not in current  # absent: left out
    assert ev.decode_event("KeyCreated", 2, current) == event
