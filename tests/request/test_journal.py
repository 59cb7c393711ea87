"""One request's journal (router/request/journal.py) over an in-memory store: its appends go
out in order at known versions; one the books refuse keeps what was queued before it; one
whose answer was lost is found out before the next; a key that moved is KeyMoved."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Any, cast

import pytest

from ledger import events as ev
from ledger.books.accounting import BudgetDenied, Effect
from ledger.store import LedgerUnavailable, RecordedEvent, WrongExpectedVersion
from ledger.store.outage import Outage
from router.request.budget import RequestBudget
from router.request.journal import Journal, KeyMoved
from tests.request.fakes import FakeBalances, FakeClock, config

KEY_STREAM = "key-key-1"


class FakeStore:
    """A ledger that takes each append (or raises the error given for it), and remembers."""

    def __init__(self) -> None:
        self.appends: list[tuple[str, int | None, list[ev.Event], dict[str, int] | None]] = []
        self.committed: list[ev.Event] = []
        self.errors: list[BaseException | None] = []  # the next appends' answers, in order
        self.commit_anyway = False  # an error raised after the append was written
        self.outage = Outage()

    def submit(
        self,
        stream_id: str,
        expected_version: int | None,
        new_events: Sequence[ev.Event],
        *,
        metadata: Mapping[str, Any] | None = None,
        effects: Sequence[Effect] = (),
        requires: Mapping[str, int] | None = None,
    ) -> asyncio.Future[list[RecordedEvent]]:
        events = list(new_events)
        self.appends.append((stream_id, expected_version, events, dict(requires or {}) or None))
        future: asyncio.Future[list[RecordedEvent]] = asyncio.get_running_loop().create_future()
        error = self.errors.pop(0) if self.errors else None
        if error is None or self.commit_anyway:
            self.committed += events
        if error is None:
            future.set_result([])
        else:
            future.set_exception(error)
        return future

    async def read_stream(self, stream_id: str, after_version: int = 0) -> list[RecordedEvent]:
        return cast(list[RecordedEvent], self.committed[after_version:])


def _world(requires: dict[str, int] | None = None) -> tuple[FakeStore, RequestBudget, Journal]:
    workspace = config().workspace("acme")
    assert workspace is not None
    budget = RequestBudget(
        FakeBalances(),
        request_id="req-1",
        workspace=workspace,
        key_id="key-1",
        model_group="chat",
        request_limit=None,
        owner="gw-test",
    )
    store = FakeStore()
    journal = Journal(
        store,
        "req-1",
        budget=budget,
        clock=FakeClock(),
        metadata={"config_generation": "unit-1"},
        requires=requires,
    )
    return store, budget, journal


def _event(n: int) -> ev.Event:
    return ev.StreamCommitted(request_id="req-1", attempt_id=f"att-{n}", endpoint="east")


async def test_queued_events_go_out_in_order_at_the_versions_that_follow() -> None:
    store, _, journal = _world()
    journal.queue(_event(1))
    await journal.flush(_event(2))
    journal.queue(_event(3))
    await journal.flush()
    await journal.flush()  # nothing queued: nothing sent

    assert [(s, v, [e.attempt_id for e in es]) for s, v, es, _ in store.appends] == [  # type: ignore[attr-defined]
        ("request-req-1", 0, ["att-1", "att-2"]),
        ("request-req-1", 2, ["att-3"]),
    ]


async def test_an_append_the_books_refuse_leaves_what_was_queued_before_it_queued() -> None:
    store, budget, journal = _world()
    journal.queue(_event(1))
    reservation = budget.reserve("att-9", "east", "m", Decimal("0.01"))
    store.errors = [BudgetDenied("workspace:acme", "workspace", Decimal(1), Decimal(0), Decimal(1))]
    submitted = await journal.submit(_event(9), step=reservation)
    assert submitted is not None
    with pytest.raises(BudgetDenied):
        await journal.committed(submitted)
    assert not journal.has_effects, "the refused reservation is not queued again"
    journal.queue(_event(2))
    await journal.flush()

    (_, first, _, _), (_, again, sent, _) = store.appends
    assert first == again == 0
    assert [e.attempt_id for e in sent] == ["att-1", "att-2"]  # type: ignore[attr-defined]


async def test_an_append_whose_answer_was_lost_is_not_written_twice() -> None:
    store, budget, journal = _world()
    reservation = budget.reserve("att-1", "east", "m", Decimal("0.01"))
    store.errors, store.commit_anyway = [LedgerUnavailable("no answer")], True
    submitted = await journal.submit(_event(1), step=reservation)
    assert submitted is not None
    with pytest.raises(LedgerUnavailable):
        await journal.committed(submitted)
    budget.forget("att-1")  # the executor's reading: no reservation, so no upstream call
    store.commit_anyway = False
    await journal.flush(_event(2))

    (_, _, written, _), (_, version, sent, _) = store.appends
    assert version == len(written) == 2, "it did commit: the next append follows it"
    finished, released, second = sent
    assert isinstance(finished, ev.AttemptFinished) and finished.attempt_id == "att-1"
    assert (finished.evidence, finished.error_code) == (
        ev.Evidence.NOT_STARTED,
        "ledger_unavailable",
    )
    assert isinstance(released, ev.BudgetReleased) and released.reason == "not_started"
    assert second == _event(2)


async def test_the_first_append_requires_the_key_as_it_was_read() -> None:
    store, _, journal = _world(requires={KEY_STREAM: 3})
    store.errors = [WrongExpectedVersion(KEY_STREAM, 3, 4)]
    journal.queue(_event(1))
    with pytest.raises(KeyMoved):
        await journal.flush()
    assert store.appends[0][3] == {KEY_STREAM: 3}

    store, _, journal = _world(requires={KEY_STREAM: 3})
    await journal.flush(_event(1))
    await journal.flush(_event(2))
    assert [requires for _, _, _, requires in store.appends] == [{KEY_STREAM: 3}, None]


async def test_another_stream_that_moved_is_not_the_key() -> None:
    store, _, journal = _world(requires={KEY_STREAM: 3})
    store.errors = [WrongExpectedVersion("request-req-1", 0, 2)]
    with pytest.raises(WrongExpectedVersion):
        await journal.flush(_event(1))
