"""The books in the append transaction, on SQLite and PostgreSQL: balances change with their
events or not at all, and no interleaving of appends overspends a budget."""

from __future__ import annotations

import asyncio
import re
from decimal import Decimal

import asyncpg
import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from ledger import events as ev
from ledger.audit.verify import verify_chain
from ledger.books.accounting import (
    AccountSpec,
    BudgetDenied,
    Hold,
    HoldStateError,
    Release,
    Reserve,
    reservation_id,
)
from ledger.store import ANY_VERSION, EventStore
from ledger.store.db import asyncpg_dsn, create_engine
from ledger.store.schema import budget_accounts, budget_resolutions, metadata

D = Decimal
SPEC = AccountSpec("key:k1:total", "key", "acme", "k1", None, D("1.00"))


def reserve(n: int, amount: str) -> tuple[list[ev.Event], Reserve]:
    event = ev.BudgetReserved(
        request_id=f"req_{n}",
        attempt_id=f"att_{n}",
        reservation_id=f"res_{n}",
        amount_usd=D(amount),
        accounts=(ev.AccountRef(account_id=SPEC.account_id, kind="key", limit_usd=D("1.00")),),
        endpoint="east",
        model="m",
    )
    hold = Hold(f"res_{n}", f"req_{n}", f"att_{n}", "acme", "k1", "east", "m", D(amount), (), "i")
    return [event], Reserve(hold, (SPEC,))


def release(n: int, amount: str) -> tuple[list[ev.Event], Release]:
    event = ev.BudgetReleased(
        request_id=f"req_{n}",
        attempt_id=f"att_{n}",
        reservation_id=f"res_{n}",
        released_usd=D(amount),
        reason="not_started",
    )
    return [event], Release(f"res_{n}")


async def balance(store: EventStore) -> tuple[Decimal, Decimal]:
    async with store.engine.connect() as conn:
        row = (await conn.execute(sa.select(budget_accounts))).one()
    return row.held_usd, row.settled_usd


async def test_a_reservation_commits_with_its_event(store: EventStore) -> None:
    events, effect = reserve(1, "0.25")
    await store.append("request-req_1", ANY_VERSION, events, effects=[effect])
    assert await balance(store) == (D("0.25"), D(0))
    assert [e.type for e in await store.read_stream("request-req_1")] == ["BudgetReserved"]


async def test_a_denied_reservation_writes_no_event(store: EventStore) -> None:
    events, effect = reserve(1, "0.90")
    await store.append("request-req_1", ANY_VERSION, events, effects=[effect])
    events, effect = reserve(2, "0.20")
    with pytest.raises(BudgetDenied):
        await store.append("request-req_2", ANY_VERSION, events, effects=[effect])
    assert await store.read_stream("request-req_2") == []
    assert await balance(store) == (D("0.90"), D(0))


def test_each_attempt_has_a_reservation_id_of_its_own() -> None:
    # budget_holds keeps no unique key of attempt ids (migration 0020): the gateway derives a
    # hold's id from its attempt's (router.request.budget), so distinct attempts have
    # distinct holds and the primary key refuses a second hold of one attempt.
    attempts = [f"att_{n:026d}" for n in range(10_000)] + ["att_x", "x_", "att_"]
    assert len({reservation_id(a) for a in attempts}) == len(attempts)
    assert reservation_id("att_01abc") == "res_01abc"


async def test_a_second_hold_of_one_attempt_is_refused(store: EventStore) -> None:
    events, effect = reserve(1, "0.25")
    await store.append("request-req_1", ANY_VERSION, events, effects=[effect])
    with pytest.raises((HoldStateError, sa.exc.IntegrityError)):
        await store.append("request-req_1", ANY_VERSION, events, effects=[effect])
    assert len(await store.read_stream("request-req_1")) == 1
    assert await balance(store) == (D("0.25"), D(0))


async def test_resolving_twice_is_refused_and_writes_nothing(store: EventStore) -> None:
    events, effect = reserve(1, "0.30")
    await store.append("request-req_1", ANY_VERSION, events, effects=[effect])
    released, release_effect = release(1, "0.3")
    await store.append("request-req_1", ANY_VERSION, released, effects=[release_effect])
    with pytest.raises(HoldStateError):
        await store.append("request-req_1", ANY_VERSION, released, effects=[release_effect])
    assert len(await store.read_stream("request-req_1")) == 2
    assert await balance(store) == (D(0), D(0))


async def test_concurrent_reservations_never_overspend(store: EventStore) -> None:
    async def attempt(n: int) -> bool:
        events, effect = reserve(n, "0.10")
        try:
            await store.append(f"request-req_{n}", ANY_VERSION, events, effects=[effect])
        except BudgetDenied:
            return False
        return True

    results = await asyncio.gather(*(attempt(n) for n in range(40)))
    assert sum(results) == 10
    assert await balance(store) == (D("1.00"), D(0))


@pytest.mark.postgres
async def test_two_stores_on_one_postgres_never_overspend(postgres_url: str) -> None:
    # Two stores, two engines, two appenders: what two gateway replicas would be.
    engines = [create_engine(postgres_url) for _ in range(2)]
    stores = [EventStore(engine) for engine in engines]

    async def attempt(n: int) -> bool:
        events, effect = reserve(n, "0.10")
        try:
            await stores[n % 2].append(f"request-req_{n}", ANY_VERSION, events, effects=[effect])
        except BudgetDenied:
            return False
        return True

    try:
        results = await asyncio.gather(*(attempt(n) for n in range(40)))
        assert sum(results) == 10
        assert await balance(stores[0]) == (D("1.00"), D(0))
    finally:
        for store, engine in zip(stores, engines, strict=True):
            await store.close()
            await engine.dispose()


@pytest.mark.postgres
async def test_an_optimistic_append_that_lost_the_race_is_decided_again_under_the_lock(
    postgres_url: str,
) -> None:
    # Two stores read the same head and the same balance without a lock, then both try to
    # move the head. A third connection holds the head row until both wait on it, so the
    # race is certain: one write moves the head, the other finds it moved, writes nothing,
    # and is decided again from what the winner committed: its reservation no longer fits.
    engines = [create_engine(postgres_url) for _ in range(2)]
    stores = [EventStore(engine) for engine in engines]
    blocker = await asyncpg.connect(asyncpg_dsn(engines[0]))
    watcher = await asyncpg.connect(asyncpg_dsn(engines[0]))
    try:
        await blocker.execute("BEGIN; SELECT 1 FROM ledger_head WHERE id = 1 FOR UPDATE")
        tries = []
        for n, store in enumerate(stores):
            events, effect = reserve(n, "0.60")
            append = store.append(f"request-req_{n}", ANY_VERSION, events, effects=[effect])
            tries.append(asyncio.create_task(append))
        waiting = 0
        for _ in range(500):
            waiting = await watcher.fetchval(  # not the blocker: its view is a snapshot
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
            if waiting == 2:
                break
            await asyncio.sleep(0.01)
        assert waiting == 2
        await blocker.execute("ROLLBACK")
        results = await asyncio.gather(*tries, return_exceptions=True)
        assert sorted(type(r).__name__ for r in results) == ["BudgetDenied", "list"]
        assert sum(store.stats["lost_races"] for store in stores) == 1
        assert await balance(stores[0]) == (D("0.60"), D(0))
        assert [r.position for r in await stores[0].read_all()] == [1]
        assert (await verify_chain(stores[0])).ok
    finally:
        await blocker.close()
        await watcher.close()
        for store, engine in zip(stores, engines, strict=True):
            await store.close()
            await engine.dispose()


@pytest.mark.postgres
async def test_postgres_itself_refuses_a_balance_over_its_limit(postgres_url: str) -> None:
    engine = create_engine(postgres_url)
    store = EventStore(engine)
    try:
        events, effect = reserve(1, "0.50")
        await store.append("request-req_1", ANY_VERSION, events, effects=[effect])
        with pytest.raises(sa.exc.IntegrityError, match="ck_budget_accounts_within_limit"):
            async with engine.begin() as conn:
                await conn.execute(sa.update(budget_accounts).values(settled_usd=D("0.60")))
        with pytest.raises(sa.exc.IntegrityError):  # a second resolution of one hold
            async with engine.begin() as conn:
                for _ in range(2):
                    await conn.execute(
                        sa.insert(budget_resolutions).values(
                            reservation_id="res_1",
                            kind="released",
                            settled_usd=D(0),
                            released_usd=D("0.5"),
                            resolved_at=sa.func.now(),
                        )
                    )
    finally:
        await store.close()
        await engine.dispose()


def _not_a_month(name: str | None, kind: str, parents: object) -> bool:
    # A month's table of the ledger on PostgreSQL (ledger.store.partitions): made as months come.
    return not (kind == "table" and name is not None and re.fullmatch(r"appends_\d{4}_\d{2}", name))


async def test_schema_module_matches_the_migrations(database_url: str) -> None:
    engine = create_engine(database_url)
    try:
        async with engine.connect() as conn:
            diff = await conn.run_sync(
                lambda sync: compare_metadata(
                    MigrationContext.configure(sync, opts={"include_name": _not_a_month}),
                    metadata,
                )
            )
    finally:
        await engine.dispose()
    assert diff == []
