"""Gateway overhead benchmark: the same load sent directly to a fake provider and through Waybill.

    .venv/bin/python bench/gateway_bench.py [--backend postgres|sqlite|sqlite,postgres]
        [--rounds 1] [--seconds 5]
        [--concurrency 1,16,64] [--modes buffered,streaming] [--json]
        [--plot bench/gateway_latency.png] [--profile PATH.speedscope.json]
        [--profile-concurrency 16] [--database waybill_gateway_bench] [--verify]

Four processes: the fake provider (``python -m router.fake_provider``), the gateway
(``waybill serve``, ledger on a fresh database), this orchestrator, and for each cell a
closed-loop keep-alive load generator (``bench/loadgen.py``). For every mode and concurrency
the load goes first straight to the fake, then through the gateway; per cell: requests/s,
p50 / p99 latency, the added p50 latency, the gateway's CPU ms per request (utime + stime of
the ``waybill serve`` process and its children, the read-model follower among them, from
/proc, from the cell's start until the gateway is idle again, so deferred work such as
projections is included), and gateway/direct throughput.

A cell is valid only if every response was a complete 200 and the ledger gained exactly one
``RequestCompleted`` (and no ``RequestFailed``) per request sent through the gateway.
With ``--profile``, one more buffered cell (concurrency 16, or ``--profile-concurrency``) runs
through the gateway under ``py-spy record`` and the hottest functions are summarised (see
``bench/profile_summary.py``).
With two backends (``--backend sqlite,postgres``) and ``--rounds N``, the whole run is repeated
for each backend, alternating (the order flips each round, so neither always runs on a
fresher machine), and each cell's median gateway throughput of the first backend over the
second's is printed: the embedded default against PostgreSQL, measured in one run.
A benchmark, not a test: figures vary with the machine; compare within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.databases import fresh_postgres
from bench.profile_summary import summarize
from ledger import apikeys
from ledger.store import EventStore
from ledger.store.db import create_engine, migrate, sync_url
from ledger.store.stored import count_types
from router.fake_provider import FakeUpstream
from tests.gateway.harness import ANTHROPIC_ENV, Route, closed_port, config_text

BENCH = Path(__file__).resolve().parent
_CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- the processes ----------------------------------------------------------------------


class _Child:
    """A process this benchmark started, with its CPU time read from /proc."""

    def __init__(
        self,
        args: Sequence[str],
        log: Path,
        env: dict[str, str] | None = None,
        *,
        pipe: bool,
        cwd: Path | None = None,
    ) -> None:
        self.log = log
        self._log_file = log.open("wb")
        stdout = subprocess.PIPE if pipe else self._log_file  # pipe: we read its first line
        self.popen = subprocess.Popen(
            list(args), stdout=stdout, stderr=self._log_file, env=env, cwd=cwd
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def cpu_s(self) -> float:
        return _tree_cpu_s(self.pid)

    def settle(self, quiet_s: float = 0.5, within_s: float = 30.0) -> None:
        """Wait until the process is (nearly) idle: deferred work from the last cell is done."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            before = self.cpu_s()
            time.sleep(quiet_s)
            if self.cpu_s() - before <= 0.02 * quiet_s + 1 / _CLK_TCK:
                return

    def wait_ready(self, url: str, what: str, within_s: float = 30.0) -> None:
        """Until ``url`` answers 200; stop the process and exit, with its log, if it ends or
        ``within_s`` passes first."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline and self.popen.poll() is None:
            try:
                with urllib.request.urlopen(url, timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:  # not listening yet (URLError is an OSError)
                time.sleep(0.1)
        self.stop()
        raise SystemExit(f"{what} did not become ready: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log_file.close()


# `waybill` from the code of the side being run: `router.cli.main:main` since the CLI became a
# package, `router.cli:main` before (a side may be an older commit, checked out to compare).
RUN_WAYBILL = (
    "import importlib; c = importlib.import_module('router.cli'); "
    "m = getattr(c, 'main', None) or importlib.import_module('router.cli.main'); "
    "getattr(m, 'main', m)()"
)


def _start_fake(tmp: Path) -> tuple[_Child, str]:
    fake = _Child(
        [sys.executable, "-m", "router.fake_provider", "--port", "0", "--name", "fake"],
        tmp / "fake.log",
        pipe=True,
    )
    assert fake.popen.stdout is not None
    line = fake.popen.stdout.readline().decode().strip()  # "listening http://HOST:PORT"
    if not line.startswith("listening "):
        fake.stop()
        raise SystemExit(f"fake provider did not start: {fake.log.read_text()[-2000:]}")
    return fake, line.removeprefix("listening ")


class _RemoteUpstream:
    """Where a fake provider in another process listens, shaped for ``config_text``."""

    def __init__(self, root_url: str) -> None:
        self.root_url = root_url
        self.base_url = f"{root_url}/v1"


def _start_gateway(
    tmp: Path,
    database_url: str,
    fake_root: str,
    *,
    source: Path | None = None,
    extra_env: dict[str, str] | None = None,
    python: str | None = None,
    checkpoints: str = "",
    serve_args: Sequence[str] = (),
    wrapper: Sequence[str] = (),
    ready_within_s: float = 30.0,
    more_upstreams: dict[str, str] | None = None,
    groups: dict[str, str] | None = None,
) -> tuple[_Child, str]:
    """``waybill serve`` on ``database_url`` in front of the fake: the code of this
    checkout (whatever the environment has installed), or with ``source`` the code of that
    checkout (``bench/ab.py``), run by ``python`` (an
    interpreter whose environment has the project's dependencies; this one by default),
    and ``extra_env`` added; ``checkpoints``: the config's checkpoints block, if any;
    ``serve_args``: more options of ``waybill serve``; ``wrapper``: a command that runs
    the interpreter (``valgrind ...``), ready within ``ready_within_s``; ``more_upstreams``
    (name → root URL) and ``groups`` (model group → its YAML): more endpoints, and model
    groups that route to them, beside ``chat``."""
    roots = {"fake": fake_root, **(more_upstreams or {})}
    upstreams = {name: cast(FakeUpstream, _RemoteUpstream(root)) for name, root in roots.items()}
    config = tmp / "waybill.yaml"
    text = config_text(
        upstreams, [Route("fake")], generation="bench-1", checkpoints=checkpoints, groups=groups
    )
    config.write_text(text)
    # What a plain `waybill serve` gets: no Redis, no OTLP export (metrics stay on).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "WAYBILL_"))}
    env.update(ANTHROPIC_ENV)
    env.update(extra_env or {})
    # Its packages first on the path, for the follower child too.
    env["PYTHONPATH"] = str(source or BENCH.parent)
    command = [*wrapper, python or sys.executable, "-c", RUN_WAYBILL]
    port = closed_port()
    serve = ["serve", "--config", str(config), "--database-url", database_url]
    serve += ["--port", str(port), "--no-migrate", *serve_args]
    gateway = _Child([*command, *serve], tmp / "gateway.log", env, pipe=False, cwd=source)
    url = f"http://127.0.0.1:{port}"
    gateway.wait_ready(f"{url}/readyz", "gateway", within_s=ready_within_s)
    return gateway, url


def _post(url: str) -> None:
    request = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=5):
        pass


# --- the ledger ---------------------------------------------------------------------------


def _fresh_database(backend: str, tmp: Path, name: str = "waybill_gateway_bench") -> str:
    """A migrated, empty ledger: the PostgreSQL database ``name`` (dropped and recreated), or
    a SQLite file in ``tmp``."""
    url = f"sqlite:///{tmp / 'gateway_bench.db'}" if backend == "sqlite" else fresh_postgres(name)
    migrate(url)
    return url


async def _create_key(database_url: str) -> str:
    engine = create_engine(database_url)
    store = EventStore(engine)
    try:
        return (await apikeys.create_key(store, "acme", "client")).secret
    finally:
        await store.close()
        await engine.dispose()


async def _outcomes(database_url: str, at_least: tuple[int, int] | None = None) -> tuple[int, int]:
    """(RequestCompleted, RequestFailed) in the ledger; with ``at_least``, wait (up to 30 s)
    until the completed count reaches it: a stream's last events may follow its last byte."""
    engine = create_engine(database_url, pool_size=1)
    deadline = time.monotonic() + 30
    try:
        while True:
            async with engine.connect() as conn:
                counts = await count_types(conn, ("RequestCompleted", "RequestFailed"))
            found = (counts.get("RequestCompleted", 0), counts.get("RequestFailed", 0))
            if at_least is None or sum(found) >= sum(at_least) or time.monotonic() > deadline:
                return found
            await asyncio.sleep(0.1)
    finally:
        await engine.dispose()


# --- one cell ---------------------------------------------------------------------------


def _load(
    url: str,
    model: str,
    api_key: str | None,
    stream: bool,
    concurrency: int,
    args: argparse.Namespace,
    headers: Sequence[str] = (),
    *,
    requests: int = 0,
) -> dict[str, Any]:
    """Run the load generator in its own process (``args.seconds`` long, or until it has
    sent ``requests``); its JSON summary. ``headers``: more ``NAME: VALUE`` headers for
    every request."""
    command = [sys.executable, str(BENCH / "loadgen.py"), "--url", f"{url}/chat/completions"]
    command += ["--model", model, "--concurrency", str(concurrency)]
    command += ["--seconds", str(args.seconds), "--warmup", str(args.warmup)]
    if requests:
        command += ["--requests", str(requests)]
    if api_key:
        command += ["--api-key", api_key]
    for header in headers:
        command += ["--header", header]
    if stream:
        command.append("--stream")
    done = subprocess.run(command, capture_output=True, check=True, timeout=args.seconds + 120)
    return cast(dict[str, Any], json.loads(done.stdout))


@dataclass(frozen=True)
class _Usage:
    """CPU seconds used so far, read together: the whole machine and each of our processes."""

    wall: float
    machine: float
    gateway: float
    fake: float
    bench: float  # this orchestrator and the load generators it has waited for

    def since(self, start: _Usage, requests: int, postgres_s: float = 0.0) -> dict[str, float]:
        """CPU ms per request of each process over the window, and how many cores the rest of
        the machine (other users' work) kept busy meanwhile."""
        wall = self.wall - start.wall
        spent = {name: getattr(self, name) - getattr(start, name) for name in ("gateway", "fake")}
        spent["postgres"] = postgres_s
        spent["bench"] = self.bench - start.bench
        others = (self.machine - start.machine) - sum(spent.values())
        out = {f"{name}_cpu_ms_per_request": _per_request(v, requests) for name, v in spent.items()}
        out["other_load_cores"] = round(max(others, 0.0) / max(wall, 1e-9), 2)
        return out


def _machine_busy_s() -> float:
    # /proc/stat "cpu" line: user nice system idle iowait irq softirq steal ...
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(values) - values[3] - values[4]) / _CLK_TCK


def _process_cpu_s(pid: int | str) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rfind(")") + 2 :].split()  # fields[0] is field 3 (state)
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime + stime


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and of every process under it, running or ended (``waybill
    serve`` on PostgreSQL runs its read models in a child, ``ledger.views.follow``; with
    ``--workers`` the workers are its children and the read models a worker's)."""
    return sum(
        # utime + stime, and cutime + cstime: its children that ended and were reaped
        sum(int(v) for v in fields[11:15]) / _CLK_TCK
        for fields in process_tree(pid).values()
    )


def process_tree(pid: int) -> dict[int, list[str]]:
    """``pid`` and the processes under it, each with the fields of its ``/proc/PID/stat``
    from the third on (``fields[0]`` is field 3, the state)."""
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # the process ended while we looked
            continue
        stats[int(entry.name)] = stat[stat.rfind(")") + 2 :].split()
    children: dict[int, list[int]] = {}
    for other, fields in stats.items():
        children.setdefault(int(fields[1]), []).append(other)
    tree: dict[int, list[str]] = {}
    todo = [pid]
    while todo:
        current = todo.pop()
        if current in stats:
            tree[current] = stats[current]
            todo += children.get(current, [])
    return tree


class _BackendCpu:
    """CPU seconds of the PostgreSQL backends serving ``database`` (their title names it),
    sampled every 100 ms by a thread: the gateway's pool opens and closes overflow connections
    during a cell, and a backend that exits takes its counters with it, so at most its last
    100 ms is missed."""

    def __init__(self, database: str) -> None:
        self._needle = f" {database} ".encode()
        self._first: dict[str, float] = {}
        self._last: dict[str, float] = {}
        self._not_postgres: set[str] = set()  # read each process's title once, not every scan
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, daemon=True)

    def __enter__(self) -> _BackendCpu:
        self._first = self._scan()  # backends already running count from here
        self._last = dict(self._first)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self._last.update(self._scan())

    @property
    def seconds(self) -> float:
        return sum(last - self._first.get(pid, 0.0) for pid, last in self._last.items())

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(0.1):
            self._last.update(self._scan())

    def _scan(self) -> dict[str, float]:
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or entry.name in self._not_postgres:
                continue
            try:
                title = (entry / "cmdline").read_bytes()
                if b"postgres" not in title:
                    self._not_postgres.add(entry.name)
                elif title.startswith(b"postgres:") and self._needle in title:
                    found[entry.name] = _process_cpu_s(entry.name)
            except OSError:  # the process ended while we looked
                continue
        return found


class _LedgerSampler:
    """The ledger while the gateway is under load, sampled every 100 ms by a thread: how
    fast it grows (events appended per second) and how far the read models trail it
    (projection lag: head position minus the furthest-behind checkpoint)."""

    def __init__(self, database_url: str) -> None:
        self._engine = sa.create_engine(sync_url(database_url), poolclass=NullPool)
        self._samples: list[tuple[float, int, int]] = []  # (time, head, lag)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, daemon=True)

    def __enter__(self) -> _LedgerSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self._engine.dispose()

    def _sample_until_stopped(self) -> None:
        with self._engine.connect() as conn:
            while True:
                head = int(conn.scalar(sa.text("SELECT position FROM ledger_head")) or 0)
                lowest = conn.scalar(sa.text("SELECT min(position) FROM projection_checkpoints"))
                conn.rollback()
                lag = head - int(lowest) if lowest is not None else 0
                self._samples.append((time.monotonic(), head, lag))
                if self._stop.wait(0.1):
                    return

    def summary(self) -> dict[str, float]:
        if len(self._samples) < 2:
            return {"events_per_s": 0.0, "projection_lag_p50": 0, "projection_lag_max": 0}
        (t0, head0, _), (t1, head1, _) = self._samples[0], self._samples[-1]
        lags = sorted(lag for _, _, lag in self._samples)
        return {
            "events_per_s": round((head1 - head0) / max(t1 - t0, 1e-9), 1),
            "projection_lag_p50": lags[len(lags) // 2],
            "projection_lag_max": lags[-1],
        }


@dataclass
class Cell:
    mode: str
    concurrency: int
    direct: dict[str, Any] = field(default_factory=dict)
    gateway: dict[str, Any] = field(default_factory=dict)
    direct_cpu: dict[str, float] = field(default_factory=dict)
    gateway_cpu: dict[str, float] = field(default_factory=dict)
    ledger_completed: int = 0
    ledger_failed: int = 0
    ledger_load: dict[str, float] = field(default_factory=dict)  # _LedgerSampler.summary

    @property
    def added_p50_ms(self) -> float:
        return round(float(self.gateway["p50_ms"]) - float(self.direct["p50_ms"]), 3)

    @property
    def throughput_ratio(self) -> float:
        return round(float(self.gateway["rps"]) / max(float(self.direct["rps"]), 1e-9), 3)

    @property
    def gateway_cpu_ms_per_request(self) -> float:
        return self.gateway_cpu["gateway_cpu_ms_per_request"]

    @property
    def valid(self) -> bool:
        sent = self.gateway["sent"]
        return (
            self.direct["ok"]
            and self.gateway["ok"]
            and self.ledger_completed == sent
            and self.ledger_failed == 0
        )

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            added_p50_ms=self.added_p50_ms, throughput_ratio=self.throughput_ratio, valid=self.valid
        )
        return out


@dataclass
class _Run:
    args: argparse.Namespace
    database_url: str
    api_key: str
    fake: _Child
    fake_url: str
    gateway: _Child
    gateway_url: str

    def usage(self) -> _Usage:
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return _Usage(
            wall=time.monotonic(),
            machine=_machine_busy_s(),
            gateway=self.gateway.cpu_s(),
            fake=self.fake.cpu_s(),
            bench=time.process_time() + children.ru_utime + children.ru_stime,
        )

    def direct(self, cell: Cell) -> None:
        stream = cell.mode == "streaming"
        self.gateway.settle()
        _post(f"{self.fake_url}/_fake/reset")  # its request log would only grow
        start = self.usage()
        fake_api = f"{self.fake_url}/v1"
        cell.direct = _load(fake_api, "fake-model", None, stream, cell.concurrency, self.args)
        cell.direct_cpu = self.usage().since(start, cell.direct["sent"])

    def through_gateway(self, cell: Cell) -> None:
        stream = cell.mode == "streaming"
        self.gateway.settle()
        _post(f"{self.fake_url}/_fake/reset")
        before = asyncio.run(_outcomes(self.database_url))
        # SQLite runs inside the gateway's process; "" matches no PostgreSQL backend then.
        database = make_url(self.database_url).database if self.args.backend == "postgres" else ""
        with _BackendCpu(database or "") as postgres:
            start = self.usage()
            api = f"{self.gateway_url}/v1"
            with _LedgerSampler(self.database_url) as ledger:
                cell.gateway = _load(api, "chat", self.api_key, stream, cell.concurrency, self.args)
            cell.ledger_load = ledger.summary()
            sent = cell.gateway["sent"]
            after = asyncio.run(_outcomes(self.database_url, (before[0] + sent, before[1])))
            # Until the gateway is idle again: work it deferred (projections) is a cost too.
            self.gateway.settle()
            end = self.usage()
        cell.gateway_cpu = end.since(start, sent, postgres.seconds)
        cell.ledger_completed = after[0] - before[0]
        cell.ledger_failed = after[1] - before[1]

    def profile(self, output: Path, concurrency: int) -> dict[str, Any]:
        """One more buffered cell through the gateway, sampled by py-spy."""
        py_spy = Path(sys.executable).with_name("py-spy")
        command = str(py_spy) if py_spy.exists() else shutil.which("py-spy") or "py-spy"
        self.gateway.settle()
        _post(f"{self.fake_url}/_fake/reset")
        duration = max(1, round(self.args.warmup + self.args.seconds))
        record = [command, "record", "--pid", str(self.gateway.pid), "--rate", "200"]
        record += ["--format", "speedscope", "--output", str(output), "--duration", str(duration)]
        spy = subprocess.Popen(record, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.5)  # let py-spy attach before the load starts
        api = f"{self.gateway_url}/v1"
        load = _load(api, "chat", self.api_key, False, concurrency, self.args)
        _, error = spy.communicate(timeout=duration + 60)
        if spy.returncode != 0:
            raise SystemExit(f"py-spy failed: {error.decode()[-2000:]}")
        return {"file": str(output), "load": load, **summarize(json.loads(output.read_text()))}


def _verify(database_url: str) -> dict[str, dict[str, Any]]:
    """``waybill verify`` and ``waybill verify --books`` on the run's ledger, once its gateway
    has stopped: each one's exit status and last line."""
    out = {}
    for name, extra in (("chain", []), ("books", ["--books"])):
        command = [sys.executable, "-c", RUN_WAYBILL, "verify", *extra]
        done = subprocess.run(
            [*command, "--database-url", database_url], capture_output=True, text=True
        )
        lines = (done.stdout or done.stderr).strip().splitlines()
        out[name] = {"ok": done.returncode == 0, "said": lines[-1] if lines else ""}
    return out


def _per_request(cpu_s: float, requests: int) -> float:
    return round(cpu_s * 1000 / max(requests, 1), 3)


# --- output -----------------------------------------------------------------------------

_COLUMNS = (
    ("mode", 9), ("c", 3), ("direct rps", 10), ("gateway rps", 11), ("ratio", 6),
    ("direct p50/p99 ms", 18), ("gateway p50/p99 ms", 19), ("added p50 ms", 12),
    ("gw CPU ms/req", 13), ("pg CPU ms/req", 13), ("other load", 10), ("ledger", 14),
    ("ledger ev/s", 11), ("proj lag p50/max", 16),
)  # fmt: skip


def _table(cells: Sequence[Cell]) -> str:
    """One line per cell; "other load" is the cores kept busy by processes outside the
    benchmark during the gateway phase (the machine has two)."""
    lines = ["  ".join(f"{name:>{width}}" for name, width in _COLUMNS)]
    for cell in cells:
        d, g = cell.direct, cell.gateway
        ledger = f"{cell.ledger_completed}/{g['sent']}" + ("" if cell.valid else " INVALID")
        values = (
            cell.mode, cell.concurrency, f"{d['rps']:,.0f}", f"{g['rps']:,.0f}",
            f"{cell.throughput_ratio:.2f}", f"{d['p50_ms']:.2f} / {d['p99_ms']:.2f}",
            f"{g['p50_ms']:.2f} / {g['p99_ms']:.2f}", f"{cell.added_p50_ms:.2f}",
            f"{cell.gateway_cpu_ms_per_request:.2f}",
            f"{cell.gateway_cpu['postgres_cpu_ms_per_request']:.2f}",
            f"{cell.gateway_cpu['other_load_cores']:.2f}", ledger,
            f"{cell.ledger_load['events_per_s']:,.0f}",
            f"{cell.ledger_load['projection_lag_p50']} / {cell.ledger_load['projection_lag_max']}",
        )  # fmt: skip
        lines.append("  ".join(f"{v!s:>{w}}" for v, (_, w) in zip(values, _COLUMNS, strict=True)))
    return "\n".join(lines)


def _plot(cells: Sequence[Cell], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({c.mode for c in cells})
    figure, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5), squeeze=False)
    for axis, mode in zip(axes[0], modes, strict=True):
        rows = sorted((c for c in cells if c.mode == mode), key=lambda c: c.concurrency)
        xs = [c.concurrency for c in rows]
        for target, colour in (("direct", "tab:blue"), ("gateway", "tab:red")):
            for stat, style in (("p50_ms", "-o"), ("p99_ms", "--^")):
                ys = [getattr(c, target)[stat] for c in rows]
                label = f"{target} {stat.removesuffix('_ms')}"
                axis.plot(xs, ys, style, color=colour, label=label)
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xticks(xs, [str(x) for x in xs])
        axis.set_xlabel("concurrency (closed loop, keep-alive)")
        axis.set_ylabel("latency per request (ms)")
        axis.set_title(mode)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# --- main -------------------------------------------------------------------------------


_MARKER = """
import time
t = time.perf_counter()
s = 0
for i in range(10_000_000):
    s += i
print(time.perf_counter() - t)
"""


def _interpreter_marker_s() -> float:
    """Seconds a fresh interpreter takes for ten million additions at module level (the
    loop marker of bench/README.md). This machine's speed moves by a third between hours
    and between machines, and the c1 latencies with it: a run's figures are read against
    it."""
    done = subprocess.run([sys.executable, "-c", _MARKER], capture_output=True, check=True)
    return round(float(done.stdout), 3)


def _bench(args: argparse.Namespace) -> dict[str, Any]:
    cells = [
        Cell(mode, c)
        for mode in args.modes.split(",")
        for c in map(int, args.concurrency.split(","))
    ]
    loadavg_before = os.getloadavg()
    marker_before = _interpreter_marker_s()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        database_url = _fresh_database(args.backend, tmp, args.database)
        api_key = asyncio.run(_create_key(database_url))
        fake, fake_url = _start_fake(tmp)
        try:
            gateway, gateway_url = _start_gateway(
                tmp, database_url, fake_url, serve_args=["--workers", str(args.workers)]
            )
        except BaseException:
            fake.stop()
            raise
        run = _Run(args, database_url, api_key, fake, fake_url, gateway, gateway_url)
        profile = None
        try:
            for cell in cells:
                run.direct(cell)
                run.through_gateway(cell)
                print(f"  {cell.mode} c{cell.concurrency} done", file=sys.stderr, flush=True)
            if args.profile:
                profile = run.profile(Path(args.profile), args.profile_concurrency)
        finally:
            gateway.stop()
            fake.stop()
        verified = _verify(database_url) if args.verify else None
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "backend": args.backend,
        "seconds_per_cell": args.seconds,
        "warmup_s": args.warmup,
        "cpu_count": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in loadavg_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "interpreter_marker_s": [marker_before, _interpreter_marker_s()],
        "cells": [cell.as_json() for cell in cells],
        "valid": all(cell.valid for cell in cells)
        and (verified is None or all(v["ok"] for v in verified.values())),
        "verify": verified,
        "profile": profile,
        "_cells": cells,
    }


def _compare(args: argparse.Namespace, backends: Sequence[str]) -> dict[str, Any]:
    """``args.rounds`` rounds of the whole run on each backend, alternating (the order flips
    each round), and per cell the median gateway throughput of each backend and the first's
    over the second's."""
    runs: dict[str, list[dict[str, Any]]] = {backend: [] for backend in backends}
    for number in range(args.rounds):
        for backend in backends if number % 2 == 0 else list(reversed(backends)):
            print(f"round {number + 1}: {backend}", file=sys.stderr, flush=True)
            result = _bench(argparse.Namespace(**{**vars(args), "backend": backend}))
            cells: list[Cell] = result.pop("_cells")
            print(_table(cells), file=sys.stderr, flush=True)
            for name, verified in (result["verify"] or {}).items():
                print(f"verify ({name}): {verified['said']}", file=sys.stderr, flush=True)
            runs[backend].append(result)
    first, second = backends
    summary = []
    for index, cell in enumerate(runs[first][0]["cells"]):
        rps = {b: [r["cells"][index]["gateway"]["rps"] for r in runs[b]] for b in backends}
        p50 = {b: [r["cells"][index]["gateway"]["p50_ms"] for r in runs[b]] for b in backends}
        medians = {b: statistics.median(v) for b, v in rps.items()}
        summary.append(
            {
                "mode": cell["mode"],
                "concurrency": cell["concurrency"],
                "rps": rps,
                "p50_ms": p50,
                "median_rps": medians,
                "median_p50_ms": {b: statistics.median(v) for b, v in p50.items()},
                "ratio": round(medians[first] / max(medians[second], 1e-9), 3),
            }
        )
    return {
        "backends": list(backends),
        "rounds": args.rounds,
        "runs": runs,
        "summary": summary,
        "valid": all(r["valid"] for results in runs.values() for r in results),
    }


def _comparison_text(result: dict[str, Any]) -> str:
    first, second = result["backends"]
    lines = [f"\nmedians of {result['rounds']} alternating rounds, {first} / {second}:"]
    for s in result["summary"]:
        rounds = "; ".join(
            f"{b} " + ", ".join(f"{x:,.0f}" for x in s["rps"][b]) for b in result["backends"]
        )
        lines.append(
            f"  {s['mode']} c{s['concurrency']}: {first} {s['median_rps'][first]:,.0f} req/s "
            f"(p50 {s['median_p50_ms'][first]:.1f} ms), {second} "
            f"{s['median_rps'][second]:,.0f} req/s (p50 {s['median_p50_ms'][second]:.1f} ms): "
            f"ratio {s['ratio']:.2f}  [rounds: {rounds}]"
        )
    for backend, results in result["runs"].items():
        markers = ", ".join(
            " / ".join(f"{m:.2f}" for m in r["interpreter_marker_s"]) for r in results
        )
        others = ", ".join(
            f"{max(c['gateway_cpu']['other_load_cores'] for c in r['cells']):.2f}" for r in results
        )
        lines.append(f"  {backend}: loop markers {markers}; other load (max per run) {others}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backend",
        default="postgres",
        help="postgres, sqlite, or two of them (sqlite,postgres) to compare in alternating rounds",
    )
    parser.add_argument("--rounds", type=int, default=1, help="with two backends: rounds of each")
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per cell")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds first")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--modes", default="buffered,streaming")
    parser.add_argument("--json", action="store_true", help="JSON on stdout, the table on stderr")
    parser.add_argument("--plot", default=str(BENCH / "gateway_latency.png"), help="'' for none")
    parser.add_argument("--profile", help="also profile a buffered cell (speedscope JSON)")
    parser.add_argument("--profile-concurrency", type=int, default=16)
    parser.add_argument("--workers", type=int, default=1, help="the gateway's `--workers`")
    parser.add_argument(
        "--verify", action="store_true", help="then `waybill verify` (and --books) on the ledger"
    )
    parser.add_argument(
        "--database", default="waybill_gateway_bench", help="PostgreSQL: dropped and recreated"
    )
    args = parser.parse_args()
    backends = args.backend.split(",")
    if len(backends) > 2 or not set(backends) <= {"postgres", "sqlite"}:
        parser.error("--backend: postgres, sqlite, or two of them separated by a comma")
    if len(backends) == 2:
        comparison = _compare(args, backends)
        report = sys.stderr if args.json else sys.stdout
        print(_comparison_text(comparison), file=report)
        if args.json:
            print(json.dumps(comparison, indent=2))
        if not comparison["valid"]:
            print("INVALID: a response was not a complete 200, or the ledger missed events")
            sys.exit(1)
        return
    result = _bench(args)
    cells: list[Cell] = result.pop("_cells")
    if args.plot:
        title = f"Waybill gateway vs direct, ledger on {args.backend}, {args.seconds:g} s per cell"
        _plot(cells, Path(args.plot), title)
    # With --json, stdout is the JSON alone and the table goes to stderr for the reader.
    report = sys.stderr if args.json else sys.stdout
    print(_table(cells), file=report)
    if result["profile"]:
        print(f"\n{result['profile']['text']}", file=report)
    before, after = result["loadavg_before"], result["loadavg_after"]
    print(f"\nload average (1, 5, 15 min) before / after: {before} / {after}", file=report)
    marker = " / ".join(f"{m:.3f}" for m in result["interpreter_marker_s"])
    print(f"interpreter marker (s, 10M-step loop) before / after: {marker}", file=report)
    for name, verified in (result["verify"] or {}).items():
        print(f"verify ({name}): {verified['said']}", file=report)
    if args.json:
        print(json.dumps(result, indent=2))
    if not result["valid"]:
        message = "INVALID: a response was not a complete 200, or the ledger missed events"
        print(message, file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
