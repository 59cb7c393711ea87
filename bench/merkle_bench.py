"""Checkpoint benchmark: what the ledger's Merkle tree and its signed checkpoints cost.

    .venv/bin/python bench/merkle_bench.py [--phases tree,verify,gateway] [--events 1000000]
        [--checkpoints 10] [--keep] [--rounds 6] [--seconds 3] [--concurrency 16] [--json]

Three phases, each optional:

- ``tree``: the tree alone, in memory, over realistic stored payloads: microseconds per
  event for the leaf hash, for keeping the frontier, and for keeping it with the sink's
  tree levels (what the checkpointer does per event).
- ``verify``: a PostgreSQL ledger of ``--events`` events (``waybill_merkle_bench``: request
  trails appended as ``bench/replay_bench.py`` appends them, by 100 concurrent appenders),
  filled in ``--checkpoints`` stages with ``waybill checkpoint`` after each stage, as a
  gateway would have taken them. Then, on that ledger: ``waybill verify`` (the hash chain)
  and ``waybill verify --checkpoints`` (the chain and every checkpoint, in the same pass)
  as subprocesses, wall time and CPU each; ``waybill prove`` of one request from the sink's
  tree files, and from the checkpoint lines alone (a pass over the ledger). ``--keep``
  reuses a ledger and sink that already hold ``--events`` events.
- ``gateway``: two ``waybill serve`` of this checkout side by side, each on a fresh
  PostgreSQL database, in front of one fake provider, the second with a ``checkpoints``
  block (every 10,000 events or 10 s); cells alternate as in ``bench/ab.py`` and the report
  gives each side's median requests/s, p50 and CPU per request and the per-round ratios.

A benchmark, not a test: compare figures within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console
from sqlalchemy import select

from bench.databases import fresh_postgres, postgres_url
from bench.replay_bench import _keys, _trail
from ledger.audit.checkpoints import generate_key, load_signing_key
from ledger.audit.merkle import Frontier, event_leaf_hash
from ledger.audit.sink import LEVELS, read_sink
from ledger.store import NO_STREAM, EventStore, canonical_payload
from ledger.store.db import create_engine, migrate
from ledger.store.schema import appends, ledger_head
from ledger.store.stored import holding
from ledger.support.process import tune_gc
from router.cli._shared import progress_bar
from tests.ledger.factories import key_created

BENCH = Path(__file__).resolve().parent
DATABASE = "waybill_merkle_bench"
WORK = Path(tempfile.gettempdir()) / DATABASE  # the sink and the key, kept with --keep
_APPENDERS = 100
_err = Console(stderr=True)


# --- tree: the tree alone ---------------------------------------------------------------------


def _payloads(count: int) -> list[bytes]:
    """Stored payloads as the ledger holds them, from realistic request trails."""
    keys = _keys()
    found: list[bytes] = []
    index = 0
    while len(found) < count:
        request_id, trail = _trail(index, keys)
        for version, event in enumerate(trail, start=1):
            found.append(
                canonical_payload(
                    stream_id=f"request-{request_id}",
                    version=version,
                    event_type=type(event).type,
                    schema_version=type(event).schema_version,
                    data=event.model_dump(mode="json"),
                    metadata={"config_generation": "bench"},
                    recorded_at="2026-05-01T12:00:00.000000+00:00",
                )
            )
        index += 1
    return found[:count]


def _per_event_us(work: Any, count: int) -> float:
    started = time.perf_counter()
    work()
    return round((time.perf_counter() - started) / count * 1e6, 3)


def _tree(count: int) -> dict[str, Any]:
    payloads = _payloads(count)
    leaves = [event_leaf_hash(i + 1, p) for i, p in enumerate(payloads)]

    def leaf_hashes() -> None:
        for i, payload in enumerate(payloads):
            event_leaf_hash(i + 1, payload)

    def frontier() -> None:
        tree = Frontier()
        for leaf in leaves:
            tree.append(leaf)

    def frontier_kept() -> None:
        tree = Frontier(keep=LEVELS)
        for leaf in leaves:
            tree.append(leaf)

    def both() -> None:
        tree = Frontier(keep=LEVELS)
        for i, payload in enumerate(payloads):
            tree.append(event_leaf_hash(i + 1, payload))

    grown = Frontier()
    for leaf in leaves:
        grown.append(leaf)
    return {
        "events": count,
        "payload_bytes_mean": round(statistics.mean(len(p) for p in payloads)),
        "leaf_hash_us": _per_event_us(leaf_hashes, count),
        "frontier_append_us": _per_event_us(frontier, count),
        "frontier_append_with_tree_levels_us": _per_event_us(frontier_kept, count),
        "per_event_total_us": _per_event_us(both, count),
        "root_us": _per_event_us(lambda: [grown.root() for _ in range(1000)], 1000),
    }


# --- verify: a ledger of --events with its checkpoints ------------------------------------


def _cli(*args: str, url: str) -> tuple[float, float, subprocess.CompletedProcess[bytes]]:
    """Run ``waybill`` as a subprocess: wall seconds, CPU seconds, the result."""
    env = {**os.environ, "WAYBILL_DATABASE_URL": url}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    command = [sys.executable, "-c", "from router.cli.main import main; main()", *args]
    done = subprocess.run(command, env=env, capture_output=True, check=False, cwd=BENCH.parent)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done


async def _head(url: str) -> int:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            return int((await conn.execute(select(ledger_head.c.position))).scalar_one())
    except Exception:  # no database or no ledger yet: nothing to keep
        return 0
    finally:
        await engine.dispose()


async def _append(url: str, first_request: int, total: int, with_keys: bool) -> int:
    """Append about ``total`` events of request trails; returns the next request index."""
    engine = create_engine(url)
    store = EventStore(engine)
    keys = _keys()
    claimed, next_request = 0, first_request
    try:
        with progress_bar(console=_err, transient=True) as bar:
            task = bar.add_task("filling the ledger", total=total)
            if with_keys:
                for workspace, key_id in keys:
                    key = key_created(key_id).model_copy(update={"workspace": workspace})
                    await store.append(f"key-{key_id}", NO_STREAM, [key])
                    claimed += 1

            async def appender() -> None:
                nonlocal claimed, next_request
                while claimed < total:
                    request_id, trail = _trail(next_request, keys)
                    next_request += 1
                    claimed += len(trail)
                    await store.append(f"request-{request_id}", NO_STREAM, trail)
                    bar.advance(task, len(trail))

            await asyncio.gather(*(appender() for _ in range(_APPENDERS)))
    finally:
        await store.close()
        await engine.dispose()
    return next_request


async def _a_request_id(url: str) -> str:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            stream = (
                await conn.execute(
                    select(appends.c.stream_id)
                    .where(holding("RequestCompleted"))
                    .order_by(appends.c.position.desc())
                    .limit(1)
                )
            ).scalar_one()
    finally:
        await engine.dispose()
    return str(stream).removeprefix("request-")


def _verify(args: argparse.Namespace) -> dict[str, Any]:
    url = postgres_url(DATABASE)
    sink, key_file, public = WORK / "sink", WORK / "signing.key", WORK / "signing.pub"
    results: dict[str, Any] = {}
    held = asyncio.run(_head(url))
    if not (args.keep and held >= args.events and key_file.exists() and sink.is_dir()):
        fresh_postgres(DATABASE)
        migrate(url)
        shutil.rmtree(WORK, ignore_errors=True)
        WORK.mkdir(parents=True)
        key = generate_key()
        key_file.write_bytes(key.private_pem())
        public.write_bytes(key.public_pem())
        stage = args.events // args.checkpoints
        next_request, taken = 0, []
        fill_s = 0.0
        for number in range(args.checkpoints):
            started = time.perf_counter()
            next_request = asyncio.run(_append(url, next_request, stage, with_keys=number == 0))
            fill_s += time.perf_counter() - started
            wall, cpu, done = _cli(
                "checkpoint", "--signing-key", str(key_file), "--out", str(sink), url=url
            )
            if done.returncode != 0:
                raise SystemExit(done.stderr.decode())
            taken.append({"wall_s": round(wall, 2), "cpu_s": round(cpu, 2)})
            _err.print(f"checkpoint {number + 1}/{args.checkpoints}: {wall:.1f} s", style="dim")
        results["fill_s"] = round(fill_s, 1)
        results["checkpoint_cli"] = taken
    key_id = load_signing_key(key_file.read_bytes()).key_id
    sizes = [e.checkpoint.size for e in read_sink(sink) if e.checkpoint]
    head = asyncio.run(_head(url))
    results.update(events=head, checkpoints=len(sizes), key_id=key_id)
    results["sink_bytes"] = sum(p.stat().st_size for p in sink.rglob("*") if p.is_file())

    wall, cpu, done = _cli("verify", url=url)
    assert done.returncode == 0, done.stdout + done.stderr
    results["verify"] = {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2)}
    args_ = ("verify", "--checkpoints", str(sink), "--public-key", str(public))
    wall, cpu, done = _cli(*args_, url=url)
    if done.returncode != 0:
        raise SystemExit(done.stdout.decode() + done.stderr.decode())
    results["verify_checkpoints"] = {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2)}
    extra = results["verify_checkpoints"]["cpu_s"] - results["verify"]["cpu_s"]
    results["checkpoints_cpu_us_per_event"] = round(extra / head * 1e6, 2)

    request_id = asyncio.run(_a_request_id(url))
    wall, cpu, done = _cli(
        "prove", request_id, "--checkpoints", str(sink), "--signing-key", str(key_file), url=url
    )
    assert done.returncode == 0, done.stderr
    proof = WORK / "proof.json"
    proof.write_bytes(done.stdout)
    results["prove_from_tree_files"] = {"wall_s": round(wall, 2), "bytes": len(done.stdout)}
    lines_only = WORK / "lines-only"
    shutil.rmtree(lines_only, ignore_errors=True)
    lines_only.mkdir()
    for line_file in sink.glob("*.jsonl"):
        shutil.copy(line_file, lines_only)
    wall, cpu, done = _cli(
        "prove",
        request_id,
        "--checkpoints",
        str(lines_only),
        "--signing-key",
        str(key_file),
        url=url,
    )
    assert done.returncode == 0 and done.stdout == proof.read_bytes(), done.stderr
    results["prove_from_a_pass"] = {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2)}
    wall, cpu, done = _cli("verify-proof", str(proof), "--public-key", str(public), url=url)
    assert done.returncode == 0, done.stdout
    results["verify_proof"] = {"wall_s": round(wall, 2)}
    return results


# --- gateway: throughput with and without checkpointing, in the same run -------------------


def _gateway(args: argparse.Namespace) -> dict[str, Any]:
    from bench.ab import _cell, _report, _Side
    from bench.gateway_bench import _create_key, _post, _start_fake, _start_gateway

    with tempfile.TemporaryDirectory() as tmp_name, contextlib.ExitStack() as stack:
        tmp = Path(tmp_name)
        key_file = tmp / "signing.key"
        key_file.write_bytes(generate_key().private_pem())
        fake, fake_url = _start_fake(tmp)
        stack.callback(fake.stop)
        sides = []
        for name, checkpoints in (
            ("plain", ""),
            ("checkpoints", f"{{signing_key: {key_file}, out: {tmp / 'sink'}, "
             "every_events: 10000, every_seconds: 10}"),
        ):  # fmt: skip
            database = f"waybill_merkle_{name}"
            url = fresh_postgres(database)
            migrate(url)
            api_key = asyncio.run(_create_key(url))
            work = tmp / name
            work.mkdir()
            gateway, gateway_url = _start_gateway(work, url, fake_url, checkpoints=checkpoints)
            stack.callback(gateway.stop)
            sides.append(_Side(name, database, api_key, gateway, gateway_url))
        a, b = sides
        for round_ in range(args.rounds):
            for side in (a, b) if round_ % 2 == 0 else (b, a):
                _post(f"{fake_url}/_fake/reset")
                side.rounds.append(_cell(side, args))
            ra, rb = a.rounds[-1], b.rounds[-1]
            _err.print(
                f"  round {round_ + 1}: rps {ra['rps']:.0f} / {rb['rps']:.0f}, CPU "
                f"{ra['gateway_cpu_ms']:.2f} / {rb['gateway_cpu_ms']:.2f} ms",
                style="dim",
            )
        signed = [e.checkpoint.size for e in read_sink(tmp / "sink") if e.checkpoint]
        report = {"concurrency": args.concurrency, "rounds": args.rounds, **_report(a, b)}
        report["checkpoints_taken"] = len(signed)
        return report


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--phases", default="tree,verify,gateway")
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--tree-events", type=int, default=200_000)
    parser.add_argument("--checkpoints", type=int, default=10)
    parser.add_argument("--keep", action="store_true", help="reuse the ledger and sink")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per cell")
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--json", action="store_true", help="the results as JSON on stdout")
    args = parser.parse_args()
    tune_gc()
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    results: dict[str, Any] = {}
    if "tree" in phases:
        results["tree"] = _tree(args.tree_events)
        _err.print(f"tree: {results['tree']}")
    if "verify" in phases:
        results["verify"] = _verify(args)
        _err.print(f"verify: {results['verify']}")
    if "gateway" in phases:
        results["gateway"] = _gateway(args)
        _err.print(f"gateway: {results['gateway']}")
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
