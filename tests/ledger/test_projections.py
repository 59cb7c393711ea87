"""Projections: checkpointed with their writes, idempotent, live-tailing, replayable."""

from __future__ import annotations

import asyncio
from decimal import Decimal
from typing import Any

from sqlalchemy import select

from ledger import events as ev
from ledger.store import NO_STREAM, EventStore
from ledger.store.db import create_engine
from ledger.store.schema import (
    all_request_views,
    api_keys,
    open_request_views,
    open_spend_attempts,
    request_views,
    spend_attempts,
)
from ledger.store.tail import Wakeup
from ledger.views import all_projections
from ledger.views.follow import vacuum_open_tables
from ledger.views.projection import ProjectionRunner, SqlAlchemyWriter
from ledger.views.queries import find_request_view
from ledger.views.requests import RequestViewProjection
from ledger.views.spend import SpendProjection
from tests.helpers import eventually
from tests.ledger.factories import key_created, succeeded_trail, unknown_then_failed_trail


async def _snapshot(store: EventStore) -> dict[str, list[dict[str, Any]]]:
    async with store.engine.connect() as conn:
        keys = (await conn.execute(select(api_keys).order_by(api_keys.c.key_id))).all()
        views = (
            await conn.execute(select(all_request_views).order_by(all_request_views.c.request_id))
        ).all()
    return {"keys": [dict(r._mapping) for r in keys], "requests": [dict(r._mapping) for r in views]}


async def _append_mixed_history(store: EventStore, n: int) -> None:
    for i in range(n):
        trail = succeeded_trail(f"r{i}") if i % 3 else unknown_then_failed_trail(f"r{i}")
        # Requests interleave in the log, as they do under load.
        half = len(trail) // 2
        await store.append(f"request-r{i}", NO_STREAM, trail[:half])
        if i % 4 == 0:
            await store.append(f"key-k{i}", NO_STREAM, [key_created(f"k{i}")])
        await store.append(f"request-r{i}", half, trail[half:])
    await store.append("key-k0", 1, [ev.KeyRevoked(key_id="k0", revoked_by="admin")])


async def _caught_up(runner: ProjectionRunner) -> bool:
    return not any((await runner.lag()).values())


async def test_request_view_folds_a_request_trail(store: EventStore) -> None:
    await store.append("request-ok", NO_STREAM, succeeded_trail("ok", cost="0.0012"))
    await store.append("request-bad", NO_STREAM, unknown_then_failed_trail("bad"))
    runner = ProjectionRunner(store, all_projections())
    await runner.catch_up()
    rows = {r["request_id"]: r for r in (await _snapshot(store))["requests"]}
    ok, bad = rows["ok"], rows["bad"]
    assert ok["status"] == "succeeded" and ok["endpoint"] == "east" and ok["attempts"] == 1
    assert ok["reserved_usd"] == Decimal("0.0030") and ok["settled_usd"] == Decimal("0.0012")
    assert ok["held_unknown_usd"] == 0
    assert bad["status"] == "failed" and bad["error_code"] == "upstream_unavailable"
    assert bad["held_unknown_usd"] == Decimal("0.0050") and bad["settled_usd"] == 0


async def test_checkpoint_moves_with_the_read_model_and_lag_is_observable(
    store: EventStore,
) -> None:
    runner = ProjectionRunner(store, all_projections(), page_size=5)
    await store.append("request-r1", NO_STREAM, succeeded_trail("r1"))
    assert await runner.lag() == {"keys": 7, "requests": 7, "spend": 7}
    requests = runner.get("requests")
    assert await runner.step(requests) == 5
    assert (await runner.lag())["requests"] == 2
    assert await runner.catch_up(requests) == 2
    assert await runner.lag() == {"keys": 7, "requests": 0, "spend": 7}


async def test_reapplying_a_page_changes_nothing(store: EventStore) -> None:
    await _append_mixed_history(store, 6)
    runner = ProjectionRunner(store, all_projections())
    await runner.catch_up()
    before = await _snapshot(store)
    page = await store.read_all()
    async with store.engine.begin() as conn:
        for projection in runner.projections.values():
            wanted = projection.event_types
            batch = [e for e in page if wanted is None or e.type in wanted]
            await projection.apply(SqlAlchemyWriter(conn), batch)
    assert await _snapshot(store) == before


async def test_replay_rebuilds_exactly_what_the_live_runner_built(store: EventStore) -> None:
    runner = ProjectionRunner(store, all_projections(), page_size=7, poll_interval_s=0.05)
    stop = asyncio.Event()
    live = asyncio.create_task(runner.run(stop))
    await _append_mixed_history(store, 30)
    await eventually(lambda: _caught_up(runner), within_s=10)
    stop.set()
    await live
    live_built = await _snapshot(store)
    assert len(live_built["requests"]) == 30 and len(live_built["keys"]) == 8

    progress: list[tuple[int, int]] = []
    for projection in runner.projections.values():
        await runner.replay(projection, progress=lambda done, total: progress.append((done, total)))
    assert await _snapshot(store) == live_built
    assert progress and progress[-1][0] == progress[-1][1]


async def test_two_runners_never_apply_the_same_page_twice(database_url: str) -> None:
    stores = [EventStore(create_engine(database_url)) for _ in range(2)]
    await _append_mixed_history(stores[0], 12)
    runners = [ProjectionRunner(s, [RequestViewProjection()], page_size=3) for s in stores]
    await asyncio.gather(*(r.catch_up(r.get("requests")) for r in runners))
    single = EventStore(create_engine(database_url))
    fresh = ProjectionRunner(single, [RequestViewProjection()])
    built = await _snapshot(single)
    await fresh.replay(fresh.get("requests"))
    assert await _snapshot(single) == built
    for s in [*stores, single]:
        await s.close()
        await s.engine.dispose()


async def test_runner_wakes_on_another_process_append(database_url: str) -> None:
    # The writer is a separate store and engine: on PostgreSQL the wake-up is the NOTIFY
    # sent by its append transaction; on SQLite it is the poll.
    reader_store = EventStore(create_engine(database_url))
    writer = EventStore(create_engine(database_url))
    postgres = reader_store.engine.dialect.name == "postgresql"
    wakeup = Wakeup(reader_store, poll_interval_s=30 if postgres else 0.05)
    runner = ProjectionRunner(reader_store, all_projections(), poll_interval_s=30)
    stop = asyncio.Event()
    live = asyncio.create_task(runner.run(stop, wakeup))
    await asyncio.sleep(0.2)  # let the listener connect
    await writer.append("request-r1", NO_STREAM, succeeded_trail("r1"))
    await eventually(lambda: _caught_up(runner))
    if postgres:
        assert wakeup.notifications >= 1
    stop.set()
    await live
    for s in (reader_store, writer):
        await s.close()
        await s.engine.dispose()


class _CountingWriter(SqlAlchemyWriter):
    """Counts the rows each table is written (upserted) per key."""

    def __init__(self, conn: Any, keys: dict[str, str]) -> None:
        super().__init__(conn)
        self.keys = keys
        self.writes: dict[tuple[str, str], int] = {}

    async def upsert(self, table: Any, key: str, rows: Any) -> None:
        for row in rows:
            at = (table.name, str(row[self.keys[table.name]]))
            self.writes[at] = self.writes.get(at, 0) + 1
        await super().upsert(table, key, rows)


async def _table_ids(store: EventStore, table: Any, key: str) -> list[str]:
    async with store.engine.connect() as conn:
        return [r[0] for r in await conn.execute(select(table.c[key]))]


async def test_a_request_in_flight_is_shown_in_flight_and_written_once_at_its_end(
    store: EventStore,
) -> None:
    trail = succeeded_trail("fly")
    await store.append("request-fly", NO_STREAM, trail[:4])  # received .. attempt started
    projections = [RequestViewProjection(), SpendProjection()]
    keys = {
        "request_views": "request_id",
        "open_request_views": "request_id",
        "spend_attempts": "reservation_id",
        "open_spend_attempts": "reservation_id",
        "unknown_settlements": "settlement_id",
    }
    writes: dict[tuple[str, str], int] = {}

    async def apply_new(after: int) -> int:
        page = await store.read_all(after=after)
        async with store.engine.begin() as conn:
            writer = _CountingWriter(conn, keys)
            for projection in projections:
                wanted = projection.event_types
                batch = [e for e in page if wanted is None or e.type in wanted]
                await projection.apply(writer, batch)
        for at, count in writer.writes.items():
            writes[at] = writes.get(at, 0) + count
        return page[-1].position

    head = await apply_new(0)
    # In flight: shown as in progress, with its hold held, from the open rows alone.
    view = await find_request_view(store.engine, "fly")
    assert view is not None and view["status"] == "in_progress" and view["endpoint"] == "east"
    assert await _table_ids(store, request_views, "request_id") == []
    assert await _table_ids(store, open_request_views, "request_id") == ["fly"]
    assert await _table_ids(store, spend_attempts, "reservation_id") == []
    assert await _table_ids(store, open_spend_attempts, "reservation_id") == ["fly-a1-r"]

    await store.append("request-fly", 4, trail[4:])
    await apply_new(head)
    view = await find_request_view(store.engine, "fly")
    assert view is not None and view["status"] == "succeeded"
    assert await _table_ids(store, open_request_views, "request_id") == []
    assert await _table_ids(store, open_spend_attempts, "reservation_id") == []
    # The indexed tables were written once each, at the end.
    assert writes[("request_views", "fly")] == 1
    assert writes[("spend_attempts", "fly-a1-r")] == 1
    async with store.engine.connect() as conn:
        [state] = (await conn.execute(select(spend_attempts.c.state))).scalars()
    assert state == "settled"


async def test_the_follower_vacuums_the_open_tables_on_postgresql(store: EventStore) -> None:
    stop = asyncio.Event()
    vacuuming = asyncio.create_task(vacuum_open_tables(store, stop, every_s=0.05))
    if store.engine.dialect.name != "postgresql":
        await vacuuming  # SQLite reuses freed pages itself: nothing to do
        return

    async def vacuumed() -> bool:
        async with store.engine.connect() as conn:
            # -1 until the table's first VACUUM (or ANALYZE), which counts its live rows.
            counts = await conn.exec_driver_sql(
                "SELECT relname, reltuples FROM pg_class "
                "WHERE relname IN ('open_request_views', 'open_spend_attempts')"
            )
            return all(row.reltuples >= 0 for row in counts)

    try:
        await eventually(vacuumed, within_s=30)
    finally:
        stop.set()
        await vacuuming
