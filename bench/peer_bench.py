"""Peer benchmark: the same load straight to the fake provider, through Waybill, through
Portkey's gateway and through LiteLLM's proxy, in one run.

    python3 -m venv /tmp/peer-venv && /tmp/peer-venv/bin/pip install 'litellm[proxy]'
    mkdir /tmp/portkey && cd /tmp/portkey && npm init -y \\
        && npm pkg set 'overrides.@hono/node-server=2.1.9' && npm install @portkey-ai/gateway
    .venv/bin/python bench/peer_bench.py --litellm /tmp/peer-venv/bin/litellm \\
        --portkey /tmp/portkey [--node node] [--database waybill_peer_bench] [--rounds 3]
        [--seconds 5] [--warmup 1] [--prewarm 5] [--commit-seconds 2] [--concurrency 1,16]
        [--modes buffered,streaming] [--json]

Machines differ by a factor of two in speed, so an absolute figure alone cannot say whether
a target was missed by the code or by the host. Measured in the same run against the same
fake provider with the same load generator, peer gateways are the yardstick: Waybill's req/s
over each peer's, its added p50 latency over each peer's, and its CPU per request (its
PostgreSQL backends included) over each peer's. Each peer serves from one process, so one
core, while Waybill's database runs on a second: the req/s ratio depends on how many idle
cores the machine has, the CPU ratio much less. On a machine shared with other work a burst of
someone else's load can land on one gateway's cell and not the next, so the run measures every
cell ``--rounds`` times, the gateways in an order that turns each round, takes each ratio
within a round, and reports the rounds' median and range; the goals for short requests
(issue 44) are read on the median. Each round starts with a bare insert-and-commit loop on
Waybill's PostgreSQL: the contract commits twice in sequence on every request (before the
upstream call, before the answer) and the peers keep no books, so Waybill's c1 added latency
is read against the peer's plus two of those commits.

Each peer runs as its plain start command would, in front of the fake, in an environment of
its own so that its dependencies never move this project's; a peer not given is skipped with
a note. LiteLLM: ``litellm --config`` (one worker, its default logging), with a master key
(it refuses to start without one) and its bundled model-cost map (no network). Portkey:
``node .../build/start-server.js --port=P`` (one Node process; it reads ``--port=P`` only),
each request naming the provider and the fake as its custom host in ``x-portkey-*``
headers. With @hono/node-server before 2.1, which ``npm install @portkey-ai/gateway`` picks,
every streamed request through Portkey fails (``TypeError: immutable``, see bench/README.md):
the run probes one and skips Portkey's streamed cells with the reason if it fails.

Neither peer keeps a ledger here; Waybill appends every event to PostgreSQL (database
``--database``, dropped and recreated), as in ``bench/gateway_bench.py``, whose processes,
load generator and validity check this reuses: a Waybill cell is valid only if every response
was a complete 200 and the ledger gained one ``RequestCompleted`` per request; a peer's cell
only if every response was a complete 200. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gateway_bench import (
    Cell,
    _Child,
    _create_key,
    _fresh_database,
    _interpreter_marker_s,
    _load,
    _per_request,
    _post,
    _Run,
    _start_fake,
    _start_gateway,
)
from tests.gateway.harness import closed_port

PEERS = ("portkey", "litellm")  # the order of the table's rows and of the measurements
_NOT_GIVEN = {"portkey": "no --portkey DIR given", "litellm": "no --litellm PATH given"}

_LITELLM_CONFIG = """\
model_list:
  - model_name: chat
    litellm_params:
      model: openai/fake-model
      api_base: {base}
      api_key: sk-fake-upstream
"""

_PORTKEY_SERVER = Path("node_modules/@portkey-ai/gateway/build/start-server.js")


# --- the peers --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Peer:
    """A peer gateway running in front of the fake, and how the load addresses it."""

    name: str
    child: _Child
    url: str  # its /v1
    model: str
    api_key: str
    version: str
    headers: tuple[str, ...] = ()
    streaming_fault: str = ""  # why its streamed cells are skipped, if they are


def _peer_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "WAYBILL_"))}


def _start_litellm(litellm: str, tmp: Path, fake_url: str) -> _Peer:
    config = tmp / "litellm.yaml"
    config.write_text(_LITELLM_CONFIG.format(base=f"{fake_url}/v1"))
    master_key = f"sk-{secrets.token_hex(24)}"
    env = _peer_env()
    env.update(LITELLM_MASTER_KEY=master_key, LITELLM_LOCAL_MODEL_COST_MAP="True")
    port = closed_port()
    command = [litellm, "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    child = _Child(command, tmp / "litellm.log", env, pipe=False, cwd=tmp)
    root = f"http://127.0.0.1:{port}"
    # It imports a great deal before it listens.
    child.wait_ready(f"{root}/health/liveliness", "LiteLLM's proxy", within_s=120)
    return _Peer("litellm", child, f"{root}/v1", "chat", master_key, _litellm_version(litellm))


def _litellm_version(litellm: str) -> str:
    python = Path(litellm).with_name("python")
    probe = "from importlib.metadata import version; print(version('litellm'))"
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    return f"litellm {done.stdout.strip() or '?'}"


def _start_portkey(directory: Path, node: str, tmp: Path, fake_url: str) -> _Peer:
    port = closed_port()
    # Its argument parser knows `--port=P` only: given `--port P` it listens on 8787.
    command = [node, str(directory / _PORTKEY_SERVER), f"--port={port}"]
    child = _Child(command, tmp / "portkey.log", _peer_env(), pipe=False, cwd=directory)
    root = f"http://127.0.0.1:{port}"
    child.wait_ready(f"{root}/", "Portkey's gateway", within_s=60)
    headers = ("x-portkey-provider: openai", f"x-portkey-custom-host: {fake_url}/v1")
    version = _portkey_version(directory, node)
    peer = _Peer("portkey", child, f"{root}/v1", "fake-model", "sk-fake-upstream", version, headers)
    return replace(peer, streaming_fault=_streaming_fault(peer))


def _portkey_version(directory: Path, node: str) -> str:
    def version(package: str) -> str:
        manifest = directory / "node_modules" / package / "package.json"
        return str(json.loads(manifest.read_text()).get("version", "?"))

    done = subprocess.run([node, "--version"], capture_output=True, text=True)
    node_version = done.stdout.strip() or "?"
    hono = version("@hono/node-server")
    return (
        f"portkey {version('@portkey-ai/gateway')} (@hono/node-server {hono}, node {node_version})"
    )


def _streaming_fault(peer: _Peer) -> str:
    """Why one streamed request through ``peer`` was not a complete 200, or ""."""
    body = json.dumps(
        {"model": peer.model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {peer.api_key}"}
    for header in peer.headers:
        name, _, value = header.partition(": ")
        headers[name] = value
    request = urllib.request.Request(f"{peer.url}/chat/completions", body, headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            status, text = answer.status, answer.read()
    except urllib.error.HTTPError as error:
        status, text = error.code, error.read()
    if status == 200 and text.rstrip().endswith(b"data: [DONE]"):
        return ""
    reason = f"a streamed request got HTTP {status}"
    if b"TypeError: immutable" in peer.child.log.read_bytes():
        reason += " (its log: TypeError: immutable; @hono/node-server >= 2.1 fixes it)"
    return reason


# --- one durable commit -----------------------------------------------------------------

_PROBE_TABLE = "peer_bench_commit_probe"
_PROBE_ROW = os.urandom(320)  # about one compressed append's row


async def _commit_latencies_ms(
    database_url: str, seconds: float, pause_s: float = 0.0
) -> list[float]:
    """A bare insert-and-commit loop on ``database_url``'s server: one row of ~320 bytes per
    transaction, each committed durably (``synchronous_commit`` as the server has it, the
    gateway's), over asyncpg and TCP as the gateway's appender reaches the ledger; the
    latency of each, send to commit acknowledged. The floor under any gateway that commits
    before it calls upstream and again before it answers. ``pause_s`` between commits: a
    backend left idle that long is woken by the next one, as a request's are at c1."""
    dsn = database_url.replace("postgresql+psycopg://", "postgresql://")
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        await conn.execute(
            f"CREATE TABLE IF NOT EXISTS {_PROBE_TABLE} (id bigserial PRIMARY KEY, payload bytea)"
        )
        insert = await conn.prepare(f"INSERT INTO {_PROBE_TABLE} (payload) VALUES ($1)")
        for _ in range(20):  # the connection's and the table's first pages, unmeasured
            await insert.fetch(_PROBE_ROW)
        latencies: list[float] = []
        deadline = time.perf_counter() + seconds
        while (start := time.perf_counter()) < deadline:
            await insert.fetch(_PROBE_ROW)  # outside a transaction block: its own commit
            latencies.append((time.perf_counter() - start) * 1000)
            if pause_s:
                await asyncio.sleep(pause_s)
        return latencies
    finally:
        await conn.execute(f"DROP TABLE IF EXISTS {_PROBE_TABLE}")
        await conn.close()


def _commit_p50s_ms(run: _Run, seconds: float) -> tuple[float, float]:
    """The p50 of one durable commit on Waybill's PostgreSQL, the gateway idle meanwhile:
    back to back (the goal's yardstick), and each after 1 ms idle (what the rest of a c1
    request's time includes: its backend is idle while the gateway and the upstream work)."""
    run.gateway.settle()
    hot = asyncio.run(_commit_latencies_ms(run.database_url, seconds / 2))
    woken = asyncio.run(_commit_latencies_ms(run.database_url, seconds / 2, pause_s=0.001))
    return round(statistics.median(hot), 3), round(statistics.median(woken), 3)


# --- one cell ---------------------------------------------------------------------------


@dataclass
class PeerResult:
    """One peer's side of a cell: the load generator's summary and the peer's CPU, or why it
    was not measured."""

    load: dict[str, Any] = field(default_factory=dict)
    cpu_ms_per_request: float = 0.0
    other_load_cores: float = 0.0  # kept busy by processes outside the benchmark meanwhile
    skipped: str = ""

    @property
    def valid(self) -> bool:
        return bool(self.skipped) or bool(self.load.get("ok"))


@dataclass
class PeerCell:
    """One mode and concurrency: the fake alone and Waybill (``Cell``, measured exactly as
    ``bench/gateway_bench.py`` measures them), then each peer."""

    cell: Cell
    peers: dict[str, PeerResult] = field(default_factory=dict)
    commit_p50_ms: float | None = None  # one durable commit on Waybill's PostgreSQL, this round
    woken_commit_p50_ms: float | None = None  # the same, each after 1 ms idle

    @property
    def valid(self) -> bool:
        return self.cell.valid and all(result.valid for result in self.peers.values())

    def measured(self, peer: str) -> dict[str, Any] | None:
        result = self.peers.get(peer)
        return result.load if result is not None and not result.skipped else None

    def added_p50_ms(self, peer: str) -> float | None:
        load = self.measured(peer)
        if load is None:
            return None
        return round(float(load["p50_ms"]) - float(self.cell.direct["p50_ms"]), 3)

    def rps_over(self, peer: str) -> float | None:
        """Waybill's req/s over the peer's."""
        load = self.measured(peer)
        if load is None:
            return None
        return round(float(self.cell.gateway["rps"]) / max(float(load["rps"]), 1e-9), 2)

    def added_p50_over(self, peer: str) -> float | None:
        """Waybill's added p50 over the peer's: below 1, Waybill adds less."""
        added = self.added_p50_ms(peer)
        if added is None:
            return None
        return round(self.cell.added_p50_ms / max(added, 1e-9), 2)

    def added_p50_over_commits(self, peer: str) -> float | None:
        """Waybill's added p50 over the peer's plus two durable commits (issue 44, item 1):
        the contract commits before the upstream call and again before the answer, which a
        gateway keeping no books does not. At most 1: Waybill adds no more than those."""
        added = self.added_p50_ms(peer)
        if added is None or self.commit_p50_ms is None:
            return None
        return round(self.cell.added_p50_ms / max(added + 2 * self.commit_p50_ms, 1e-9), 2)

    def beyond_commits_ms(self, peer: str) -> float | None:
        """What Waybill adds beyond the peer's added p50 and two commits, in ms."""
        added = self.added_p50_ms(peer)
        if added is None or self.commit_p50_ms is None:
            return None
        return round(self.cell.added_p50_ms - added - 2 * self.commit_p50_ms, 3)

    @property
    def waybill_cpu_ms_per_request(self) -> float:
        """Waybill's process tree and its PostgreSQL backends: the peers keep no ledger, so
        the database's work counts as Waybill's."""
        postgres = self.cell.gateway_cpu["postgres_cpu_ms_per_request"]
        return round(self.cell.gateway_cpu_ms_per_request + postgres, 3)

    def cpu_over(self, peer: str) -> float | None:
        """Waybill's CPU per request over the peer's: below 1, Waybill spends less. It depends
        much less than req/s on how many idle cores each gateway found."""
        result = self.peers.get(peer)
        if result is None or result.skipped:
            return None
        return round(self.waybill_cpu_ms_per_request / max(result.cpu_ms_per_request, 1e-9), 2)

    def as_json(self) -> dict[str, Any]:
        return {
            **self.cell.as_json(),
            "commit_p50_ms": self.commit_p50_ms,
            "woken_commit_p50_ms": self.woken_commit_p50_ms,
            "peers": {
                name: {
                    **asdict(result),
                    "added_p50_ms": self.added_p50_ms(name),
                    "waybill_rps_over_peer": self.rps_over(name),
                    "waybill_added_p50_over_peer": self.added_p50_over(name),
                    "waybill_cpu_over_peer": self.cpu_over(name),
                    "waybill_added_p50_over_peer_and_commits": self.added_p50_over_commits(name),
                    "waybill_beyond_peer_and_commits_ms": self.beyond_commits_ms(name),
                }
                for name, result in self.peers.items()
            },
            "valid": self.valid,
        }


def _through_peer(run: _Run, peer: _Peer, cell: Cell, args: argparse.Namespace) -> PeerResult:
    stream = cell.mode == "streaming"
    if stream and peer.streaming_fault:
        return PeerResult(skipped=peer.streaming_fault)
    peer.child.settle()
    _post(f"{run.fake_url}/_fake/reset")
    start, before = run.usage(), peer.child.cpu_s()
    load = _load(peer.url, peer.model, peer.api_key, stream, cell.concurrency, args, peer.headers)
    peer.child.settle()  # work it deferred (its logging) is a cost too
    end, spent = run.usage(), peer.child.cpu_s() - before
    # The machine's busy time less this benchmark's processes (the peer counted apart).
    ours = sum(getattr(end, n) - getattr(start, n) for n in ("gateway", "fake", "bench"))
    others = (end.machine - start.machine) - ours - spent
    other_load = round(max(others, 0.0) / max(end.wall - start.wall, 1e-9), 2)
    return PeerResult(load, _per_request(spent, load["sent"]), other_load)


def _prewarm(run: _Run, peers: dict[str, _Peer], args: argparse.Namespace) -> None:
    """Unmeasured load at concurrency 16 through Waybill and each peer, in each mode, before
    the first cell: Node compiles Portkey's hot paths over its first seconds of traffic (after
    a start, its first three 5-s cells at c16 ran at 179, 352 and 585 req/s), and the
    first cell should not measure a peer's warm-up."""
    if args.prewarm <= 0:
        return
    unmeasured = argparse.Namespace(**{**vars(args), "seconds": args.prewarm, "warmup": 0.0})
    for stream in sorted({mode == "streaming" for mode in args.modes.split(",")}):
        _load(f"{run.gateway_url}/v1", "chat", run.api_key, stream, 16, unmeasured)
        for peer in peers.values():
            if stream and peer.streaming_fault:
                continue
            _load(peer.url, peer.model, peer.api_key, stream, 16, unmeasured, peer.headers)


# --- the goals --------------------------------------------------------------------------


def _spread(values: list[float | None]) -> dict[str, float] | None:
    """Median and range of the rounds' ratios (those measured), or None if none was."""
    found = [v for v in values if v is not None]
    if not found:
        return None
    return {"median": round(statistics.median(found), 2), "min": min(found), "max": max(found)}


_RATIOS = {
    "rps": PeerCell.rps_over,
    "added_p50": PeerCell.added_p50_over,
    "cpu": PeerCell.cpu_over,
}
# Read by the goals only, not shown per cell: Waybill's added p50 over the peer's plus two
# durable commits measured in the same round.
_GOAL_RATIOS = {**_RATIOS, "added_p50_commits": PeerCell.added_p50_over_commits}


def _over(cell: PeerCell, peer: str, ratio: str) -> float | None:
    return _GOAL_RATIOS[ratio](cell, peer)


@dataclass(frozen=True)
class Goal:
    """A goal for short requests (issue 44, items 1 and 2): a ratio of Waybill over a peer,
    measured in each round of this run, read on the rounds' median."""

    text: str
    mode: str
    concurrency: int
    peer: str
    ratio: str  # a key of _GOAL_RATIOS: Waybill's req/s, added p50 or CPU over the peer's
    at_least: float | None = None
    at_most: float | None = None

    def holds(self, value: float) -> bool:
        low = self.at_least is None or value >= self.at_least
        return low and (self.at_most is None or value <= self.at_most)

    def read(self, rounds: list[list[PeerCell]]) -> dict[str, Any]:
        key = (self.mode, self.concurrency)
        values = [
            _over(cell, self.peer, self.ratio)
            for cells in rounds
            for cell in cells
            if (cell.cell.mode, cell.cell.concurrency) == key
        ]
        spread = _spread(values)
        measured = [v for v in values if v is not None]
        return {
            "goal": self.text,
            "ratios": values,
            "spread": spread,
            "met": None if spread is None else self.holds(spread["median"]),
            "rounds_met": sum(self.holds(v) for v in measured),
            "rounds": len(measured),
        }


GOALS = (
    Goal(
        "buffered c1 added p50 <= Portkey's + 2 commits",
        "buffered", 1, "portkey", "added_p50_commits", at_most=1.0,
    ),
    Goal("buffered c16 req/s, Waybill / Portkey >= 1.0", "buffered", 16, "portkey", "rps", 1.0),
    Goal("streaming c16 req/s, Waybill / Portkey >= 1.2", "streaming", 16, "portkey", "rps", 1.2),
    Goal(
        "buffered c16 CPU/req, Waybill / Portkey <= 1",
        "buffered", 16, "portkey", "cpu", at_most=1.0,
    ),
    Goal(
        "streaming c16 CPU/req, Waybill / Portkey <= 1",
        "streaming", 16, "portkey", "cpu", at_most=1.0,
    ),
    Goal("buffered c16 req/s, Waybill / LiteLLM >= 10", "buffered", 16, "litellm", "rps", 10),
    Goal("streaming c16 req/s, Waybill / LiteLLM >= 15", "streaming", 16, "litellm", "rps", 15),
)  # fmt: skip


# --- the run ----------------------------------------------------------------------------


def _round(
    run: _Run, peers: dict[str, _Peer], number: int, args: argparse.Namespace
) -> list[PeerCell]:
    """Every cell once: the fake alone first, then Waybill and the peers in an order that
    turns by one place each round, so that no gateway always follows another's load. First,
    one durable commit's latency on Waybill's PostgreSQL, the c1 goal's yardstick."""
    targets = ["waybill", *PEERS]
    order = targets[number % len(targets) :] + targets[: number % len(targets)]
    hot, woken = (
        _commit_p50s_ms(run, args.commit_seconds) if args.commit_seconds > 0 else (None, None)
    )
    cells = [
        PeerCell(Cell(mode, c), commit_p50_ms=hot, woken_commit_p50_ms=woken)
        for mode in args.modes.split(",")
        for c in map(int, args.concurrency.split(","))
    ]
    for cell in cells:
        run.direct(cell.cell)
        for target in order:
            if target == "waybill":
                run.through_gateway(cell.cell)
            elif target in peers:
                cell.peers[target] = _through_peer(run, peers[target], cell.cell, args)
            else:
                cell.peers[target] = PeerResult(skipped=_NOT_GIVEN[target])
        where = f"round {number + 1}: {cell.cell.mode} c{cell.cell.concurrency}"
        print(f"  {where} done", file=sys.stderr, flush=True)
    return cells


def _bench(args: argparse.Namespace) -> dict[str, Any]:
    marker_before = _interpreter_marker_s()
    versions: dict[str, str] = {}
    rounds: list[list[PeerCell]] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        database_url = _fresh_database("postgres", tmp, args.database)
        api_key = asyncio.run(_create_key(database_url))
        fake, fake_url = _start_fake(tmp)
        children = [fake]
        try:
            gateway, gateway_url = _start_gateway(
                tmp, database_url, fake_url, serve_args=["--workers", str(args.workers)]
            )
            children.append(gateway)
            peers: dict[str, _Peer] = {}
            if args.portkey:
                peers["portkey"] = _start_portkey(Path(args.portkey), args.node, tmp, fake_url)
                children.append(peers["portkey"].child)
            if args.litellm:
                peers["litellm"] = _start_litellm(args.litellm, tmp, fake_url)
                children.append(peers["litellm"].child)
            versions = {name: peer.version for name, peer in peers.items()}
            run = _Run(args, database_url, api_key, fake, fake_url, gateway, gateway_url)
            _prewarm(run, peers, args)
            rounds = [_round(run, peers, number, args) for number in range(args.rounds)]
        finally:
            for child in reversed(children):
                child.stop()
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "peers": versions,
        "seconds_per_cell": args.seconds,
        "warmup_s": args.warmup,
        "prewarm_s": args.prewarm,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "interpreter_marker_s": [marker_before, _interpreter_marker_s()],
        "rounds": [[cell.as_json() for cell in cells] for cells in rounds],
        "goals": [goal.read(rounds) for goal in GOALS],
        "valid": all(cell.valid for cells in rounds for cell in cells),
        "_rounds": rounds,
    }


# --- output -----------------------------------------------------------------------------

_COLUMNS = (
    ("mode", 9), ("c", 3), ("through", 7), ("req/s", 8), ("p50 ms", 7), ("p99 ms", 7),
    ("added p50 ms", 12), ("CPU ms/req", 10), ("other load", 10), ("check", 16),
)  # fmt: skip


def _measures(
    load: dict[str, Any], added: float | None, cpu: float | None, other: float
) -> list[str]:
    """req/s, p50, p99, added p50, CPU ms/req and other load, as the table shows them."""
    return [
        f"{load['rps']:,.1f}" if load["rps"] < 100 else f"{load['rps']:,.0f}",
        f"{load['p50_ms']:.2f}",
        f"{load['p99_ms']:.2f}",
        "" if added is None else f"{added:.2f}",
        "" if cpu is None else f"{cpu:.2f}",
        f"{other:.2f}",
    ]


def _row(values: list[object]) -> str:
    return " ".join(str(v).rjust(w) for v, (_, w) in zip(values, _COLUMNS, strict=True))


def _table(cells: list[PeerCell]) -> str:
    """One row per mode, concurrency and target: the fake alone, Waybill, each peer."""
    lines = [" ".join(name.rjust(width) for name, width in _COLUMNS)]
    for c in cells:
        head: list[object] = [c.cell.mode, c.cell.concurrency]
        direct, waybill = c.cell.direct, c.cell.gateway
        check = "ok" if direct["ok"] else f"FAILED {direct['statuses']}"
        other = c.cell.direct_cpu["other_load_cores"]
        lines.append(_row([*head, "direct", *_measures(direct, None, None, other), check]))
        check = f"ledger {c.cell.ledger_completed}/{waybill['sent']}"
        check += "" if c.cell.valid else " INVALID"
        added, cpu = c.cell.added_p50_ms, c.waybill_cpu_ms_per_request
        other = c.cell.gateway_cpu["other_load_cores"]
        lines.append(_row([*head, "waybill", *_measures(waybill, added, cpu, other), check]))
        for name in PEERS:
            result = c.peers[name]
            if result.skipped:
                blank = _row([*head, name, *[""] * (len(_COLUMNS) - 3)]).rstrip()
                lines.append(f"{blank}  skipped: {result.skipped}")
                continue
            load = result.load
            check = "ok" if load["ok"] else f"FAILED {load['statuses']}"
            cpu = result.cpu_ms_per_request
            measures = _measures(load, c.added_p50_ms(name), cpu, result.other_load_cores)
            lines.append(_row([*head, name, *measures, check]))
    return "\n".join([*lines, *_commit_lines(cells)])


def _commit_lines(cells: list[PeerCell]) -> list[str]:
    """One durable commit's p50, and each c1 cell's added p50 read against it."""
    if not cells or cells[0].commit_p50_ms is None:
        return []
    commit = cells[0].commit_p50_ms
    lines = [f"one durable commit (insert-and-commit loop), p50: {commit:.3f} ms"]
    if cells[0].woken_commit_p50_ms is not None:
        woken = cells[0].woken_commit_p50_ms
        lines[0] += f"; each after 1 ms idle: {woken:.3f} ms"
    for c in cells:
        beyond = c.beyond_commits_ms("portkey")
        if c.cell.concurrency != 1 or beyond is None:
            continue
        portkey = c.added_p50_ms("portkey")
        lines.append(
            f"{c.cell.mode} c1: Waybill's added p50 {c.cell.added_p50_ms:.2f} ms = Portkey's "
            f"{portkey:.2f} + 2 commits {2 * commit:.2f} {beyond:+.2f} ms"
        )
    return lines


def _ratio(spread: dict[str, float] | None) -> str:
    if spread is None:
        return "—"
    if spread["min"] == spread["max"]:
        return f"{spread['median']:g}"
    return f"{spread['median']:g} ({spread['min']:g}–{spread['max']:g})"


def _ratios(rounds: list[list[PeerCell]]) -> str:
    """Waybill over each peer, per cell: the median of the rounds' ratios and their range.
    req/s: above 1, Waybill serves more; added p50 and CPU per request: below 1, Waybill adds
    less latency or spends less CPU (its PostgreSQL backends included)."""
    lines = []
    for peer in PEERS:
        lines.append(f"Waybill over {peer}, median (range) of {len(rounds)} round(s):")
        heads = ("req/s", "added p50", "CPU per request")
        lines.append(f"{'mode':>9} {'c':>3} " + " ".join(f"{h:>20}" for h in heads))
        for index, cell in enumerate(rounds[0]):
            same = [cells[index] for cells in rounds]
            spreads = [_spread([_over(c, peer, r) for c in same]) for r in _RATIOS]
            ratios = " ".join(f"{_ratio(s):>20}" for s in spreads)
            lines.append(f"{cell.cell.mode:>9} {cell.cell.concurrency:>3} {ratios}")
    return "\n".join(lines)


def _goals(goals: list[dict[str, Any]]) -> str:
    lines = ["goals for short requests (issue 44), on the median of the rounds' ratios:"]
    for goal in goals:
        verdict = {True: "met", False: "MISSED", None: "not measured"}[goal["met"]]
        if goal["rounds"]:
            verdict += f" (met in {goal['rounds_met']} of {goal['rounds']} rounds)"
        lines.append(f"  {goal['goal']:<48} {_ratio(goal['spread']):>18}  {verdict}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--litellm", help="the `litellm` executable of LiteLLM's environment")
    parser.add_argument("--portkey", help="the directory where @portkey-ai/gateway is installed")
    parser.add_argument("--node", default="node", help="the Node.js that runs Portkey")
    parser.add_argument(
        "--database", default="waybill_peer_bench", help="Waybill's ledger, dropped and recreated"
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per cell")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds first")
    parser.add_argument(
        "--prewarm", type=float, default=5.0, help="unmeasured seconds per gateway and mode"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="every cell this many times, targets in turn"
    )
    parser.add_argument(
        "--commit-seconds",
        type=float,
        default=2.0,
        help="seconds of the insert-and-commit loop each round (0: none)",
    )
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--workers", type=int, default=1, help="Waybill's `--workers`")
    parser.add_argument("--modes", default="buffered,streaming")
    parser.add_argument("--json", action="store_true", help="JSON on stdout, the table on stderr")
    parser.set_defaults(backend="postgres")  # _Run reads it: the ledger on PostgreSQL
    args = parser.parse_args()
    if args.litellm and not Path(args.litellm).is_file():
        parser.error(f"--litellm {args.litellm}: no such file (see this script's docstring)")
    if args.portkey and not (Path(args.portkey) / _PORTKEY_SERVER).is_file():
        parser.error(f"--portkey {args.portkey}: no {_PORTKEY_SERVER} there (see the docstring)")
    result = _bench(args)
    rounds: list[list[PeerCell]] = result.pop("_rounds")
    report = sys.stderr if args.json else sys.stdout
    for name in PEERS:
        print(f"{name}: {result['peers'].get(name, f'skipped ({_NOT_GIVEN[name]})')}", file=report)
    for number, cells in enumerate(rounds, 1):
        print(f"\nround {number} of {len(rounds)}\n{_table(cells)}", file=report)
    print(f"\n{_ratios(rounds)}\n\n{_goals(result['goals'])}\n", file=report)
    marker = " / ".join(f"{m:.3f}" for m in result["interpreter_marker_s"])
    print(f"interpreter marker (s, 10M-step loop) before / after: {marker}", file=report)
    if args.json:
        print(json.dumps(result, indent=2))
    if not result["valid"]:
        print(
            "INVALID: a response was not a complete 200, or the ledger missed events",
            file=sys.stderr,
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
