"""``waybill serve`` and ``waybill demo`` as real processes."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.harness import ANTHROPIC_ENV, closed_port
from tests.gateway.processes import serve_process
from tests.ledger.test_cli import waybill


def test_demo_check_serves_a_buffered_and_a_streamed_request(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'demo.db'}"
    result = waybill("demo", "--check", "--port", str(closed_port()), database_url=url)
    assert result.returncode == 0, result.stderr
    assert "buffered: 200 via demo-primary" in result.stdout
    assert "streamed: 200" in result.stdout
    assert "curl -s http://127.0.0.1:" in result.stdout
    verified = waybill("verify", database_url=url)
    assert verified.returncode == 0 and "ledger OK" in verified.stdout


def test_serve_refuses_a_bad_config_with_the_offending_path(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(
        Path("docs/config.example.yaml").read_text().replace("weight: 3", "weight: 0", 1)
    )
    result = waybill(
        "serve",
        "--config",
        str(config),
        database_url=f"sqlite:///{tmp_path / 'x.db'}",
        env=ANTHROPIC_ENV | {"OPENAI_API_KEY": "k", "ANTHROPIC_API_KEY": "k"},
    )
    assert result.returncode == 1
    assert "models[0].mappings[0].weight" in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_without_a_config_says_how_to_give_one(tmp_path: Path) -> None:
    result = waybill("serve", database_url=f"sqlite:///{tmp_path / 'x.db'}")
    assert result.returncode == 1
    assert "--config" in result.stderr


def test_serve_migrates_and_answers_readyz(tmp_path: Path) -> None:
    port = closed_port()
    url = f"sqlite:///{tmp_path / 'fresh.db'}"  # never migrated: serve does it first
    process = serve_process(
        Path("docs/config.example.yaml"),
        url,
        port,
        migrate=True,
        env={"OPENAI_API_KEY": "k", "ANTHROPIC_API_KEY": "k"},
    )
    try:
        answer = httpx.get(f"http://127.0.0.1:{port}/v1/models")
        assert answer.status_code == 401
        assert "server" not in answer.headers  # nothing says what serves it
    finally:
        process.terminate()
        process.wait(timeout=20)


def test_sighup_reloads_the_config_file(tmp_path: Path) -> None:
    import signal

    import sqlalchemy as sa

    from router.fake_upstream import FakeUpstream
    from tests.gateway.harness import Route, config_text

    url = f"sqlite:///{tmp_path / 'hup.db'}"
    port = closed_port()
    with FakeUpstream("east") as east:
        config = tmp_path / "waybill.yaml"
        config.write_text(config_text({"east": east}, [Route("east")]))
        process = serve_process(config, url, port, migrate=True)
        try:
            config.write_text(config.read_text().replace("generation: test-1", "generation: hup"))
            process.send_signal(signal.SIGHUP)
            engine = sa.create_engine(url)
            deadline = time.monotonic() + 20
            while True:
                with engine.connect() as conn:
                    generations = [
                        row[0]
                        for row in conn.execute(
                            sa.text(
                                "SELECT json_extract(data, '$.generation') FROM events "
                                "WHERE type = 'ConfigActivated' ORDER BY position"
                            )
                        )
                    ]
                if generations == ["test-1", "hup"]:
                    break
                assert time.monotonic() < deadline, generations
                time.sleep(0.1)
            engine.dispose()
            assert process.poll() is None  # still serving
        finally:
            process.terminate()
            process.wait(timeout=20)


def _followers_of(pid: int) -> list[int]:
    """The read-model followers (ledger.follow) that process ``pid`` started."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat[stat.rfind(")") + 2 :].split()[1])
        if parent == pid and b"ledger.follow" in cmdline:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"  # an exited child not yet reaped is not alive


def _wait_for(check: Callable[[], Any], within_s: float = 20) -> Any:
    deadline = time.monotonic() + within_s
    while not (result := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return result


@pytest.mark.postgres
def test_serve_on_postgres_keeps_read_models_in_a_child_it_restarts_and_stops(
    postgres_url: str, tmp_path: Path
) -> None:
    import os
    import signal

    import sqlalchemy as sa

    from router.fake_upstream import FakeUpstream
    from tests.gateway.harness import Route, config_text
    from tests.gateway.processes import new_key

    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
    port = closed_port()
    engine = sa.create_engine(postgres_url.replace("postgresql://", "postgresql+psycopg://"))

    def viewed(request_id: str) -> bool:
        with engine.connect() as conn:
            query = sa.text("SELECT status FROM request_views WHERE request_id = :r")
            return conn.execute(query, {"r": request_id}).scalar() == "succeeded"

    with FakeUpstream("east") as east:
        config = tmp_path / "waybill.yaml"
        config.write_text(config_text({"east": east}, [Route("east")]))
        secret = new_key(postgres_url)
        process = serve_process(config, postgres_url, port)
        headers = {"Authorization": f"Bearer {secret}"}
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        try:
            [follower] = _wait_for(lambda: _followers_of(process.pid))
            first = httpx.post(url, json=body, headers=headers)
            assert first.status_code == 200
            _wait_for(lambda: viewed(first.headers["x-request-id"]))

            os.kill(follower, signal.SIGKILL)  # the gateway starts another
            [restarted] = _wait_for(
                lambda: [p for p in _followers_of(process.pid) if p != follower]
            )
            second = httpx.post(url, json=body, headers=headers)
            assert second.status_code == 200
            _wait_for(lambda: viewed(second.headers["x-request-id"]))
        finally:
            process.terminate()
            process.wait(timeout=20)
            engine.dispose()
        # Stopping the gateway stopped its follower (uvicorn exits by re-raising SIGTERM).
        assert process.returncode == -signal.SIGTERM
        assert not _alive(restarted)


@pytest.mark.postgres
def test_a_follower_whose_gateway_was_killed_stops_by_itself(
    postgres_url: str, tmp_path: Path
) -> None:
    import signal

    from router.fake_upstream import FakeUpstream
    from tests.gateway.harness import Route, config_text

    with FakeUpstream("east") as east:
        config = tmp_path / "waybill.yaml"
        config.write_text(config_text({"east": east}, [Route("east")]))
        process = serve_process(config, postgres_url, closed_port())
        [follower] = _wait_for(lambda: _followers_of(process.pid))
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
        _wait_for(lambda: not _alive(follower), within_s=10)
