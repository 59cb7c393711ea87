"""The append path: how an event gets into the ledger, ordered, hashed and written.

1. ``prepare``, in the caller's task (``EventStore.submit``): the events are checked against
   the catalogue and each one's data and the append's metadata are encoded to sorted-key JSON,
   once. A refused event never reaches the queue.
2. The ``Appender``, one task per store, takes everything queued as one batch (group commit):
   while one transaction is in flight, the next appends queue up and share the following one.
3. The backend's ``Committer`` (``ledger.store.postgres``, ``ledger.store.sqlite``; in the
   workers of ``waybill serve --workers N`` but the first, the forwarding committer of
   ``ledger.store.shared_appends``) finds what the batch is decided on (the head, the streams'
   versions, the books), has ``decide`` decide it, and writes what passed in one transaction,
   which holds the ledger's one lock when it commits: whatever the batch was decided on is
   what the ledger held then (THE LOCK, in ``ledger.store.postgres``).
4. ``decide`` checks each append on its own (its expected version, the streams it requires,
   its budget effects): a stream version that is already taken fails that append alone, with
   nothing of it written. Those that pass get the next positions and versions, and each event's
   hash covers the previous event's hash, its position and its exact canonical bytes
   (``ledger.store.recorded``), so ``verify`` detects any edit, insertion or deletion made
   around the database's immutability triggers.
5. The callers' futures are resolved; the commit listeners are told afterwards, off the
   request path.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import orjson

from ledger.books.accounting import Books, BudgetDenied, Effect, HoldStateError
from ledger.events import Event, EventValidationError, encode_event
from ledger.store.db import LedgerUnavailable
from ledger.store.outage import Outage
from ledger.store.recorded import RecordedEvent, WrongExpectedVersion, payloads_from_parts
from ledger.store.stored import chain_digest, row_of

__all__ = [
    "Appender",
    "Batch",
    "Bookkeeping",
    "Committer",
    "EncodedEvent",
    "PendingAppend",
    "Written",
    "decide",
    "forwarded_event",
    "prepare",
    "recorded",
    "streams_of",
]

_MAX_BATCH_EVENTS = 1000
_TELL_WITHIN_S = 0.01
"""The longest the commit listeners wait to hear of a commit (see ``EventStore.on_commit``)."""
_log = logging.getLogger("waybill.ledger")


@dataclass(slots=True)
class EncodedEvent:
    """One event of an append, encoded once. Never changed, yet not frozen: a frozen
    dataclass sets each field through ``object.__setattr__``, and an append makes one per
    event (see bench/README.md, Decisions: the event store)."""

    type: str
    type_json: bytes  # the type as a JSON string
    schema_version: int
    data: dict[str, Any]
    data_json: bytes  # sorted keys, as in the payload
    event: Event | None  # None: a forwarded append's (only its bytes crossed)


@dataclass(slots=True)
class PendingAppend:
    """An append on its way: checked and encoded, queued, then decided (``result``)."""

    stream_id: str
    expected_version: int | None
    events: list[EncodedEvent]
    metadata: dict[str, Any]
    metadata_json: bytes  # sorted keys, as in the payload
    future: asyncio.Future[list[RecordedEvent]]
    effects: tuple[Effect, ...] = ()
    requires: tuple[tuple[str, int], ...] = ()  # other streams' versions, only checked
    result: list[RecordedEvent] | BaseException | None = None
    # Sent by another worker of the same `waybill serve` (ledger.store.shared_appends): its
    # commit listeners are told there, not here.
    forwarded: bool = False


Batch = list[PendingAppend]


def _exact(encoded: bytes) -> bytes:
    """``encoded`` in a block of its own size. orjson returns its bytes in the buffer it
    wrote them to, far larger than an event's JSON, and an append waiting for its commit
    would hold one per event (see bench/README.md, Decisions: the event store)."""
    return memoryview(encoded).tobytes()


@functools.lru_cache(maxsize=1024)
def _json_string(text: str) -> bytes:
    """An event type as JSON (a few dozen, over and over: cached)."""
    return orjson.dumps(text)


def prepare(
    stream_id: str,
    expected_version: int | None,
    new_events: Sequence[Event],
    metadata: Mapping[str, Any] | None,
    effects: Sequence[Effect],
    requires: Mapping[str, int] | None,
) -> PendingAppend:
    """The append, checked and encoded (``EventStore.submit``); ``EventValidationError`` for
    anything the ledger would refuse whatever its state."""
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
            EncodedEvent(
                cls.type, _json_string(cls.type), cls.schema_version, data, data_json, event
            )
        )
    meta = dict(metadata or {})
    try:
        metadata_json = _exact(orjson.dumps(meta, option=orjson.OPT_SORT_KEYS))
    except TypeError as error:
        raise EventValidationError(f"metadata is not JSON: {error}") from None
    future: asyncio.Future[list[RecordedEvent]] = asyncio.get_running_loop().create_future()
    pending = PendingAppend(stream_id, expected_version, encoded, meta, metadata_json, future)
    pending.effects = tuple(effects)
    if requires:
        for required, version in requires.items():
            if not required or version < 0 or required == stream_id:
                raise EventValidationError(f"invalid requirement {required!r} at {version}")
        pending.requires = tuple(sorted(requires.items()))
    return pending


def forwarded_event(event_type: str, schema_version: int, data_json: bytes) -> EncodedEvent:
    """An event another worker checked and encoded (``ledger.store.shared_appends``)."""
    return EncodedEvent(event_type, _json_string(event_type), schema_version, {}, data_json, None)


@dataclass(frozen=True, slots=True)
class Written:
    """What a decided batch writes: its accepted events and their rows, and the new head."""

    events: list[RecordedEvent]
    head: int
    head_hash: str
    recorded_at: datetime
    rows: list[dict[str, Any]]  # one ``appends`` row per accepted append, in order


def decide(
    batch: Batch,
    position: int,
    previous: str,
    versions: dict[str, int],
    books: Books | None,
    recorded_at: datetime,
) -> Written | None:
    """Decide every append of ``batch`` against the ledger as it stands under the lock: the
    head at ``position`` with hash ``previous``, the streams at ``versions`` (the batch's and
    those it requires; a stream not there has none), and ``books`` (those its effects touch).

    Each append is checked on its own (its expected version, its requirements, its budget
    effects); those that pass get the next positions and versions, in the batch's order, and
    are chained onto ``previous``. Sets each pending append's result; returns what to write
    (None: nothing passed)."""
    stamp = orjson.dumps(recorded_at.isoformat())
    chained = bytes.fromhex(previous)  # the hash chain, in bytes until the rows are made
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
        events = pending.events
        payloads = payloads_from_parts(
            stream_id=orjson.dumps(pending.stream_id),
            first_version=current + 1,
            events=events,
            metadata=pending.metadata_json,
            recorded_at=stamp,
        )
        first = position + 1
        accepted = []
        for offset, payload in enumerate(payloads):
            position += 1
            chained = chain_digest(chained, position, payload)
            accepted.append(
                recorded(
                    pending,
                    events[offset],
                    position,
                    current + 1 + offset,
                    recorded_at,
                    chained.hex(),
                    payload,
                )
            )
        rows.append(
            row_of(
                first,
                pending.stream_id,
                current + 1,
                [e.type for e in events],
                recorded_at,
                chained,
                payloads,
            )
        )
        versions[pending.stream_id] = current + len(pending.events)
        pending.result = accepted
        written.extend(accepted)
    if not written:
        return None
    return Written(written, position, written[-1].hash, recorded_at, rows)


def recorded(
    pending: PendingAppend,
    encoded: EncodedEvent,
    position: int,
    version: int,
    recorded_at: datetime,
    hash_: str,
    payload: bytes,
) -> RecordedEvent:
    """One event of ``pending`` as committed at ``position``."""
    return RecordedEvent(  # positional: keywords cost more, once per event
        position,
        pending.stream_id,
        version,
        encoded.type,
        encoded.schema_version,
        encoded.data,
        pending.metadata,
        recorded_at,
        hash_,
        payload,
        encoded.event,
    )


def streams_of(batch: Batch) -> set[str]:
    """The streams whose versions ``batch`` is decided on: those it appends to and those
    it requires."""
    streams = {p.stream_id for p in batch}
    for pending in batch:
        streams.update(s for s, _ in pending.requires)
    return streams


Bookkeeping = Callable[[], None]
"""A committer's own work after a commit, done once the callers it woke have had their turn."""


class Committer(Protocol):
    """Where a batch is decided and written: one per backend (``ledger.store.postgres``,
    ``ledger.store.sqlite``), or the first worker's appender (``ledger.store.shared_appends``)."""

    async def commit(self, batch: Batch) -> Bookkeeping | None:
        """Decide ``batch`` with ``decide`` on the ledger as it stands when the write holds
        the ledger's lock (read under the lock, or checked by the write's guard at it), and
        write what passed in one transaction, setting every append's ``result``.

        Raises if the transaction's fate is not known to be a commit: ``LedgerUnavailable``
        when the database could not commit now (the driver's errors are translated here, at
        the boundary), anything else (a constraint the batch broke: a bug) as itself. May
        return its own bookkeeping, which the appender runs after the callers' turn."""
        ...


class Appender:
    """The one task that commits a store's appends, in batches (group commit).

    One task per store and event loop is the only writer through the store's committer, so
    nothing here takes a lock: the callers only append to the queue, and the committer's
    connection and what it knows are only ever touched by this task. Between stores and
    processes, the ledger's own lock serializes the commits (THE LOCK, in
    ``ledger.store.postgres``)."""

    def __init__(self, committer: Committer, outage: Outage | None = None) -> None:
        self.committer = committer
        self._outage = outage or Outage()
        self.batches = 0
        self._queue: deque[PendingAppend] = deque()
        # What the idle appender waits on: a bare future, not an asyncio.Event, set and
        # awaited twice a request (see bench/README.md, Decisions: the event store).
        self._idle: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._commit_signals: weakref.WeakSet[asyncio.Event] = weakref.WeakSet()
        self._listeners: list[Callable[[Sequence[RecordedEvent]], None]] = []
        self._untold: list[Batch] = []  # committed, listeners not yet told
        self._tell_timer: asyncio.TimerHandle | None = None

    @property
    def queued(self) -> int:
        return len(self._queue)

    def submit(self, pending: PendingAppend) -> None:
        """Queue ``pending``; ``LedgerUnavailable`` once the store is closing."""
        if self._closing:
            raise LedgerUnavailable("the event store is closed")
        self._enqueue([pending])

    def take(self, pendings: Sequence[PendingAppend]) -> bool:
        """Queue appends another worker prepared; False while closing (not taken)."""
        if self._closing:
            return False
        self._enqueue(pendings)
        return True

    def _enqueue(self, pendings: Sequence[PendingAppend]) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="waybill-appender")
        self._queue.extend(pendings)
        self._wake()

    def _wake(self) -> None:
        if self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    def on_commit(self, listener: Callable[[Sequence[RecordedEvent]], None]) -> Callable[[], None]:
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def commit_signal(self) -> asyncio.Event:
        signal = asyncio.Event()
        self._commit_signals.add(signal)
        return signal

    async def _run(self) -> None:
        queue = self._queue
        while True:
            if not queue:
                if self._closing:
                    return
                self._idle = asyncio.get_running_loop().create_future()
                await self._idle
                self._idle = None
                continue
            batch: Batch = []
            size = 0
            while queue and (not batch or size + len(queue[0].events) <= _MAX_BATCH_EVENTS):
                pending = queue.popleft()
                batch.append(pending)
                size += len(pending.events)
            loop = asyncio.get_running_loop()
            if self._untold:
                # Run at the commit's first wait for the database, the batch already sent.
                loop.call_soon(self._tell_untold)
            bookkeeping: Bookkeeping | None = None
            try:
                bookkeeping = await self.committer.commit(batch)
            except Exception as error:
                # Every caller must hear how its append ended: the committer raised
                # LedgerUnavailable for a database that could not commit now (retryable),
                # anything else (a constraint the batch broke: a bug) as itself.
                for pending in batch:
                    pending.result = error
                if isinstance(error, LedgerUnavailable):
                    self._outage.failed(error)
            else:
                self._outage.succeeded()
            for pending in batch:
                _resolve(pending)
            # The callers this commit woke go first; what follows is this task's own
            # bookkeeping, done while they wait for their next answer.
            await asyncio.sleep(0)
            if bookkeeping is not None:
                bookkeeping()
            self.batches += 1
            if self._listeners:
                # Not now: the callers this commit woke answer first. Told while the next
                # batch's statement is with the database (above), or by the timer when idle:
                # told in the loop's next turns instead, they held up the next request at c1
                # (see bench/README.md, Decisions: the event store).
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

    async def close(self) -> None:
        """Commit what is queued, stop, and tell the listeners what they were not told yet."""
        self._closing = True
        self._wake()
        if self._task is not None:
            await self._task
        self._tell_untold()


def _resolve(pending: PendingAppend) -> None:
    if pending.future.done():
        return
    if isinstance(pending.result, BaseException):
        pending.future.set_exception(pending.result)
    elif pending.result is None:
        pending.future.set_exception(LedgerUnavailable("append was not processed"))
    else:
        pending.future.set_result(pending.result)
