"""Run an installed Waybill as its user would, on SQLite and on PostgreSQL.

``scripts/check-wheel`` runs this file with the Python of a fresh virtualenv that holds only
the built wheel and its dependencies, from an empty folder: nothing of the checkout is on
``sys.path``. For each backend: ``waybill migrate``, ``waybill keys create --json``,
``waybill serve`` (``/readyz`` at the newest migration, then a buffered and a streamed chat
completion through the bundled fake provider, ``waybill fake-provider``), ``waybill verify``
and ``waybill demo --check``. First, once: ``waybill --version``, and ``waybill demo --check``
without a database, which must leave the folder as it found it. The PostgreSQL database is
created for the run and dropped after it.

Usage: python wheel_check.py --postgres-admin-url URL --source-migrations DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

_BIN = Path(sys.executable).parent
_TIMEOUT_S = 120
_WORKSPACE = "acme"
_CONFIG = """\
generation: wheel-check
endpoints:
  - id: fake-primary
    driver: openai
    base_url: {base_url}
    region: local
    data_classes: [public, internal]
models:
  - name: chat-default
    mappings:
      - endpoint: fake-primary
        model: fake-model
        capabilities: [text, stream]
        context_window: 128000
        max_output_tokens: 4096
        price: {{input_per_mtok: 0.15, output_per_mtok: 0.60}}
workspaces:
  - id: {workspace}
    models: [chat-default]
    regions: [local]
    data_class: internal
"""


class CheckFailed(Exception):
    pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--postgres-admin-url", required=True)
    parser.add_argument("--source-migrations", required=True, type=Path)
    args = parser.parse_args()
    folder = Path.cwd()
    try:
        _check_installed(args.source_migrations)
        _check_newcomer(folder)
        _check_backend("sqlite", f"sqlite:///{folder / 'waybill.db'}", folder)
        with _throwaway_database(args.postgres_admin_url) as url:
            _check_backend("postgresql", url, folder)
    except CheckFailed as failure:
        print(f"FAILED: {failure}", file=sys.stderr)
        return 1
    return 0


def _check_installed(source_migrations: Path) -> None:
    """The packages come from the virtualenv and carry every migration of the source."""
    import ledger
    import otel
    import router
    from ledger.store.db import ALEMBIC_DIR

    for package in (ledger, router, otel, ALEMBIC_DIR):
        where = Path(str(getattr(package, "__file__", package))).resolve()
        if not where.is_relative_to(Path(sys.prefix).resolve()):
            raise CheckFailed(f"{where} is not inside the virtualenv {sys.prefix}")
    shipped = _migration_files(ALEMBIC_DIR)
    wanted = _migration_files(source_migrations)
    if shipped != wanted:
        raise CheckFailed(
            f"the wheel's migrations differ from the source's: missing {sorted(wanted - shipped)}"
            f", extra {sorted(shipped - wanted)}"
        )
    print(f"installed: {len(shipped)} migration files in {ALEMBIC_DIR}")


def _check_newcomer(folder: Path) -> None:
    """A first run in an empty folder: `--version`, and `demo --check` leaving nothing behind
    (its ledger is temporary when no database is named)."""
    version = _waybill("--version")
    if not version.stdout.startswith("waybill ") or "(schema " not in version.stdout:
        raise CheckFailed(f"--version printed {version.stdout!r}")
    before = set(folder.iterdir())
    demo = _waybill("demo", "--check", "--port", str(_free_port()))
    if "buffered: 200" not in demo.stdout or "streamed: 200" not in demo.stdout:
        raise CheckFailed(f"demo --check printed {demo.stdout!r}")
    left = sorted(str(p.name) for p in set(folder.iterdir()) - before)
    if left:
        raise CheckFailed(f"demo --check without a database left {left} in {folder}")
    print(f"newcomer: {version.stdout.strip()}; demo --check on a temporary ledger")


def _migration_files(folder: Path) -> set[str]:
    return {
        str(path.relative_to(folder))
        for path in folder.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }


def _check_backend(backend: str, url: str, folder: Path) -> None:
    started = time.monotonic()
    _waybill("migrate", "--database-url", url)
    created = _waybill("keys", "create", "--workspace", _WORKSPACE, "--json", "--database-url", url)
    key = json.loads(created.stdout)
    if key.get("workspace") != _WORKSPACE or not str(key.get("secret", "")).startswith("wb_"):
        raise CheckFailed(f"keys create printed {created.stdout!r}")
    with _fake_provider() as base_url:
        config = folder / f"{backend}.yaml"
        config.write_text(_CONFIG.format(base_url=base_url, workspace=_WORKSPACE))
        with _serving(config, url, folder / f"serve-{backend}.log") as gateway:
            _chat(gateway, key["secret"])
    verified = _waybill("verify", "--database-url", url)
    if "ledger OK" not in verified.stdout:
        raise CheckFailed(f"verify printed {verified.stdout!r}")
    demo = _waybill("demo", "--check", "--database-url", url, "--port", str(_free_port()))
    if "buffered: 200" not in demo.stdout or "streamed: 200" not in demo.stdout:
        raise CheckFailed(f"demo --check printed {demo.stdout!r}")
    took = time.monotonic() - started
    print(
        f"{backend}: migrate, keys create, serve (ready, chat), verify, demo --check: {took:.0f} s"
    )


def _waybill(*args: str) -> subprocess.CompletedProcess[str]:
    command = [str(_BIN / "waybill"), *args]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=_TIMEOUT_S, env=_env(), check=False
    )
    if done.returncode != 0:
        raise CheckFailed(
            f"`waybill {' '.join(args[:2])}` exited {done.returncode}:\n{done.stdout}{done.stderr}"
        )
    return done


def _env() -> dict[str, str]:
    """This process's environment without anything pointing at a checkout or a database."""
    return {
        name: value
        for name, value in os.environ.items()
        if name != "PYTHONPATH" and not name.startswith("WAYBILL_")
    }


@contextlib.contextmanager
def _fake_provider() -> Iterator[str]:
    """The bundled fake provider as its own process (`waybill fake-provider`); yields its
    OpenAI-style base URL."""
    process = subprocess.Popen(
        [str(_BIN / "waybill"), "fake-provider", "--port", "0", "--name", "fake-primary"],
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline().strip()  # "listening http://HOST:PORT"
        if not line.startswith("listening "):
            raise CheckFailed(f"the fake provider said {line!r}")
        yield line.removeprefix("listening ") + "/v1"
    finally:
        _stop(process)


@contextlib.contextmanager
def _serving(config: Path, url: str, log: Path) -> Iterator[str]:
    """``waybill serve`` until ``/readyz`` answers ready at the newest migration."""
    from ledger.store.db import head_revision

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    command = [str(_BIN / "waybill"), "serve", "--config", str(config), "--database-url", url]
    with log.open("w") as output:
        process = subprocess.Popen(
            [*command, "--port", str(port)], stdout=output, stderr=output, env=_env()
        )
    try:
        deadline = time.monotonic() + _TIMEOUT_S
        ready: dict[str, str] = {}
        while ready.get("status") != "ready":
            if process.poll() is not None or time.monotonic() > deadline:
                raise CheckFailed(f"`waybill serve` did not get ready:\n{log.read_text()}")
            time.sleep(0.2)
            with contextlib.suppress(httpx.TransportError):
                ready = httpx.get(f"{base}/readyz", timeout=5).json()
        if ready.get("migration") != head_revision():
            raise CheckFailed(f"/readyz said {ready}, the newest migration is {head_revision()}")
        yield base
    except BaseException:
        _stop(process)
        raise
    # SIGTERM is a graceful shutdown, after which uvicorn re-raises the signal; a gateway
    # still running after _stop's grace period is killed and fails the check.
    status = _stop(process)
    if status not in (0, -signal.SIGTERM):
        raise CheckFailed(f"`waybill serve` stopped with {status}:\n{log.read_text()}")


def _chat(base: str, secret: str) -> None:
    headers = {"Authorization": f"Bearer {secret}"}
    body = {"model": "chat-default", "messages": [{"role": "user", "content": "Hello"}]}
    reply = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=30)
    if reply.status_code != 200 or reply.headers.get("x-waybill-endpoint") != "fake-primary":
        raise CheckFailed(f"chat completion answered {reply.status_code}: {reply.text}")
    if not reply.json()["choices"][0]["message"]["content"]:
        raise CheckFailed(f"chat completion without content: {reply.text}")
    streamed = {**body, "stream": True}
    with httpx.stream(
        "POST", f"{base}/v1/chat/completions", json=streamed, headers=headers, timeout=30
    ) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data:")]
    if stream.status_code != 200 or events[-1:] != ["data: [DONE]"]:
        raise CheckFailed(f"streamed chat completion answered {stream.status_code}: {events}")


def _stop(process: subprocess.Popen[Any]) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return -signal.SIGKILL


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextlib.contextmanager
def _throwaway_database(admin_url: str) -> Iterator[str]:
    """A new, empty PostgreSQL database next to ``admin_url``'s, dropped afterwards."""
    name = f"waybill_wheel_{secrets.token_hex(4)}"
    admin = make_url(admin_url).set(drivername="postgresql+psycopg")
    engine = create_engine(admin, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        try:
            yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
        finally:
            with engine.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        engine.dispose()


if __name__ == "__main__":
    sys.exit(main())
