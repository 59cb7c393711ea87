"""`waybill serve` as a real process, for the tests that need several gateways, signals
or kill -9: start one and wait until it is ready, and create keys through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx

from tests.gateway.harness import ANTHROPIC_ENV
from tests.ledger.test_cli import WAYBILL, waybill

__all__ = ["new_key", "serve_process", "wait_ready"]


def serve_process(
    config: Path,
    database_url: str,
    port: int,
    *,
    migrate: bool = False,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start `waybill serve` and return once it answers /readyz."""
    command = [
        *WAYBILL,
        "serve",
        "--config",
        str(config),
        "--database-url",
        database_url,
        "--port",
        str(port),
    ]
    if not migrate:
        command.append("--no-migrate")
    process = subprocess.Popen(
        command,
        env={**os.environ, **ANTHROPIC_ENV, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    wait_ready(port, process)
    return process


def wait_ready(port: int, process: subprocess.Popen[bytes], within_s: float = 30) -> None:
    deadline = time.monotonic() + within_s
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        if process.poll() is not None:
            stderr = process.stderr.read().decode(errors="replace") if process.stderr else ""
            raise AssertionError(f"the gateway exited: {stderr}")
        assert time.monotonic() < deadline, "the gateway did not become ready"
        time.sleep(0.1)


def new_key(database_url: str, workspace: str = "acme", role: str = "client") -> str:
    created = waybill(
        "keys",
        "create",
        "--workspace",
        workspace,
        "--role",
        role,
        "--json",
        database_url=database_url,
    )
    assert created.returncode == 0, created.stderr
    return str(json.loads(created.stdout)["secret"])
