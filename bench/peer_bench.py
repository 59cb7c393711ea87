"""Peer benchmark: the same load straight to the fake provider, through Waybill, and through
LiteLLM's proxy, in one run.

    python3 -m venv /tmp/peer-venv && /tmp/peer-venv/bin/pip install 'litellm[proxy]'
    .venv/bin/python bench/peer_bench.py --litellm /tmp/peer-venv/bin/litellm \\
        [--seconds 5] [--concurrency 1,16] [--modes buffered,streaming] [--json]

Machines differ by a factor of two in speed, so an absolute figure alone cannot say whether
a target was missed by the code or by the host. Measured in the same run against the same
fake provider with the same load generator, a peer gateway is the yardstick: Waybill's
req/s over the peer's, and the peer's own req/s placing the machine (for scale, LiteLLM's
proxy serves about 50 buffered and 27 streamed req/s at concurrency 16 on a 2-core machine).

The peer runs as a plain ``litellm --config`` would (one worker, its default logging), with a
master key (it refuses to start without one) and its bundled model-cost map (no network),
in its own virtual environment so that its pinned dependencies never move this project's.
It keeps no ledger here; Waybill appends every event to PostgreSQL, as in
``bench/gateway_bench.py``, whose processes, load generator and validity check this reuses:
a Waybill cell is valid only if every response was a complete 200 and the ledger gained one
``RequestCompleted`` per request; a peer cell only if every response was a complete 200.
A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

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

_PEER_CONFIG = """\
model_list:
  - model_name: chat
    litellm_params:
      model: openai/fake-model
      api_base: {base}
      api_key: sk-fake-upstream
"""


@dataclass
class PeerCell:
    """One mode and concurrency: the fake alone, Waybill and the peer (``Cell`` holds the
    first two, measured exactly as ``bench/gateway_bench.py`` measures them)."""

    cell: Cell
    peer: dict[str, Any] = field(default_factory=dict)
    peer_cpu_ms_per_request: float = 0.0

    @property
    def valid(self) -> bool:
        return self.cell.valid and bool(self.peer.get("ok"))

    @property
    def waybill_over_peer(self) -> float:
        return round(float(self.cell.gateway["rps"]) / max(float(self.peer["rps"]), 1e-9), 2)

    def as_json(self) -> dict[str, Any]:
        return {
            **self.cell.as_json(),
            "peer": self.peer,
            "peer_cpu_ms_per_request": self.peer_cpu_ms_per_request,
            "waybill_over_peer": self.waybill_over_peer,
            "valid": self.valid,
        }


def _start_peer(litellm: str, tmp: Path, fake_url: str) -> tuple[_Child, str, str]:
    """LiteLLM's proxy in front of the fake; (process, its /v1 URL, its master key)."""
    config = tmp / "litellm.yaml"
    config.write_text(_PEER_CONFIG.format(base=f"{fake_url}/v1"))
    master_key = f"sk-{secrets.token_hex(24)}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "WAYBILL_"))}
    env.update(LITELLM_MASTER_KEY=master_key, LITELLM_LOCAL_MODEL_COST_MAP="True")
    port = closed_port()
    command = [litellm, "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    peer = _Child(command, tmp / "litellm.log", env, pipe=False, cwd=tmp)
    root = f"http://127.0.0.1:{port}"
    # It imports a great deal before it listens.
    peer.wait_ready(f"{root}/health/liveliness", "the peer", within_s=120)
    return peer, f"{root}/v1", master_key


def _through_peer(
    run: _Run, peer: _Child, url: str, key: str, cell: PeerCell, args: argparse.Namespace
) -> None:
    stream = cell.cell.mode == "streaming"
    peer.settle()
    _post(f"{run.fake_url}/_fake/reset")
    before = peer.cpu_s()
    cell.peer = _load(url, "chat", key, stream, cell.cell.concurrency, args)
    peer.settle()  # work it deferred (its logging) is a cost too
    cell.peer_cpu_ms_per_request = _per_request(peer.cpu_s() - before, cell.peer["sent"])


def _bench(args: argparse.Namespace) -> dict[str, Any]:
    cells = [
        PeerCell(Cell(mode, c))
        for mode in args.modes.split(",")
        for c in map(int, args.concurrency.split(","))
    ]
    marker_before = _interpreter_marker_s()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        database_url = _fresh_database(args.backend, tmp)
        api_key = asyncio.run(_create_key(database_url))
        fake, fake_url = _start_fake(tmp)
        children = [fake]
        try:
            gateway, gateway_url = _start_gateway(tmp, database_url, fake_url)
            children.append(gateway)
            peer, peer_url, peer_key = _start_peer(args.litellm, tmp, fake_url)
            children.append(peer)
            run = _Run(args, database_url, api_key, fake, fake_url, gateway, gateway_url)
            for cell in cells:
                run.direct(cell.cell)
                run.through_gateway(cell.cell)
                _through_peer(run, peer, peer_url, peer_key, cell, args)
                print(f"  {cell.cell.mode} c{cell.cell.concurrency} done", file=sys.stderr)
        finally:
            for child in reversed(children):
                child.stop()
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "peer": _peer_version(args.litellm),
        "seconds_per_cell": args.seconds,
        "warmup_s": args.warmup,
        "interpreter_marker_s": [marker_before, _interpreter_marker_s()],
        "cells": [cell.as_json() for cell in cells],
        "valid": all(cell.valid for cell in cells),
        "_cells": cells,
    }


def _peer_version(litellm: str) -> str:
    python = Path(litellm).with_name("python")
    probe = "from importlib.metadata import version; print(version('litellm'))"
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    return f"litellm {done.stdout.strip() or '?'}"


_COLUMNS = (
    ("mode", 9), ("c", 3), ("direct rps", 10), ("waybill rps", 11), ("peer rps", 9),
    ("waybill/peer", 12), ("waybill p50 ms", 14), ("peer p50 ms", 11),
    ("waybill CPU ms/req", 18), ("peer CPU ms/req", 15), ("waybill ledger", 14),
)  # fmt: skip


def _table(cells: list[PeerCell]) -> str:
    lines = [" ".join(name.rjust(width) for name, width in _COLUMNS)]
    for c in cells:
        row = (
            c.cell.mode,
            c.cell.concurrency,
            f"{c.cell.direct['rps']:,.0f}",
            f"{c.cell.gateway['rps']:,.0f}",
            f"{c.peer['rps']:,.1f}",
            f"{c.waybill_over_peer:g}",
            f"{c.cell.gateway['p50_ms']:.2f}",
            f"{c.peer['p50_ms']:.1f}",
            f"{c.cell.gateway_cpu_ms_per_request:.2f}",
            f"{c.peer_cpu_ms_per_request:.1f}",
            f"{c.cell.ledger_completed}/{c.cell.gateway['sent']}",
        )
        lines.append(" ".join(str(v).rjust(w) for v, (_, w) in zip(row, _COLUMNS, strict=True)))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--litellm", required=True, help="the peer's `litellm` executable")
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per cell")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds first")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--modes", default="buffered,streaming")
    parser.add_argument("--json", action="store_true", help="JSON on stdout, the table on stderr")
    parser.set_defaults(backend="postgres")  # _Run reads it: the ledger on PostgreSQL
    args = parser.parse_args()
    if not Path(args.litellm).is_file():
        parser.error(f"--litellm {args.litellm}: no such file (see this script's docstring)")
    result = _bench(args)
    cells: list[PeerCell] = result.pop("_cells")
    report = sys.stderr if args.json else sys.stdout
    print(f"peer: {result['peer']}", file=report)
    print(_table(cells), file=report)
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
