"""`waybill serve --workers N`: several serving processes behind one port, supervised."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

from ledger.store.shared_appends import MAX_RETRY_AFTER_S
from router.fake_provider import FakeUpstream
from tests.gateway.harness import Route, closed_port, config_text
from tests.gateway.processes import new_key, serve_process, wait_ready
from tests.helpers import ledger_events
from tests.ledger.test_cli import waybill

BODY: dict[str, Any] = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}


def _worker_pids(parent: int) -> list[int]:
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    return sorted(int(pid) for pid in children)


def _requests_answered(metrics: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(metrics)
        if family.name == "waybill_requests"
        for sample in family.samples
        if sample.name == "waybill_requests_total"
    )


@contextmanager
def _workers(tmp_path: Path, database_url: str, count: int) -> Iterator[tuple[int, Any]]:
    with FakeUpstream("east") as east:
        config = tmp_path / "waybill.yaml"
        config.write_text(config_text({"east": east}, [Route("east")]))
        port = closed_port()
        process = serve_process(config, database_url, port, env={"WAYBILL_WORKERS": str(count)})
        try:
            yield port, process
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=30)


async def _send(port: int, secret: str, count: int) -> list[httpx.Response]:
    # A connection per request, so that the kernel spreads them over the workers.
    async def one() -> httpx.Response:
        async with httpx.AsyncClient(
            headers={"Authorization": f"Bearer {secret}"}, timeout=30
        ) as http:
            return await http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=BODY)

    return list(await asyncio.gather(*(one() for _ in range(count))))


@pytest.mark.slow
@pytest.mark.postgres
def test_workers_share_the_port_the_ledger_and_one_metrics_answer(
    postgres_url: str, tmp_path: Path
) -> None:
    secret = new_key(postgres_url)
    with _workers(tmp_path, postgres_url, 2) as (port, process):
        assert len(_worker_pids(process.pid)) == 2
        engine = sa.create_engine(postgres_url)
        # Each worker is a gateway instance of its own; both serve. (A burst of connections
        # can all be accepted by one worker, the one whose accept loop wakes first: send
        # more until each has served.)
        sent, owners = 0, set[str]()
        while len(owners) < 2:
            assert sent < 300, owners
            answers = asyncio.run(_send(port, secret, 30))
            assert [a.status_code for a in answers] == [200] * 30
            sent += 30
            with engine.connect() as conn:
                events = ledger_events(conn)
            owners = {e.data["owner"].split("/")[0] for e in events if e.type == "BudgetReserved"}
        assert {o[-3:] for o in owners} == {"-w0", "-w1"}, owners
        assert sum(e.type == "RequestCompleted" for e in events) == sent
        # Both started with the same config: it was activated once.
        assert sum(e.type == "ConfigActivated" for e in events) == 1
        # Whichever worker answers /metrics, it counts every worker's requests.
        for _ in range(6):
            with httpx.Client() as http:  # a new connection, maybe another worker
                text = http.get(f"http://127.0.0.1:{port}/metrics").text
            assert _requests_answered(text) == sent
        # One worker keeps the read models: they reach the ledger's head.
        deadline = time.monotonic() + 20
        while True:
            with engine.connect() as conn:
                behind = conn.execute(
                    sa.text(
                        "SELECT count(*) FROM projection_checkpoints, ledger_head"
                        " WHERE projection_checkpoints.position < ledger_head.position"
                    )
                ).scalar()
            if behind == 0:
                break
            assert time.monotonic() < deadline, f"{behind} read models behind the head"
            time.sleep(0.2)
        engine.dispose()
        pids = _worker_pids(process.pid)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert not any(Path(f"/proc/{pid}").exists() for pid in pids)


@pytest.mark.slow
@pytest.mark.postgres
def test_a_worker_that_dies_is_started_again_and_serves(postgres_url: str, tmp_path: Path) -> None:
    secret = new_key(postgres_url)
    with _workers(tmp_path, postgres_url, 2) as (port, process):
        first = _worker_pids(process.pid)
        os.kill(first[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:
            now = _worker_pids(process.pid)
            if len(now) == 2 and now != first:
                break
            assert process.poll() is None, "the command stopped"
            assert time.monotonic() < deadline, "the worker was not started again"
            time.sleep(0.1)
        wait_ready(port, process)
        answers = asyncio.run(_send(port, secret, 20))
        assert [a.status_code for a in answers] == [200] * 20, [a.text for a in answers]


def test_workers_need_postgresql(sqlite_url: str) -> None:
    port = str(closed_port())
    result = waybill("serve", "--workers", "2", "--port", port, database_url=sqlite_url)
    assert result.returncode == 1
    assert "--workers needs a PostgreSQL ledger" in result.stderr
    assert "Traceback" not in result.stderr


def _followed(pid: int) -> bool:
    """Whether worker ``pid`` runs the read models' follower (the first worker does)."""
    return bool(Path(f"/proc/{pid}/task/{pid}/children").read_text().split())


@pytest.mark.slow
@pytest.mark.postgres
def test_the_workers_commit_through_the_first_and_commit_themselves_while_it_is_gone(
    postgres_url: str, tmp_path: Path
) -> None:
    secret = new_key(postgres_url)
    with _workers(tmp_path, postgres_url, 2) as (port, process):
        assert process.stderr is not None
        os.set_blocking(process.stderr.fileno(), False)
        said = b""
        answers = asyncio.run(_send(port, secret, 40))
        assert [a.status_code for a in answers] == [200] * 40
        pids = _worker_pids(process.pid)
        first = next(pid for pid in pids if _followed(pid))
        os.kill(first, signal.SIGKILL)
        # The other worker serves alone meanwhile: it commits its appends itself.
        answers = asyncio.run(_send(port, secret, 20))
        assert [a.status_code for a in answers] == [200] * 20
        # The first is started again; the other commits through it again, at its next try to
        # reconnect: those back off up to MAX_RETRY_AFTER_S apart, and a restart under load
        # can take a while, so wait for that (a bound, not a measure: it passes as soon as).
        deadline = time.monotonic() + 2 * MAX_RETRY_AFTER_S + 30
        while b"appender is back" not in said:
            assert time.monotonic() < deadline, said.decode(errors="replace")
            answers = asyncio.run(_send(port, secret, 2))
            assert [a.status_code for a in answers] == [200] * 2
            said += process.stderr.read() or b""
            time.sleep(0.2)
        text = said.decode(errors="replace")
        assert "the first worker's appender closed its socket: this worker commits itself" in text
        assert "Traceback" not in text
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    verified = waybill("verify", database_url=postgres_url)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    engine = sa.create_engine(postgres_url)
    with engine.connect() as conn:
        events = ledger_events(conn)
    engine.dispose()
    completed = sum(e.type == "RequestCompleted" for e in events)
    assert completed == sum(e.type == "RequestReceived" for e in events) >= 62


async def _calls(port: int, calls: list[tuple[str, str, str, Any]]) -> list[httpx.Response]:
    """Each (key, method, path, body) on a connection of its own, all at once: the kernel
    spreads them over the workers."""

    async def one(secret: str, method: str, path: str, body: Any) -> httpx.Response:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}",
            headers={"Authorization": f"Bearer {secret}"},
            timeout=30,
        ) as http:
            return await http.request(method, path, json=body)

    return list(await asyncio.gather(*(one(*call) for call in calls)))


def _events(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return ledger_events(conn)


_CHAT = "/v1/chat/completions"
_SPARE: dict[str, Any] = {**BODY, "model": "spare"}


def _reload(port: int, admin: str) -> httpx.Response:
    return httpx.post(
        f"http://127.0.0.1:{port}/v1/admin/config/reload",
        headers={"Authorization": f"Bearer {admin}"},
        timeout=60,
    )


def _every_worker_serves(
    engine: sa.Engine, port: int, secret: str, admin: str, generation: str, spare: bool
) -> None:
    """Bursts of calls until both workers have served some (their chat requests' events
    name them): every answer is ``generation``'s, the model group "spare" served or refused
    (``spare``), the models listed and the endpoints' generation agreeing."""
    owners: set[str] = set()
    for _ in range(10):
        mark = len(_events(engine))
        answers = asyncio.run(
            _calls(
                port,
                [(secret, "POST", _CHAT, BODY)] * 16
                + [(secret, "POST", _CHAT, _SPARE)] * 16
                + [(secret, "GET", "/v1/models", None)] * 8
                + [(admin, "GET", "/v1/endpoints", None)] * 8,
            )
        )
        chat, refused, models, endpoints = (
            answers[:16],
            answers[16:32],
            answers[32:40],
            answers[40:],
        )
        assert {a.status_code for a in chat} == {200}
        if spare:
            assert {a.status_code for a in refused} == {200}
        else:
            assert {a.status_code for a in refused} == {404}
            assert {a.json()["error"]["code"] for a in refused} == {"model_not_found"}
        listed = ("chat", "spare") if spare else ("chat",)
        assert {tuple(m["id"] for m in a.json()["data"]) for a in models} == {listed}
        assert {a.json()["config_generation"] for a in endpoints} == {generation}
        events = _events(engine)[mark:]
        assert {e.data["config_generation"] for e in events if e.type == "RequestReceived"} == {
            generation
        }
        owners |= {e.data["owner"].split("/")[0][-3:] for e in events if e.type == "BudgetReserved"}
        if owners == {"-w0", "-w1"}:
            return
    raise AssertionError(f"only {owners} served in 10 bursts")


@pytest.mark.slow
@pytest.mark.postgres
def test_a_reload_reloads_every_worker_and_a_bad_file_none(
    postgres_url: str, tmp_path: Path
) -> None:
    secret = new_key(postgres_url)
    admin = new_key(postgres_url, role="admin")
    with FakeUpstream("east") as east:
        config = tmp_path / "waybill.yaml"
        first = config_text({"east": east}, [Route("east")], strategies={"spare": "weighted"})
        config.write_text(first)
        port = closed_port()
        process = serve_process(config, postgres_url, port, env={"WAYBILL_WORKERS": "2"})
        engine = sa.create_engine(postgres_url)
        try:
            _every_worker_serves(engine, port, secret, admin, "test-1", spare=True)
            # A file that does not validate is refused, and every worker keeps the old one.
            config.write_text(first.replace("strategy: weighted", "strategy: fastest"))
            refused = _reload(port, admin)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["code"] == "invalid_request"
            _every_worker_serves(engine, port, secret, admin, "test-1", spare=True)
            # The next generation takes "spare" away from the workspace: once the reload has
            # answered, no worker serves it.
            second = first.replace("models: [chat, spare]", "models: [chat]")
            config.write_text(second.replace("generation: test-1", "generation: test-2"))
            reloaded = _reload(port, admin)
            assert reloaded.status_code == 200, reloaded.text
            assert reloaded.json() == {"previous_generation": "test-1", "generation": "test-2"}
            _every_worker_serves(engine, port, secret, admin, "test-2", spare=False)
            # A worker started again serves the generation the reload accepted.
            pids = _worker_pids(process.pid)
            os.kill(pids[0], signal.SIGKILL)
            deadline = time.monotonic() + 30
            while len(now := _worker_pids(process.pid)) < 2 or now == pids:
                assert time.monotonic() < deadline, "the worker was not started again"
                time.sleep(0.1)
            wait_ready(port, process)
            _every_worker_serves(engine, port, secret, admin, "test-2", spare=False)
            # SIGHUP to the command reloads every worker the same way (each says so).
            assert process.stderr is not None
            os.set_blocking(process.stderr.fileno(), False)
            said = process.stderr.read() or b""
            config.write_text(first.replace("generation: test-1", "generation: test-3"))
            process.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 30
            while said.count(b"config reloaded: generation test-2 -> test-3") < 2:
                assert time.monotonic() < deadline, said.decode(errors="replace")
                time.sleep(0.1)
                said += process.stderr.read() or b""
            _every_worker_serves(engine, port, secret, admin, "test-3", spare=True)
        finally:
            engine.dispose()
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)
        said += process.stderr.read() or b""
        assert b"Traceback" not in said, said.decode(errors="replace")


@pytest.mark.slow
@pytest.mark.postgres
def test_a_key_created_and_revoked_through_the_key_api_acts_on_every_worker(
    postgres_url: str, tmp_path: Path
) -> None:
    admin = new_key(postgres_url, role="admin")
    with _workers(tmp_path, postgres_url, 2) as (port, _):
        url = f"http://127.0.0.1:{port}/v1/admin/keys"
        headers = {"Authorization": f"Bearer {admin}"}
        with httpx.Client(timeout=30) as http:
            created = http.post(url, headers=headers, json={"workspace": "acme", "name": "w"})
        assert created.status_code == 201, created.text
        key = created.json()
        # Connections of their own, spread over the workers: each reads the key, and keeps it.
        answers = asyncio.run(_send(port, key["secret"], 30))
        assert [a.status_code for a in answers] == [200] * 30
        with httpx.Client(timeout=30) as http:  # maybe another worker
            revoked = http.post(f"{url}/{key['key_id']}/revoke", headers=headers)
        assert revoked.status_code == 200, revoked.text
        refused = asyncio.run(_send(port, key["secret"], 30))
        assert [a.status_code for a in refused] == [401] * 30
