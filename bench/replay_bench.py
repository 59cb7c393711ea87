"""Replay benchmark: rebuild every read model from a ledger of 1,000,000 events.

    .venv/bin/python bench/replay_bench.py [--events 1000000] [--backend postgres|sqlite]
                                           [--keep] [--json]

Fills a fresh database (PostgreSQL ``waybill_replay_bench``, or a SQLite file) with N events
of realistic request trails, appended through ``EventStore.append`` by 100 concurrent
appenders, one whole trail per append (``tests/ledger/factories.py``, dressed with the
gateway's id shapes and a few workspaces, keys and routes). Then, on that ledger: a raw read
of every event (the floor: read + decode), a replay of all read models in one pass through
``ProjectionRunner.replay()`` (the first after a fill builds them into empty tables), the
same replay through ``waybill replay`` as a subprocess, and the API replay again. Each
rebuild must produce the same read models, row for row, with as many rows as the ledger has
requests, holds, unknown-usage settlements and keys; otherwise the run prints INVALID and
exits 1. Each phase reports events/s and the cores kept busy by Python, by the PostgreSQL
backends and by everything else on the machine.

``--keep`` reuses the database when it already holds at least N events, so the replays can
be measured again without the fill. A benchmark, not a test: compare figures within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import Progress
from sqlalchemy import Table, select, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.databases import fresh_postgres, postgres_url
from ledger import events as ev
from ledger.books.accounting import reservation_id, settlement_id
from ledger.store import NO_STREAM, EventStore
from ledger.store.db import create_engine, migrate
from ledger.store.schema import (
    api_keys,
    ledger_head,
    projection_checkpoints,
    request_views,
    spend_attempts,
    unknown_settlements,
)
from ledger.store.stored import count_types
from ledger.support.process import tune_gc
from ledger.views import all_projections
from ledger.views.projection import ProjectionRunner
from router.cli._shared import progress_bar
from tests.ledger.factories import key_created, succeeded_trail, unknown_then_failed_trail

DATABASE = "waybill_replay_bench"
_ROOT = Path(__file__).resolve().parent.parent
SQLITE_PATH = Path(tempfile.gettempdir()) / f"{DATABASE}.db"

_APPENDERS = 100
_WORKSPACES = ("acme", "globex", "initech")
_KEYS_PER_WORKSPACE = 2
_ROUTES = (  # (model group, endpoint, upstream model)
    ("chat-default", "east", "gpt-4o-mini"),
    ("chat-large", "west", "gpt-4o"),
    ("chat-eu", "eu", "claude-haiku"),
)
_UNKNOWN_EVERY = 20  # one request in 20 ends failed with its usage unknown
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_err = Console(stderr=True)

# What a rebuild is compared on: a few columns per read model, rows in key order.
_FINGERPRINT: dict[Table, tuple[str, ...]] = {
    request_views: (
        "request_id",
        "workspace",
        "key_id",
        "status",
        "endpoint",
        "upstream_model",
        "reserved_usd",
        "settled_usd",
        "held_unknown_usd",
        "input_tokens",
        "last_position",
    ),
    spend_attempts: (
        "reservation_id",
        "workspace",
        "key_id",
        "model_group",
        "state",
        "settled_usd",
        "held_unknown_usd",
        "output_tokens",
        "last_position",
    ),
    unknown_settlements: ("settlement_id", "state", "held_usd", "last_position"),
    api_keys: ("key_id", "workspace", "role", "created_at"),
}
# Each read model holds one row per event of a type: requests per RequestReceived, holds
# per BudgetReserved, settlements per UnknownUsageOpened, keys per KeyCreated.
_ROWS_PER_EVENT = {
    request_views: ev.RequestReceived.type,
    spend_attempts: ev.BudgetReserved.type,
    unknown_settlements: ev.UnknownUsageOpened.type,
    api_keys: ev.KeyCreated.type,
}


# --- the database -------------------------------------------------------------------------


def _database_url(backend: str) -> str:
    if backend == "sqlite":
        return f"sqlite:///{SQLITE_PATH}"
    return postgres_url(DATABASE)


def _fresh_database(backend: str) -> str:
    if backend == "sqlite":
        for suffix in ("", "-wal", "-shm"):
            Path(f"{SQLITE_PATH}{suffix}").unlink(missing_ok=True)
    else:
        fresh_postgres(DATABASE)
    url = _database_url(backend)
    migrate(url)
    return url


async def _events_held(backend: str, url: str) -> int:
    """The ledger's head position, or 0 when there is no ledger there yet."""
    if backend == "sqlite" and not SQLITE_PATH.exists():
        return 0
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            return int((await conn.execute(select(ledger_head.c.position))).scalar_one())
    except SQLAlchemyError:  # no such database, or never migrated: nothing to keep
        return 0
    finally:
        await engine.dispose()


async def _sizes_mb(engine: AsyncEngine, backend: str) -> dict[str, float]:
    mb = 1024 * 1024
    if backend == "sqlite":
        files = [Path(f"{SQLITE_PATH}{suffix}") for suffix in ("", "-wal")]
        return {"database_mb": round(sum(f.stat().st_size for f in files if f.exists()) / mb, 1)}
    models = ", ".join(f"'{table.name}'" for table in _FINGERPRINT)
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                text(
                    "SELECT pg_total_relation_size('events'), pg_relation_size('events'),"
                    " (SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class c"
                    f"  WHERE c.relname IN ({models}) AND c.relkind = 'r'),"
                    " pg_database_size(current_database())"
                )
            )
        ).one()
    return {
        "events_mb": round(row[0] / mb, 1),
        "events_heap_mb": round(row[1] / mb, 1),
        "read_models_mb": round(int(row[2]) / mb, 1),
        "database_mb": round(row[3] / mb, 1),
    }


async def _server(engine: AsyncEngine) -> dict[str, str]:
    """The server settings that change what a replay costs: without autovacuum, nothing
    ANALYZEs the read-model tables while a replay fills them."""
    if engine.dialect.name != "postgresql":
        return {}
    async with engine.connect() as conn:
        version = (await conn.execute(text("SHOW server_version"))).scalar_one()
        autovacuum = (await conn.execute(text("SHOW autovacuum"))).scalar_one()
    return {"version": str(version), "autovacuum": str(autovacuum)}


# --- the ledger's content -----------------------------------------------------------------


def _keys() -> list[tuple[str, str]]:
    return [(ws, f"key_{ws}_{k}") for ws in _WORKSPACES for k in range(_KEYS_PER_WORKSPACE)]


def _dress(event: ev.Event, fields: dict[str, Any]) -> ev.Event:
    """``event`` with those of ``fields`` that the factory set replaced (its trails are all
    acme / k_1 / east; the gateway's ids are ``att_…``, ``res_…``, ``unk_…``), plus what the
    gateway adds: a hold's spend dimensions (router/request/budget.py) and an attempt's hold."""
    present = {name: value for name, value in fields.items() if getattr(event, name, None)}
    if isinstance(event, ev.BudgetReserved):
        present.update({name: fields[name] for name in ("workspace", "key_id", "model_group")})
    if isinstance(event, ev.AttemptStarted):
        present["reservation_id"] = fields["reservation_id"]
    if isinstance(event, ev.RouteEvaluated) and event.chosen is not None:
        route = {"endpoint": fields["endpoint"], "model": fields["model"]}
        present["chosen"] = event.chosen.model_copy(update=route)
        first, *others = event.candidates
        present["candidates"] = (first.model_copy(update=route), *others)
    return event.model_copy(update=present)


def _trail(index: int, keys: list[tuple[str, str]]) -> tuple[str, list[ev.Event]]:
    """Request ``index``'s events as the gateway writes them: a success, or one request in
    ``_UNKNOWN_EVERY`` failed after an attempt whose usage is unknown."""
    request_id = f"req_{index:012x}bench"
    attempt_id = f"att_{index:012x}bench"
    workspace, key_id = keys[index % len(keys)]
    model_group, endpoint, model = _ROUTES[(index // len(keys)) % len(_ROUTES)]
    if index % _UNKNOWN_EVERY == _UNKNOWN_EVERY - 1:
        trail = unknown_then_failed_trail(request_id)
    else:
        trail = succeeded_trail(request_id, cost=str(Decimal(index % 25 + 1) / 10000))
    fields: dict[str, Any] = {
        "attempt_id": attempt_id,
        "after_attempt_id": attempt_id,
        "reservation_id": reservation_id(attempt_id),
        "settlement_id": settlement_id(attempt_id),
        "workspace": workspace,
        "key_id": key_id,
        "model_group": model_group,
        "endpoint": endpoint,
        "model": model,
        "accounts": (
            ev.AccountRef(
                account_id=f"workspace:{workspace}", kind="workspace", limit_usd=Decimal(1000)
            ),
        ),
    }
    return request_id, [_dress(event, fields) for event in trail]


async def _fill(store: EventStore, total: int) -> dict[str, Any]:
    """Append ``total`` events: the keys first, then request trails from ``_APPENDERS``
    concurrent appenders (the last trail is cut short: a request still in flight)."""
    keys = _keys()
    claimed = 0
    next_request = 0
    batches = store.stats["batches"]
    with progress_bar(console=_err, transient=True) as bar:
        task = bar.add_task("filling the ledger", total=total)
        started = time.perf_counter()
        for workspace, key_id in keys:
            key = key_created(key_id).model_copy(update={"workspace": workspace})
            await store.append(f"key-{key_id}", NO_STREAM, [key])
            claimed += 1
            bar.advance(task)

        async def appender() -> None:
            nonlocal claimed, next_request
            while claimed < total:
                # Claimed before the await: the appenders share one event loop, so no other
                # appender runs between the check and the claim.
                request_id, trail = _trail(next_request, keys)
                trail = trail[: total - claimed]
                next_request += 1
                claimed += len(trail)
                await store.append(f"request-{request_id}", NO_STREAM, trail)
                bar.advance(task, len(trail))

        await asyncio.gather(*(appender() for _ in range(_APPENDERS)))
        elapsed = time.perf_counter() - started
    batches = store.stats["batches"] - batches
    return {
        "events": claimed,
        "requests": next_request,
        "seconds": round(elapsed, 1),
        "events_per_s": round(claimed / elapsed),
        "events_per_tx": round(claimed / max(batches, 1), 1),
    }


# --- CPU accounting -----------------------------------------------------------------------


def _machine_busy_s() -> float:
    # /proc/stat "cpu" line: user nice system idle iowait irq softirq steal ...
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(values) - values[3] - values[4]) / _CLK_TCK


def _process_cpu_s(pid: str) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rfind(")") + 2 :].split()  # fields[0] is field 3 (state)
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime + stime


@dataclass
class _Cpu:
    """Wall time and CPU seconds of one phase: this process, its children (the CLI), the
    PostgreSQL backends serving the benchmark's database, and the whole machine. Backends
    are sampled every 200 ms by a thread: the CLI's backends exit with it, and
    a backend that exits takes its counters with it (at most its last 200 ms is missed)."""

    wall_s: float = 0.0
    own_s: float = 0.0
    children_s: float = 0.0
    postgres_s: float = 0.0
    machine_s: float = 0.0
    _started: tuple[float, ...] = ()
    _first: dict[str, float] = field(default_factory=dict)
    _last: dict[str, float] = field(default_factory=dict)
    _skip: set[str] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> _Cpu:
        self._first = self._scan()
        self._last = dict(self._first)
        self._thread = threading.Thread(target=self._sample_until_stopped, daemon=True)
        self._thread.start()
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        self._started = (
            time.perf_counter(),
            time.process_time(),
            children.ru_utime + children.ru_stime,
            _machine_busy_s(),
        )
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        wall, own, child, machine = self._started
        self.wall_s = time.perf_counter() - wall
        self.own_s = time.process_time() - own
        self.children_s = children.ru_utime + children.ru_stime - child
        self.machine_s = _machine_busy_s() - machine
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self._last.update(self._scan())
        self.postgres_s = sum(cpu - self._first.get(pid, 0.0) for pid, cpu in self._last.items())

    def cores(self) -> dict[str, float]:
        """Mean cores kept busy over the phase, by whom."""
        ours = self.own_s + self.children_s + self.postgres_s
        return {
            "python_cores": round((self.own_s + self.children_s) / self.wall_s, 2),
            "postgres_cores": round(self.postgres_s / self.wall_s, 2),
            "other_load_cores": round(max(self.machine_s - ours, 0.0) / self.wall_s, 2),
        }

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(0.2):
            self._last.update(self._scan())

    def _scan(self) -> dict[str, float]:
        needle = f" {DATABASE} ".encode()
        found = {}
        for entry in Path("/proc").iterdir():
            pid = entry.name
            if not pid.isdigit() or pid in self._skip:
                continue
            try:
                if pid not in self._first and pid not in self._last:
                    title = (entry / "cmdline").read_bytes()
                    if not (title.startswith(b"postgres:") and needle in title):
                        self._skip.add(pid)  # a process's title is read once
                        continue
                found[pid] = _process_cpu_s(pid)
            except OSError:  # the process ended while we looked
                continue
        return found


# --- the phases ---------------------------------------------------------------------------


def _rate(count: int, cpu: _Cpu) -> dict[str, Any]:
    return {
        "events": count,
        "seconds": round(cpu.wall_s, 2),
        "events_per_s": round(count / cpu.wall_s),
        **cpu.cores(),
    }


async def _read(store: EventStore) -> dict[str, Any]:
    count = 0
    with _Cpu() as cpu:
        async for _ in store.iterate():
            count += 1
    return _rate(count, cpu)


def _bar_callback(bar: Progress, description: str) -> Callable[[int, int], None]:
    task = bar.add_task(description, total=None)

    def update(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total)

    return update


async def _replay_api(store: EventStore) -> dict[str, Any]:
    runner = ProjectionRunner(store, all_projections())
    with progress_bar(console=_err, transient=True) as bar, _Cpu() as cpu:
        count = await runner.replay(progress=_bar_callback(bar, "replaying (API)"))
    return _rate(count, cpu)


def _cli() -> list[str]:
    script = Path(sys.executable).parent / "waybill"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from router.cli.main import main; main()"]


def _replay_cli(url: str) -> dict[str, Any]:
    """``waybill replay`` as a user runs it; its progress bar goes to our stderr. Process
    start alone is timed with ``waybill projections`` (start, connect, two queries)."""
    started = time.perf_counter()
    subprocess.run([*_cli(), "projections", "--database-url", url], check=True, capture_output=True)
    start_s = time.perf_counter() - started
    with _Cpu() as cpu:
        done = subprocess.run(
            [*_cli(), "replay", "--database-url", url],
            check=True,
            stdout=subprocess.PIPE,
            text=True,
            cwd=_ROOT,
        )
    # "requests: rebuilt from N events", one line per projection; all read the same pages.
    counts = {int(line.split()[-2]) for line in done.stdout.splitlines() if "rebuilt" in line}
    if len(counts) != 1:
        raise RuntimeError(f"unexpected output from waybill replay: {done.stdout!r}")
    return {**_rate(counts.pop(), cpu), "process_start_s": round(start_s, 2)}


async def _read_models(engine: AsyncEngine) -> dict[str, dict[str, Any]]:
    """Per read model: its rows and a SHA-256 of a few columns, rows in key order."""
    found = {}
    async with engine.connect() as conn:
        for table, columns in _FINGERPRINT.items():
            result = await conn.execute(
                select(*(table.c[name] for name in columns)).order_by(table.c[columns[0]])
            )
            digest = hashlib.sha256()
            rows = 0
            for row in result:
                digest.update(repr(tuple(row)).encode())
                rows += 1
            found[table.name] = {"rows": rows, "sha256": digest.hexdigest()[:16]}
    return found


async def _expected(engine: AsyncEngine) -> dict[str, Any]:
    """What the ledger says the read models must hold: rows per table, and every
    checkpoint at the head."""
    async with engine.connect() as conn:
        counts = await count_types(conn, set(_ROWS_PER_EVENT.values()))
        head = (await conn.execute(select(ledger_head.c.position))).scalar_one()
        checkpoints = (await conn.execute(select(projection_checkpoints.c.position))).scalars()
        behind = [int(head) - int(position) for position in checkpoints]
    return {
        "rows": {table.name: counts.get(kind, 0) for table, kind in _ROWS_PER_EVENT.items()},
        "checkpoints_behind_head": max(behind, default=int(head)),
    }


def _check(expected: dict[str, Any], rebuilds: dict[str, dict[str, Any]]) -> list[str]:
    problems = []
    if expected["checkpoints_behind_head"] != 0:
        problems.append(f"a checkpoint is {expected['checkpoints_behind_head']} behind the head")
    (first_phase, first), *others = rebuilds.items()
    for name, rows in expected["rows"].items():
        if first[name]["rows"] != rows:
            problems.append(f"{name}: {first[name]['rows']} rows, the ledger says {rows}")
        for phase, rebuild in others:
            if rebuild[name] != first[name]:
                problems.append(
                    f"{name}: {phase} rebuilt {rebuild[name]}, {first_phase} {first[name]}"
                )
    return problems


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    url = _database_url(args.backend)
    held = await _events_held(args.backend, url) if args.keep else 0
    results: dict[str, Any] = {
        "backend": args.backend,
        "events_asked": args.events,
        "load_before": [round(x, 2) for x in os.getloadavg()],
    }
    if held < args.events:
        url = _fresh_database(args.backend)
    else:
        migrate(url)  # a no-op unless the schema moved on since the fill
    engine = create_engine(url)
    store = EventStore(engine)
    rebuilds: dict[str, dict[str, Any]] = {}
    try:
        results["server"] = await _server(engine)
        if held < args.events:
            results["fill"] = await _fill(store, args.events)
        else:
            results["fill"] = {"kept": held}
        _err.print(f"fill: {results['fill']}")
        results["read"] = await _read(store)
        _err.print(f"read: {results['read']}")
        # The first replay after a fill builds the read models into empty tables; the
        # others replace full ones. They can differ (see bench/README.md), so both count.
        for phase in ("replay_api_first", "replay_cli", "replay_api_again"):
            if phase == "replay_cli":
                results[phase] = _replay_cli(url)
            else:
                results[phase] = await _replay_api(store)
            _err.print(f"{phase}: {results[phase]}")
            rebuilds[phase] = await _read_models(engine)
        results["size"] = await _sizes_mb(engine, args.backend)
        expected = await _expected(engine)
    finally:
        await store.close()
        await engine.dispose()
    results["read_models"] = rebuilds["replay_api_first"]
    results["problems"] = _check(expected, rebuilds)
    results["load_after"] = [round(x, 2) for x in os.getloadavg()]
    return results


def _table(results: dict[str, Any]) -> str:
    lines = []
    for key, value in results.items():
        if isinstance(value, dict):
            lines.append(f"{key}:")
            lines.extend(f"  {name:<22} {item}" for name, item in value.items())
        else:
            lines.append(f"{key:<24} {value}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--backend", choices=["postgres", "sqlite"], default="postgres")
    parser.add_argument(
        "--keep", action="store_true", help="reuse the database if it holds >= N events"
    )
    parser.add_argument("--json", action="store_true", help="JSON on stdout, the table on stderr")
    args = parser.parse_args()
    if args.events < 1000:
        parser.error("--events: at least 1000")
    # As every Waybill process runs (router.cli.main), so the API phases are like-for-like.
    tune_gc()
    results = asyncio.run(_bench(args))
    if args.json:
        print(json.dumps(results, indent=2))
        print(_table(results), file=sys.stderr)
    else:
        print(_table(results))
    if results["problems"]:
        print("INVALID: " + "; ".join(results["problems"]), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
