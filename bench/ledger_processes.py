"""What binds when several processes append to one PostgreSQL ledger: the head's lock or CPU.

    .venv/bin/python bench/ledger_bench.py --processes 1,2,4,8 [--per-process 16] [--shared]
        [--seconds 4] [--database waybill_bench]

For each N, on a fresh database: N processes (as ``waybill serve --workers N`` would run when
each worker commits its own appends, or N replicas on one ledger), each with its own
``EventStore`` and ``--per-process`` appenders. An appender sends a buffered request's trail
as a gateway does: its first four events to a new stream (``NO_STREAM``), then the other
three at the version that left. Every append is durably committed before it returns. With
``--shared`` the processes but the first commit through the first one's appender, as the
workers of ``waybill serve --workers N`` do (``ledger.store.shared_appends``).
While they run, a thread samples ``pg_stat_activity`` every 10 ms: how many of the
appenders' backends wait for a lock (the only lock an append waits for is the head row's,
THE LOCK in ``ledger.store.postgres``), and whether one holds the head (in the write that
moves it, or in a transaction of the locked path). The CPU of the appender processes and of
their PostgreSQL backends, and of the whole machine, is read from ``/proc``.

What it prints per N: events/s, events per transaction (group commit), the share of batches
written without a read and the races lost, the mean number of backends waiting for the head
(``waiting``: seconds of waiting per second), the share of time the head is held (``held``)
and so the commits per second the lock alone would allow (``ceiling``: commits/s over
``held``), the CPU (ms per 1,000 events: the appenders', PostgreSQL's) and the machine's busy
cores, of which ``other`` were not these processes' (other load). The lock binds when
``held`` nears 1 while cores are idle; CPU binds when the machine is busy and ``held`` stays
well below 1. A holder waiting for a core still holds the head, so on a busy machine ``held``
also grows with the CPU's queue: read it beside ``busy``.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import sys
import tempfile
import threading
import time
from multiprocessing.synchronize import Barrier, Event
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.databases import fresh_postgres
from bench.gateway_bench import _BackendCpu, _machine_busy_s
from ledger.store import NO_STREAM, EventStore
from ledger.store.db import create_engine, migrate
from ledger.store.shared_appends import AppendClient, AppendServer
from ledger.support.process import tune_gc
from tests.ledger.factories import succeeded_trail

__all__ = ["bench_processes", "table"]

_FIRST = 4  # the events a request appends before the upstream call (the rest after it)

_SAMPLE = """
    SELECT count(*) FILTER (WHERE wait_event_type = 'Lock'),
           count(*) FILTER (
               WHERE state = 'idle in transaction'
                  OR (state = 'active' AND wait_event_type IS DISTINCT FROM 'Lock'
                      AND query LIKE '%%UPDATE ledger_head%%')
           )
    FROM pg_stat_activity
    WHERE datname = %s AND pid <> pg_backend_pid() AND backend_type = 'client backend'
"""


async def _appender_process(
    index: int,
    url: str,
    appenders: int,
    seconds: float,
    barrier: Barrier,
    socket: str | None,
    serving: Event,
) -> dict[str, Any]:
    tune_gc()
    engine = create_engine(url)
    store = EventStore(engine)
    server: AppendServer | None = None
    client: AppendClient | None = None
    if socket is not None and index == 0:  # as the first worker of `serve --workers N`
        server = AppendServer(store, socket)
        await server.start()
        serving.set()
    elif socket is not None:  # as the other workers
        await asyncio.to_thread(serving.wait, 60)
        client = AppendClient(socket)
        store.forward_to(client)
    trail = succeeded_trail("bench")
    first, rest = trail[:_FIRST], trail[_FIRST:]
    counts = [0] * appenders

    async def request(stream: str) -> int:
        await store.append(stream, NO_STREAM, first)
        await store.append(stream, _FIRST, rest)
        return len(trail)

    await request(f"request-p{index}-warm")  # connected, statements prepared
    await asyncio.to_thread(barrier.wait)
    before, cpu_before = dict(store.stats), time.process_time()
    forwarded = client.forwarded_batches if client is not None else 0
    deadline = time.perf_counter() + seconds

    async def appender(worker: int) -> None:
        i = 0
        while time.perf_counter() < deadline:
            counts[worker] += await request(f"request-p{index}-{worker}-{i}")
            i += 1

    started = time.perf_counter()
    await asyncio.gather(*(appender(w) for w in range(appenders)))
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu_before
    after = store.stats
    if client is not None:
        # Its batches went to the first process, which committed them with its own.
        forwarded = client.forwarded_batches - forwarded
        after = dict(after, batches=after["batches"] - forwarded)
    await asyncio.to_thread(barrier.wait)  # every process is done: nothing more comes
    if client is not None:
        await client.close()
    if server is not None:
        await server.close()
    await store.close()
    await engine.dispose()
    spent = {name: after[name] - before[name] for name in after if name != "queued"}
    return {"events": sum(counts), "wall": wall, "cpu_s": cpu, **spent}


def _child(
    index: int,
    url: str,
    appenders: int,
    seconds: float,
    barrier: Barrier,
    out: Any,
    socket: str | None,
    serving: Event,
) -> None:
    result = asyncio.run(
        _appender_process(index, url, appenders, seconds, barrier, socket, serving)
    )
    out.put(result)


class _HeadSampler:
    """Samples the appenders' backends every 10 ms: waiting for a lock, holding the head."""

    def __init__(self, url: str, database: str) -> None:
        self._url, self._database = url, database
        self.samples = self.waiting = self.held = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _HeadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with psycopg.connect(self._url, autocommit=True) as conn:
            while not self._stop.wait(0.01):
                row = conn.execute(_SAMPLE, (self._database,)).fetchone()
                assert row is not None
                self.samples += 1
                self.waiting += int(row[0])
                self.held += int(row[1]) > 0


def _one(
    processes: int, appenders: int, seconds: float, database: str, shared: bool
) -> dict[str, Any]:
    url = fresh_postgres(database)
    migrate(url)
    spawn = multiprocessing.get_context("spawn")
    barrier = spawn.Barrier(processes + 1)  # at the start, then at the end
    out = spawn.Queue()
    serving = spawn.Event()  # the first process's append server listens
    with tempfile.TemporaryDirectory() as tmp:
        socket = str(Path(tmp) / "appends.sock") if shared else None
        children = [
            spawn.Process(
                target=_child, args=(i, url, appenders, seconds, barrier, out, socket, serving)
            )
            for i in range(processes)
        ]
        for child in children:
            child.start()
        barrier.wait(timeout=120)
        started, busy = time.perf_counter(), _machine_busy_s()
        with _BackendCpu(database) as postgres, _HeadSampler(url, database) as head:
            barrier.wait(timeout=seconds + 60)
        wall = time.perf_counter() - started
        busy = _machine_busy_s() - busy
        results = []
        for _ in children:
            try:
                results.append(out.get(timeout=60))
            except queue.Empty:
                raise SystemExit("an appender process did not report") from None
        for child in children:
            child.join()
    events = sum(r["events"] for r in results)
    batches = sum(r["batches"] for r in results)
    run = max(r["wall"] for r in results)
    held = head.held / max(head.samples, 1)
    return {
        "processes": processes,
        "shared": shared,
        "appenders": processes * appenders,
        "events_per_s": round(events / run),
        "events_per_tx": round(events / max(batches, 1), 1),
        "commits_per_s": round(batches / run),
        "unread_share": round(sum(r["unread_batches"] for r in results) / max(batches, 1), 2),
        "lost_races": sum(r["lost_races"] for r in results),
        "waiting": round(head.waiting / max(head.samples, 1), 2),
        "held": round(held, 2),
        "ceiling_commits_per_s": round(batches / run / held) if held else None,
        "appender_cpu_ms_per_1k": round(sum(r["cpu_s"] for r in results) * 1e6 / events, 1),
        "postgres_cpu_ms_per_1k": round(postgres.seconds * 1e6 / events, 1),
        "busy_cores": round(busy / wall, 2),
        # What the machine spent beyond these appenders and their backends: other users' work.
        "other_cores": round(
            max(0.0, busy - sum(r["cpu_s"] for r in results) - postgres.seconds) / wall, 2
        ),
        "cores": os.cpu_count(),
    }


def bench_processes(
    counts: list[int], appenders: int, seconds: float, database: str, *, shared: bool = False
) -> list[dict[str, Any]]:
    """One row per number of appender processes, each on a fresh ledger; ``shared``: the
    processes but the first commit through the first one's appender, as the workers of
    ``waybill serve --workers N`` do (``ledger.store.shared_appends``)."""
    return [_one(n, appenders, seconds, database, shared) for n in counts]


def table(rows: list[dict[str, Any]]) -> str:
    columns = (
        ("processes", "N"),
        ("shared", "shared"),
        ("events_per_s", "events/s"),
        ("events_per_tx", "ev/tx"),
        ("commits_per_s", "commits/s"),
        ("unread_share", "unread"),
        ("lost_races", "lost"),
        ("waiting", "waiting"),
        ("held", "held"),
        ("ceiling_commits_per_s", "ceiling"),
        ("appender_cpu_ms_per_1k", "app ms/1k"),
        ("postgres_cpu_ms_per_1k", "pg ms/1k"),
        ("busy_cores", "busy"),
        ("other_cores", "other"),
    )
    lines = ["".join(f"{title:>11}" for _, title in columns)]
    for row in rows:
        lines.append("".join(f"{row[key]!s:>11}" for key, _ in columns))
    return "\n".join(lines)
