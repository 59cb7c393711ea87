"""The ``endpoints`` stream (contract §5 "Disabled endpoints"): its fold, and the writes that
decide on it, on SQLite and PostgreSQL, racing writers included."""

from __future__ import annotations

import asyncio

from ledger import events as ev
from ledger.endpoints import ENDPOINTS_STREAM, EndpointStates, read_states, record_disabled
from ledger.endpoints import record_enabled as enable
from ledger.store import EventStore
from ledger.store.db import create_engine


def _disabled(endpoint: str = "east", key_check: str | None = "check-a") -> ev.EndpointDisabled:
    return ev.EndpointDisabled(
        endpoint=endpoint,
        http_status=401,
        error_code="invalid_api_key",
        key_check=key_check,
        request_id="req_1",
        attempt_id="att_1",
        config_generation="gen-1",
    )


async def test_a_disabling_is_folded_with_its_evidence(store: EventStore) -> None:
    states, recorded = await record_disabled(store, _disabled())
    assert recorded
    east = states.disabled["east"]
    assert (east.http_status, east.error_code, east.key_check) == (
        401,
        "invalid_api_key",
        "check-a",
    )
    assert (east.request_id, east.attempt_id, east.config_generation) == ("req_1", "att_1", "gen-1")
    assert states.version == 1 and states.named == {"east"}
    assert await read_states(store) == states
    assert east.as_json()["position"] == east.position
    assert "key_check" not in east.as_json()


async def test_the_same_key_is_disabled_once_and_another_key_again(store: EventStore) -> None:
    await record_disabled(store, _disabled())
    states, recorded = await record_disabled(store, _disabled())
    assert not recorded and states.version == 1
    states, recorded = await record_disabled(store, _disabled(key_check="check-b"))
    assert recorded and states.disabled["east"].key_check == "check-b"
    assert [e.type for e in await store.read_stream(ENDPOINTS_STREAM)] == [
        "EndpointDisabled",
        "EndpointDisabled",
    ]


async def test_enabling_lifts_a_disabling_and_only_a_disabling(store: EventStore) -> None:
    states, nothing = await enable(
        store, "east", cause="operator", actor="key_admin", generation="gen-1"
    )
    assert nothing is None and states == EndpointStates()
    await record_disabled(store, _disabled())
    states, enabled = await enable(
        store, "east", cause="operator", actor="key_admin", generation="gen-1"
    )
    assert enabled == ev.EndpointEnabled(
        endpoint="east", cause="operator", actor="key_admin", config_generation="gen-1"
    )
    assert states.disabled == {} and states.named == {"east"} and states.version == 2
    # A new key lifts only another key's disabling.
    await record_disabled(store, _disabled(key_check="check-b"))
    _, kept = await enable(
        store,
        "east",
        cause="key_changed",
        actor=None,
        generation="gen-2",
        lifts=lambda disabled: disabled.key_check != "check-b",
    )
    assert kept is None


async def test_racing_writers_record_one_disabling_and_agree_on_the_states(
    database_url: str,
) -> None:
    # Two gateway processes (two stores on one ledger) meet the same refused key at once;
    # each decides on what it read, and the loser of the append reads and decides again.
    engines = [create_engine(database_url) for _ in range(2)]
    stores = [EventStore(engine) for engine in engines]
    try:
        results = await asyncio.gather(
            *(record_disabled(stores[i % 2], _disabled()) for i in range(10))
        )
        assert sum(recorded for _, recorded in results) == 1
        assert {states.version for states, _ in results} == {1}
        assert len(await stores[0].read_stream(ENDPOINTS_STREAM)) == 1
    finally:
        for store in stores:
            await store.close()
        for engine in engines:
            await engine.dispose()


async def test_folding_again_what_was_folded_changes_nothing(store: EventStore) -> None:
    states, _ = await record_disabled(store, _disabled())
    again = states.apply(await store.read_stream(ENDPOINTS_STREAM))
    assert again is states
