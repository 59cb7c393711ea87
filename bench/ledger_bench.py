"""Ledger benchmark: append throughput with group commit, replay throughput, tail lag.

    .venv/bin/python bench/ledger_bench.py [--backend postgres|sqlite|both] [--seconds 5]
    .venv/bin/python bench/ledger_bench.py --processes 1,2,4,8 [--per-process 16] [--shared]
        [--seconds 4] [--database waybill_bench]

For each backend, on a fresh database: events/s appended by 1, 10 and 100 concurrent
appenders (each append one realistic request-trail event, durably committed), with the
mean events per transaction; then events/s replayed through the request-view projection
(read + decode + fold + write); and the live projection's lag sampled while 100 appenders
run. With ``--processes``, instead, what binds when several processes append to one
PostgreSQL ledger (``bench/ledger_processes.py``). A benchmark, not a test: figures vary
with the machine; compare within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.databases import fresh_postgres
from ledger.store import ANY_VERSION, EventStore
from ledger.store.db import create_engine, migrate
from ledger.support.process import tune_gc
from ledger.views import all_projections
from ledger.views.projection import ProjectionRunner
from tests.ledger.factories import succeeded_trail


def _fresh_database(backend: str, tmp: Path, database: str = "waybill_bench") -> str:
    url = f"sqlite:///{tmp / 'bench.db'}" if backend == "sqlite" else fresh_postgres(database)
    migrate(url)
    return url


async def _append_load(
    store: EventStore, concurrency: int, seconds: float, per_append: int = 1
) -> tuple[int, float]:
    trail = succeeded_trail("bench")
    deadline = time.perf_counter() + seconds
    counts = [0] * concurrency

    async def worker(index: int) -> None:
        i = 0
        while time.perf_counter() < deadline:
            batch = [trail[(i + k) % len(trail)] for k in range(per_append)]
            await store.append(f"request-bench-{index}-{i // len(trail)}", ANY_VERSION, batch)
            counts[index] += per_append
            i += per_append

    started = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return sum(counts), time.perf_counter() - started


async def bench_backend(
    backend: str, seconds: float, database: str = "waybill_bench"
) -> dict[str, object]:
    results: dict[str, object] = {"backend": backend}
    with tempfile.TemporaryDirectory() as tmp:
        url = _fresh_database(backend, Path(tmp), database)
        engine = create_engine(url)
        store = EventStore(engine)
        for concurrency, per_append in ((1, 1), (10, 1), (100, 1), (100, 5), (100, 10)):
            before = store.stats["batches"]
            events, elapsed = await _append_load(store, concurrency, seconds, per_append)
            batches = store.stats["batches"] - before
            label = f"append_c{concurrency}x{per_append}"
            results[f"{label}_events_per_s"] = round(events / elapsed)
            results[f"{label}_events_per_tx"] = round(events / max(batches, 1), 1)

        # Tail lag under load: a live projection runner beside 100 appenders.
        runner = ProjectionRunner(store, all_projections(), poll_interval_s=0.05)
        await runner.catch_up()
        stop = asyncio.Event()
        live = asyncio.create_task(runner.run(stop))
        lags: list[int] = []

        async def sample() -> None:
            while not stop.is_set():
                lags.append(max((await runner.lag()).values()))
                await asyncio.sleep(0.1)

        sampler = asyncio.create_task(sample())
        events, elapsed = await _append_load(store, 100, seconds)
        stop.set()
        await asyncio.gather(live, sampler)
        results["tail_load_events_per_s"] = round(events / elapsed)
        results["tail_lag_p50_events"] = int(statistics.median(lags)) if lags else 0
        results["tail_lag_max_events"] = max(lags) if lags else 0

        head = (await store.head())[0]
        started = time.perf_counter()
        count = 0
        async for _ in store.iterate():
            count += 1
        results["read_events_per_s"] = round(count / (time.perf_counter() - started))
        requests = runner.get("requests")
        started = time.perf_counter()
        replayed = await runner.replay(requests)
        results["replay_requests_events_per_s"] = round(replayed / (time.perf_counter() - started))
        results["ledger_events"] = head
        await store.close()
        await engine.dispose()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["postgres", "sqlite", "both"], default="both")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--database", default="waybill_bench", help="dropped and recreated")
    parser.add_argument(
        "--processes", help="comma-separated numbers of appender processes (PostgreSQL only)"
    )
    parser.add_argument("--per-process", type=int, default=16, help="appenders per process")
    parser.add_argument(
        "--shared",
        action="store_true",
        help="the processes commit through the first one's appender, as --workers N does",
    )
    args = parser.parse_args()
    tune_gc()  # as every Waybill process runs
    if args.processes:
        from bench.ledger_processes import bench_processes, table

        counts = [int(n) for n in args.processes.split(",")]
        rows = bench_processes(
            counts, args.per_process, args.seconds, args.database, shared=args.shared
        )
        print(table(rows))
        return
    backends = ["postgres", "sqlite"] if args.backend == "both" else [args.backend]
    for backend in backends:
        results = asyncio.run(bench_backend(backend, args.seconds, args.database))
        width = max(len(k) for k in results)
        for key, value in results.items():
            print(f"{key:<{width}}  {value}")
        print()


if __name__ == "__main__":
    main()
