"""Instructions per request: two versions of the gateway counted by callgrind, not timed.

    .venv/bin/python bench/instructions_bench.py --a main --b WORKTREE [--env-b NAME=VALUE ...]
        [--requests 300] [--warmup 100] [--concurrency 1] [--stream | --chunks N]
        [--chunk-delay-ms 1] [--repeat 1] [--keep DIR] [--database waybill_instructions]
        [--json] [--backend postgres|sqlite]

A change that saves 3 % of the gateway's CPU is lost in this machine's noise: ``bench/ab.py``'s
rounds of c16 requests/s move by ±20 % within minutes. Instructions do not move with the
machine. Each side's ``waybill serve`` runs under ``valgrind --tool=callgrind`` (about fifty
times slower; its follower child and PostgreSQL run natively, unmeasured) in front of the fake
provider, on a fresh PostgreSQL database of its own (``--database``, then ``_a`` or ``_b``:
two counts at once need two prefixes; ``--backend sqlite``: a SQLite file of its own, whose
work is then all in the counted process). After ``--warmup`` requests the counters
are zeroed (``callgrind_control -z``), ``--requests`` more are sent by the load generator, and
the counters are dumped: the serving process's instructions over the requests, start-up and
warm-up left out. The same version counted twice agrees to about 0.5 % (timers and the
heartbeat run a little more or less often); at concurrency 1 each commit holds one request's
appends, as under light load. ``--repeat`` counts each side that many times, alternating.
``--chunks N`` streams from the bench mock (``bench/stream_mock.py``, N content chunks 1 ms
apart, or ``--chunk-delay-ms``) instead of the fake provider, whose streams are short: two runs
with different N give the relay's instructions per chunk. A gateway under callgrind that falls
behind the mock reads several chunks at once, and fewer reads cost fewer instructions, so a
load on the machine that slows it moves the count (``bench/README.md``, "Instructions");
chunks 20 ms apart are each read alone.

``--a`` / ``--b`` name a git ref (checked out into a temporary worktree) or ``WORKTREE``;
``--env-a`` / ``--env-b`` add environment variables to one side. ``--keep DIR`` keeps each
count's callgrind file there (``callgrind_annotate FILE``: which C functions, the interpreter's,
the collector's, zlib's, spent them). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.ab import _checkout, _env, _prepared
from bench.databases import fresh_postgres
from bench.gateway_bench import _load, _post, _start_fake, _start_gateway
from bench.streams_bench import _start_mock

_VALGRIND = ["valgrind", "--tool=callgrind", "--dump-instr=no", "--compress-strings=no"]


def _totals(dump: Path) -> int:
    """The instruction count a callgrind dump file holds (its ``summary:`` line)."""
    for line in dump.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise SystemExit(f"no totals in {dump}")


def _count(
    name: str,
    source: Path,
    env: dict[str, str],
    fake_root: str,
    tmp: Path,
    args: argparse.Namespace,
    run: int,
) -> float:
    """One side counted once: instructions per request of its serving process."""
    where = tmp / f"{name}{run}"
    where.mkdir()
    database = f"{args.database}_{name}"
    url = (
        f"sqlite:///{where / 'ledger.db'}" if args.backend == "sqlite" else fresh_postgres(database)
    )
    api_key = _prepared(url, source, None)
    out = where / "callgrind.out"
    gateway, gateway_url = _start_gateway(
        where,
        url,
        fake_root,
        source=source,
        extra_env=env,
        wrapper=[*_VALGRIND, f"--callgrind-out-file={out}"],
        ready_within_s=300.0,
    )
    try:
        api = f"{gateway_url}/v1"
        load = argparse.Namespace(seconds=3600, warmup=0)
        stream = args.stream or args.chunks > 0
        warm = _load(api, "chat", api_key, stream, args.concurrency, load, requests=args.warmup)
        if not warm["ok"]:
            raise SystemExit(f"{name}: the warm-up failed: {warm}")
        pid = str(gateway.pid)
        subprocess.run(["callgrind_control", "-z", pid], check=True, capture_output=True)
        measured = _load(
            api, "chat", api_key, stream, args.concurrency, load, requests=args.requests
        )
        subprocess.run(["callgrind_control", "-d", pid], check=True, capture_output=True)
        if not measured["ok"]:
            raise SystemExit(f"{name}: not every response was a complete 200: {measured}")
        dumps = sorted(where.glob("callgrind.out*"), key=lambda p: p.stat().st_mtime)
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            shutil.copy(dumps[-1], args.keep / f"callgrind.{name}{run + 1}")
        return _totals(dumps[-1]) / int(measured["sent"])
    finally:
        gateway.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", default="HEAD", help="git ref or WORKTREE (default HEAD)")
    parser.add_argument("--b", default="WORKTREE", help="git ref or WORKTREE (default)")
    parser.add_argument("--env-a", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--env-b", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--requests", type=int, default=300, help="requests counted")
    parser.add_argument("--warmup", type=int, default=100, help="requests before counting")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument(
        "--database",
        default="waybill_instructions",
        help="each side's database is this with _a or _b, dropped and recreated",
    )
    parser.add_argument("--stream", action="store_true")
    parser.add_argument(
        "--chunks", type=int, default=0, help="stream N chunks from the bench mock (0: no)"
    )
    parser.add_argument(
        "--chunk-delay-ms",
        type=float,
        default=1.0,
        help="the mock's chunks this far apart (each its own read if the gateway keeps up)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="counts per side, alternating")
    parser.add_argument("--keep", type=Path, help="keep the callgrind files in this folder")
    parser.add_argument("--json", action="store_true", help="JSON on stdout")
    parser.add_argument("--backend", choices=["postgres", "sqlite"], default="postgres")
    args = parser.parse_args()

    counts: dict[str, list[float]] = {"a": [], "b": []}
    with tempfile.TemporaryDirectory(prefix="waybill-instructions-") as name:
        tmp = Path(name)
        if args.chunks > 0:
            fake, fake_root = _start_mock(tmp, args.chunks, args.chunk_delay_ms)
        else:
            fake, fake_root = _start_fake(tmp)
        try:
            with _checkout(args.a, tmp, "a") as a, _checkout(args.b, tmp, "b") as b:
                sides = {"a": (a, _env(args.env_a)), "b": (b, _env(args.env_b))}
                for run in range(args.repeat):
                    for side in ("a", "b") if run % 2 == 0 else ("b", "a"):
                        if args.chunks == 0:
                            _post(f"{fake_root}/_fake/reset")
                        source, env = sides[side]
                        counts[side].append(_count(side, source, env, fake_root, tmp, args, run))
                        print(
                            f"  {side} run {run + 1}: {counts[side][-1]:,.0f} instructions "
                            "per request",
                            file=sys.stderr,
                            flush=True,
                        )
        finally:
            fake.stop()
    a_median, b_median = statistics.median(counts["a"]), statistics.median(counts["b"])
    report: dict[str, Any] = {
        "a": args.a,
        "b": args.b,
        "mode": f"{args.chunks} chunks"
        if args.chunks
        else "streaming"
        if args.stream
        else "buffered",
        "concurrency": args.concurrency,
        "requests": args.requests,
        "a_instructions_per_request": [round(c) for c in counts["a"]],
        "b_instructions_per_request": [round(c) for c in counts["b"]],
        "b_over_a": round(b_median / a_median, 4),
    }
    print(
        f"instructions per request ({report['mode']}, c{args.concurrency}): "
        f"A {a_median:,.0f}, B {b_median:,.0f}, B/A {report['b_over_a']:.4f}",
        file=sys.stderr,
    )
    if args.json:
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
