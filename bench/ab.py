"""A/B benchmark: two versions of the gateway under the same load, in alternating short cells.

    .venv/bin/python bench/ab.py --a main --b WORKTREE [--env-b NAME=VALUE ...]
        [--python-b PATH] [--rounds 8] [--seconds 3] [--concurrency 1] [--stream] [--json]
        [--backend postgres|sqlite]

This machine's speed drifts by tens of per cent within minutes, so two runs of
``bench/gateway_bench.py`` minutes apart cannot tell a 5% change from the noise. Here both
versions run at once, each a ``waybill serve`` on a fresh PostgreSQL database of its own (or,
with ``--backend sqlite``, a SQLite file of its own) in
front of one shared fake provider, and the cells alternate A, B, B, A, A, B, ... so that each
pair is measured seconds apart. Per round: requests/s, p50 latency and CPU ms per request
(the ``waybill serve`` process tree, and the PostgreSQL backends of its database); the
report gives each side's median and the median of the per-round B/A ratios.

``--a`` and ``--b`` name a git ref (checked out into a temporary worktree) or ``WORKTREE``
(this checkout as it is on disk); ``--env-a`` / ``--env-b`` add environment variables to one
side (an experiment behind a variable needs no second checkout); ``--python-a`` /
``--python-b`` run one side's gateway on another interpreter (a virtual environment's
``python`` with the project's dependencies installed). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.databases import fresh_postgres
from bench.gateway_bench import (
    RUN_WAYBILL,
    _BackendCpu,
    _Child,
    _create_key,
    _load,
    _per_request,
    _post,
    _start_fake,
    _start_gateway,
)
from ledger.store.db import migrate

REPO = Path(__file__).resolve().parent.parent
WORKTREE = "WORKTREE"


@dataclass
class _Side:
    name: str
    database: str
    api_key: str
    gateway: _Child
    url: str
    rounds: list[dict[str, float]] = field(default_factory=list)


@contextlib.contextmanager
def _checkout(ref: str, tmp: Path, name: str) -> Iterator[Path]:
    """The source tree of ``ref``: this checkout for WORKTREE, else a temporary worktree."""
    if ref == WORKTREE:
        yield REPO
        return
    path = tmp / f"src-{name}"
    git = ["git", "-C", str(REPO)]
    subprocess.run([*git, "worktree", "add", "--detach", str(path), ref], check=True)
    try:
        yield path
    finally:
        subprocess.run([*git, "worktree", "remove", "--force", str(path)], check=False)


def _prepared(url: str, source: Path, python: str | None) -> str:
    """Migrate ``url`` and make a client key on it with the side's own code (two versions
    may differ in schema), and return the key."""
    if source == REPO and python is None:
        migrate(url)
        return asyncio.run(_create_key(url))
    command = [python or sys.executable, "-c", RUN_WAYBILL]
    env = {**os.environ, "PYTHONPATH": str(source)}
    env.pop("WAYBILL_CONFIG", None)
    run = functools.partial(
        subprocess.run, env=env, cwd=source, check=True, capture_output=True, text=True
    )
    run([*command, "migrate", "--database-url", url])
    made = run([*command, "keys", "create", "--workspace", "acme", "--json", "--database-url", url])
    return str(json.loads(made.stdout)["secret"])


def _env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--env-a/--env-b take NAME=VALUE, not {pair!r}")
        env[name] = value
    return env


def _cell(side: _Side, args: argparse.Namespace) -> dict[str, float]:
    side.gateway.settle()
    # SQLite runs inside the gateway's process; "" matches no PostgreSQL backend then.
    with _BackendCpu(side.database if args.backend == "postgres" else "") as postgres:
        before = side.gateway.cpu_s()
        load = _load(f"{side.url}/v1", "chat", side.api_key, args.stream, args.concurrency, args)
        side.gateway.settle()  # deferred work (projections, metrics) counts too
        spent = side.gateway.cpu_s() - before
    if not load["ok"]:
        raise SystemExit(f"{side.name}: not every response was a complete 200: {load}")
    return {
        "rps": float(load["rps"]),
        "p50_ms": float(load["p50_ms"]),
        "gateway_cpu_ms": _per_request(spent, int(load["sent"])),
        "postgres_cpu_ms": _per_request(postgres.seconds, int(load["sent"])),
    }


def _report(a: _Side, b: _Side) -> dict[str, Any]:
    out: dict[str, Any] = {"rounds": len(a.rounds)}
    for metric in ("rps", "p50_ms", "gateway_cpu_ms", "postgres_cpu_ms"):
        # (no PostgreSQL CPU on SQLite: a ratio of zeros is 1)
        ratios = [
            rb[metric] / ra[metric] if ra[metric] else 1.0
            for ra, rb in zip(a.rounds, b.rounds, strict=True)
        ]
        out[metric] = {
            "a_median": round(statistics.median(r[metric] for r in a.rounds), 3),
            "b_median": round(statistics.median(r[metric] for r in b.rounds), 3),
            "b_over_a_median": round(statistics.median(ratios), 3),
            "b_over_a_range": [round(min(ratios), 3), round(max(ratios), 3)],
            "b_better_in": sum((x < 1) if metric != "rps" else (x > 1) for x in ratios),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", default="HEAD", help="git ref or WORKTREE (default HEAD)")
    parser.add_argument("--b", default=WORKTREE, help="git ref or WORKTREE (default)")
    parser.add_argument("--env-a", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--env-b", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--python-a", help="interpreter for A's gateway (default: this one)")
    parser.add_argument("--python-b", help="interpreter for B's gateway (default: this one)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per cell")
    parser.add_argument("--warmup", type=float, default=0.5, help="unmeasured seconds first")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--json", action="store_true", help="also the report as JSON on stdout")
    parser.add_argument("--backend", choices=["postgres", "sqlite"], default="postgres")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name, contextlib.ExitStack() as stack:
        tmp = Path(tmp_name)
        fake, fake_url = _start_fake(tmp)
        stack.callback(fake.stop)
        sides = []
        for name, ref, env, python in (
            ("a", args.a, args.env_a, args.python_a),
            ("b", args.b, args.env_b, args.python_b),
        ):
            source = stack.enter_context(_checkout(ref, tmp, name))
            database = f"waybill_ab_{name}"
            url = (
                f"sqlite:///{tmp / f'{database}.db'}"
                if args.backend == "sqlite"
                else fresh_postgres(database)
            )
            api_key = _prepared(url, source, python)
            work = tmp / name
            work.mkdir()
            gateway, gateway_url = _start_gateway(
                work, url, fake_url, source=source, extra_env=_env(env), python=python
            )
            stack.callback(gateway.stop)
            sides.append(_Side(name, database, api_key, gateway, gateway_url))
        a, b = sides
        for round_ in range(args.rounds):
            order = (a, b) if round_ % 2 == 0 else (b, a)
            for side in order:
                _post(f"{fake_url}/_fake/reset")
                side.rounds.append(_cell(side, args))
            ra, rb = a.rounds[-1], b.rounds[-1]
            print(
                f"  round {round_ + 1}: rps {ra['rps']:.0f} / {rb['rps']:.0f}, "
                f"p50 {ra['p50_ms']:.2f} / {rb['p50_ms']:.2f} ms, "
                f"CPU {ra['gateway_cpu_ms']:.2f} / {rb['gateway_cpu_ms']:.2f} ms",
                file=sys.stderr,
                flush=True,
            )
        report = {"a": args.a, "b": args.b, "env_a": args.env_a, "env_b": args.env_b}
        report.update(python_a=args.python_a, python_b=args.python_b)
        report.update(concurrency=args.concurrency, stream=args.stream, **_report(a, b))
        for metric in ("rps", "p50_ms", "gateway_cpu_ms", "postgres_cpu_ms"):
            m = report[metric]
            low, high = m["b_over_a_range"]
            print(
                f"{metric:>16}: A {m['a_median']}, B {m['b_median']}, B/A {m['b_over_a_median']}"
                f" ({low}-{high}), B better in {m['b_better_in']} of {args.rounds}",
                file=sys.stderr,
            )
        if args.json:
            print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
