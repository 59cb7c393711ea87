"""Long streams benchmark: many long streams at once, straight to a mock provider and through
Waybill, in one run.

    .venv/bin/python bench/streams_bench.py [--concurrency 200,1000] [--seconds 10]
        [--warmup 3] [--chunks 50] [--chunk-delay-ms 20] [--max-in-flight N]
        [--database waybill_streams_bench] [--source CHECKOUT] [--serve-arg ARG ...] [--json]
        [--profile DIR]

The load an LLM gateway carries is many long streams at once. The bench mock
(``bench/stream_mock.py``) answers every request with a stream of ``--chunks`` content chunks
``--chunk-delay-ms`` apart (with its role chunk first and its finish chunk, usage chunk and
``[DONE]`` last: ``--chunks`` + 4 events). For each concurrency the closed-loop load
generator (``bench/loadgen.py``) runs that load first straight to the mock, then through a
fresh ``waybill serve`` (ledger on a fresh PostgreSQL database, ``--max-in-flight`` twice the
concurrency unless given, so that every request is served: this measures the relay, not
admission). Per cell and side:

- streams/s and chunks/s: complete streams (and their events) that ended inside the measured
  window, over its length;
- TTFT p50 / p99: from sending the request to the first content (the first chunk with text);
- broken: connections closed before their response was whole (``lost``: not one byte came;
  ``cut``: part of it came);

and for the gateway: its CPU per chunk relayed (the ``waybill serve`` process and its
children, from the cell's start until it is idle again, over every event of every stream of
the cell), its memory per open stream (peak RSS of the serving process during the cell, less
its RSS after a quarter of the load, over the streams added), and PostgreSQL's CPU per stream.

A gateway cell is valid only if every response was a complete 200 and the ledger gained one
``RequestCompleted``, and no ``RequestFailed``, per request sent. ``--source`` serves the
gateway of another checkout (a ``git worktree`` of an older commit: before and after a
change, minutes apart, same machine; its ledger is migrated by this checkout's migrations,
so the schema must be the same). ``--profile DIR`` runs each
gateway cell under ``py-spy record`` (its figures then include py-spy's cost) and prints a
summary (``bench/profile_summary.py``). A benchmark, not a test: compare within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

from sqlalchemy.engine import make_url

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.databases import fresh_postgres
from bench.gateway_bench import (
    BENCH,
    _BackendCpu,
    _Child,
    _create_key,
    _interpreter_marker_s,
    _machine_busy_s,
    _outcomes,
    _start_gateway,
    process_tree,
)
from bench.profile_summary import summarize
from ledger.store.db import migrate

# --- the processes ----------------------------------------------------------------------


def _start_mock(tmp: Path, chunks: int, delay_ms: float) -> tuple[_Child, str]:
    """The bench mock (``bench/stream_mock.py``): every answer a long paced stream."""
    command = [sys.executable, str(BENCH / "stream_mock.py"), "--chunks", str(chunks)]
    mock = _Child([*command, "--delay-ms", str(delay_ms)], tmp / "mock.log", pipe=True)
    assert mock.popen.stdout is not None
    line = mock.popen.stdout.readline().decode().strip()  # "listening http://HOST:PORT"
    if not line.startswith("listening "):
        mock.stop()
        raise SystemExit(f"the bench mock did not start: {mock.log.read_text()[-2000:]}")
    return mock, line.removeprefix("listening ")


def _rss_kb(pid: int) -> int:
    """The resident memory of ``pid`` and of the processes under it (a serving process's
    workers and read-model follower)."""
    total = 0
    for each in process_tree(pid):
        with contextlib.suppress(OSError):  # it ended while we looked
            for line in Path(f"/proc/{each}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total


class _PeakRss:
    """The serving process's resident memory, sampled every 100 ms by a thread."""

    def __init__(self, pid: int) -> None:
        self._pid = pid
        self.peak_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> _PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while True:
            try:
                self.peak_kb = max(self.peak_kb, _rss_kb(self._pid))
            except OSError:
                return
            if self._stop.wait(0.1):
                return


def _load(
    url: str, api_key: str | None, concurrency: int, seconds: float, warmup: float, chunks: int
) -> dict[str, Any]:
    """The load generator in its own process: streams, each asking for ``chunks`` tokens,
    the streams started one after another over the first two thirds of the warm-up (as load
    grows on a gateway in service, not all in one instant)."""
    model = "chat" if api_key else "mock-model"
    command = [sys.executable, str(BENCH / "loadgen.py"), "--url", f"{url}/chat/completions"]
    command += ["--model", model, "--concurrency", str(concurrency), "--stream"]
    command += ["--seconds", str(seconds), "--warmup", str(warmup), "--ramp", str(warmup * 2 / 3)]
    command += ["--max-tokens", str(max(64, 2 * chunks))]
    if api_key:
        command += ["--api-key", api_key]
    done = subprocess.run(command, capture_output=True, check=True, timeout=seconds + 300)
    return cast(dict[str, Any], json.loads(done.stdout))


@dataclass(frozen=True)
class _Cpu:
    wall: float
    machine: float
    ours: dict[str, float]  # process name -> CPU seconds (with its children)


def _cpu(children: dict[str, _Child]) -> _Cpu:
    ours = {name: child.cpu_s() for name, child in children.items()}
    return _Cpu(time.monotonic(), _machine_busy_s(), ours)


# --- one cell ---------------------------------------------------------------------------


@dataclass
class Cell:
    concurrency: int
    direct: dict[str, Any] = field(default_factory=dict)
    gateway: dict[str, Any] = field(default_factory=dict)
    direct_cpu_s: dict[str, float] = field(default_factory=dict)
    gateway_cpu_s: dict[str, float] = field(default_factory=dict)
    other_load_cores: float = 0.0
    gateway_window_s: float = 0.0  # from the gateway cell's start until the gateway is idle
    client_cpu_s: float = 0.0  # the load generator's, through the gateway
    rss_idle_kb: int = 0  # after a quarter of the load (baseline_streams at once)
    rss_peak_kb: int = 0
    baseline_streams: int = 0
    ledger_completed: int = 0
    ledger_failed: int = 0
    profile: dict[str, Any] | None = None

    @property
    def streams_ratio(self) -> float:
        direct = float(self.direct["window_streams_per_s"])
        return round(float(self.gateway["window_streams_per_s"]) / max(direct, 1e-9), 3)

    @property
    def added_ttft_p50_ms(self) -> float:
        return round(float(self.gateway["ttft_p50_ms"]) - float(self.direct["ttft_p50_ms"]), 1)

    @property
    def added_ttft_p99_ms(self) -> float:
        return round(float(self.gateway["ttft_p99_ms"]) - float(self.direct["ttft_p99_ms"]), 1)

    @property
    def gateway_cpu_us_per_chunk(self) -> float:
        return round(self.gateway_cpu_s["gateway"] * 1e6 / max(int(self.gateway["events"]), 1), 1)

    @property
    def postgres_cpu_ms_per_stream(self) -> float:
        return round(self.gateway_cpu_s["postgres"] * 1e3 / max(int(self.gateway["sent"]), 1), 3)

    @property
    def cores(self) -> dict[str, float]:
        """How much of a core each process kept busy through the gateway cell: the gateway
        (its follower child and workers included), PostgreSQL, the mock, the load generator.
        Beside the streams/s, whether the gateway or the machine ran out."""
        spent = {**self.gateway_cpu_s, "load generator": self.client_cpu_s}
        window = max(self.gateway_window_s, 1e-9)
        return {
            name: round(spent.get(name, 0.0) / window, 2)
            for name in ("gateway", "postgres", "mock", "load generator")
        }

    @property
    def kb_per_open_stream(self) -> float:
        more = max(self.concurrency - self.baseline_streams, 1)
        return round((self.rss_peak_kb - self.rss_idle_kb) / more, 1)

    @property
    def broken(self) -> int:
        return int(self.gateway["lost"]) + int(self.gateway["cut"])

    @property
    def valid(self) -> bool:
        return (
            self.direct["ok"]
            and self.gateway["ok"]
            and self.ledger_completed == self.gateway["sent"]
            and self.ledger_failed == 0
        )

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            streams_ratio=self.streams_ratio,
            added_ttft_p50_ms=self.added_ttft_p50_ms,
            added_ttft_p99_ms=self.added_ttft_p99_ms,
            gateway_cpu_us_per_chunk=self.gateway_cpu_us_per_chunk,
            postgres_cpu_ms_per_stream=self.postgres_cpu_ms_per_stream,
            kb_per_open_stream=self.kb_per_open_stream,
            cores=self.cores,
            valid=self.valid,
        )
        return out


@dataclass
class _Bench:
    args: argparse.Namespace
    tmp: Path
    database_url: str
    api_key: str
    mock: _Child
    mock_url: str

    def direct(self, cell: Cell) -> None:
        args = self.args
        start = _cpu({"mock": self.mock})
        cell.direct = _load(
            f"{self.mock_url}/v1", None, cell.concurrency, args.seconds, args.warmup, args.chunks
        )
        end = _cpu({"mock": self.mock})
        cell.direct_cpu_s = {"mock": round(end.ours["mock"] - start.ours["mock"], 2)}

    def through_gateway(self, cell: Cell) -> None:
        args, c = self.args, cell.concurrency
        capacity = args.max_in_flight or 2 * c
        source = Path(args.source) if args.source else None
        gateway, url = _start_gateway(
            self.tmp,
            self.database_url,
            self.mock_url,
            source=source,
            serve_args=[
                "--max-in-flight",
                str(capacity),
                "--workers",
                str(args.workers),
                *args.serve_arg,
            ],
        )
        try:
            # A quarter of the load first: what the gateway holds whatever the number of
            # streams (caches, pools, the allocator's arenas) is in the baseline, so that
            # the memory per open stream is the slope from there to the full load.
            cell.baseline_streams = max(4, c // 4)
            _load(f"{url}/v1", self.api_key, cell.baseline_streams, 3.0, 0.0, args.chunks)
            gateway.settle()
            cell.rss_idle_kb = _rss_kb(gateway.pid)  # its workers' too, with --workers
            before = asyncio.run(_outcomes(self.database_url))
            database = make_url(self.database_url).database or ""
            spy = self._spy(gateway, c) if args.profile else None
            with _BackendCpu(database) as postgres, _PeakRss(gateway.pid) as rss:
                start = _cpu({"gateway": gateway, "mock": self.mock})
                cell.gateway = _load(
                    f"{url}/v1", self.api_key, c, args.seconds, args.warmup, args.chunks
                )
                sent = cell.gateway["sent"]
                after = asyncio.run(_outcomes(self.database_url, (before[0] + sent, before[1])))
                gateway.settle()
                end = _cpu({"gateway": gateway, "mock": self.mock})
            if spy is not None:
                cell.profile = self._spied(spy, c)
            cell.rss_peak_kb = rss.peak_kb
            spent = {name: end.ours[name] - start.ours[name] for name in end.ours}
            spent["postgres"] = postgres.seconds
            cell.gateway_cpu_s = {name: round(v, 2) for name, v in spent.items()}
            machine = end.machine - start.machine
            # This orchestrator and the load generator are not in `spent`; the load
            # generator's own CPU is reported by it (client_cpu_ms_per_request).
            client = cell.gateway["client_cpu_ms_per_request"] * cell.gateway["measured"] / 1e3
            others = machine - sum(spent.values()) - client
            window = end.wall - start.wall
            cell.other_load_cores = round(max(others, 0.0) / max(window, 1e-9), 2)
            cell.gateway_window_s = round(window, 2)
            cell.client_cpu_s = round(client, 2)
            cell.ledger_completed = after[0] - before[0]
            cell.ledger_failed = after[1] - before[1]
        finally:
            gateway.stop()

    def _spy(self, gateway: _Child, concurrency: int) -> subprocess.Popen[bytes]:
        py_spy = Path(sys.executable).with_name("py-spy")
        command = str(py_spy) if py_spy.exists() else shutil.which("py-spy") or "py-spy"
        output = Path(self.args.profile) / f"streams_c{concurrency}.speedscope.json"
        output.parent.mkdir(parents=True, exist_ok=True)
        duration = round(self.args.warmup + self.args.seconds)
        record = [command, "record", "--pid", str(gateway.pid), "--rate", "100"]
        if self.args.native:
            record.append("--native")
        record += ["--format", "speedscope", "--output", str(output), "--duration", str(duration)]
        spy = subprocess.Popen(record, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.5)  # let py-spy attach before the load starts
        return spy

    def _spied(self, spy: subprocess.Popen[bytes], concurrency: int) -> dict[str, Any]:
        _, error = spy.communicate(timeout=600)
        if spy.returncode != 0:
            raise SystemExit(f"py-spy failed: {error.decode()[-2000:]}")
        output = Path(self.args.profile) / f"streams_c{concurrency}.speedscope.json"
        return {"file": str(output), **summarize(json.loads(output.read_text()))}


# --- output -----------------------------------------------------------------------------

_COLUMNS = (
    ("c", 5), ("direct streams/s", 16), ("gateway streams/s", 17), ("ratio", 6),
    ("direct chunks/s", 15), ("gateway chunks/s", 16), ("direct TTFT p50/p99", 19),
    ("gateway TTFT p50/p99", 20), ("added p99", 9), ("broken", 6), ("gw CPU us/chunk", 15),
    ("pg CPU ms/stream", 16), ("KB/open stream", 14), ("cores gw/pg/mock/load", 21),
    ("other load", 10), ("ledger", 16),
)  # fmt: skip


def _table(cells: Sequence[Cell]) -> str:
    lines = ["  ".join(f"{name:>{width}}" for name, width in _COLUMNS)]
    for cell in cells:
        d, g = cell.direct, cell.gateway
        ledger = f"{cell.ledger_completed}/{g['sent']}" + ("" if cell.valid else " INVALID")
        values = (
            cell.concurrency, f"{d['window_streams_per_s']:,.0f}",
            f"{g['window_streams_per_s']:,.0f}", f"{cell.streams_ratio:.2f}",
            f"{d['window_events_per_s']:,.0f}", f"{g['window_events_per_s']:,.0f}",
            f"{d['ttft_p50_ms']:.1f} / {d['ttft_p99_ms']:.1f}",
            f"{g['ttft_p50_ms']:.1f} / {g['ttft_p99_ms']:.1f}", f"{cell.added_ttft_p99_ms:.1f}",
            cell.broken, f"{cell.gateway_cpu_us_per_chunk:.1f}",
            f"{cell.postgres_cpu_ms_per_stream:.2f}", f"{cell.kb_per_open_stream:.1f}",
            "/".join(f"{v:.2f}" for v in cell.cores.values()), f"{cell.other_load_cores:.2f}",
            ledger,
        )  # fmt: skip
        lines.append("  ".join(f"{v!s:>{w}}" for v, (_, w) in zip(values, _COLUMNS, strict=True)))
    return "\n".join(lines)


def _plot(cells: Sequence[Cell], path: Path, title: str) -> None:
    """Streams/s (left) and time to first token (right) against concurrency, direct and
    through the gateway."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(cells, key=lambda c: c.concurrency)
    xs = [c.concurrency for c in rows]
    figure, (rate, ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    for target, colour in (("direct", "tab:blue"), ("gateway", "tab:red")):
        name = "Waybill" if target == "gateway" else target
        runs = [getattr(c, target) for c in rows]
        rate.plot(xs, [r["window_streams_per_s"] for r in runs], "-o", color=colour, label=name)
        for stat, style in (("ttft_p50_ms", "-o"), ("ttft_p99_ms", "--^")):
            label = f"{name} {stat.removeprefix('ttft_').removesuffix('_ms')}"
            ttft.plot(xs, [r[stat] for r in runs], style, color=colour, label=label)
    rate.set_ylabel("complete streams per second")
    ttft.set_ylabel("time to first token (ms)")
    ttft.set_yscale("log")
    for axis in (rate, ttft):
        axis.set_xticks(xs, [str(x) for x in xs])
        axis.set_xlabel("concurrent streams (closed loop)")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# --- main -------------------------------------------------------------------------------


def _bench(args: argparse.Namespace) -> dict[str, Any]:
    cells = [Cell(c) for c in map(int, args.concurrency.split(","))]
    loadavg_before = os.getloadavg()
    marker_before = _interpreter_marker_s()
    database_url = fresh_postgres(args.database)
    migrate(database_url)
    api_key = asyncio.run(_create_key(database_url))
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        mock, mock_url = _start_mock(tmp, args.chunks, args.chunk_delay_ms)
        bench = _Bench(args, tmp, database_url, api_key, mock, mock_url)
        try:
            for cell in cells:
                bench.direct(cell)
                bench.through_gateway(cell)
                print(f"  c{cell.concurrency} done", file=sys.stderr, flush=True)
        finally:
            mock.stop()
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "chunks": args.chunks,
        "chunk_delay_ms": args.chunk_delay_ms,
        "seconds_per_cell": args.seconds,
        "warmup_s": args.warmup,
        "cpu_count": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in loadavg_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "interpreter_marker_s": [marker_before, _interpreter_marker_s()],
        "cells": [cell.as_json() for cell in cells],
        "valid": all(cell.valid for cell in cells),
        "_cells": cells,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="200,1000")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per cell")
    parser.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds first")
    parser.add_argument("--chunks", type=int, default=50, help="content chunks per stream")
    parser.add_argument("--chunk-delay-ms", type=float, default=20.0)
    parser.add_argument(
        "--max-in-flight", type=int, default=0, help="the gateway's (0: twice the concurrency)"
    )
    parser.add_argument("--database", default="waybill_streams_bench", help="dropped, recreated")
    parser.add_argument("--workers", type=int, default=1, help="the gateway's `--workers`")
    parser.add_argument("--source", help="serve the gateway of this checkout (default: this one)")
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more option of the gateway's `waybill serve` (repeat for more)",
    )
    parser.add_argument("--json", action="store_true", help="JSON on stdout, the table on stderr")
    parser.add_argument("--profile", help="profile each gateway cell with py-spy into this folder")
    parser.add_argument("--native", action="store_true", help="profiles include C frames")
    parser.add_argument(
        "--plot", default="", help="write streams/s and TTFT against concurrency to this PNG"
    )
    args = parser.parse_args()
    result = _bench(args)
    cells: list[Cell] = result.pop("_cells")
    report = sys.stderr if args.json else sys.stdout
    print(_table(cells), file=report)
    for cell in cells:
        if cell.profile is not None:
            print(f"\nc{cell.concurrency} profile:\n{cell.profile['text']}", file=report)
    before, after = result["loadavg_before"], result["loadavg_after"]
    print(f"\nload average (1, 5, 15 min) before / after: {before} / {after}", file=report)
    marker = " / ".join(f"{m:.3f}" for m in result["interpreter_marker_s"])
    print(f"interpreter marker (s, 10M-step loop) before / after: {marker}", file=report)
    if args.plot:
        title = (
            f"{args.chunks} chunks {args.chunk_delay_ms:g} ms apart, ledger on PostgreSQL, "
            f"{result['cpu_count']} cores"
        )
        _plot(cells, Path(args.plot), title)
        print(f"plot: {args.plot}", file=report)
    if args.json:
        print(json.dumps(result, indent=2))
    if not result["valid"]:
        message = "INVALID: a response was not a complete 200, or the ledger missed events"
        print(message, file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
