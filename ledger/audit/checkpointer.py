"""Taking checkpoints: follow the ledger into the Merkle tree, sign it, write the sink.

:class:`Checkpointer` is the one writer of one sink (``ledger.audit.sink``). It keeps the tree's
frontier (``ledger.audit.merkle.Frontier``) in memory: each event read from the ledger costs one
leaf hash and, on average, one node hash, never a rescan. When it opens a sink it starts
from the sink's last checkpoint, with the frontier rebuilt from the sink's tree files and
checked against that checkpoint's signed root, and it refuses a ledger whose event at that
position no longer has the signed head hash: a rewritten ledger is reported at once, and
nothing is ever signed on top of it. A new sink starts from position 1.

A checkpoint is taken by :meth:`Checkpointer.take` (``waybill checkpoint``) or by
:meth:`Checkpointer.run`, the task ``waybill serve`` runs beside the request path when the
config has a ``checkpoints`` block: every ``every_events`` events, or every
``every_seconds`` when anything was appended meanwhile (the ``CheckpointTaken`` events the
checkpoints themselves append do not count, or an idle ledger would be signed forever).
Taking one: sign (size, root, head hash, time, key id); append the tree's new nodes to the
sink's files and fsync them; append the checkpoint's line and fsync it; then append
``CheckpointTaken`` to the ledger's ``checkpoint`` stream, for reference. The key is used
in memory only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

from ledger.audit.checkpoints import (
    Checkpoint,
    KeyFileError,
    SigningKey,
    format_time,
    load_signing_key,
)
from ledger.audit.merkle import Frontier, event_leaf_hash
from ledger.audit.sink import LEVELS, SinkBusy, SinkError, SinkWriter
from ledger.events import CheckpointTaken
from ledger.store import ANY_VERSION, EventStore
from ledger.store.stored import FROM_POSITION_SQL, PREVIOUS_SQL, stored_events, types_of
from ledger.support.process import run, tune_gc
from ledger.views.follow import serve_as_child, supervise_child

__all__ = ["CHECKPOINT_STREAM", "CheckpointTask", "Checkpointer", "LedgerMismatch", "Schedule"]

CHECKPOINT_STREAM: Final = "checkpoint"
_PAGE: Final = 1000
_SLICE: Final = 200
_POLL_S: Final = 1.0
_MAX_BACKOFF_S: Final = 60.0
_log = logging.getLogger("waybill.checkpoints")
# The child's settings (CheckpointTask): not its arguments, which `ps` shows to everyone.
_URL_VARIABLE = "WAYBILL_CHECKPOINT_DATABASE_URL"
_PARENT_VARIABLE = "WAYBILL_CHECKPOINT_PARENT"
_SINK_VARIABLE = "WAYBILL_CHECKPOINT_SINK"
_SCHEDULE_VARIABLE = "WAYBILL_CHECKPOINT_SCHEDULE"

# Through store.hot: on PostgreSQL asyncpg, far less CPU per event read than SQLAlchemy
# (bench/README.md, "Decisions"). The rows from the one holding the event after :after up
# to the last that may hold one of the page's :limit events: with only the lower bound,
# which comes from a subquery, the planner of a ledger never analysed read the whole month's
# partition and sorted it (as the read models' page did: ledger/views/projection.py). Those
# rows are never more than :limit (each holds at least one event, and only the first starts
# at or before :after + 1), so the LIMIT never cuts a page short.
_READ_PAGE = (
    f"SELECT position, types, {PREVIOUS_SQL}, payloads FROM appends WHERE "
    + FROM_POSITION_SQL.format(after=":after")
    + " AND position <= :after + :limit ORDER BY position LIMIT :limit"
)
_NEXT_ROW = "SELECT position FROM appends WHERE position > :after ORDER BY position LIMIT 1"
_HASH_AT = (
    f"SELECT position, {PREVIOUS_SQL}, payloads FROM appends WHERE position <= :position "
    "ORDER BY position DESC LIMIT 1"
)


class LedgerMismatch(SinkError):
    """The ledger is not the one the sink's checkpoints signed (rewritten, cut, another)."""


@dataclass(frozen=True, slots=True)
class Schedule:
    """When ``waybill serve`` takes a checkpoint (config ``checkpoints``)."""

    every_events: int
    every_seconds: float


class Checkpointer:
    """The writer of one sink; see the module docstring."""

    def __init__(self, store: EventStore, key: SigningKey, directory: Path) -> None:
        self.store = store
        self.key = key
        self.directory = directory.resolve()
        self._writer: SinkWriter | None = None
        self._frontier = Frontier()
        self._head_hash = ""
        self.unsigned = 0  # events since the last checkpoint, CheckpointTaken left out
        self._last_taken_at = time.monotonic()

    @property
    def size(self) -> int:
        return self._frontier.size

    async def open(self) -> Checkpoint | None:
        """Lock the sink and take up where its last checkpoint left off; returns that
        checkpoint. SinkBusy, SinkError, LedgerMismatch."""
        writer = await asyncio.to_thread(SinkWriter.open, self.directory)
        try:
            last = writer.last
            size = last.size if last is not None else 0
            frontier = await asyncio.to_thread(_frontier_at, writer, size)
            if last is not None:
                if frontier.root().hex() != last.root:
                    raise SinkError(
                        f"the tree files of {self.directory} do not lead to the root its last "
                        f"checkpoint (size {size}) signed: they are damaged"
                    )
                stored = await self._hash_at(size)
                if stored != last.head_hash:
                    found = "no event" if stored is None else f"hash {stored}"
                    raise LedgerMismatch(
                        f"the ledger does not match the last checkpoint in {self.directory}: "
                        f"it signed head hash {last.head_hash} at position {size}, the ledger "
                        f"has {found} there (rewritten, cut short, or another ledger); run "
                        "`waybill verify --checkpoints`"
                    )
                self._head_hash = last.head_hash
        except BaseException:
            writer.close()
            raise
        self._writer, self._frontier = writer, frontier
        self.unsigned = 0
        self._last_taken_at = time.monotonic()
        return last

    async def _hash_at(self, position: int) -> str | None:
        row = await self.store.hot.first(_HASH_AT, {"position": position})
        if row is None:
            return None
        found = stored_events(int(row.position), row.previous, bytes(row.payloads))
        return next((hash_ for at, hash_, _ in found if at == position), None)

    async def catch_up(self, progress: Callable[[int], None] | None = None) -> int:
        """Bring the tree to the ledger's head; returns the events read."""
        read = 0
        while True:
            after = self._frontier.size
            rows = await self.store.hot.rows(_READ_PAGE, {"after": after, "limit": _PAGE})
            events = 0
            for first in range(0, len(rows), _SLICE):
                for row in rows[first : first + _SLICE]:
                    position, types = int(row.position), str(row.types)
                    for at, hash_, payload in stored_events(
                        position, row.previous, bytes(row.payloads), after=after
                    ):
                        self._add(at, payload, hash_, types_of(types[at - position])[0])
                        events += 1
                # The request path's turn: hashing holds the event loop for one slice at a
                # time, never a whole page (bench/README.md, "Decisions").
                await asyncio.sleep(0)
            read += events
            if progress is not None and events:
                progress(events)
            if self._frontier.size < after + _PAGE:
                # The page ended before its bound: the ledger ends here, unless a hole of a
                # page or more hid the rows past it from the bounded read (or one committed
                # since: taken on the next catch-up).
                later = await self.store.hot.rows(_NEXT_ROW, {"after": self._frontier.size})
                if later and int(later[0].position) != self._frontier.size + 1:
                    raise self._hole(int(later[0].position))
                return read

    def _hole(self, position: int) -> LedgerMismatch:
        # Positions are gapless (store.py): a hole is an edit, never signed over.
        return LedgerMismatch(
            f"the ledger has no event at position {self._frontier.size + 1} "
            f"(the next is {position}): run `waybill verify`"
        )

    def _add(self, position: int, payload: bytes, hash_: str, event_type: str) -> None:
        if position != self._frontier.size + 1:
            raise self._hole(position)
        self._frontier.append(event_leaf_hash(position, payload))
        self._head_hash = hash_
        if event_type != CheckpointTaken.type:
            self.unsigned += 1

    async def take(self) -> Checkpoint:
        """Catch up, sign the tree at the head, write it to the sink, record it."""
        writer = self._writer
        if writer is None:
            raise SinkError("the sink is not open")
        await self.catch_up()
        size = self._frontier.size
        if size == 0:
            raise SinkError("the ledger is empty: there is nothing to sign yet")
        moment = datetime.now(UTC)
        if writer.last is not None:
            moment = max(moment, writer.last.moment)  # never back in time, whatever the clock
        checkpoint = self.key.sign(
            size, self._frontier.root().hex(), self._head_hash, format_time(moment)
        )
        kept = {level: nodes for level, nodes in self._frontier.kept.items() if nodes}
        await asyncio.to_thread(writer.append_tree, kept)
        for nodes in self._frontier.kept.values():
            nodes.clear()
        await asyncio.to_thread(writer.append, checkpoint)
        self.unsigned = 0
        self._last_taken_at = time.monotonic()
        await self.store.append(
            CHECKPOINT_STREAM,
            ANY_VERSION,
            [
                CheckpointTaken(
                    size=checkpoint.size,
                    root=checkpoint.root,
                    head_hash=checkpoint.head_hash,
                    time=checkpoint.time,
                    key_id=checkpoint.key_id,
                    signature=checkpoint.signature,
                    sink=str(self.directory),
                )
            ],
        )
        return checkpoint

    def due(self, schedule: Schedule) -> bool:
        if self.unsigned >= schedule.every_events:
            return True
        elapsed = time.monotonic() - self._last_taken_at
        return self.unsigned > 0 and elapsed >= schedule.every_seconds

    async def close(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            await asyncio.to_thread(writer.close)

    async def run(self, schedule: Schedule, stop: asyncio.Event) -> None:
        """``waybill serve``'s task: checkpoint on schedule until ``stop``, then once more
        if anything is left unsigned. Never raises: a busy sink (another gateway writes it)
        is tried again each interval, any other failure is logged and retried with
        back-off; the request path never waits for any of it."""
        poll_s = min(_POLL_S, schedule.every_seconds)
        failures = 0
        busy_said = False
        try:
            while not stop.is_set():
                wait_s = poll_s
                try:
                    if self._writer is None:
                        await self.open()
                        _log.info("checkpointing the ledger into %s", self.directory)
                        busy_said = False
                    await self.catch_up()
                    if self.due(schedule):
                        await self.take()
                    failures = 0
                except SinkBusy as error:
                    if not busy_said:
                        _log.warning("not checkpointing while %s", error)
                        busy_said = True
                except Exception as error:
                    failures += 1
                    wait_s = min(_MAX_BACKOFF_S, poll_s * 2**failures)
                    _log.error("checkpointing into %s failed: %s", self.directory, error)
                    await self.close()  # start again from the sink's last checkpoint
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait_s):
                        await stop.wait()
            if self._writer is not None:
                await self.catch_up()
                if self.unsigned:
                    await self.take()
        except Exception as error:
            _log.error("the last checkpoint into %s failed: %s", self.directory, error)
        finally:
            await self.close()


class CheckpointTask:
    """``waybill serve``'s checkpointing: :meth:`Checkpointer.run` in this process, or with
    ``database_url`` in a process of its own (``python -m ledger.audit.checkpointer``, restarted if
    it dies, as the read-model follower is: on PostgreSQL, reading and hashing every event
    then never shares the request path's event loop). The key goes to the child through its
    standard input, never its arguments or environment. :meth:`stop` waits for the last
    checkpoint."""

    def __init__(
        self,
        store: EventStore,
        key: SigningKey,
        directory: Path,
        schedule: Schedule,
        *,
        database_url: str | None = None,
    ) -> None:
        self._stop = asyncio.Event()
        if database_url is None:
            work = Checkpointer(store, key, directory).run(schedule, self._stop)
        else:
            env = {
                _URL_VARIABLE: database_url,
                _PARENT_VARIABLE: str(os.getpid()),
                _SINK_VARIABLE: str(directory),
                _SCHEDULE_VARIABLE: f"{schedule.every_events} {schedule.every_seconds!r}",
            }
            work = supervise_child(
                "ledger.audit.checkpointer",
                env,
                self._stop,
                name="the checkpointer",
                stdin=key.private_pem(),
            )
        self._task = asyncio.create_task(work, name="waybill-checkpoints")

    async def stop(self) -> None:
        self._stop.set()
        await self._task


def _frontier_at(writer: SinkWriter, size: int) -> Frontier:
    """The frontier at ``size`` from the sink's tree files, which are cut back to it."""
    writer.keep_tree(size)
    if writer.tree.leaves < size:
        raise SinkError(
            f"the tree files of {writer.directory} hold {writer.tree.leaves} leaves, its last "
            f"checkpoint signed {size}: they are damaged"
        )
    return Frontier.from_source(size, writer.tree.perfect, keep=LEVELS)


async def _checkpoint_in_child(
    database_url: str, parent: int, key: SigningKey, directory: Path, schedule: Schedule
) -> None:
    async def checkpoint(store: EventStore, stop: asyncio.Event) -> None:
        await Checkpointer(store, key, directory).run(schedule, stop)

    await serve_as_child(database_url, parent, checkpoint)


def main() -> None:
    """``python -m ledger.audit.checkpointer``: started by ``waybill serve`` (CheckpointTask)."""
    tune_gc()
    logging.basicConfig(level=logging.WARNING, format="waybill checkpoints: %(message)s")
    database_url = os.environ.get(_URL_VARIABLE)
    parent = os.environ.get(_PARENT_VARIABLE, "")
    directory = os.environ.get(_SINK_VARIABLE)
    every = os.environ.get(_SCHEDULE_VARIABLE, "").split()
    if not database_url or not parent.isdigit() or not directory or len(every) != 2:
        sys.exit("ledger.audit.checkpointer is started by `waybill serve`, not by hand")
    try:
        key = load_signing_key(sys.stdin.buffer.read())
    except KeyFileError as error:
        sys.exit(f"the checkpoint key from the gateway is not one: {error}")
    schedule = Schedule(int(every[0]), float(every[1]))
    run(_checkpoint_in_child(database_url, int(parent), key, Path(directory), schedule))


if __name__ == "__main__":
    main()
