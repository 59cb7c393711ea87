"""One request's journal: its events, appended in order to its own ledger stream
(``request-<id>``), batched, and never lost or written twice.

Events are queued as the request goes and sent together at the moments that need them
durable (contract §4: before an upstream call, before an answer). The request is its
stream's only writer, so each append's expected version is known before the last one
returns. An append the books refuse (``BudgetDenied``) or the database cannot take
(``LedgerUnavailable``) is taken as not written, and what it carried stays queued; when the
database failed, the commit may have happened all the same (its answer lost), and the next
append reads the stream first to find out (:meth:`Journal._resolve_unsure`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from ledger import events as ev
from ledger.books.accounting import BudgetDenied, Effect, HoldStateError, Reserve
from ledger.store import NO_STREAM, LedgerUnavailable, RecordedEvent, WrongExpectedVersion
from ledger.support.frozen import direct_init
from router.errors import ErrorCode
from router.request.budget import StepRecord
from router.request.ports import Budget, Clock, RequestLedger
from router.request.records import AttemptEnd, attempt_finished

__all__ = ["Journal", "KeyMoved", "Submitted"]

# Between tries to record the end of an abandoned request while the ledger is unreachable
# (its hold stays counted meanwhile, and crash recovery is the last resort).
_PATIENCE_S: Final = (0.5, 1, 2, 4, 8, 16)


class KeyMoved(Exception):
    """The request's first append was refused: its key's ledger stream moved (the key was
    revoked) since the key was read. Nothing was recorded and no upstream call made; the
    caller reads the key again."""


@dataclass(frozen=True, slots=True)
class _Unsure:
    """An append that failed with the ledger unavailable: maybe committed, maybe not."""

    version: int  # the stream's version it expected
    events: tuple[ev.Event, ...]
    effects: tuple[Effect, ...]


@direct_init
@dataclass(frozen=True, slots=True)
class Submitted:
    """An append on its way to the ledger, and what to restore if it is refused."""

    future: asyncio.Future[list[RecordedEvent]]
    version: int  # the stream's version it expects
    pending: list[ev.Event]  # what was queued before it was sent
    pending_effects: list[Effect]
    events: tuple[ev.Event, ...]  # all it sends
    effects: tuple[Effect, ...]


class Journal:
    """The appends of one request (the executor's :class:`router.request.ports.Journal`)."""

    __slots__ = (
        "_budget",
        "_clock",
        "_metadata",
        "_pending",
        "_pending_effects",
        "_request_id",
        "_requires",
        "_store",
        "_stream_id",
        "_unsure",
        "_version",
    )

    def __init__(
        self,
        store: RequestLedger,
        request_id: str,
        *,
        budget: Budget,
        clock: Clock,
        metadata: Mapping[str, Any],
        requires: dict[str, int] | None = None,
    ) -> None:
        """``requires``: the stream versions the first append requires (the key's, as it
        was read: :class:`KeyMoved` if it moved)."""
        self._store = store
        self._request_id = request_id
        self._stream_id = f"request-{request_id}"
        self._budget = budget
        self._clock = clock
        self._metadata = metadata
        self._requires = requires
        self._pending: list[ev.Event] = []
        self._pending_effects: list[Effect] = []
        self._version = NO_STREAM
        self._unsure: _Unsure | None = None  # an append whose commit answer was lost

    def queue(self, event: ev.Event) -> None:
        self._pending.append(event)

    def record(self, step: StepRecord) -> None:
        """Queue a budget step: its events and book effects go out in the next append."""
        self._pending.extend(step.events)
        self._pending_effects.extend(step.effects)

    @property
    def has_effects(self) -> bool:
        return bool(self._pending_effects)

    async def flush(self, *more: ev.Event, step: StepRecord | None = None) -> None:
        submitted = await self.submit(*more, step=step)
        if submitted is not None:
            await self.committed(submitted)

    async def submit(self, *more: ev.Event, step: StepRecord | None = None) -> Submitted | None:
        """Send what is queued (and ``more``) to the ledger; await :meth:`committed` on what
        this returns (None: nothing to send). Work between the two overlaps the commit."""
        if self._unsure is not None:
            await self._resolve_unsure()  # an earlier append's answer was lost
        pending, effects = self._pending, self._pending_effects
        events = [*pending, *(step.events if step else ()), *more]
        all_effects = [*effects, *(step.effects if step else ())]
        self._pending, self._pending_effects = [], []
        if not events:
            return None
        # The stream's only writer knows the next version before the append returns; a
        # cancelled caller's append still commits (see EventStore.append), and whatever is
        # recorded after it must follow it.
        expected, self._version = self._version, self._version + len(events)
        try:
            future = self._store.submit(
                self._stream_id,
                expected,
                events,
                metadata=self._metadata,
                effects=all_effects,
                requires=self._requires,
            )
        except BaseException:
            self._version = expected
            self._pending, self._pending_effects = pending, effects
            raise
        return Submitted(future, expected, pending, effects, tuple(events), tuple(all_effects))

    async def committed(self, submitted: Submitted) -> None:
        try:
            await submitted.future
            self._requires = None
        except WrongExpectedVersion as refusal:
            if self._requires is None or refusal.stream_id not in self._requires:
                raise
            raise KeyMoved(str(refusal)) from None  # nothing of this request is recorded
        except (BudgetDenied, HoldStateError, LedgerUnavailable) as error:
            # Refused by the books, or the database is down: taken as not written, and what
            # was queued stays queued (before anything queued since). When the database
            # failed, the commit may have happened all the same (its answer lost): the next
            # append finds out first.
            self._version = submitted.version
            self._pending = [*submitted.pending, *self._pending]
            self._pending_effects = [*submitted.pending_effects, *self._pending_effects]
            if isinstance(error, LedgerUnavailable):
                self._unsure = _Unsure(submitted.version, submitted.events, submitted.effects)
            raise

    async def flush_patiently(self, *more: ev.Event) -> None:
        """The end of an abandoned request, retried while the ledger is unreachable."""
        for tries, delay in enumerate(_PATIENCE_S):
            try:
                await self.flush(*more)
                return
            except LedgerUnavailable:
                if not tries:
                    self._store.outage.recorded_late()
                await self._clock.sleep(delay)
        await self.flush(*more)

    async def _resolve_unsure(self) -> None:
        """An earlier append failed with the ledger unavailable: did it commit after all?

        Anything past the version it expected is that append. If it committed, its events
        are not written again, and an attempt it started is finished as never run (the
        executor makes no upstream call without the start's answer) with its reservation
        released."""
        unsure = self._unsure
        assert unsure is not None
        recorded = await self._store.read_stream(self._stream_id, unsure.version)
        self._unsure = None
        if not recorded:
            return  # it did not commit: carry on as if it never happened
        self._requires = None  # it was accepted: what it required held
        if len(recorded) != len(unsure.events):
            raise RuntimeError(
                f"stream {self._stream_id} has {len(recorded)} events past version "
                f"{unsure.version}, not the {len(unsure.events)} of the unanswered append"
            )
        self._version = unsure.version + len(recorded)
        written = {id(e) for e in unsure.events}
        resolved = {id(e) for e in unsure.effects}
        self._pending = [e for e in self._pending if id(e) not in written]
        self._pending_effects = [e for e in self._pending_effects if id(e) not in resolved]
        budget = self._budget
        for effect in unsure.effects:
            if isinstance(effect, Reserve) and not budget.has_hold(effect.hold.attempt_id):
                hold = effect.hold
                budget.adopt(hold)
                end = AttemptEnd(
                    "failed", ev.Evidence.NOT_STARTED, error_code=ErrorCode.LEDGER_UNAVAILABLE
                )
                self.queue(attempt_finished(self._request_id, hold.attempt_id, end, 0))
                self.record(budget.release(hold.attempt_id, "not_started"))
