"""One appender for the workers of ``waybill serve --workers N``.

Every append takes the ledger head's lock (``ledger.store``, THE LOCK). One process's
appender commits its appends in batches, one round trip each, deciding a batch on what its
own last commit left. Several processes appending to one ledger take turns at the lock:
each finds the head moved by the others, reads before it writes, and after a lost race
commits under the lock in four round trips. Measured with two workers at concurrency 16,
that cost more than the second core gave (``bench/README.md``, "Processes").

So the workers but the first send their batches to the first worker's appender, over a
Unix socket in the workers' private directory: one frame per batch, each append already
checked and encoded (``EventStore.submit``), the reply the positions, hashes and payloads
it was given, or why it was refused. The first worker queues them beside its own appends,
so one batch, one lock and one commit serve every worker. The sender keeps its callers'
futures and commit listeners (its metrics are its own).

When the first worker cannot be reached (not yet started, being started again, stopping),
a worker commits its batches itself, through its own connection, and tries the socket
again after :data:`RETRY_AFTER_S` doubling to :data:`MAX_RETRY_AFTER_S`. A batch whose
reply never comes (the first worker died with it) may or may not have been committed: its
appends fail with ``LedgerUnavailable``, as when a database connection drops mid-commit,
and ``ledger.books.recovery`` settles what they had started.

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
from typing import Any, Final

from ledger.books.accounting import BudgetDenied, HoldStateError
from ledger.store.append import (
    EventStore,
    WrongExpectedVersion,
    _PendingAppend,
    forwarded,
    forwarded_result,
    take_result,
)
from ledger.store.db import LedgerUnavailable

__all__ = ["MAX_RETRY_AFTER_S", "RETRY_AFTER_S", "AppendClient", "AppendServer"]

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


def _sendable(result: Any) -> Any:
    """A refusal as itself; any other failure as LedgerUnavailable (its type may not
    cross, and the sender's callers only need to know the append did not commit)."""
    if isinstance(result, BaseException) and not isinstance(result, _KNOWN_REFUSALS):
        return LedgerUnavailable(f"the ledger could not commit: {type(result).__name__}")
    return result


class AppendServer:
    """The first worker's side: commits the batches the other workers send."""

    def __init__(self, store: EventStore, path: str) -> None:
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
                appends = await _read_frame(reader)
                pendings = self._store.take_forwarded(appends)
                if pendings is None:  # closing: the sender commits the batch itself
                    writer.write(_frame(None))
                    await writer.drain()
                    return
                await asyncio.wait([p.future for p in pendings])
                for pending in pendings:
                    pending.future.exception()  # retrieved: it goes back in the reply
                writer.write(_frame([_sendable(forwarded_result(p)) for p in pendings]))
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
    """The other workers' side (``EventStore.forward_to``).

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

    async def commit(self, batch: list[_PendingAppend]) -> bool:
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
            writer.write(_frame([forwarded(p) for p in batch]))
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
            take_result(pending, result)
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
