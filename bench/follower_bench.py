"""The read models' CPU per request: replay them over an existing ledger, as the follower folds.

    .venv/bin/python bench/follower_bench.py --database NAME [--rounds 5] [--page-size 2000]
        [--source CHECKOUT]

Rebuilds every read model of the PostgreSQL database NAME (a ledger a gateway wrote, e.g.
``gateway_bench.py --database NAME``'s; its read models are cleared and rebuilt) with
``ProjectionRunner.replay()`` in this process, on uvloop as the follower runs, ``--rounds``
times, and prints per round and as the median the CPU this process and the database's
PostgreSQL backends spent per request (``RequestCompleted``) of the ledger. A replay reads,
decodes, folds and writes what the follower of ``waybill serve`` does, in pages of
``--page-size`` events (the follower's pages hold what 0.2 s of load appended: ~1,400 events
at 1,000 buffered requests/s). ``--source``: the checkout whose code replays (this one by
default). The same ledger replayed by two versions of the code gives their difference
without the noise of a gateway under load; the follower's own figures under
load are ``gateway_bench.py``'s (its CPU is in the gateway's). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _backends_cpu_s(database: str) -> dict[str, float]:
    """CPU seconds so far of each PostgreSQL backend serving ``database`` (its title names it)."""
    needle = f" {database} ".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "cmdline").read_bytes():
                continue
            stat = (entry / "stat").read_text()
        except OSError:  # the process ended while we looked
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if stat.startswith(f"{entry.name} (postgres)"):
            found[entry.name] = (int(fields[11]) + int(fields[12])) / _CLK_TCK
    return found


async def _main(args: argparse.Namespace) -> None:
    # The code of --source, imported only once the path says where it is.
    from sqlalchemy import text

    from ledger.store import EventStore
    from ledger.store.db import create_engine
    from ledger.support.process import tune_gc
    from ledger.views import all_projections
    from ledger.views.projection import ProjectionRunner

    tune_gc()
    engine = create_engine(f"postgresql://{args.host}/{args.database}")
    store = EventStore(engine)
    runner = ProjectionRunner(store, all_projections(), page_size=args.page_size)
    try:
        async with engine.connect() as conn:
            requests = (
                await conn.execute(text("SELECT count(*) FROM appends WHERE types LIKE '%N%'"))
            ).scalar_one()
        if not requests:
            raise SystemExit(f"{args.database} holds no completed request")
        mine, theirs = [], []
        for round_ in range(1, args.rounds + 1):
            before = _backends_cpu_s(args.database)
            started = time.process_time()
            await runner.replay()
            spent = time.process_time() - started
            after = _backends_cpu_s(args.database)
            postgres = sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())
            mine.append(spent * 1e6 / requests)
            theirs.append(postgres * 1e6 / requests)
            print(
                f"round {round_}: runner {mine[-1]:.1f} µs, PostgreSQL {theirs[-1]:.1f} µs "
                "per request",
                flush=True,
            )
        print(
            f"median of {args.rounds} replays of {requests:,} requests "
            f"(pages of {args.page_size} events): runner {statistics.median(mine):.1f} µs, "
            f"PostgreSQL {statistics.median(theirs):.1f} µs per request"
        )
    finally:
        await store.close()
        await engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--database", required=True, help="a ledger's PostgreSQL database")
    parser.add_argument("--host", default="postgres@127.0.0.1:5432")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--page-size", type=int, default=2000)
    parser.add_argument("--source", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args()
    sys.path.insert(0, str(args.source.resolve()))
    from ledger.support.process import run

    run(_main(args))


if __name__ == "__main__":
    main()
