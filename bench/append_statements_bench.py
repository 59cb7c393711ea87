"""PostgreSQL's CPU for the appender's own statements: a buffered request's two appends.

    .venv/bin/python bench/append_statements_bench.py --database NAME [--pairs 1500]
        [--concurrency 4] [--warmup 600]

Drops and migrates the PostgreSQL database NAME, then appends, ``--concurrency`` at a time,
pairs like a buffered request's: a reservation with its event on a new stream (the hold, its
open state, its account), then its settlement (the resolution, the account, the open state
deleted). Prints the PostgreSQL CPU per pair of the database's backends (``perf stat -e
task-clock`` when ``perf`` runs here, else /proc ticks), after ``--warmup`` pairs that connect,
prepare and fill. No HTTP, no read models: only the appender's statements (a pair's appends
are nearly all decided without a read: ``_Known``). Small concurrencies give small batches,
as a gateway's: each statement's fixed cost counts most there. Run it with the checkout to
measure as ``PYTHONPATH`` and alternate two checkouts. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg

from ledger.store import NO_STREAM, EventStore
from ledger.store.db import create_engine, migrate
from tests.ledger.test_append_known import settled
from tests.ledger.test_books import reserve

_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
_CLK_TCK = os.sysconf("SC_CLK_TCK")


async def _pairs(store: EventStore, first: int, count: int, concurrency: int) -> None:
    turns = asyncio.Semaphore(concurrency)

    async def pair(n: int) -> None:
        async with turns:
            events, reservation = reserve(n, "0.000001")
            await store.append(f"request-req_{n}", NO_STREAM, events, effects=[reservation])
            events, settlement = settled(n, "0.000001", "0.000001")
            await store.append(f"request-req_{n}", 1, events, effects=[settlement])

    await asyncio.gather(*(pair(n) for n in range(first, first + count)))


def _backends(database: str) -> list[int]:
    with psycopg.connect(_ADMIN, autocommit=True) as conn:
        query = "SELECT pid FROM pg_stat_activity WHERE datname = %s"
        return [int(pid) for (pid,) in conn.execute(query, (database,))]


def _ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total


def _perf(pids: list[int]) -> subprocess.Popen[str] | None:
    if not shutil.which("perf"):
        return None
    command = ["perf", "stat", "-x,", "-e", "task-clock", "-p", ",".join(map(str, pids))]
    return subprocess.Popen(command, stderr=subprocess.PIPE, text=True)


async def _main(args: argparse.Namespace) -> None:
    with psycopg.connect(_ADMIN, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {args.database} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {args.database}")
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{args.database}"
    migrate(url)
    engine = create_engine(url)
    store = EventStore(engine)
    await _pairs(store, 0, args.warmup, args.concurrency)
    pids = _backends(args.database)
    perf = _perf(pids)
    await asyncio.sleep(0.3)  # perf attached
    ticks = _ticks(pids)
    started = time.perf_counter()
    await _pairs(store, args.warmup, args.pairs, args.concurrency)
    elapsed = time.perf_counter() - started
    ticks = _ticks(pids) - ticks
    cpu_ms = ticks * 1000 / _CLK_TCK
    if perf is not None:
        perf.send_signal(signal.SIGINT)
        lines = perf.communicate()[1].splitlines()
        cpu_ms = float(next(line for line in lines if "task-clock" in line).split(",")[0])
    print(
        f"{args.database}: {args.pairs} pairs at c{args.concurrency}: PostgreSQL CPU "
        f"{cpu_ms * 1000 / args.pairs:.1f} µs a pair, {args.pairs / elapsed:.0f} pairs/s, "
        f"{store.stats}"
    )
    await store.close()
    await engine.dispose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--database", required=True)
    parser.add_argument("--pairs", type=int, default=1500)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=600)
    asyncio.run(_main(parser.parse_args()))
