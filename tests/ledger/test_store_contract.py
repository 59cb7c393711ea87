"""The event store's contract: one abstract case, ``StoreContract``, run against each backend
(``TestSQLiteStore``, ``TestPostgresStore``), as the eventsourcing library runs one recorder
test case against each of its databases. A backend's subclass names its database and how a
test reaches behind the store (tampering with rows, holding the ledger's write lock); the
behaviour asked of the store is the same, races between two stores included."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import asyncpg
import pytest
from pydantic import ValidationError
from sqlalchemy import func, select, text
from sqlalchemy.engine import make_url

from ledger import events as ev
from ledger.audit.verify import verify_chain
from ledger.store import (
    ANY_VERSION,
    GENESIS_HASH,
    NO_STREAM,
    EventStore,
    LedgerUnavailable,
    RecordedEvent,
    WrongExpectedVersion,
    chain_hash,
)
from ledger.store.db import asyncpg_dsn, create_engine, sqlite_path
from ledger.store.schema import appends
from ledger.store.stored import payloads_of, types_of
from tests.helpers import eventually
from tests.ledger.factories import key_created, received, succeeded_trail
from tests.ledger.tamper import Stored, edit_ledger

AtTheLock = Callable[[], Awaitable[None]]
"""Returns once the stores' appends are waiting for the ledger's write lock."""


async def _count(store: EventStore) -> int:
    async with store.engine.connect() as conn:
        query = select(func.coalesce(func.sum(func.length(appends.c.types)), 0))
        return int((await conn.execute(query)).scalar_one())


@contextlib.asynccontextmanager
async def _stores(database_url: str, n: int) -> AsyncIterator[list[EventStore]]:
    """``n`` stores on engines of their own: what ``n`` gateway processes would be."""
    stores = [EventStore(create_engine(database_url)) for _ in range(n)]
    try:
        yield stores
    finally:
        for store in stores:
            await store.close()
            await store.engine.dispose()


def _edit_bytes(events: list[Stored]) -> None:
    events[5].payload = events[5].payload.replace(b"0.0012", b"0.0001")


def _edit_type(events: list[Stored]) -> None:
    events[5].type = "RequestFailed"


def _edit_stream(events: list[Stored]) -> None:
    events[7].stream_id = "request-r3"  # the second append's row


def _drop_event(events: list[Stored]) -> None:
    del events[5]


def _drop_row(events: list[Stored]) -> None:
    events[:] = [e for e in events if e.row != 1]


async def _plant_event_at_next_position(store: EventStore) -> None:
    # A row written behind the appender's back at the position it will assign next: its
    # insert then breaks the ledger's primary key (a bug's symptom, not an outage).
    async with store.engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO appends (position, recorded_at, version, stream_id, types, hash, "
                "payloads) SELECT position + length(types), recorded_at, 1, 'planted', types, "
                "hash, payloads FROM appends ORDER BY position DESC LIMIT 1"
            )
        )


class StoreContract:
    """What an ``EventStore`` does on every backend. A subclass per backend provides
    ``database_url`` (a migrated, empty ledger; the ``store`` fixture opens it), ``tamper``
    and ``ledger_locked``."""

    @pytest.fixture
    def database_url(self) -> str:
        raise NotImplementedError

    async def tamper(self, store: EventStore, statement: str) -> None:
        """Run ``statement`` on the ledger's rows behind the immutability triggers' back, as
        an attacker with the database's rights might."""
        raise NotImplementedError

    def ledger_locked(
        self, database_url: str, stores: Sequence[EventStore]
    ) -> contextlib.AbstractAsyncContextManager[AtTheLock]:
        """Hold the ledger's write lock from a connection of the test's own until the block
        ends; what it yields waits until the ``stores``' appends wait for the lock."""
        raise NotImplementedError

    async def test_append_then_read_back_in_order_with_typed_events(
        self, store: EventStore
    ) -> None:
        trail = succeeded_trail("r1")
        recorded = await store.append("request-r1", NO_STREAM, trail, metadata={"trace_id": "t1"})

        assert [r.position for r in recorded] == list(range(1, len(trail) + 1))
        assert [r.version for r in recorded] == list(range(1, len(trail) + 1))
        assert await store.read_stream("request-r1") == recorded
        assert await store.read_all() == recorded
        assert [r.event() for r in recorded] == trail
        assert all(r.metadata == {"trace_id": "t1"} for r in recorded)
        assert await store.head() == (len(trail), recorded[-1].hash)

    async def test_each_hash_covers_previous_hash_position_and_exact_bytes(
        self, store: EventStore
    ) -> None:
        recorded = await store.append("request-r1", NO_STREAM, succeeded_trail("r1"))
        previous = GENESIS_HASH
        for r in recorded:
            assert r.hash == chain_hash(previous, r.position, r.payload)
            previous = r.hash
        # The stored bytes are the exact bytes that were hashed, not a re-serialization.
        async with store.engine.connect() as conn:
            [row] = (await conn.execute(select(appends))).all()
        assert payloads_of(bytes(row.payloads)) == [r.payload for r in recorded]
        assert bytes(row.hash) == bytes.fromhex(recorded[-1].hash)  # the others follow from it

    async def test_an_append_is_one_row_whose_columns_are_its_events_own(
        self, store: EventStore
    ) -> None:
        recorded = await store.append(
            "request-r1", NO_STREAM, succeeded_trail("r1"), metadata={"trace_id": "t1", "n": [1]}
        )
        recorded += await store.append("key-k1", NO_STREAM, [key_created("k1")])
        async with store.engine.connect() as conn:
            rows = (await conn.execute(select(appends).order_by(appends.c.position))).all()
        assert [(r.position, r.stream_id, r.version) for r in rows] == [
            (1, "request-r1", 1),
            (8, "key-k1", 1),
        ]
        assert types_of(rows[0].types) == [r.type for r in recorded[:7]]
        assert types_of(rows[1].types) == ["KeyCreated"]
        for row in rows:
            for payload in payloads_of(bytes(row.payloads)):
                body = json.loads(payload)
                assert body["stream_id"] == row.stream_id
        assert recorded[0].metadata == {"trace_id": "t1", "n": [1]}

    async def test_money_is_recorded_as_exact_decimal_strings(self, store: EventStore) -> None:
        [recorded] = await store.append(
            "request-r1",
            NO_STREAM,
            [succeeded_trail("r1", cost="0.0000015")[5]],
        )
        assert recorded.data["settled_usd"] == "0.0000015"
        assert b'"settled_usd":"0.0000015"' in recorded.payload

    async def test_taken_version_raises_and_writes_nothing(self, store: EventStore) -> None:
        await store.append("request-r1", NO_STREAM, [received("r1")])
        with pytest.raises(WrongExpectedVersion) as caught:
            await store.append("request-r1", NO_STREAM, succeeded_trail("r1")[1:3])
        assert caught.value.actual == 1
        assert "another writer appended first" in str(caught.value)
        assert await _count(store) == 1
        assert (await store.head())[0] == 1

    async def test_concurrent_appends_at_same_version_exactly_one_wins(
        self, store: EventStore
    ) -> None:
        await store.append("request-r1", NO_STREAM, [received("r1")])
        trail = succeeded_trail("r1")
        outcomes = await asyncio.gather(
            *(store.append("request-r1", 1, [trail[1]]) for _ in range(5)), return_exceptions=True
        )
        winners = [o for o in outcomes if isinstance(o, list)]
        losers = [o for o in outcomes if isinstance(o, WrongExpectedVersion)]
        assert len(winners) == 1 and len(losers) == 4
        assert [r.version for r in await store.read_stream("request-r1")] == [1, 2]

    async def test_a_conflict_in_a_batch_does_not_fail_the_other_appends(
        self, store: EventStore
    ) -> None:
        await store.append("request-r1", NO_STREAM, [received("r1")])
        outcomes = await asyncio.gather(
            store.append("request-r2", NO_STREAM, [received("r2")]),
            store.append("request-r1", NO_STREAM, [received("r1")]),  # taken
            store.append("request-r3", ANY_VERSION, [received("r3")]),
            return_exceptions=True,
        )
        assert isinstance(outcomes[0], list) and isinstance(outcomes[2], list)
        assert isinstance(outcomes[1], WrongExpectedVersion)
        assert [r.position for r in await store.read_all()] == [1, 2, 3]

    async def test_an_append_requiring_another_stream_where_it_is_is_accepted(
        self,
        store: EventStore,
    ) -> None:
        await store.append("key-k_1", NO_STREAM, [key_created("k_1")])
        [recorded] = await store.append(
            "request-r1", NO_STREAM, [received("r1")], requires={"key-k_1": 1}
        )
        assert recorded.version == 1
        assert [r.version for r in await store.read_stream("key-k_1")] == [1]  # only checked

    async def test_an_append_requiring_a_stream_that_moved_is_refused_and_writes_nothing(
        self,
        store: EventStore,
    ) -> None:
        await store.append("key-k_1", NO_STREAM, [key_created("k_1")])
        await store.append("key-k_1", 1, [ev.KeyRevoked(key_id="k_1")])
        outcomes = await asyncio.gather(
            store.append("request-r1", NO_STREAM, [received("r1")], requires={"key-k_1": 1}),
            store.append("request-r2", NO_STREAM, [received("r2")], requires={"key-k_9": 1}),
            store.append("request-r3", NO_STREAM, [received("r3")], requires={"key-k_1": 2}),
            return_exceptions=True,
        )
        moved, missing, accepted = outcomes
        assert isinstance(moved, WrongExpectedVersion)
        assert (moved.stream_id, moved.expected, moved.actual) == ("key-k_1", 1, 2)
        assert isinstance(missing, WrongExpectedVersion) and missing.actual == 0
        assert isinstance(accepted, list)
        assert await store.read_stream("request-r1") == []
        assert await _count(store) == 3

    async def test_a_requirement_is_checked_after_the_appends_before_it_in_a_batch(
        self,
        store: EventStore,
    ) -> None:
        await store.append("key-k_1", NO_STREAM, [key_created("k_1")])
        revoked, refused = await asyncio.gather(
            store.append("key-k_1", 1, [ev.KeyRevoked(key_id="k_1")]),
            store.append("request-r1", NO_STREAM, [received("r1")], requires={"key-k_1": 1}),
            return_exceptions=True,
        )
        assert isinstance(revoked, list)
        assert isinstance(refused, WrongExpectedVersion) and refused.actual == 2

    @pytest.mark.parametrize("requires", [{"": 1}, {"key-k_1": -1}, {"request-r1": 0}])
    async def test_a_malformed_requirement_is_refused_before_anything_is_written(
        self, store: EventStore, requires: dict[str, int]
    ) -> None:
        with pytest.raises(ev.EventValidationError, match="invalid requirement"):
            await store.append("request-r1", NO_STREAM, [received("r1")], requires=requires)
        assert await _count(store) == 0

    async def test_any_version_appends_at_the_stream_end(self, store: EventStore) -> None:
        await store.append("request-r1", NO_STREAM, [received("r1")])
        [second] = await store.append("request-r1", ANY_VERSION, [succeeded_trail("r1")[1]])
        assert second.version == 2

    async def test_unknown_type_and_bad_payload_are_refused_and_nothing_is_written(
        self,
        store: EventStore,
    ) -> None:
        with pytest.raises(ev.UnknownEventType, match="'RequestTeleported'"):
            ev.decode_event("RequestTeleported", 1, {})
        with pytest.raises(ev.InvalidEventPayload, match="weight"):
            ev.decode_event(
                "RouteEvaluated",
                1,
                {
                    "request_id": "r1",
                    "sequence": 1,
                    "candidates": [
                        {
                            "endpoint": "e",
                            "model": "m",
                            "mapping_index": 0,
                            "tier": 0,
                            "weight": 0,
                            "eligible": True,
                        }
                    ],
                },
            )
        with pytest.raises(ValidationError):
            ev.BudgetSettled(  # a float is not money
                request_id="r1",
                attempt_id="a",
                reservation_id="r",
                reserved_usd=0.1,
                settled_usd="0.1",
                released_usd="0",
                usage=ev.Usage(input_tokens=1, output_tokens=1),
            )
        with pytest.raises(ValidationError):
            ev.KeyCreated(
                key_id="k", workspace="w", role="client", secret_sha256="x" * 64, extra_field=1
            )  # type: ignore[call-arg]
        with pytest.raises(ev.EventValidationError):
            await store.append("request-r1", NO_STREAM, [{"type": "RequestReceived"}])  # type: ignore[list-item]
        with pytest.raises(ev.EventValidationError):
            await store.append("request-r1", NO_STREAM, [received("r1")], metadata={"x": object()})
        assert await _count(store) == 0

    async def test_group_commit_batches_concurrent_appends_without_gaps(
        self, store: EventStore
    ) -> None:
        n = 300
        await asyncio.gather(
            *(store.append(f"request-r{i}", NO_STREAM, [received(f"r{i}")]) for i in range(n))
        )
        assert store.stats["batches"] < n / 3, store.stats
        positions = [r.position for r in await store.read_all(limit=10_000)]
        assert positions == list(range(1, n + 1))

    async def test_cancelled_caller_still_gets_its_append_committed(
        self, store: EventStore
    ) -> None:
        task = asyncio.create_task(store.append("request-r1", NO_STREAM, [received("r1")]))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await store.append("request-r2", NO_STREAM, [received("r2")])  # flushes the queue
        assert {r.stream_id for r in await store.read_all()} == {"request-r1", "request-r2"}

    @pytest.mark.slow
    async def test_concurrent_appenders_and_a_tailing_reader_see_every_event_once_in_order(
        self,
        database_url: str,
    ) -> None:
        # Two stores on two engines stand for two gateway processes: their transactions really
        # interleave in the database. A reader tails `position > checkpoint` meanwhile.
        writers = [EventStore(create_engine(database_url)) for _ in range(2)]
        reader = EventStore(create_engine(database_url))
        per_task, tasks_per_writer = 40, 8
        expected_total = per_task * tasks_per_writer * len(writers) * 2
        done = asyncio.Event()

        async def write(store: EventStore, w: int, t: int) -> None:
            for i in range(per_task):
                rid = f"w{w}t{t}i{i}"
                await store.append(f"request-{rid}", NO_STREAM, succeeded_trail(rid)[:2])

        seen: list[RecordedEvent] = []

        async def tail() -> None:
            checkpoint = 0
            while True:
                finished = done.is_set()
                page = await reader.read_all(after=checkpoint, limit=500)
                seen.extend(page)
                if page:
                    checkpoint = page[-1].position
                elif finished:
                    return
                else:
                    await asyncio.sleep(0.005)

        tailer = asyncio.create_task(tail())
        await asyncio.gather(
            *(write(s, w, t) for w, s in enumerate(writers) for t in range(tasks_per_writer))
        )
        done.set()
        await tailer
        assert [r.position for r in seen] == list(range(1, expected_total + 1))
        assert len({(r.stream_id, r.version) for r in seen}) == expected_total
        assert (await verify_chain(reader)).ok
        for s in [*writers, reader]:
            await s.close()
            await s.engine.dispose()

    async def test_verify_passes_on_an_untouched_ledger(self, store: EventStore) -> None:
        for i in range(5):
            await store.append(f"request-r{i}", NO_STREAM, succeeded_trail(f"r{i}"))
        result = await verify_chain(store)
        assert result.ok and result.checked == 35 and result.head_position == 35

    @pytest.mark.parametrize(
        ("change", "position", "problem"),
        [
            # A row keeps its last event's hash: an edit inside it is named by its first position.
            (_edit_bytes, 1, "hash does not match"),
            (_edit_type, 6, "column 'type'"),
            (_edit_stream, 8, "column 'stream_id'"),
            (_drop_event, 1, "hash does not match"),
            (_drop_row, 1, "position 1 is missing"),
        ],
    )
    async def test_verify_names_the_first_event_edited_behind_the_triggers(
        self, database_url: str, change: Callable[[list[Stored]], None], position: int, problem: str
    ) -> None:
        engine = create_engine(database_url)
        store = EventStore(engine)
        await store.append("request-r1", NO_STREAM, succeeded_trail("r1"))
        await store.append("request-r2", NO_STREAM, succeeded_trail("r2"))
        await store.close()
        edit_ledger(database_url, change)
        result = await verify_chain(store)
        await engine.dispose()
        assert not result.ok
        assert result.first_bad_position == position
        assert problem in (result.problem or "")

    async def test_verify_catches_a_truncated_tail(self, store: EventStore) -> None:
        await store.append("request-r1", NO_STREAM, succeeded_trail("r1"))
        await store.append("request-r2", NO_STREAM, succeeded_trail("r2"))
        await self.tamper(store, "DELETE FROM appends WHERE position = 8")
        result = await verify_chain(store)
        assert not result.ok and result.first_bad_position == 8

    async def test_database_refuses_update_and_delete_of_events(self, store: EventStore) -> None:
        await store.append("request-r1", NO_STREAM, [received("r1")])
        for statement in ("UPDATE appends SET types = 'X'", "DELETE FROM appends"):
            with pytest.raises(Exception, match="append-only"):
                async with store.engine.begin() as conn:
                    await conn.execute(text(statement))
        assert await _count(store) == 1

    async def test_a_refusal_that_is_not_an_outage_is_raised_as_itself(
        self, store: EventStore
    ) -> None:
        # LedgerUnavailable means "not now, retry"; a broken constraint would fail the same way
        # on every retry, so it must not be reported as one (the gateway answers it 500).
        await store.append("request-r1", NO_STREAM, [received("r1")])
        await _plant_event_at_next_position(store)
        with pytest.raises(Exception) as raised:
            await store.append("request-r2", NO_STREAM, [received("r2")])
        assert not isinstance(raised.value, LedgerUnavailable)
        assert "unique" in str(raised.value).lower() or "duplicate" in str(raised.value).lower()
        assert await store.read_stream("request-r2") == []

    async def test_commit_listeners_hear_every_committed_event_once_in_position_order(
        self,
        store: EventStore,
    ) -> None:
        heard: list[int] = []
        store.on_commit(lambda events: heard.extend(e.position for e in events))

        def failing(events: object) -> None:
            raise RuntimeError("a listener's bug")

        store.on_commit(failing)  # logged, nothing more
        await store.append("request-r1", NO_STREAM, [received("r1")])
        outcomes = await asyncio.gather(
            store.append("request-r2", NO_STREAM, [received("r2")]),
            store.append("request-r1", NO_STREAM, [received("r1")]),  # refused: not heard
            store.append("request-r3", NO_STREAM, [received("r3")]),
            return_exceptions=True,
        )
        assert isinstance(outcomes[1], WrongExpectedVersion)

        async def all_heard() -> bool:
            return heard == [1, 2, 3]

        await eventually(all_heard, within_s=2)  # no append follows: told within 10 ms

    async def test_what_listeners_were_not_told_yet_is_told_at_close(
        self, database_url: str
    ) -> None:
        engine = create_engine(database_url)
        store = EventStore(engine)
        heard: list[str] = []
        store.on_commit(lambda events: heard.extend(e.stream_id for e in events))
        await store.append("request-r1", NO_STREAM, [received("r1")])
        await store.close()  # at once, before the timer
        await engine.dispose()
        assert heard == ["request-r1"]

    async def test_two_stores_racing_for_one_version_one_wins_the_other_is_told(
        self, database_url: str
    ) -> None:
        # Two stores stand for two processes. Each submits an append at the same version of
        # one stream while the ledger's write lock is held elsewhere, so both are at the lock
        # (on PostgreSQL both have decided, one on what it knows, one on a read) when it is
        # let go: one wins, the other is decided again on the winner's commit and refused.
        async with _stores(database_url, 2) as stores:
            await stores[0].append("request-r1", NO_STREAM, [received("r1")])
            trail = succeeded_trail("r1")
            async with self.ledger_locked(database_url, stores) as at_the_lock:
                tries = [s.submit("request-r1", 1, [trail[n + 1]]) for n, s in enumerate(stores)]
                await at_the_lock()
            outcomes = await asyncio.gather(*tries, return_exceptions=True)
            winners = [o for o in outcomes if isinstance(o, list)]
            losers = [o for o in outcomes if isinstance(o, WrongExpectedVersion)]
            assert len(winners) == 1 and len(losers) == 1, outcomes
            assert (losers[0].stream_id, losers[0].expected, losers[0].actual) == (
                "request-r1",
                1,
                2,
            )
            stream = await stores[1].read_stream("request-r1")
            assert [r.version for r in stream] == [1, 2]
            assert stream[1] == winners[0][0]  # the winner's event, as it was answered
            assert [r.position for r in await stores[1].read_all()] == [1, 2]
            assert (await verify_chain(stores[1])).ok

    async def test_two_stores_starting_the_same_streams_lose_and_double_nothing(
        self, database_url: str
    ) -> None:
        # Both stores start the same new streams at once (NO_STREAM), batched as they come:
        # each stream is won by exactly one, and the ledger holds each event once, in order.
        n = 30
        async with _stores(database_url, 2) as stores:
            outcomes = await asyncio.gather(
                *(
                    store.append(f"request-r{i}", NO_STREAM, [received(f"r{i}")])
                    for i in range(n)
                    for store in stores
                ),
                return_exceptions=True,
            )
            for i in range(n):
                pair = outcomes[2 * i : 2 * i + 2]
                won = [o for o in pair if isinstance(o, list)]
                refused = [o for o in pair if isinstance(o, WrongExpectedVersion)]
                assert len(won) == 1 and len(refused) == 1, (i, pair)
                assert refused[0].actual == 1
            stored = await stores[0].read_all(limit=10_000)
            assert [r.position for r in stored] == list(range(1, n + 1))
            assert sorted(r.stream_id for r in stored) == sorted(f"request-r{i}" for i in range(n))
            assert (await verify_chain(stores[0])).ok


async def test_every_catalogue_type_round_trips_through_its_json_form() -> None:
    for name, cls in ev.CATALOGUE.items():
        assert cls.type == name
        assert cls.model_config.get("frozen") is True
        assert cls.model_config.get("extra") == "forbid"
    for event in [*succeeded_trail("r1"), key_created()]:
        data = ev.encode_event(event)
        assert ev.decode_event(type(event).type, type(event).schema_version, data) == event


def test_a_request_received_before_doors_were_named_came_through_chat_completions() -> None:
    (received,) = [e for e in succeeded_trail("r1") if isinstance(e, ev.RequestReceived)]
    data = ev.encode_event(received)
    assert data["api"] == "openai.chat_completions"
    older = {k: v for k, v in data.items() if k != "api"}
    assert ev.decode_event("RequestReceived", 1, older) == received
    anthropic = received.model_copy(update={"api": "anthropic.messages"})
    assert ev.decode_event("RequestReceived", 1, ev.encode_event(anthropic)) == anthropic
    with pytest.raises(ev.InvalidEventPayload, match="api"):
        ev.decode_event("RequestReceived", 1, {**data, "api": "telnet"})


class TestSQLiteStore(StoreContract):
    @pytest.fixture
    def database_url(self, sqlite_url: str) -> str:
        return sqlite_url

    async def tamper(self, store: EventStore, statement: str) -> None:
        async with store.engine.begin() as conn:
            await conn.execute(text("DROP TRIGGER appends_no_update"))
            await conn.execute(text("DROP TRIGGER appends_no_delete"))
            await conn.execute(text(statement))

    @contextlib.asynccontextmanager
    async def ledger_locked(
        self, database_url: str, stores: Sequence[EventStore]
    ) -> AsyncIterator[AtTheLock]:
        """The database's write lock (``BEGIN IMMEDIATE``). SQLite does not show who waits
        for it: the stores' appends are taken to be at it once their appenders have taken
        them from their queues (one writer at a time is all the race SQLite has)."""
        path = sqlite_path(database_url)
        assert path is not None
        holder = sqlite3.connect(path, timeout=30, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")

        async def taken() -> bool:
            return all(store.stats["queued"] == 0 for store in stores)

        async def at_the_lock() -> None:
            await eventually(taken)

        try:
            yield at_the_lock
        finally:
            holder.execute("ROLLBACK")
            holder.close()


@pytest.mark.postgres
class TestPostgresStore(StoreContract):
    @pytest.fixture
    def database_url(self, postgres_url: str) -> str:
        return postgres_url

    async def tamper(self, store: EventStore, statement: str) -> None:
        async with store.engine.begin() as conn:
            await conn.execute(text("ALTER TABLE appends DISABLE TRIGGER USER"))
            await conn.execute(text(statement))
            await conn.execute(text("ALTER TABLE appends ENABLE TRIGGER USER"))

    @contextlib.asynccontextmanager
    async def ledger_locked(
        self, database_url: str, stores: Sequence[EventStore]
    ) -> AsyncIterator[AtTheLock]:
        """The head row's lock (THE LOCK, in ``ledger.store.postgres``), held by a
        transaction of the test's own; the stores' appends are at it once PostgreSQL shows
        as many sessions waiting for a lock."""
        dsn = make_url(database_url).set(drivername="postgresql").render_as_string(False)
        holder = await asyncpg.connect(dsn)
        watcher = await asyncpg.connect(dsn)  # not the holder: its view is a snapshot

        async def waiting() -> bool:
            count = await watcher.fetchval(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
            return bool(count == len(stores))

        async def at_the_lock() -> None:
            await eventually(waiting)

        try:
            await holder.execute("BEGIN; SELECT 1 FROM ledger_head WHERE id = 1 FOR UPDATE")
            yield at_the_lock
        finally:
            await holder.execute("ROLLBACK")
            await holder.close()
            await watcher.close()

    async def test_the_database_refuses_truncate_of_the_ledger(self, database_url: str) -> None:
        engine = create_engine(database_url)
        try:
            with pytest.raises(Exception, match="append-only"):
                async with engine.begin() as conn:
                    await conn.execute(text("TRUNCATE appends"))
        finally:
            await engine.dispose()

    async def test_the_append_finds_holds_by_index_however_many_there_are(
        self, database_url: str
    ) -> None:
        # The append's read must probe the holds it needs, never scan them all: a scan makes
        # each append cost more as holds accumulate (one per attempt, forever). Checked on the
        # plan the appender's connection caches, made once while the table is empty (the plan
        # then stays: nothing re-analyses on these servers) and once when it holds 20,000.
        from ledger.store.postgres import _PG_READ
        from ledger.store.reads import close_quietly, connect, positional

        engine = create_engine(database_url)
        sql, names = positional(_PG_READ)
        arguments: dict[str, Any] = {"streams": ["request-r1"], "holds": ["res_7"], "accounts": []}

        async def cached_plan() -> str:
            conn = await connect(asyncpg_dsn(engine), appender=True)
            try:
                await conn.execute("SET plan_cache_mode = force_generic_plan")
                statement = await conn.prepare(sql)
                return json.dumps(await statement.explain(*(arguments[n] for n in names)))
            finally:
                await close_quietly(conn)

        try:
            for holds in (0, 20_000):
                async with engine.begin() as conn:
                    await conn.execute(
                        text(
                            "INSERT INTO budget_holds (reservation_id, request_id, attempt_id, "
                            "workspace, key_id, endpoint, model, amount_usd, accounts, "
                            "created_at) SELECT 'res_' || i, 'req_' || i, 'att_' || i, "
                            "'acme', 'k', 'east', 'm', 0.01, '[]', now() "
                            "FROM generate_series(1, :n) AS i ON CONFLICT DO NOTHING"
                        ),
                        {"n": holds},
                    )
                plan = await cached_plan()
                assert "budget_holds_pkey" in plan, plan
                assert '"Seq Scan"' not in plan, plan
        finally:
            await engine.dispose()
