"""On PostgreSQL a batch that needs only what the appender's own last commit left is
decided without reading the ledger, and every way that knowledge can be wrong falls back to
reading: another writer moved the head, a stream or reservation taken to be new was not."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from decimal import Decimal

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from ledger import events as ev
from ledger.audit.verify import verify_chain
from ledger.books.accounting import (
    AccountSpec,
    Books,
    BudgetDenied,
    Effect,
    Hold,
    HoldStateError,
    Release,
    Reserve,
    Settle,
)
from ledger.store import ANY_VERSION, NO_STREAM, EventStore, WrongExpectedVersion
from ledger.store.db import create_engine
from ledger.store.postgres import PostgresCommitter, _Known
from ledger.store.schema import budget_accounts
from tests.ledger.factories import key_created, received
from tests.ledger.test_books import balance, release, reserve

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


async def reserved(store: EventStore, n: int, amount: str) -> None:
    """Reserve ``amount`` as ``res_<n>``, the first append of a new stream ``request-req_<n>``."""
    events, effect = reserve(n, amount)
    await store.append(f"request-req_{n}", NO_STREAM, events, effects=[effect])


def settled(n: int, reserved: str = "0.30", spent: str = "0.10") -> tuple[list[ev.Event], Settle]:
    """Settle ``res_<n>`` (``reserved``) at ``spent``: the event and its effect."""
    event = ev.BudgetSettled(
        request_id=f"req_{n}",
        attempt_id=f"att_{n}",
        reservation_id=f"res_{n}",
        reserved_usd=D(reserved),
        settled_usd=D(spent),
        released_usd=D(reserved) - D(spent),
        usage=ev.Usage(input_tokens=12, output_tokens=30),
    )
    return [event], Settle(f"res_{n}", D(spent))


async def test_a_request_s_appends_after_the_first_are_decided_without_reading(
    stores: list[EventStore],
) -> None:
    store = stores[0]
    for n in range(3):
        await reserved(store, n, "0.30")
        events, settle = settled(n)
        await store.append(f"request-req_{n}", 1, events, effects=[settle])
    # The first append reads (nothing is known yet); the other five, each to a new stream
    # or to one this store wrote, on balances and holds it saved, do not.
    assert store.stats["unread_batches"] == 5
    assert store.stats["wrong_guesses"] == 0
    assert await balance(store) == (D(0), D("0.30"))
    assert [r.version for r in await store.read_stream("request-req_2")] == [1, 2]
    assert (await verify_chain(store)).ok


async def test_the_appender_never_plans_its_statements_again(
    stores: list[EventStore],
) -> None:
    # Planning a write can cost as much as running it: the appender's statements run on
    # their cached generic plans from the first time, every shape of them (left to choose,
    # PostgreSQL plans each five times first and may go on planning; ledger.store.reads.connect).
    store = stores[0]
    for n in range(12):
        await reserved(store, n, "0.01")
        events, settle = settled(n, "0.01", "0.01")
        await store.append(f"request-req_{n}", 1, events, effects=[settle])
    backend = store._backend
    conn = backend._conn if isinstance(backend, PostgresCommitter) else None
    assert conn is not None
    plans = await conn.fetch(
        "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements "
        "WHERE statement LIKE '%WITH head AS%'"
    )
    assert len(plans) >= 2  # a reservation's write and a settlement's, at least
    for plan in plans:
        assert plan["custom_plans"] == 0, plan["statement"]
    assert sum(plan["generic_plans"] for plan in plans) >= 24  # each write ran on one


async def test_a_required_stream_this_store_wrote_is_checked_without_reading(
    stores: list[EventStore],
) -> None:
    store = stores[0]
    await store.append("key-k_1", NO_STREAM, [key_created("k_1")])
    for n in range(3):
        await store.append(f"request-r{n}", NO_STREAM, [received(f"r{n}")], requires={"key-k_1": 1})
    assert store.stats["unread_batches"] == 3
    assert store.stats["wrong_guesses"] == 0


async def test_a_key_another_writer_revoked_refuses_the_next_append_that_requires_it(
    stores: list[EventStore],
) -> None:
    a, b = stores
    await a.append("key-k_1", NO_STREAM, [key_created("k_1")])
    await a.append("request-r1", NO_STREAM, [received("r1")], requires={"key-k_1": 1})
    await b.append("key-k_1", 1, [ev.KeyRevoked(key_id="k_1")])
    with pytest.raises(WrongExpectedVersion) as refused:
        await a.append("request-r2", NO_STREAM, [received("r2")], requires={"key-k_1": 1})
    assert (refused.value.stream_id, refused.value.actual) == ("key-k_1", 2)
    assert await a.read_stream("request-r2") == []
    assert a.stats["unread_batches"] == 1  # only r1: the refusal was decided on a read


async def test_a_balance_another_writer_changed_is_read_again_before_deciding(
    stores: list[EventStore],
) -> None:
    a, b = stores
    await reserved(a, 1, "0.60")
    await reserved(b, 2, "0.30")
    # `a` last saw 0.60 held, where 0.30 more would fit; the ledger holds 0.90 by now.
    with pytest.raises(BudgetDenied, match="cannot cover"):
        await reserved(a, 3, "0.30")
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
        await reserved(store, n, "0.10")
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
    await reserved(a, 1, "0.60")
    await reserved(b, 2, "0.30")
    # This append needs a read (a stream at a version `a` does not know); the read shows
    # a head `a` did not leave, so the balance `a` saved (0.60 held) is no longer true.
    await a.append("request-other", ANY_VERSION, [received("other")])
    with pytest.raises(BudgetDenied, match="cannot cover"):
        await reserved(a, 3, "0.30")
    assert await balance(a) == (D("0.90"), D(0))


async def test_a_reservation_not_known_is_read_before_it_is_settled(
    stores: list[EventStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_Known, "LIMIT", 1)
    store = stores[0]
    for n in (1, 2):
        await reserved(store, n, "0.30")
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
    await reserved(b, 1, "0.30")
    await a.append("request-other", NO_STREAM, [received("other")])  # `a` knows the head
    await reserved(a, 2, "0.30")
    assert a.stats["wrong_guesses"] == 0
    assert await balance(a) == (D("0.60"), D(0))


async def test_a_refusal_decided_on_what_was_known_is_checked_by_a_read(
    stores: list[EventStore],
) -> None:
    # With every append of a batch refused there is nothing to write, so no guard would
    # notice that what `a` knows is stale: the stream moved on, the budget was freed.
    a, b = stores
    await a.append("request-s", NO_STREAM, [received("s")])
    await b.append("request-s", 1, [received("s")])
    await a.append("request-s", 2, [received("s")])  # `a` knew version 1
    await reserved(a, 1, "0.90")
    events, effect = release(1, "0.90")
    await b.append("request-req_1", 1, events, effects=[effect])
    await reserved(a, 2, "0.50")  # `a` knew 0.90 held
    assert await balance(a) == (D("0.50"), D(0))


async def test_a_refusal_beside_an_append_that_is_written_is_still_decided_on_a_read(
    stores: list[EventStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by the property test below: the store had forgotten stream "x" (it keeps one),
    # took it to be new for a NO_STREAM append, and refused that append for its effect (a
    # hold already resolved) instead of for its version, the check that comes first. The
    # other append of the batch was written, so the head guard passed.
    monkeypatch.setattr(_Known, "LIMIT", 1)
    store = stores[0]
    await store.append("request-x", NO_STREAM, [received("x")])
    await reserved(store, 1, "0.30")
    events, effect = release(1, "0.30")
    await store.append("request-req_1", 1, events, effects=[effect])
    outcomes = await asyncio.gather(
        _outcome(store, "request-x", NO_STREAM, [effect]),
        _outcome(store, "request-y", NO_STREAM, []),
    )
    assert list(outcomes) == ["WrongExpectedVersion", "appended"]


# --- property: whatever the interleaving of two writers, each append ends as a single
# writer applying the same appends in the same order would have it end. It found three bugs
# (the two refusal tests above, and Books changing a caller's hold: test_accounting). With
# learn()'s forgetting or state_for's hold or account check removed it failed, though not
# in every run of 250 examples (the hold check's loss needs a mixed batch). ------------

_examples = itertools.count()
_OP = st.tuples(
    st.sampled_from(["reserve", "settle", "release", "plain"]),
    st.integers(0, 2),  # the reservation
    st.integers(0, 6),  # tenths of a dollar reserved or settled
    st.integers(0, 2),  # the stream
    st.sampled_from(["exact", "exact", "new", "any", "wrong"]),  # the expected version
)
# Steps: a writer and the appends it makes at once (queued together: one batch).
_STEPS = st.lists(st.tuples(st.integers(0, 1), st.lists(_OP, min_size=1, max_size=3)), max_size=20)


@pytest.mark.slow  # ~20 s: fewer examples missed a store that kept stale balances
@settings(
    max_examples=250,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],  # explain: minutes
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(steps=_STEPS, limit=st.sampled_from([1, 2, _Known.LIMIT]))
async def test_two_writers_end_every_append_as_one_writer_would(
    postgres_url: str, steps: list[tuple[int, list[tuple[str, int, int, int, str]]]], limit: int
) -> None:
    prefix = f"x{next(_examples)}"
    spec = AccountSpec(f"key:{prefix}:total", "key", "acme", prefix, None, D("1.00"))
    engines = [create_engine(postgres_url) for _ in range(2)]
    stores = [EventStore(engine) for engine in engines]
    oracle, versions = Books(), dict[str, int]()
    saved_limit, _Known.LIMIT = _Known.LIMIT, limit
    try:
        for writer, ops in steps:
            appends, wanted = [], []
            for kind, n, tenths, j, version in ops:
                stream = f"request-{prefix}-{j}"
                expected = {
                    "exact": versions.get(stream, 0),
                    "new": NO_STREAM,
                    "any": ANY_VERSION,
                    "wrong": versions.get(stream, 0) + 1,
                }[version]
                rid, amount = f"res_{prefix}_{n}", D(tenths) / 10
                effects: list[Effect] = []
                if kind == "reserve":
                    hold = Hold(rid, "r", f"a_{rid}", "acme", prefix, "east", "m", amount, (), "i")
                    effects = [Reserve(hold, (spec,))]
                elif kind == "settle":
                    effects = [Settle(rid, amount)]
                elif kind == "release":
                    effects = [Release(rid)]
                appends.append(_outcome(stores[writer], stream, expected, effects))
                wanted.append(_oracle(oracle, versions, stream, expected, effects))
            assert await asyncio.gather(*appends) == wanted
        for store in stores:
            assert (await verify_chain(store)).ok
        async with engines[0].connect() as conn:
            account = (
                await conn.execute(
                    sa.select(budget_accounts.c.held_usd, budget_accounts.c.settled_usd).where(
                        budget_accounts.c.account_id == spec.account_id
                    )
                )
            ).one_or_none()
        booked = oracle.accounts.get(spec.account_id)
        assert (tuple(account) if account else None) == (
            (booked.held_usd, booked.settled_usd) if booked else None
        )
    finally:
        _Known.LIMIT = saved_limit
        for store, engine in zip(stores, engines, strict=True):
            await store.close()
            await engine.dispose()


async def _outcome(
    store: EventStore, stream: str, expected: int | None, effects: list[Effect]
) -> str:
    try:
        await store.append(stream, expected, [received("r")], effects=effects)
    except (WrongExpectedVersion, BudgetDenied, HoldStateError) as refusal:
        return type(refusal).__name__
    return "appended"


def _oracle(
    books: Books, versions: dict[str, int], stream: str, expected: int | None, effects: list[Effect]
) -> str:
    current = versions.get(stream, 0)
    if expected is not None and expected != current:
        return "WrongExpectedVersion"
    try:
        books.apply(effects)
    except (BudgetDenied, HoldStateError) as refusal:
        return type(refusal).__name__
    versions[stream] = current + 1
    return "appended"
