"""`waybill serve --append-process`: the ledger's appends committed by a child process of
their own (ledger.store.append_process), every serving process forwarding its batches there."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from ledger.store.shared_appends import MAX_RETRY_AFTER_S
from router.fake_provider import Behavior, FakeUpstream
from tests.gateway.harness import Route, closed_port, config_text
from tests.gateway.processes import new_key, serve_process
from tests.gateway.test_crash_under_load import (
    _assert_holds_as_the_attempts_call_for,
    _ledger,
    _load,
)
from tests.gateway.test_workers import _send
from tests.ledger.test_cli import waybill

_OPTION = {"WAYBILL_APPEND_PROCESS": "1"}


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        try:
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except FileNotFoundError:
            continue
        found += [int(child) for child in children]
        todo += [int(child) for child in children]
    return found


def _append_processes(pid: int) -> list[int]:
    """The append processes under ``pid``."""
    found = []
    for child in _descendants(pid):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"ledger.store.append_process" in command:
            found.append(child)
    return found


def _stop(process: subprocess.Popen[bytes]) -> str:
    """SIGTERM, and what it said on stderr (one process ends as uvicorn does, by the
    signal it was stopped with, once it has shut down; the workers' supervisor with 0)."""
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) in (0, -signal.SIGTERM)
    assert process.stderr is not None
    return process.stderr.read().decode(errors="replace")


def _verified(database_url: str) -> None:
    for check in ((), ("--books",)):
        verified = waybill("verify", *check, database_url=database_url)
        assert verified.returncode == 0, verified.stdout + verified.stderr


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.parametrize("workers", [1, 2])
def test_serve_with_an_append_process_answers_and_commits(
    postgres_url: str, tmp_path: Path, workers: int
) -> None:
    secret = new_key(postgres_url)
    with FakeUpstream("east") as east:
        config = tmp_path / "waybill.yaml"
        config.write_text(config_text({"east": east}, [Route("east")]))
        port = closed_port()
        env = {**_OPTION, "WAYBILL_WORKERS": str(workers)}
        process = serve_process(config, postgres_url, port, env=env)
        try:
            (child,) = _append_processes(process.pid)  # one, whatever the workers
            answers = asyncio.run(_send(port, secret, 40))
            assert [a.status_code for a in answers] == [200] * 40, [a.text for a in answers]
            said = _stop(process)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert not Path(f"/proc/{child}").exists()  # stopped with the gateway
    # Every serving process reached it at once: none committed itself.
    assert "commits itself" not in said, said
    assert "Traceback" not in said, said
    events = _ledger(postgres_url)
    assert sum(e.type == "RequestCompleted" for e in events) == 40
    assert sum(e.type == "ConfigActivated" for e in events) == 1
    _verified(postgres_url)


@pytest.mark.slow
@pytest.mark.postgres
def test_the_append_process_killed_under_load_loses_nothing_answered(
    postgres_url: str, tmp_path: Path
) -> None:
    """kill -9 of the append process under load: the batch it held fails as the ledger
    unavailable (it may have committed; the requests resolve it by reading their streams),
    the gateway commits itself until the process is started again, then forwards again.
    Every answered request is complete, every attempt ended, every hold resolved as its
    attempt calls for, and the ledger and the books verify."""
    with FakeUpstream("east", default=Behavior.ok(latency_ms=30, chunk_delay_ms=10)) as east:
        config = tmp_path / "waybill.yaml"
        config.write_text(
            config_text(
                {"east": east},
                [Route("east")],
                workspace_extra="    budget: {limit_usd: 1000, window: month}",
            )
        )
        secret = new_key(postgres_url)
        port = closed_port()
        process = serve_process(config, postgres_url, port, env=_OPTION)
        assert process.stderr is not None
        os.set_blocking(process.stderr.fileno(), False)
        answered: list[str] = []
        said = b""
        try:
            (first,) = _append_processes(process.pid)

            async def run() -> bytes:
                stop, started = asyncio.Event(), asyncio.Event()
                load = asyncio.create_task(_load(port, secret, 120, answered, stop, started))
                heard = b""
                try:
                    async with asyncio.timeout(20):
                        await started.wait()
                    await asyncio.sleep(0.7)
                    os.kill(first, signal.SIGKILL)
                    # Served meanwhile; then forwarded again once the process is back (the
                    # client backs off up to MAX_RETRY_AFTER_S: a bound, not a measure).
                    deadline = time.monotonic() + 2 * MAX_RETRY_AFTER_S + 30
                    while b"the append process is back" not in heard:
                        assert time.monotonic() < deadline, heard.decode(errors="replace")
                        assert process.poll() is None, "the gateway stopped"
                        await asyncio.sleep(0.2)
                        heard += process.stderr.read() or b""  # type: ignore[union-attr]
                    counted = len(answered)
                    while len(answered) < counted + 20:  # and it serves on
                        assert time.monotonic() < deadline, "no answers since it is back"
                        await asyncio.sleep(0.1)
                finally:
                    stop.set()
                    await load
                return heard

            said = asyncio.run(run())
            (again,) = _append_processes(process.pid)
            assert again != first
            os.set_blocking(process.stderr.fileno(), True)
            said += _stop(process).encode()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    text = said.decode(errors="replace")
    assert "the append process" in text and "this worker commits itself" in text, text
    assert "Traceback" not in text, text
    assert answered
    events = _ledger(postgres_url)
    by_request: dict[str, list[str]] = {}
    started: set[str] = set()
    ended: set[str] = set()
    for e in events:
        by_request.setdefault(e.stream_id, []).append(e.type)
        if e.type == "AttemptStarted":
            started.add(e.data["attempt_id"])
        if e.type in ("AttemptFinished", "UnknownUsageOpened"):
            ended.add(e.data["attempt_id"])
    for request_id in answered:
        assert "RequestCompleted" in by_request[f"request-{request_id}"], request_id
    assert started <= ended, f"{len(started - ended)} attempts neither finished nor held"
    engine = sa.create_engine(postgres_url)
    with engine.connect() as conn:
        books = {
            str(reservation): str(state)
            for reservation, state in conn.execute(
                sa.text(
                    "SELECT h.reservation_id, coalesce(o.state, 'resolved') "
                    "FROM budget_holds h LEFT JOIN budget_open_holds o USING (reservation_id)"
                )
            )
        }
    engine.dispose()
    # The gateway did not crash: no hold was left for crash recovery.
    _assert_holds_as_the_attempts_call_for(events, books, left_open=set())
    _verified(postgres_url)


def test_the_append_process_needs_postgresql(sqlite_url: str) -> None:
    port = str(closed_port())
    result = waybill("serve", "--append-process", "--port", port, database_url=sqlite_url)
    assert result.returncode == 1
    assert "--append-process needs a PostgreSQL ledger" in result.stderr
    assert "Traceback" not in result.stderr
