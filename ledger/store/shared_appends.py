"""One appender for the workers of ``waybill serve --workers N``.

Every append takes the ledger head's lock (THE LOCK, in ``ledger.store.postgres``). One
process's appender commits its appends in batches, one round trip each, deciding a batch on
what its own last commit left. Several processes appending to one ledger take turns at the
lock: each finds the head moved by the others, reads before it writes, and after a lost race
commits under the lock. With two workers at concurrency 16, that cost more than the second
core gave (see bench/README.md, Decisions: Processes).

So the workers but the first commit through ``ForwardingCommitter``: it sends each batch to
the first worker's appender, over a Unix socket in the workers' private directory, one frame
per batch, each append already checked and encoded (``EventStore.submit``); the reply is the
positions, hashes and payloads each append was given, or why it was refused. The first
worker queues them beside its own appends (``AppendServer``), so one batch, one lock and one
commit serve every worker. The sender keeps its callers' futures and commit listeners (its
metrics are its own).

When the first worker cannot be reached (not yet started, being started again, stopping),
a worker commits its batches itself, through its own backend, and tries the socket again
after :data:`RETRY_AFTER_S` doubling to :data:`MAX_RETRY_AFTER_S`. A batch whose reply never
comes (the first worker died with it) may or may not have been committed: its appends fail
with ``LedgerUnavailable``, as when a database connection drops mid-commit, and
``ledger.books.recovery`` settles what they had started.

Frames are pickles: only processes of the same user reach the socket (its directory is
0700), the same trust as the forked workers' shared memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import struct
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Final, Protocol

from ledger.books.accounting import BudgetDenied, Effect, HoldStateError
from ledger.store.append import (
    Batch,
    Bookkeeping,
    Committer,
    PendingAppend,
    forwarded_event,
    recorded,
)
from ledger.store.db import LedgerUnavailable
from ledger.store.recorded import WrongExpectedVersion


class _Taker(Protocol):
    """What the first worker's server needs of its store (``EventStore.take_forwarded``):
    a protocol rather than the class, which builds the committers of this module."""

    def take_forwarded(self, pendings: Sequence[PendingAppend]) -> bool: ...


__all__ = [
    "MAX_RETRY_AFTER_S",
    "RETRY_AFTER_S",
    "AppendClient",
    "AppendServer",
    "ForwardingCommitter",
]

RETRY_AFTER_S: Final = 1.0
MAX_RETRY_AFTER_S: Final = 30.0

_log = logging.getLogger("waybill.ledger")
_LENGTH: Final = struct.Struct("!I")
_KNOWN_REFUSALS: Final = (WrongExpectedVersion, BudgetDenied, HoldStateError, LedgerUnavailable)


def _frame(value: Any) -> bytes:
    body = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    (size,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    return pickle.loads(await reader.readexactly(size))


def _sendable(failure: BaseException) -> BaseException:
    """A refusal as itself; any other failure as LedgerUnavailable (its type may not
    cross, and the sender's callers only need to know the append did not commit)."""
    if not isinstance(failure, _KNOWN_REFUSALS):
        return LedgerUnavailable(f"the ledger could not commit: {type(failure).__name__}")
    return failure


# An append as it crosses to the first worker's appender: the stream, the expected version,
# each event's type, schema version and data as JSON, the metadata as JSON, the budget effects
# and the required versions.
_WireAppend = tuple[
    str,
    int | None,
    tuple[tuple[str, int, bytes], ...],
    bytes,
    tuple[Effect, ...],
    tuple[tuple[str, int], ...],
]
# What became of it: the events' first position and version, their recorded time, hashes
# and payloads; or why it was refused or failed.
_WireResult = tuple[int, int, datetime, list[str], list[bytes]] | BaseException


def _to_wire(pending: PendingAppend) -> _WireAppend:
    events = tuple((e.type, e.schema_version, e.data_json) for e in pending.events)
    return (
        pending.stream_id,
        pending.expected_version,
        events,
        pending.metadata_json,
        pending.effects,
        pending.requires,
    )


def _from_wire(appends: list[_WireAppend]) -> list[PendingAppend]:
    """The appends another worker sent, to be queued here; their futures are done once
    their commit is."""
    loop = asyncio.get_running_loop()
    return [
        PendingAppend(
            stream_id,
            expected,
            [forwarded_event(*event) for event in events],
            {},
            metadata_json,
            loop.create_future(),
            effects,
            requires,
            forwarded=True,
        )
        for stream_id, expected, events, metadata_json, effects, requires in appends
    ]


def _result_to_wire(pending: PendingAppend) -> _WireResult:
    """The result of an append another worker sent, to send back."""
    result = pending.result
    if isinstance(result, BaseException):
        return _sendable(result)
    assert result  # resolved: a commit sets every append's result
    first = result[0]
    hashes = [r.hash for r in result]
    return (first.position, first.version, first.recorded_at, hashes, [r.payload for r in result])


def _take_result(pending: PendingAppend, result: _WireResult) -> None:
    """Set ``pending``'s result from what the worker that committed it sent back."""
    if isinstance(result, BaseException):
        pending.result = result
        return
    position, version, recorded_at, hashes, payloads = result
    pending.result = [
        recorded(pending, encoded, position + i, version + i, recorded_at, hash_, payload)
        for i, (encoded, hash_, payload) in enumerate(
            zip(pending.events, hashes, payloads, strict=True)
        )
    ]


class ForwardingCommitter:
    """The committer of a worker but the first (``EventStore.forward_to``): each batch goes
    to the first worker's appender, or, when that cannot take it, to this worker's own
    backend (``local``)."""

    def __init__(self, client: AppendClient, local: Committer) -> None:
        self._client = client
        self._local = local

    async def commit(self, batch: Batch) -> Bookkeeping | None:
        if await self._client.commit(batch):
            return None
        return await self._local.commit(batch)


class AppendServer:
    """The first worker's side: commits the batches the other workers send."""

    def __init__(self, store: _Taker, path: str) -> None:
        self._store = store
        self._path = path
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=self._path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while True:
                pendings = _from_wire(await _read_frame(reader))
                if not self._store.take_forwarded(pendings):
                    # Closing: the sender commits the batch itself.
                    writer.write(_frame(None))
                    await writer.drain()
                    return
                await asyncio.wait([p.future for p in pendings])
                for pending in pendings:
                    pending.future.exception()  # retrieved: it goes back in the reply
                writer.write(_frame([_result_to_wire(p) for p in pendings]))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the sender went away
        except asyncio.CancelledError:
            pass  # stopping: the sender's reads fail, it commits itself from now on
        except Exception:  # a bug: the sender's batch ends as LedgerUnavailable
            _log.exception("a batch another worker sent could not be answered")
        finally:
            self._handlers.discard(task)
            writer.close()

    async def close(self) -> None:
        """After the store's close: no new senders, and the connections ended, each idle or
        answered."""
        if self._server is not None:
            self._server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)


class AppendClient:
    """The other workers' side (``ForwardingCommitter``).

    Quiet until it has reached the first worker once (at start-up the workers come up
    together, and a worker that cannot reach it yet commits its first batches itself);
    then a loss and a return are logged once each."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._retry_at = 0.0
        self._backoff = RETRY_AFTER_S
        self._reached = False  # once connected, a loss is worth a warning
        self._lost = False  # a loss was logged, its end is not yet
        self.forwarded_batches = 0

    async def commit(self, batch: Batch) -> bool:
        """Commit ``batch`` through the first worker, setting each append's result; False
        if it was not sent (this worker commits it then)."""
        reader, writer = self._reader, self._writer
        if reader is not None and (reader.at_eof() or writer is None or writer.is_closing()):
            # It closed while this worker was idle (it died, or stopped): nothing was sent.
            self._drop()
            self._away("closed its socket")
            return False
        if writer is None:
            if not await self._connect():
                return False
            reader, writer = self._reader, self._writer
        assert reader is not None and writer is not None
        try:
            writer.write(_frame([_to_wire(p) for p in batch]))
            results = await _read_frame(reader)
        except BrokenPipeError:
            # Refused as it was written: the first worker's end was closed, so it never
            # read the batch (a frame it began to read and could not finish, it drops).
            self._drop()
            self._away("closed its socket")
            return False
        except BaseException as error:
            self._drop()
            if isinstance(error, asyncio.IncompleteReadError | OSError):
                self._away("went away with a batch")
                raise LedgerUnavailable(
                    "the worker that commits the ledger's appends went away with a batch"
                ) from None
            raise
        if results is None:
            self._drop()
            self._away("is stopping")
            return False
        for pending, result in zip(batch, results, strict=True):
            _take_result(pending, result)
        self.forwarded_batches += 1
        return True

    async def _connect(self) -> bool:
        if time.monotonic() < self._retry_at:
            return False
        try:
            self._reader, self._writer = await asyncio.open_unix_connection(self._path)
        except OSError as error:
            self._away(f"cannot be reached ({type(error).__name__})")
            return False
        if self._lost:
            _log.warning("the first worker's appender is back: this worker commits there again")
        self._reached, self._lost = True, False
        self._backoff = RETRY_AFTER_S
        return True

    def _away(self, why: str) -> None:
        """Commit here for now; try the first worker again after the back-off."""
        if self._reached and not self._lost:
            _log.warning("the first worker's appender %s: this worker commits itself", why)
            self._lost = True
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, MAX_RETRY_AFTER_S)

    def _drop(self) -> None:
        writer, self._writer, self._reader = self._writer, None, None
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.close()

    async def close(self) -> None:
        self._drop()
