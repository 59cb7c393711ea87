"""The append-only event store: the one place where events are ordered, hashed and written.

Appends from every concurrent request in this process go through one ``Appender`` task that
commits them in batches (group commit): while one transaction is in flight, the next
appends queue up and share the following transaction. Each append is still atomic and
checked on its own: a stream version that is already taken fails that append alone, with
nothing of it written.

Every event's hash covers the previous event's hash, its position and its exact canonical
bytes (``payload``), so ``verify`` detects any edit, insertion or deletion made around the
database's immutability triggers.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any, Final, Literal, Protocol, TypeVar

import asyncpg
import orjson
from sqlalchemy import func, insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ledger.books.accounting import (
    Balance,
    Books,
    BudgetDenied,
    Effect,
    Hold,
    HoldStateError,
    Reserve,
)
from ledger.books.balances import (
    balance_of,
    book_needs,
    book_writes,
    hold_of,
    load_books,
    save_books,
)
from ledger.events import Event, EventValidationError, decode_event, encode_event
from ledger.store.db import READ_ONLY, LedgerUnavailable, asyncpg_dsn, is_unavailable
from ledger.store.partitions import ensure_months, month_bounds, month_of
from ledger.store.reads import HotReads, close_quietly, connect, positional
from ledger.store.schema import appends, ledger_head
from ledger.store.stored import (
    GENESIS_HASH,
    chain_hash,
    from_position,
    previous_hash,
    row_of,
    stored_events,
)

__all__ = [
    "ANY_VERSION",
    "GENESIS_HASH",
    "NO_STREAM",
    "EventStore",
    "LedgerUnavailable",
    "RecordedEvent",
    "WrongExpectedVersion",
    "chain_hash",
    "decode_row",
]

ANY_VERSION: None = None
"""``expected_version`` that appends at the stream's end, whatever its version."""
NO_STREAM = 0
"""``expected_version`` for a stream that must not exist yet."""

_MAX_BATCH_EVENTS = 1000
_TELL_WITHIN_S = 0.01
"""The longest the commit listeners wait to hear of a commit (see ``EventStore.on_commit``)."""
_V = TypeVar("_V")
_log = logging.getLogger("waybill.ledger")


class WrongExpectedVersion(Exception):
    """The stream is not at the version the caller expected; nothing was written."""

    def __init__(self, stream_id: str, expected: int, actual: int) -> None:
        super().__init__(
            f"stream {stream_id!r} is at version {actual}, not the expected {expected}: "
            "another writer appended first; nothing was written"
        )
        self.stream_id = stream_id
        self.expected = expected
        self.actual = actual

    def __reduce__(self) -> tuple[Any, ...]:  # across processes (ledger.store.shared_appends)
        return (WrongExpectedVersion, (self.stream_id, self.expected, self.actual))


@dataclass(frozen=True, slots=True)
class RecordedEvent:
    """An event as it stands in the ledger."""

    position: int
    stream_id: str
    version: int
    type: str
    schema_version: int
    data: dict[str, Any]
    metadata: dict[str, Any]
    recorded_at: datetime
    hash: str
    payload: bytes
    _event: Event | None = field(default=None, compare=False, repr=False)

    def event(self) -> Event:
        """The typed event, upcast to the current schema version (validated once, then
        shared by every reader of this record: the events are immutable)."""
        typed = self._event
        if typed is None:
            typed = decode_event(self.type, self.schema_version, self.data)
            object.__setattr__(self, "_event", typed)
        return typed

    def as_json(self) -> dict[str, Any]:
        """The event in the query API's stable shape (contract §3)."""
        return {
            "position": self.position,
            "stream_id": self.stream_id,
            "version": self.version,
            "type": self.type,
            "schema_version": self.schema_version,
            "data": self.data,
            "metadata": self.metadata,
            "recorded_at": self.recorded_at.isoformat(),
            "hash": self.hash,
        }


def canonical_payload(
    *,
    stream_id: str,
    version: int,
    event_type: str,
    schema_version: int,
    data: Mapping[str, Any],
    metadata: Mapping[str, Any],
    recorded_at: str,
) -> bytes:
    """The exact bytes that are stored and hashed: sorted-key, compact UTF-8 JSON."""
    return orjson.dumps(
        {
            "stream_id": stream_id,
            "version": version,
            "type": event_type,
            "schema_version": schema_version,
            "data": data,
            "metadata": metadata,
            "recorded_at": recorded_at,
        },
        option=orjson.OPT_SORT_KEYS,
    )


def _payload_from_parts(
    *,
    stream_id: bytes,
    version: int,
    event_type: bytes,
    schema_version: int,
    data: bytes,
    metadata: bytes,
    recorded_at: bytes,
) -> bytes:
    """``canonical_payload``'s bytes from parts already JSON-encoded (the ``data`` and
    ``metadata`` objects with sorted keys, the strings quoted): the append encodes each
    event's data once, for these bytes and for the queryable column alike. The keys are
    written in sorted order, as ``OPT_SORT_KEYS`` writes them."""
    return b"".join(
        (
            b'{"data":',
            data,
            b',"metadata":',
            metadata,
            b',"recorded_at":',
            recorded_at,
            b',"schema_version":',
            str(schema_version).encode(),
            b',"stream_id":',
            stream_id,
            b',"type":',
            event_type,
            b',"version":',
            str(version).encode(),
            b"}",
        )
    )


def _exact(encoded: bytes) -> bytes:
    """``encoded`` in a block of its own size. orjson returns its bytes in the buffer it
    wrote them to, 4 KB at least: an append waiting for its commit holds one per event."""
    return memoryview(encoded).tobytes()


@functools.lru_cache(maxsize=1024)
def _json_string(text: str) -> bytes:
    """An event type as JSON (a few dozen, over and over: cached)."""
    return orjson.dumps(text)


def decode_payload(position: int, hash_: str, payload: bytes) -> RecordedEvent:
    body = orjson.loads(payload)
    return RecordedEvent(
        position=position,
        stream_id=body["stream_id"],
        version=body["version"],
        type=body["type"],
        schema_version=body["schema_version"],
        data=body["data"],
        metadata=body["metadata"],
        recorded_at=_recorded_at(body["recorded_at"]),
        hash=hash_,
        payload=payload,
    )


def decode_row(
    position: int, previous: bytes | None, payloads: bytes, *, after: int = 0
) -> list[RecordedEvent]:
    """The events an ``appends`` row holds (those past position ``after``), in order;
    ``previous`` is the previous row's hash (``ledger.store.stored.previous_hash``)."""
    return [
        decode_payload(at, hash_, payload)
        for at, hash_, payload in stored_events(position, previous, bytes(payloads), after=after)
    ]


def _utc_now() -> datetime:
    return datetime.now(UTC)


# The events of one append batch share their recorded time: a page of events holds few
# distinct ones, so each is parsed once (datetimes are immutable).
_recorded_at = functools.lru_cache(maxsize=256)(datetime.fromisoformat)


@dataclass(slots=True)
class _PendingAppend:
    stream_id: str
    expected_version: int | None
    events: list[_Encoded]
    metadata: dict[str, Any]
    metadata_json: bytes  # sorted keys, as in the payload
    future: asyncio.Future[list[RecordedEvent]]
    effects: tuple[Effect, ...] = ()
    requires: tuple[tuple[str, int], ...] = ()  # other streams' versions, only checked
    result: list[RecordedEvent] | BaseException | None = None
    # Sent by another worker of the same `waybill serve` (ledger.store.shared_appends): its
    # commit listeners are told there, not here.
    forwarded: bool = False


@dataclass(slots=True)
class _Encoded:
    """One event of an append, encoded once. Never changed, yet not frozen: a frozen
    dataclass sets each field through ``object.__setattr__`` (~4x the time), and an
    append makes one per event."""

    type: str
    type_json: bytes  # the type as a JSON string
    schema_version: int
    data: dict[str, Any]
    data_json: bytes  # sorted keys, as in the payload
    event: Event | None  # None: a forwarded append's (only its bytes crossed)


@dataclass
class _AppenderState:
    queue: deque[_PendingAppend] = field(default_factory=deque)
    # What the idle appender waits on (a bare future: an asyncio.Event's wait and set cost
    # ~1% of the gateway's CPU at c1, twice a request).
    idle: asyncio.Future[None] | None = None
    task: asyncio.Task[None] | None = None
    closing: bool = False
    batches: int = 0

    def wake(self) -> None:
        if self.idle is not None and not self.idle.done():
            self.idle.set_result(None)


class EventStore:
    """Append to and read from the ledger. One instance per process and event loop."""

    def __init__(self, engine: AsyncEngine, *, clock: Callable[[], datetime] | None = None) -> None:
        """``clock``: the recorded time of each batch (UTC now; a test may set the month)."""
        self.engine = engine
        self.clock = clock or _utc_now
        postgres = engine.dialect.name == "postgresql"
        self._pg = _PostgresAppender(engine, self.clock) if postgres else None
        self._state = _AppenderState()
        self.hot = HotReads(engine)  # the request path's single-statement reads
        self._commit_signals: weakref.WeakSet[asyncio.Event] = weakref.WeakSet()
        self._listeners: list[Callable[[Sequence[RecordedEvent]], None]] = []
        self._untold: list[list[_PendingAppend]] = []  # committed, listeners not yet told
        self._tell_timer: asyncio.TimerHandle | None = None
        # Set in the workers of `waybill serve --workers N` but the first: their batches go
        # to the first worker's appender (ledger.store.shared_appends).
        self._forwarder: Forwarder | None = None

    def on_commit(self, listener: Callable[[Sequence[RecordedEvent]], None]) -> Callable[[], None]:
        """Call ``listener`` with the events of each batch this store commits, soon after
        the commit (this process's appends only, in position order): while the database
        works on the next batch, or within ``_TELL_WITHIN_S`` if none comes. Never before
        the callers the commit woke have had their turn, so the listeners (the metrics: ~7%
        of the gateway's CPU, ~0.15 ms at c1) are off the request path. It must be quick
        and must not raise; what it raises is logged. Returns the way to unsubscribe."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def commit_signal(self) -> asyncio.Event:
        """An event this store sets after each commit (the caller clears it)."""
        signal = asyncio.Event()
        self._commit_signals.add(signal)
        return signal

    # --- append path ---

    async def append(
        self,
        stream_id: str,
        expected_version: int | None,
        new_events: Sequence[Event],
        *,
        metadata: Mapping[str, Any] | None = None,
        effects: Sequence[Effect] = (),
        requires: Mapping[str, int] | None = None,
    ) -> list[RecordedEvent]:
        """Append ``new_events`` and wait for the commit: ``await submit(...)``."""
        return await self.submit(
            stream_id,
            expected_version,
            new_events,
            metadata=metadata,
            effects=effects,
            requires=requires,
        )

    def submit(
        self,
        stream_id: str,
        expected_version: int | None,
        new_events: Sequence[Event],
        *,
        metadata: Mapping[str, Any] | None = None,
        effects: Sequence[Effect] = (),
        requires: Mapping[str, int] | None = None,
    ) -> asyncio.Future[list[RecordedEvent]]:
        """Append ``new_events`` to ``stream_id`` atomically.

        ``effects`` are the budget changes these events record (``ledger.books.accounting``):
        they are applied to the books in the same transaction, or the append fails with
        ``BudgetDenied`` / ``HoldStateError`` and writes nothing.

        ``requires`` names other streams and the versions they must be at when the events
        are committed (nothing is written to them): the append is accepted only if none of
        them has moved, else it fails with ``WrongExpectedVersion`` for the first that did
        and writes nothing. (A request's first append requires its API key's stream to be
        where the key was read unrevoked: ``ledger.apikeys``.)

        ``expected_version`` is the stream's current version (``NO_STREAM`` for a new
        stream) or ``ANY_VERSION``. Raises ``WrongExpectedVersion`` if another writer got
        there first, ``EventValidationError`` for an event the catalogue refuses (both
        before anything is written) and ``LedgerUnavailable`` if the commit failed.

        Returns at once (validation errors are raised here) with the future of the commit:
        its result is the recorded events, once they are durable; the refusals above are
        its exception. What the caller does before awaiting it overlaps the commit.
        """
        pending = self._prepare(stream_id, expected_version, new_events, metadata)
        pending.effects = tuple(effects)
        if requires:
            for required, version in requires.items():
                if not required or version < 0 or required == stream_id:
                    raise EventValidationError(f"invalid requirement {required!r} at {version}")
            pending.requires = tuple(sorted(requires.items()))
        if self._state.closing:
            raise LedgerUnavailable("the event store is closed")
        self._enqueue([pending])
        # A cancelled caller cancels only its wait: the append stays queued and is committed
        # all the same (an answered request must never be missing from the ledger).
        return pending.future

    def _prepare(
        self,
        stream_id: str,
        expected_version: int | None,
        new_events: Sequence[Event],
        metadata: Mapping[str, Any] | None,
    ) -> _PendingAppend:
        if not stream_id or len(stream_id) > 200:
            raise EventValidationError(f"invalid stream id {stream_id!r}")
        if expected_version is not None and expected_version < 0:
            raise EventValidationError(f"invalid expected version {expected_version}")
        if not new_events:
            raise EventValidationError("an append needs at least one event")
        encoded = []
        for event in new_events:
            if not isinstance(event, Event):
                raise EventValidationError(f"not a catalogue event: {event!r}")
            cls = type(event)
            data = encode_event(event)
            data_json = _exact(orjson.dumps(data, option=orjson.OPT_SORT_KEYS))
            encoded.append(
                _Encoded(
                    cls.type, _json_string(cls.type), cls.schema_version, data, data_json, event
                )
            )
        meta = dict(metadata or {})
        try:
            metadata_json = _exact(orjson.dumps(meta, option=orjson.OPT_SORT_KEYS))
        except TypeError as error:
            raise EventValidationError(f"metadata is not JSON: {error}") from None
        future: asyncio.Future[list[RecordedEvent]] = asyncio.get_running_loop().create_future()
        return _PendingAppend(stream_id, expected_version, encoded, meta, metadata_json, future)

    async def _run_appender(self) -> None:
        state = self._state
        while True:
            if not state.queue:
                if state.closing:
                    return
                state.idle = asyncio.get_running_loop().create_future()
                await state.idle
                state.idle = None
                continue
            batch: list[_PendingAppend] = []
            size = 0
            while state.queue and (
                not batch or size + len(state.queue[0].events) <= _MAX_BATCH_EVENTS
            ):
                pending = state.queue.popleft()
                batch.append(pending)
                size += len(pending.events)
            loop = asyncio.get_running_loop()
            if self._untold:
                # Run at the commit's first wait for the database, the batch already sent.
                loop.call_soon(self._tell_untold)
            try:
                await self._commit(batch)
            except Exception as error:
                # Every caller must hear how its append ended; a database that could not
                # commit now is reported as LedgerUnavailable (retryable), anything else (a
                # constraint the batch broke: a bug) as itself.
                failure: BaseException = error
                if is_unavailable(error):
                    failure = LedgerUnavailable(f"the ledger could not commit: {error}")
                for pending in batch:
                    pending.result = failure
            for pending in batch:
                _resolve(pending)
            # The callers this commit woke go first; what follows is this task's own
            # bookkeeping, done while they wait for their next answer.
            await asyncio.sleep(0)
            if self._pg is not None:
                self._pg.learn()
            state.batches += 1
            if self._listeners:
                # Not now: the callers this commit woke answer first. Told while the next
                # batch's statement is with the database (above), or by the timer when idle.
                # (Told in the loop's next turns instead, at c1 they held up the next request:
                # its p50 was 0.17 ms lower with no listeners at all, bench/ab.py.)
                self._untold.append(batch)
                if self._tell_timer is None:
                    self._tell_timer = loop.call_later(_TELL_WITHIN_S, self._tell_untold)
            if self._commit_signals:  # (iterating a WeakSet costs, even an empty one)
                for signal in self._commit_signals:
                    signal.set()

    def _tell_untold(self) -> None:
        if self._tell_timer is not None:
            self._tell_timer.cancel()
            self._tell_timer = None
        untold, self._untold = self._untold, []
        for batch in untold:
            committed = [
                e for p in batch if isinstance(p.result, list) and not p.forwarded for e in p.result
            ]
            if not committed:
                continue
            for listener in list(self._listeners):
                try:
                    listener(committed)
                except Exception:
                    _log.exception("a commit listener failed")

    async def _commit(self, batch: list[_PendingAppend]) -> None:
        if self._forwarder is not None and await self._forwarder.commit(batch):
            return
        if self._pg is not None:
            await self._pg.commit(batch)
            return
        async with self.engine.begin() as conn:
            # SQLite: BEGIN IMMEDIATE (ledger.store.db) takes the database write lock, which is
            # the same serialization as PostgreSQL's head-row lock (see _PG_BEGIN_AND_LOCK).
            head = (
                await conn.execute(
                    select(ledger_head.c.position, ledger_head.c.hash).where(ledger_head.c.id == 1)
                )
            ).one()
            versions = await _stream_versions(conn, _streams_of(batch))
            books = None
            if any(p.effects for p in batch):
                books = await load_books(conn, (e for p in batch for e in p.effects))
            written = _assign(
                batch, int(head.position), str(head.hash), versions, books, self.clock()
            )
            if written is None:
                return
            if books is not None:
                await save_books(conn, books, written.recorded_at)
            await conn.execute(insert(appends), written.rows)
            await conn.execute(
                update(ledger_head)
                .where(ledger_head.c.id == 1)
                .values(position=written.head, hash=written.head_hash)
            )

    # --- the appends of several workers, through one appender (ledger.store.shared_appends) ---

    def forward_to(self, forwarder: Forwarder) -> None:
        """Commit each batch through ``forwarder`` (another process's appender) when it
        takes it; this store's own connection when it does not."""
        self._forwarder = forwarder

    def take_forwarded(self, appends: Sequence[ForwardedAppend]) -> list[_PendingAppend] | None:
        """Queue appends another worker prepared (``submit``'s checks done there); each
        one's future is done once its commit is (``forwarded_result`` is then what to send
        back). None while closing: the sender commits them itself."""
        if self._state.closing:
            return None
        loop = asyncio.get_running_loop()
        taken = []
        for stream_id, expected, events, metadata_json, effects, requires in appends:
            encoded = [
                _Encoded(t, _json_string(t), schema_version, {}, data_json, None)
                for t, schema_version, data_json in events
            ]
            pending = _PendingAppend(
                stream_id,
                expected,
                encoded,
                {},
                metadata_json,
                loop.create_future(),
                effects,
                requires,
                forwarded=True,
            )
            taken.append(pending)
        self._enqueue(taken)
        return taken

    def _enqueue(self, pendings: list[_PendingAppend]) -> None:
        """Queue ``pendings`` for the appender, starting it on its first append."""
        state = self._state
        if state.task is None:
            state.task = asyncio.create_task(self._run_appender(), name="waybill-appender")
        state.queue.extend(pendings)
        state.wake()

    async def close(self) -> None:
        """Commit what is queued, then stop the appender."""
        state = self._state
        state.closing = True
        state.wake()
        if state.task is not None:
            await state.task
        self._tell_untold()
        if self._pg is not None:
            await self._pg.close()
        await self.hot.close()

    @property
    def stats(self) -> dict[str, int]:
        appender = {  # PostgreSQL's ways of deciding a batch (0 on SQLite)
            name: getattr(self._pg, name, 0)
            for name in ("lost_races", "unread_batches", "wrong_guesses")
        }
        return {"batches": self._state.batches, "queued": len(self._state.queue), **appender}

    # --- reads ---

    async def head(self) -> tuple[int, str]:
        """The last committed position and its hash (0 and the genesis hash when empty)."""
        async with self._read() as conn:
            row = (
                await conn.execute(
                    select(ledger_head.c.position, ledger_head.c.hash).where(ledger_head.c.id == 1)
                )
            ).one()
        return int(row.position), str(row.hash)

    async def read_all(self, after: int = 0, limit: int = 1000) -> list[RecordedEvent]:
        """At most ``limit`` events with position > ``after``, in position order (fewer only
        at the head)."""
        a = appends.c
        async with self._read() as conn:
            result = await conn.execute(
                select(a.position, previous_hash(), a.payloads)
                .where(from_position(after))
                .order_by(a.position)
                .limit(limit)  # rows: each holds at least one event
            )
            found: list[RecordedEvent] = []
            for row in result:
                found += decode_row(row.position, row.previous, row.payloads, after=after)
            return found[:limit]

    async def read_stream(self, stream_id: str, after_version: int = 0) -> list[RecordedEvent]:
        a = appends.c
        async with self._read() as conn:
            result = await conn.execute(
                select(a.position, a.version, previous_hash(), a.payloads)
                .where(
                    a.stream_id == stream_id, a.version + func.length(a.types) > after_version + 1
                )
                .order_by(a.version)
            )
            found: list[RecordedEvent] = []
            for row in result:
                skip = max(0, after_version + 1 - row.version)
                found += decode_row(row.position, row.previous, row.payloads)[skip:]
            return found

    async def iterate(self, after: int = 0, page: int = 2000) -> AsyncIterator[RecordedEvent]:
        while True:
            batch = await self.read_all(after, page)
            for recorded in batch:
                yield recorded
            if len(batch) < page:
                return
            after = batch[-1].position

    def _read(self) -> _ReadConnection:
        return _ReadConnection(self.engine)


class _ReadConnection:
    """A connection for reads: on SQLite it does not take the write lock; on PostgreSQL it
    runs in autocommit (no BEGIN/ROLLBACK round trips)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._conn: AsyncConnection | None = None

    async def __aenter__(self) -> AsyncConnection:
        self._conn = await self._engine.connect()
        if self._engine.dialect.name == "postgresql":
            return await self._conn.execution_options(isolation_level="AUTOCOMMIT")
        return await self._conn.execution_options(**{READ_ONLY: True})

    async def __aexit__(self, *exc: object) -> None:
        assert self._conn is not None
        await self._conn.close()


@dataclass(frozen=True, slots=True)
class _Written:
    events: list[RecordedEvent]
    head: int
    head_hash: str
    recorded_at: datetime
    rows: list[dict[str, Any]]  # one ``appends`` row per accepted append, in order


def _assign(
    batch: list[_PendingAppend],
    position: int,
    previous: str,
    versions: dict[str, int],
    books: Books | None,
    recorded_at: datetime,
) -> _Written | None:
    """Decide every append of ``batch`` against the ledger as it stands under the lock.

    Each append is checked on its own (its expected version, its budget effects); those that
    pass get the next positions and versions and are chained onto ``previous``. Sets each
    pending append's result; returns what to write (None: nothing passed)."""
    stamp = orjson.dumps(recorded_at.isoformat())
    written: list[RecordedEvent] = []
    rows: list[dict[str, Any]] = []
    for pending in batch:
        current = versions.get(pending.stream_id, 0)
        expected = pending.expected_version
        if expected is not None and expected != current:
            pending.result = WrongExpectedVersion(pending.stream_id, expected, current)
            continue
        moved = next((r for r in pending.requires if versions.get(r[0], 0) != r[1]), None)
        if moved is not None:
            pending.result = WrongExpectedVersion(*moved, versions.get(moved[0], 0))
            continue
        if books is not None and pending.effects:
            try:
                books.apply(pending.effects)
            except (BudgetDenied, HoldStateError) as refusal:
                pending.result = refusal
                continue
        recorded = []
        stream_json = orjson.dumps(pending.stream_id)
        for offset, encoded in enumerate(pending.events, 1):
            position += 1
            payload = _payload_from_parts(
                stream_id=stream_json,
                version=current + offset,
                event_type=encoded.type_json,
                schema_version=encoded.schema_version,
                data=encoded.data_json,
                metadata=pending.metadata_json,
                recorded_at=stamp,
            )
            previous = chain_hash(previous, position, payload)
            recorded.append(
                _recorded(
                    pending, encoded, position, current + offset, recorded_at, previous, payload
                )
            )
        rows.append(
            row_of(
                recorded[0].position,
                pending.stream_id,
                current + 1,
                [r.type for r in recorded],
                recorded_at,
                [r.hash for r in recorded],
                [r.payload for r in recorded],
            )
        )
        versions[pending.stream_id] = current + len(pending.events)
        pending.result = recorded
        written.extend(recorded)
    if not written:
        return None
    return _Written(written, position, previous, recorded_at, rows)


# THE LOCK. Every append that commits, in every process, holds the single ledger_head row's
# lock at its commit and moves the head to the positions it wrote. So transactions that write
# events are strictly serialized: positions are head+1, head+2, ... with no gaps, and the
# transaction that got position N has committed (and is visible) before the one that gets N+1
# can even read the head. A reader tailing `position > p` therefore can never see N+1 without
# N — the bigserial pitfall (sequence values taken in one order, committed in another) cannot
# happen. It also gives the hash chain its single predecessor, and serializes every change to
# the books (balances read after the lock include every reservation committed before, by any
# process). The cost, one writer at a time, is paid once per batch rather than per event
# thanks to group commit.
#
# A batch is first tried OPTIMISTICALLY, in two autocommit statements and no explicit
# transaction: the read (_PG_READ, one snapshot: head, versions and books agree), then the
# write (_pg_write), whose every part is gated on moving the head from the position read
# (`UPDATE ledger_head ... WHERE position = :expected AND hash = :expected_hash`; the hash
# too, so that a database restored under a running gateway to another history with the same
# length is not taken for the one it knew). That UPDATE takes the head lock, or
# waits for whoever holds it and then sees the moved head; if the head moved since the read,
# the statement writes nothing at all and the batch is decided again under the lock. The
# guard covers the books too because nothing changes a book row except an append, which
# always moves the head. Two round trips instead of four (BEGIN+lock, read, write, COMMIT):
# 0.2-0.3 ms less per append, two appends per request. A process that loses the race goes
# LOCKED for the next few batches, so two busy gateways on one database do not keep paying
# for reads they throw away. And when the head is still where this appender's own last
# commit left it, the read is skipped altogether: what the batch needs is KNOWN (_Known).
#
# A stream's first append must find it without rows. On PostgreSQL the table is partitioned
# by month (ledger.store.partitions) and can hold no unique key on (stream_id, version), so the
# write's guard also asks that the streams it starts have no row; a stream taken to be new
# that was not (the KNOWN guess) then writes nothing, like a moved head, and the batch is
# read and decided again.
_PG_BEGIN_AND_LOCK = "BEGIN; SELECT 1 FROM ledger_head WHERE id = 1 FOR UPDATE"

# Everything the batch is decided on, read in one statement, so in one snapshot; on the
# locked path AFTER the lock's statement: in READ COMMITTED a statement reads from a
# snapshot taken when it starts, so reads folded into the locking statement could miss the
# transaction that held the lock before us. The head, the streams' last versions (one
# index probe each, never a scan), the holds the batch resolves, and the accounts it touches
# (named by its reservations, or by the holds' own account lists). Money travels as text so
# that it stays exact. Rows are found by `= ANY(array)`, never joined to a
# set-returning function: the planner guesses such a function returns 100 rows and would
# hash-join it against a scan of the whole table, making every append's cost grow with the
# number of holds ever made (measured under c1 load on a fresh ledger: the append's
# statements took 0.29 ms each after 5 s and 0.66 ms after 30 s; now 0.17 and 0.26 ms). The
# write's UPDATEs name their rows the same way.
_PG_READ = """
    SELECT
      (SELECT position FROM ledger_head WHERE id = 1) AS position,
      (SELECT hash FROM ledger_head WHERE id = 1) AS hash,
      (SELECT coalesce(json_agg(json_build_array(s.id, coalesce((
                  SELECT e.version + length(e.types) - 1 FROM appends e
                  WHERE e.stream_id = s.id ORDER BY e.version DESC LIMIT 1), (
                  SELECT a.version FROM archived_streams a WHERE a.stream_id = s.id)))), '[]')
       FROM unnest(:streams::text[]) AS s(id)) AS versions,
      (SELECT coalesce(json_agg(json_build_object(
                  'reservation_id', h.reservation_id, 'request_id', h.request_id,
                  'attempt_id', h.attempt_id, 'workspace', h.workspace, 'key_id', h.key_id,
                  'endpoint', h.endpoint, 'model', h.model, 'amount_usd', h.amount_usd::text,
                  'accounts', h.accounts, 'owner', o.owner,
                  'state', coalesce(o.state, 'resolved'))), '[]')
       FROM budget_holds h LEFT JOIN budget_open_holds o USING (reservation_id)
       WHERE h.reservation_id = ANY(:holds::text[])) AS holds,
      (SELECT coalesce(json_agg(json_build_object(
                  'account_id', a.account_id, 'kind', a.kind, 'workspace', a.workspace,
                  'key_id', a.key_id, 'window_start', a.window_start,
                  'limit_usd', a.limit_usd::text, 'held_usd', a.held_usd::text,
                  'settled_usd', a.settled_usd::text,
                  'overrun_usd', a.overrun_usd::text)), '[]')
       FROM budget_accounts a WHERE a.account_id = ANY(:accounts::text[] || ARRAY(
           SELECT jsonb_array_elements_text(h.accounts::jsonb) FROM budget_holds h
           WHERE h.reservation_id = ANY(:holds::text[])))) AS accounts
"""

# Everything the batch writes, in one statement: the events as parallel arrays (asyncpg
# encodes them in its binary format, in C; their positions follow the head read, so they
# are numbered by the statement), each part of the books that has rows as a JSON document
# of its own (money as exact decimal strings) or an array of reservation ids, the head row,
# and the NOTIFY that wakes tailing readers at commit. (The events as one JSON document
# cost the same on the client and halved throughput at large batches: PostgreSQL then
# parses every payload twice.) The statement holds only the parts the batch writes
# (_pg_write: a few shapes, each prepared once; a reservation writes a hold, its open state
# and its accounts, a settlement closes a hold and writes its resolution and accounts):
# every data-modifying CTE costs the server its setup even when it has no rows. New and
# changed rows of a table are disjoint sets (ledger.books.accounting.Books), so the CTEs never
# touch the same row twice. Every part waits on `head`, the guarded move of the head (see
# THE LOCK): when it moves nothing, nothing is written (`moved` = 0).
_PG_WRITE_HEAD = """
    WITH head AS (
        UPDATE ledger_head SET position = :head, hash = :head_hash
        WHERE id = 1 AND position = :expected AND hash = :expected_hash
          AND NOT EXISTS (SELECT 1 FROM appends WHERE stream_id = ANY(:new_streams::text[]))
          AND NOT EXISTS (SELECT 1 FROM archived_streams
                          WHERE stream_id = ANY(:new_streams::text[]))
        RETURNING 1
    )"""
_PG_WRITE_BOOKS = {
    "new_accounts": """
    , new_accounts AS (
        INSERT INTO budget_accounts (account_id, kind, workspace, key_id, window_start,
                                     limit_usd, held_usd, settled_usd, overrun_usd,
                                     updated_at)
        SELECT u.*, :recorded_at
        FROM jsonb_to_recordset(:new_accounts::jsonb) AS u(
            account_id text, kind text, workspace text, key_id text, window_start text,
            limit_usd numeric, held_usd numeric, settled_usd numeric, overrun_usd numeric)
        WHERE EXISTS (SELECT 1 FROM head)
        RETURNING 1
    )""",
    "changed_accounts": """
    , changed_accounts AS (
        UPDATE budget_accounts a
        SET limit_usd = u.limit_usd, held_usd = u.held_usd, settled_usd = u.settled_usd,
            overrun_usd = u.overrun_usd, updated_at = :recorded_at
        FROM jsonb_to_recordset(:changed_accounts::jsonb) AS u(
            account_id text, limit_usd numeric, held_usd numeric, settled_usd numeric,
            overrun_usd numeric)
        WHERE a.account_id = u.account_id
          AND a.account_id = ANY(:changed_account_ids::text[])
          AND EXISTS (SELECT 1 FROM head)
        RETURNING 1
    )""",
    "new_holds": """
    , new_holds AS (
        INSERT INTO budget_holds (reservation_id, request_id, attempt_id, workspace, key_id,
                                  endpoint, model, amount_usd, accounts, created_at)
        SELECT u.*, :recorded_at
        FROM jsonb_to_recordset(:new_holds::jsonb) AS u(
            reservation_id text, request_id text, attempt_id text, workspace text,
            key_id text, endpoint text, model text, amount_usd numeric, accounts text)
        WHERE EXISTS (SELECT 1 FROM head)
        RETURNING 1
    )""",
    "open_holds": """
    , open_holds AS (
        INSERT INTO budget_open_holds (reservation_id, state, owner)
        SELECT u.*
        FROM jsonb_to_recordset(:open_holds::jsonb) AS u(
            reservation_id text, state text, owner text)
        WHERE EXISTS (SELECT 1 FROM head)
        RETURNING 1
    )""",
    "unknown_holds": """
    , unknown_holds AS (
        UPDATE budget_open_holds SET state = 'unknown'
        WHERE reservation_id = ANY(:unknown_holds::text[]) AND EXISTS (SELECT 1 FROM head)
        RETURNING 1
    )""",
    "closed_holds": """
    , closed_holds AS (
        DELETE FROM budget_open_holds
        WHERE reservation_id = ANY(:closed_holds::text[]) AND EXISTS (SELECT 1 FROM head)
        RETURNING 1
    )""",
    "resolutions": """
    , resolutions AS (
        INSERT INTO budget_resolutions (reservation_id, kind, settled_usd, released_usd,
                                        overrun_usd, resolved_at)
        SELECT u.*, :recorded_at
        FROM jsonb_to_recordset(:resolutions::jsonb) AS u(
            reservation_id text, kind text, settled_usd numeric, released_usd numeric,
            overrun_usd numeric)
        WHERE EXISTS (SELECT 1 FROM head)
        RETURNING 1
    )""",
}
_PG_WRITE_EVENTS = """
    , inserted AS (
        INSERT INTO appends (position, recorded_at, version, stream_id, types, hash, payloads)
        SELECT p, :recorded_at, v, s, t, h, b
        FROM unnest(:positions::bigint[], :versions::int[], :stream_ids::text[],
                    :types::text[], :hashes::bytea[], :payloads::bytea[]) AS u(p, v, s, t, h, b)
        WHERE EXISTS (SELECT 1 FROM head)
        RETURNING 1
    )
    SELECT CASE WHEN EXISTS (SELECT 1 FROM head)
                THEN pg_notify('waybill_events', :head::text) END,
           (SELECT count(*) FROM inserted) AS inserted, (SELECT count(*) FROM head) AS moved,
           EXISTS (SELECT 1 FROM appends WHERE stream_id = ANY(:new_streams::text[]))
           OR EXISTS (SELECT 1 FROM archived_streams
                      WHERE stream_id = ANY(:new_streams::text[])) AS taken
"""


_ID_PARTS: Final = frozenset({"unknown_holds", "closed_holds"})
"""The parts of ``_PG_WRITE_BOOKS`` whose rows are reservation ids."""


@functools.lru_cache(maxsize=64)
def _pg_write(parts: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    """The write statement for a batch whose books have rows in ``parts`` (names of
    ``_PG_WRITE_BOOKS``, in its order), with asyncpg's ``$n`` and the parameters' names."""
    books = "".join(_PG_WRITE_BOOKS[part] for part in parts)
    return positional(_PG_WRITE_HEAD + books + _PG_WRITE_EVENTS)


class _Known:
    """What this appender's own commits left in the ledger, as long as nobody else wrote.

    After each batch the appender keeps the head it left, the versions of the streams it
    wrote or read and the balances and holds it saved or read. While the head is still
    there (the write's guard checks exactly that), these are the database's current values,
    so a batch that needs nothing else is decided without reading: one round trip. A
    request's first append is to a new stream (``NO_STREAM``) and makes a new hold, which
    are taken to be absent; if one was not, the write finds the stream's rows (its guard) or
    breaks the holds' key, writes nothing, and the batch is read and decided again. Only
    acceptances are decided this way: a batch with any append refused is read and decided
    again. Bounded: the oldest entries are
    forgotten (forgetting is always safe, it only costs a read)."""

    LIMIT = 4096

    def __init__(self) -> None:
        self.head: tuple[int, str] | None = None
        self.versions: dict[str, int] = {}
        self.accounts: dict[str, Balance] = {}
        self.holds: dict[str, Hold] = {}

    def forget(self) -> None:
        self.head = None
        self.versions.clear()
        self.accounts.clear()
        self.holds.clear()

    def state_for(
        self, batch: list[_PendingAppend], effects: list[Effect]
    ) -> tuple[int, str, dict[str, int], Books | None] | None:
        """The head, versions and books ``batch`` is decided on, or None: something it
        needs is not known (then it is read)."""
        if self.head is None:
            return None
        versions = {}
        for pending in batch:
            version = self.versions.get(pending.stream_id)
            if version is not None:
                versions[pending.stream_id] = version
            elif pending.expected_version != NO_STREAM:
                return None  # a stream that exists, at a version not known here
            for required, _ in pending.requires:
                version = self.versions.get(required)
                if version is None:
                    return None
                versions[required] = version
        if not effects:
            return (*self.head, versions, None)
        account_ids, hold_ids = book_needs(effects)
        new_holds = {e.hold.reservation_id for e in effects if isinstance(e, Reserve)}
        books = Books()
        for hold_id in hold_ids:
            hold = self.holds.get(hold_id)
            if hold is None:
                if hold_id not in new_holds:
                    return None
                continue  # a new reservation: its id is taken to be free
            books.holds[hold_id] = copy.copy(hold)  # Books.apply changes them in place
            account_ids.update(hold.accounts)
        for account_id in account_ids:
            balance = self.accounts.get(account_id)
            if balance is None:
                return None
            books.accounts[account_id] = copy.copy(balance)
        return (*self.head, versions, books)

    def learn(
        self,
        decided_on: tuple[int, str],
        head: tuple[int, str],
        versions: dict[str, int],
        books: Books | None,
    ) -> None:
        """A batch decided on the ledger at ``decided_on`` (known here, or just read) left
        it at ``head``, with these versions and books among others. A batch decided on
        another head than the one known here means others wrote: all else is forgotten."""
        if decided_on != self.head:
            self.forget()
        self.head = head
        _remember(self.versions, versions.items())
        if books is not None:
            _remember(self.accounts, books.accounts.items())
            _remember(self.holds, books.holds.items())


def _remember(known: dict[str, _V], entries: Iterable[tuple[str, _V]]) -> None:
    for key, value in entries:
        known.pop(key, None)  # to the end: the most recently used
        known[key] = value
    while len(known) > _Known.LIMIT:
        del known[next(iter(known))]


_NEVER: Final = datetime.min.replace(tzinfo=UTC)


class _PostgresAppender:
    """The appender's own connection on PostgreSQL, and a batch in one to four statements.

    Known (see ``_Known``): the one guarded write, decided on what this appender's last
    commit left. Optimistic (see THE LOCK): the one read of what the batch is decided on,
    then the write, each its own transaction, however many appends the batch holds. When
    the head moved in between, the batch is decided again LOCKED: BEGIN with the head lock
    (one simple-protocol round trip), the read, the write, COMMIT. Through the SQLAlchemy
    pool the same transaction took a dozen statements; through psycopg's async connection
    each statement still cost ~100 µs of CPU in its wait loop (asyncpg: ~25 µs). A
    connection that failed mid-batch is dropped, which rolls back what it had not
    committed; the next batch connects afresh."""

    LOCKED_AFTER_A_LOST_RACE = 16
    """Batches committed under the lock after an optimistic write found the head moved."""

    def __init__(self, engine: AsyncEngine, clock: Callable[[], datetime]) -> None:
        self._clock = clock
        self._dsn = asyncpg_dsn(engine)
        self._conn: asyncpg.Connection | None = None
        self._locked_batches_left = 0
        self._known = _Known()
        self._unlearned: _Learned | None = None  # what the last batch left, for learn()
        # The month whose partitions this appender has made sure of: its first instant and
        # the next month's (a comparison per batch; formatting the month cost 5 µs).
        self._month: tuple[datetime, datetime] = (_NEVER, _NEVER)
        self.lost_races = 0
        self.unread_batches = 0
        self.wrong_guesses = 0

    def learn(self) -> None:
        """Take in what the last batch left (``_Known.learn``): after its callers are
        woken, and in any case before the next batch is decided."""
        if self._unlearned is not None:
            self._known.learn(*self._unlearned)
            self._unlearned = None

    async def commit(self, batch: list[_PendingAppend]) -> None:
        self.learn()
        conn = self._conn
        if conn is None or conn.is_closed():
            conn = self._conn = await connect(self._dsn, appender=True)
        try:
            now = self._clock()
            if not self._month[0] <= now < self._month[1]:
                await ensure_months(conn, now)  # this month's table and the next one's exist
                self._month = month_bounds(month_of(now))
            if self._locked_batches_left == 0:
                if await self._commit(conn, batch, how="known"):
                    return
                if await self._commit(conn, batch, how="read"):
                    return
                self.lost_races += 1
                self._locked_batches_left = self.LOCKED_AFTER_A_LOST_RACE
            self._locked_batches_left -= 1
            await self._commit(conn, batch, how="locked")
        except BaseException:
            self._unlearned = None
            self._known.forget()  # the batch may have committed, its answer lost
            self._conn = None
            await close_quietly(conn)
            raise

    async def _commit(
        self, conn: asyncpg.Connection, batch: list[_PendingAppend], *, how: _How
    ) -> bool:
        """Decide and write ``batch``; False if nothing was written and the next way must
        decide it again (every append's result is then set again): unlocked, the head moved;
        known, also when nothing could be decided without a read, an append was refused, or
        a guess was wrong."""
        effects = [e for p in batch for e in p.effects]
        if how == "known":
            state = self._known.state_for(batch, effects)
            if state is None:
                return False
            position, previous, versions, books = state
        else:
            if how == "locked":
                await conn.execute(_PG_BEGIN_AND_LOCK)  # no arguments: one simple query
            position, previous, versions, books = await _read(conn, batch, effects)
        written = _assign(batch, position, previous, versions, books, self._clock())
        if how == "known" and any(isinstance(p.result, BaseException) for p in batch):
            # A refusal is only ever decided on a read. Decided on what is known, it could
            # rest on a guess (a stream taken to be new may exist: the version check comes
            # first), and with nothing else to write no guard would check the rest.
            return False
        if written is None:
            if how == "locked":
                await conn.execute("ROLLBACK")
            self._unlearned = ((position, previous), (position, previous), versions, books)
            return True
        parameters, parts = _write_parameters(written, books, expected=(position, previous))
        write, names = _pg_write(parts)
        try:
            outcome = await conn.fetchrow(write, *(parameters[name] for name in names))
        except asyncpg.UniqueViolationError:
            if how != "known":
                raise
            # A stream or reservation taken to be new was not. What is known is still true
            # (the head has not moved); the read adds what was missing.
            self.wrong_guesses += 1
            return False
        assert outcome is not None
        if outcome["moved"] != 1:
            if how == "locked":  # the head is ours under the lock: it cannot have moved
                raise RuntimeError("the ledger head moved under its lock")
            if outcome["taken"]:  # a stream taken to be new was not
                self.wrong_guesses += how == "known"
            return False  # the read that follows shows the new head: learn() forgets
        if how == "locked":
            await conn.execute("COMMIT")
        elif how == "known":
            self.unread_batches += 1
        self._unlearned = ((position, previous), (written.head, written.head_hash), versions, books)
        return True

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await close_quietly(conn)


_How = Literal["known", "read", "locked"]

# An append as it crosses to another worker's appender (ledger.store.shared_appends): the stream,
# the expected version, each event's type, schema version and data as JSON, the metadata as
# JSON, the budget effects and the required versions.
ForwardedAppend = tuple[
    str,
    int | None,
    tuple[tuple[str, int, bytes], ...],
    bytes,
    tuple[Effect, ...],
    tuple[tuple[str, int], ...],
]
# What became of it: the events' first position and version, their recorded time, hashes
# and payloads; or why it was refused or failed.
ForwardedResult = tuple[int, int, datetime, list[str], list[bytes]] | BaseException


class Forwarder(Protocol):
    async def commit(self, batch: list[_PendingAppend]) -> bool:
        """Commit ``batch`` elsewhere, setting each append's result; False if it was not
        sent (this process commits it then)."""
        ...


def forwarded(pending: _PendingAppend) -> ForwardedAppend:
    events = tuple((e.type, e.schema_version, e.data_json) for e in pending.events)
    return (
        pending.stream_id,
        pending.expected_version,
        events,
        pending.metadata_json,
        pending.effects,
        pending.requires,
    )


def forwarded_result(pending: _PendingAppend) -> ForwardedResult:
    """The result of an append another worker forwarded, to send back."""
    result = pending.result
    if isinstance(result, BaseException):
        return result
    assert result  # resolved: a commit sets every append's result
    first = result[0]
    hashes = [r.hash for r in result]
    return (first.position, first.version, first.recorded_at, hashes, [r.payload for r in result])


def take_result(pending: _PendingAppend, result: ForwardedResult) -> None:
    """Set ``pending``'s result from what the worker that committed it sent back."""
    if isinstance(result, BaseException):
        pending.result = result
        return
    position, version, recorded_at, hashes, payloads = result
    pending.result = [
        _recorded(pending, encoded, position + i, version + i, recorded_at, hash_, payload)
        for i, (encoded, hash_, payload) in enumerate(
            zip(pending.events, hashes, payloads, strict=True)
        )
    ]


def _recorded(
    pending: _PendingAppend,
    encoded: _Encoded,
    position: int,
    version: int,
    recorded_at: datetime,
    hash_: str,
    payload: bytes,
) -> RecordedEvent:
    """One event of ``pending`` as committed at ``position``."""
    return RecordedEvent(
        position=position,
        stream_id=pending.stream_id,
        version=version,
        type=encoded.type,
        schema_version=encoded.schema_version,
        data=encoded.data,
        metadata=pending.metadata,
        recorded_at=recorded_at,
        hash=hash_,
        payload=payload,
        _event=encoded.event,
    )


_Learned = tuple[tuple[int, str], tuple[int, str], dict[str, int], Books | None]


async def _read(
    conn: asyncpg.Connection, batch: list[_PendingAppend], effects: list[Effect]
) -> tuple[int, str, dict[str, int], Books | None]:
    """The head, the batch's streams' versions and the books its effects touch, in one
    statement (so one snapshot)."""
    account_ids, hold_ids = book_needs(effects)
    read, names = positional(_PG_READ)
    parameters = {
        "streams": sorted(_streams_of(batch)),
        "holds": sorted(hold_ids),
        "accounts": sorted(account_ids),
    }
    row = await conn.fetchrow(read, *(parameters[name] for name in names))
    assert row is not None
    versions = {str(s): int(v) for s, v in orjson.loads(row["versions"]) if v is not None}
    books = None
    if effects:
        books = Books()
        for fields in orjson.loads(row["holds"]):
            hold = hold_of(SimpleNamespace(**fields))
            books.holds[hold.reservation_id] = hold
        for fields in orjson.loads(row["accounts"]):
            balance = balance_of(SimpleNamespace(**fields))
            books.accounts[balance.account_id] = balance
    return int(row["position"]), str(row["hash"]), versions, books


def _write_parameters(
    written: _Written, books: Books | None, *, expected: tuple[int, str]
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The write's parameters, and the parts of the books that have rows (``_pg_write``)."""
    new = written.events
    assert new[0].position == expected[0] + 1 and written.head == expected[0] + len(new)
    rows = written.rows
    parameters: dict[str, Any] = {
        "expected": expected[0],
        "expected_hash": expected[1],
        "recorded_at": written.recorded_at,
        "positions": [r["position"] for r in rows],
        "versions": [r["version"] for r in rows],
        "stream_ids": [r["stream_id"] for r in rows],
        "types": [r["types"] for r in rows],
        "hashes": [r["hash"] for r in rows],
        "payloads": [r["payloads"] for r in rows],
        "head": written.head,
        "head_hash": written.head_hash,
        # Streams the batch starts: none may have a row (see THE LOCK).
        "new_streams": [r["stream_id"] for r in rows if r["version"] == 1],
    }
    if books is None:
        return parameters, ()
    writes = book_writes(books, written.recorded_at)
    parts = tuple(part for part in _PG_WRITE_BOOKS if getattr(writes, part))
    for part in parts:
        rows = getattr(writes, part)
        # Rows as JSON, Decimals as their exact strings (the timestamps are the statement's
        # own); reservation ids as an array.
        parameters[part] = rows if part in _ID_PARTS else orjson.dumps(rows, default=str).decode()
    parameters["changed_account_ids"] = [a["account_id"] for a in writes.changed_accounts]
    return parameters, parts


def _streams_of(batch: list[_PendingAppend]) -> set[str]:
    """The streams whose versions ``batch`` is decided on: those it appends to and those
    it requires."""
    streams = {p.stream_id for p in batch}
    for pending in batch:
        streams.update(s for s, _ in pending.requires)
    return streams


async def _stream_versions(conn: AsyncConnection, stream_ids: set[str]) -> dict[str, int]:
    # SQLite: a VALUES table of the ids (placeholders only; the ids are bound), one index
    # probe per stream.
    names = [f"s{i}" for i in range(len(stream_ids))]
    rows = ", ".join(f"(:{name})" for name in names)
    result = await conn.execute(
        text(
            f"WITH s(id) AS (VALUES {rows}) SELECT s.id, "
            "coalesce((SELECT max(e.version + length(e.types) - 1) FROM appends e "
            "WHERE e.stream_id = s.id), (SELECT a.version FROM archived_streams a "
            "WHERE a.stream_id = s.id)) FROM s"
        ),
        dict(zip(names, sorted(stream_ids), strict=True)),
    )
    return {str(stream_id): int(version) for stream_id, version in result if version is not None}


def _resolve(pending: _PendingAppend) -> None:
    if pending.future.done():
        return
    if isinstance(pending.result, BaseException):
        pending.future.set_exception(pending.result)
    elif pending.result is None:
        pending.future.set_exception(LedgerUnavailable("append was not processed"))
    else:
        pending.future.set_result(pending.result)
