"""Ledger size benchmark: bytes on disk per request, every table and index included.

    .venv/bin/python bench/ledger_size_bench.py [--requests 10000] [--concurrency 16]
        [--stream | --mix SHARE [--chunks 50] [--stream-concurrency 100]]
        [--after-vacuum] [--experiment SQL] [--database waybill_size_bench] [--json]

A fresh PostgreSQL database, migrated; a fake provider and ``waybill serve`` (its read-model
follower included) as ``gateway_bench.py`` runs them; N chat completions through the gateway
by the load generator. Once the ledger holds N ``RequestCompleted`` and every read model has
caught up, the gateway stops and the size of every table of the schema is read
(``pg_total_relation_size``: heap, TOAST and indexes), as the requests left it: no VACUUM,
as on a server whose autovacuum has not passed yet. Prints one row per table (heap, TOAST,
indexes, total, bytes per request) and the total per request, the empty migrated database's
size subtracted. With ``--mix SHARE`` that share of the N requests are long streams (the bench
mock's, ``bench/stream_mock.py``: ``--chunks`` chunks 20 ms apart, through a model group of
their own, ``--stream-concurrency`` at a time) sent while the rest, short buffered requests,
go to the fake provider at ``--concurrency``. With ``--after-vacuum``, N requests, a plain
``VACUUM`` (what autovacuum does on a server that runs it), and N more: the figures are the
second N's, the growth from the vacuumed tables. A benchmark, not a test: figures vary with the
PostgreSQL version and the request; compare within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.databases import fresh_postgres
from bench.gateway_bench import (
    _Child,
    _create_key,
    _load,
    _outcomes,
    _start_fake,
    _start_gateway,
)
from bench.streams_bench import _start_mock
from ledger.store.db import migrate
from tests.gateway.harness import Route, mappings_yaml

_SIZES = """
    SELECT c.relname,
           pg_relation_size(c.oid) AS heap,
           coalesce(pg_total_relation_size(nullif(c.reltoastrelid, 0)), 0) AS toast,
           pg_indexes_size(c.oid) AS indexes,
           pg_total_relation_size(c.oid) AS total,
           c.reltuples
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p', 'm')
    ORDER BY pg_total_relation_size(c.oid) DESC, c.relname
"""

# A partitioned table's sizes are its partitions' (it holds nothing itself).
_PARTITIONS = """
    SELECT p.relname, c.relname
    FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent
"""


def _sizes(database_url: str) -> dict[str, dict[str, int]]:
    """Each table's heap, TOAST, index and total bytes, a partitioned table's partitions
    folded into it (its parent; they are not listed on their own)."""
    with psycopg.connect(database_url) as conn:
        conn.execute("CHECKPOINT")  # the files as a restart would find them
        parent_of = {str(child): str(parent) for parent, child in conn.execute(_PARTITIONS)}
        tables: dict[str, dict[str, int]] = {}
        for name, heap, toast, indexes, total, _ in conn.execute(_SIZES):
            table = parent_of.get(str(name), str(name))
            row = tables.setdefault(table, {"heap": 0, "toast": 0, "indexes": 0, "total": 0})
            for key, value in (("heap", heap), ("toast", toast), ("indexes", indexes)):
                row[key] += int(value)
            row["total"] += int(total)
    return tables


def _rewritten(database_url: str) -> dict[str, int]:
    """Rows of the read models written again after their first write (row versions made by
    an UPDATE), and rows the follower kept open while their request was in flight (inserts
    into the open tables; the follower's backends have ended, so their counts are in)."""
    with psycopg.connect(database_url) as conn:
        rows = conn.execute(
            "SELECT relname, n_tup_upd FROM pg_stat_user_tables "
            "WHERE relname IN ('request_views', 'spend_attempts') "
            "UNION ALL SELECT relname || ' (opened)', n_tup_ins FROM pg_stat_user_tables "
            "WHERE relname IN ('open_request_views', 'open_spend_attempts')"
        ).fetchall()
    return {str(name): int(count) for name, count in rows}


async def _caught_up(database_url: str, within_s: float = 120.0) -> int:
    """Wait until every read model's checkpoint is at the head; the head."""
    deadline = time.monotonic() + within_s
    with psycopg.connect(database_url, autocommit=True) as conn:
        while True:
            row = conn.execute(
                "SELECT h.position, min(c.position) FROM ledger_head h, projection_checkpoints c "
                "WHERE c.name IN ('keys', 'requests', 'spend') GROUP BY h.position"
            ).fetchone()
            if row is not None and row[1] is not None and row[1] >= row[0]:
                return int(row[0])
            if time.monotonic() > deadline:
                raise SystemExit(f"the read models did not catch up: {row}")
            await asyncio.sleep(0.2)


def _long_streams(args: argparse.Namespace) -> int:
    """How many of the N requests are long streams (``--mix``)."""
    return round(args.requests * args.mix) if args.mix else 0


def _send(args: argparse.Namespace, gateway_url: str, api_key: str) -> dict[str, Any]:
    """The N requests, by one load generator, or with ``--mix`` by two at once (the long
    streams and the short buffered requests); what they say together."""
    # Sent until N: an hour is only the bound.
    bound = argparse.Namespace(seconds=3600.0, warmup=0.0)
    url = f"{gateway_url}/v1"
    long = _long_streams(args)
    if not long:
        return _load(
            url, "chat", api_key, args.stream, args.concurrency, bound, requests=args.requests
        )
    # Each load generator stops after its own count (0 would mean no limit: none is run).
    kinds = [(long, "long", True, args.stream_concurrency)]
    kinds.append((args.requests - long, "chat", False, args.concurrency))
    with ThreadPoolExecutor(2) as pool:
        running = [
            pool.submit(_load, url, model, api_key, stream, c, bound, requests=n)
            for n, model, stream, c in kinds
            if n > 0
        ]
        loads = [load.result() for load in running]
    return {
        "sent": sum(int(load["sent"]) for load in loads),
        "ok": all(bool(load["ok"]) for load in loads),
    }


def _vacuum(database_url: str) -> None:
    """A plain VACUUM of every table, as autovacuum would run it (no file shrinks)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("VACUUM")


def _bench(args: argparse.Namespace) -> dict[str, Any]:
    database_url = fresh_postgres(args.database)
    migrate(database_url)
    if args.experiment:
        # A schema lever tried before it is made a migration (bench/README.md, "Ledger size").
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(args.experiment)
    empty = _sizes(database_url)
    api_key = asyncio.run(_create_key(database_url))
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        children: list[_Child] = []
        try:
            fake, fake_url = _start_fake(tmp)
            children.append(fake)
            more: dict[str, str] = {}
            if args.mix:
                mock, more["mock"] = _start_mock(tmp, args.chunks, 20.0)
                children.append(mock)
            groups = {"long": "    mappings:\n" + mappings_yaml([Route("mock")])} if more else None
            gateway, gateway_url = _start_gateway(
                tmp, database_url, fake_url, more_upstreams=more, groups=groups
            )
            children.append(gateway)
            started = time.perf_counter()
            load = _send(args, gateway_url, api_key)
            if args.after_vacuum:
                # What autovacuum leaves a server (these run without it): the dead row
                # versions and deleted rows of the first N reclaimed for reuse, then N more.
                asyncio.run(_outcomes(database_url, (load["sent"], 0)))
                asyncio.run(_caught_up(database_url))
                _vacuum(database_url)
                empty = _sizes(database_url)
                second = _send(args, gateway_url, api_key)
                load = {
                    "sent": int(load["sent"]) + int(second["sent"]),
                    "ok": bool(load["ok"]) and bool(second["ok"]),
                    "measured": int(second["sent"]),
                }
            elapsed = time.perf_counter() - started
            completed, failed = asyncio.run(_outcomes(database_url, (load["sent"], 0)))
            head = asyncio.run(_caught_up(database_url))
        finally:
            for child in reversed(children):
                child.stop()
    full = _sizes(database_url)
    rewritten = _rewritten(database_url)
    ledger = "appends" if "appends" in full else "events"  # the table of the events
    sent = int(load["sent"])
    requests = int(load.get("measured", sent))  # with --after-vacuum, the second N
    total = sum(t["total"] for t in full.values())

    def grown(table: str) -> int:
        """A table's bytes; with --after-vacuum, what it grew by over the second N."""
        before = empty.get(table, {}).get("total", 0) if args.after_vacuum else 0
        return full[table]["total"] - before

    empty_total = sum(t["total"] for t in empty.values())
    return {
        "requests": requests,
        "stream": args.stream,
        "long_streams": _long_streams(args),
        "chunks": args.chunks,
        "completed": completed,
        "failed": failed,
        "after_vacuum": args.after_vacuum,
        "valid": bool(load["ok"]) and completed == sent and failed == 0,
        "events": head,
        "head": head,
        "load_s": round(elapsed, 1),
        "tables": {
            name: {**sizes, "per_request": round(grown(name) / max(requests, 1), 1)}
            for name, sizes in full.items()
        },
        "rewritten": rewritten,
        "total_bytes": total,
        "empty_bytes": empty_total,
        "bytes_per_request": round((total - empty_total) / max(requests, 1), 1),
        "bytes_per_event": round(full[ledger]["total"] / max(head, 1), 1),
    }


def _table(result: dict[str, Any]) -> str:
    header = f"{'table':<26}{'heap':>12}{'toast':>12}{'indexes':>12}{'total':>12}{'B/req':>9}"
    lines = [header, "-" * len(header)]
    for name, t in result["tables"].items():
        lines.append(
            f"{name:<26}{t['heap']:>12,}{t['toast']:>12,}{t['indexes']:>12,}"
            f"{t['total']:>12,}{t['per_request']:>9,.0f}"
        )
    lines.append("-" * len(header))
    long = result["long_streams"]
    kind = "streamed" if result["stream"] else "buffered"
    if long:
        kind = f"mixed ({long:,} long streams of {result['chunks']} chunks, the rest buffered)"
    if result["after_vacuum"]:
        kind += " after as many and a VACUUM (what they grew the tables by)"
    lines.append(
        f"{result['requests']:,} {kind} requests, "
        f"{result['events']:,} events; all tables {result['total_bytes']:,} bytes "
        f"({'vacuumed' if result['after_vacuum'] else 'empty'}: {result['empty_bytes']:,}); "
        f"**{result['bytes_per_request']:,.0f} bytes per request**, "
        f"the events' table {result['bytes_per_event']:,.0f} bytes per event"
    )
    rewritten = ", ".join(f"{t} {n:,}" for t, n in sorted(result["rewritten"].items()))
    lines.append(
        f"rows written again, and rows kept open, by the follower (the whole run): {rewritten}"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=16)
    kinds = parser.add_mutually_exclusive_group()
    kinds.add_argument("--stream", action="store_true", help="streamed requests")
    kinds.add_argument(
        "--mix", type=float, default=0.0, help="the share of long streams among the requests"
    )
    parser.add_argument("--chunks", type=int, default=50, help="content chunks of a long stream")
    parser.add_argument("--stream-concurrency", type=int, default=100)
    parser.add_argument(
        "--experiment", help="SQL run on the migrated database before the load (a lever tried)"
    )
    parser.add_argument(
        "--after-vacuum",
        action="store_true",
        help="N requests, VACUUM, N more: the bytes per request of the second N",
    )
    parser.add_argument("--database", default="waybill_size_bench", help="dropped and recreated")
    parser.add_argument("--json", action="store_true", help="JSON on stdout, the table on stderr")
    args = parser.parse_args()
    result = _bench(args)
    report = sys.stderr if args.json else sys.stdout
    print(_table(result), file=report)
    if args.json:
        print(json.dumps(result, indent=2))
    if not result["valid"]:
        print("INVALID: a response was not a complete 200, or the ledger missed one", file=report)
        sys.exit(1)


if __name__ == "__main__":
    main()
