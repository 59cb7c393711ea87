"""On PostgreSQL a batch that needs only what the appender's own last commit left is
decided without reading the ledger, and every way that knowledge can be wrong falls back to
reading: another writer moved the head, a stream or reservation taken to be new was not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from decimal import Decimal

import pytest

from ledger import events as ev
from ledger.accounting import HoldStateError, Settle
from ledger.db import create_engine
from ledger.store import ANY_VERSION, NO_STREAM, EventStore, WrongExpectedVersion, _Known
from ledger.verify import verify_chain
from tests.ledger.factories import received
from tests.ledger.test_books import balance, reserve

pytestmark = pytest.mark.postgres
D = Decimal


@pytest.fixture
async def stores(postgres_url: str) -> AsyncIterator[list[EventStore]]:
    """Two stores on one database: what two gateway replicas would be."""
    engines = [create_engine(postgres_url) for _ in range(2)]
    stores = [EventStore(engine) for engine in engines]
    yield stores
    for store, engine in zip(stores, engines, strict=True):
        await store.close()
        await engine.dispose()


def settled(n: int) -> tuple[list[ev.Event], Settle]:
    event = ev.BudgetSettled(
        request_id=f"req_{n}",
        attempt_id=f"att_{n}",
        reservation_id=f"res_{n}",
        reserved_usd=D("0.30"),
        settled_usd=D("0.10"),
        released_usd=D("0.20"),
        usage=ev.Usage(input_tokens=12, output_tokens=30),
    )
    return [event], Settle(f"res_{n}", D("0.10"))


async def test_a_request_s_appends_after_the_first_are_decided_without_reading(
    stores: list[EventStore],
) -> None:
    store = stores[0]
    for n in range(3):
        events, effect = reserve(n, "0.30")
        await store.append(f"request-req_{n}", NO_STREAM, events, effects=[effect])
        events, settle = settled(n)
        await store.append(f"request-req_{n}", 1, events, effects=[settle])
    # The first append reads (nothing is known yet); the other five, each to a new stream
    # or to one this store wrote, on balances and holds it saved, do not.
    assert store.stats["unread_batches"] == 5
    assert store.stats["wrong_guesses"] == 0
    assert await balance(store) == (D(0), D("0.30"))
    assert [r.version for r in await store.read_stream("request-req_2")] == [1, 2]
    assert (await verify_chain(store)).ok


async def test_a_balance_another_writer_changed_is_read_again_before_deciding(
    stores: list[EventStore],
) -> None:
    a, b = stores
    events, effect = reserve(1, "0.60")
    await a.append("request-req_1", NO_STREAM, events, effects=[effect])
    events, effect = reserve(2, "0.30")
    await b.append("request-req_2", NO_STREAM, events, effects=[effect])
    # `a` last saw 0.60 held, where 0.30 more would fit; the ledger holds 0.90 by now.
    events, effect = reserve(3, "0.30")
    with pytest.raises(Exception, match="cannot cover") as refused:
        await a.append("request-req_3", NO_STREAM, events, effects=[effect])
    assert type(refused.value).__name__ == "BudgetDenied"
    assert a.stats["unread_batches"] == 0  # its guarded write found the head moved
    assert await balance(a) == (D("0.90"), D(0))
    assert (await verify_chain(a)).ok


async def test_a_stream_taken_to_be_new_that_exists_is_refused_after_a_read(
    stores: list[EventStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_Known, "LIMIT", 2)  # so that the store forgets its first stream
    store = stores[0]
    for name in ("first", "second", "third"):
        await store.append(f"request-{name}", NO_STREAM, [received(name)])
    with pytest.raises(WrongExpectedVersion):
        await store.append("request-first", NO_STREAM, [received("first")])
    assert store.stats["wrong_guesses"] == 1
    # An append at a version the store does not know (it keeps two streams: "second" made
    # room for "first", read after the wrong guess) is read, never guessed.
    await store.append("request-second", ANY_VERSION, [received("second")])
    assert [r.version for r in await store.read_stream("request-second")] == [1, 2]
    assert store.stats["wrong_guesses"] == 1
    assert (await verify_chain(store)).ok


async def test_a_reservation_taken_to_be_new_that_exists_is_refused_after_a_read(
    stores: list[EventStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_Known, "LIMIT", 1)
    store = stores[0]
    for n in (1, 2):
        events, effect = reserve(n, "0.10")
        await store.append(f"request-req_{n}", NO_STREAM, events, effects=[effect])
    events, effect = reserve(1, "0.10")  # res_1 again, forgotten by the store
    with pytest.raises(HoldStateError, match="already exists"):
        await store.append("request-again", NO_STREAM, events, effects=[effect])
    assert store.stats["wrong_guesses"] == 1
    assert await balance(store) == (D("0.20"), D(0))
    assert await store.read_stream("request-again") == []


async def test_what_was_known_before_another_writer_s_commit_is_dropped_when_a_read_shows_it(
    stores: list[EventStore],
) -> None:
    a, b = stores
    events, effect = reserve(1, "0.60")
    await a.append("request-req_1", NO_STREAM, events, effects=[effect])
    events, effect = reserve(2, "0.30")
    await b.append("request-req_2", NO_STREAM, events, effects=[effect])
    # This append needs a read (a stream at a version `a` does not know); the read shows
    # a head `a` did not leave, so the balance `a` saved (0.60 held) is no longer true.
    await a.append("request-other", ANY_VERSION, [received("other")])
    events, effect = reserve(3, "0.30")
    with pytest.raises(Exception, match="cannot cover"):
        await a.append("request-req_3", NO_STREAM, events, effects=[effect])
    assert await balance(a) == (D("0.90"), D(0))


async def test_a_reservation_not_known_is_read_before_it_is_settled(
    stores: list[EventStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_Known, "LIMIT", 1)
    store = stores[0]
    for n in (1, 2):
        events, effect = reserve(n, "0.30")
        await store.append(f"request-req_{n}", NO_STREAM, events, effects=[effect])
    unread = store.stats["unread_batches"]
    events, settle = settled(1)  # res_1, forgotten by now, to a new stream
    await store.append("request-settlement", NO_STREAM, events, effects=[settle])
    assert store.stats["unread_batches"] == unread
    assert store.stats["wrong_guesses"] == 0
    assert await balance(store) == (D("0.30"), D("0.10"))


async def test_an_account_not_known_is_read_not_taken_to_be_new(
    stores: list[EventStore],
) -> None:
    a, b = stores
    events, effect = reserve(1, "0.30")
    await b.append("request-req_1", NO_STREAM, events, effects=[effect])
    await a.append("request-other", NO_STREAM, [received("other")])  # `a` knows the head
    events, effect = reserve(2, "0.30")
    await a.append("request-req_2", NO_STREAM, events, effects=[effect])
    assert a.stats["wrong_guesses"] == 0
    assert await balance(a) == (D("0.60"), D(0))
