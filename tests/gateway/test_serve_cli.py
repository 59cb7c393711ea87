"""``waybill serve`` and ``waybill demo`` as real processes."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from ledger.store.db import sync_url
from tests.gateway.harness import ANTHROPIC_ENV, closed_port
from tests.gateway.processes import serve_process
from tests.helpers import ledger_events
from tests.ledger.test_cli import WAYBILL, waybill


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

    from router.fake_provider import FakeUpstream
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
                        e.data["generation"]
                        for e in ledger_events(conn)
                        if e.type == "ConfigActivated"
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
    """The read-model followers (ledger.views.follow) that process ``pid`` started."""
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
        if parent == pid and b"ledger.views.follow" in cmdline:
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


def test_serve_keeps_read_models_in_a_child_it_restarts_and_stops(
    database_url: str, tmp_path: Path
) -> None:
    # On SQLite too: the child folds pages without the write lock (ledger.views.follow).
    import os
    import signal

    import sqlalchemy as sa

    from router.fake_provider import FakeUpstream
    from tests.gateway.harness import Route, config_text
    from tests.gateway.processes import new_key

    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
    port = closed_port()
    engine = sa.create_engine(sync_url(database_url))

    def viewed(request_id: str) -> bool:
        with engine.connect() as conn:
            query = sa.text("SELECT status FROM request_views WHERE request_id = :r")
            return conn.execute(query, {"r": request_id}).scalar() == "succeeded"

    with FakeUpstream("east") as east:
        config = tmp_path / "waybill.yaml"
        config.write_text(config_text({"east": east}, [Route("east")]))
        secret = new_key(database_url)
        process = serve_process(config, database_url, port)
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


def test_a_follower_whose_gateway_was_killed_stops_by_itself(
    database_url: str, tmp_path: Path
) -> None:
    import signal

    from router.fake_provider import FakeUpstream
    from tests.gateway.harness import Route, config_text

    with FakeUpstream("east") as east:
        config = tmp_path / "waybill.yaml"
        config.write_text(config_text({"east": east}, [Route("east")]))
        process = serve_process(config, database_url, closed_port())
        [follower] = _wait_for(lambda: _followers_of(process.pid))
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
        _wait_for(lambda: not _alive(follower), within_s=10)


def _listening_inodes(port: int) -> set[str]:
    """The inodes of the TCP sockets listening on ``port`` (state 0A in /proc/net/tcp*)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                    found.add(fields[9])
    return found


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    return inodes


@pytest.mark.postgres
def test_the_gateways_children_never_hold_its_listening_socket(
    postgres_url: str, tmp_path: Path
) -> None:
    # A child that kept it (say, after the gateway was killed) would accept connections
    # nobody ever serves.
    import signal

    from router.fake_provider import FakeUpstream
    from tests.gateway.harness import Route, config_text

    with FakeUpstream("east") as east:
        config = tmp_path / "waybill.yaml"
        config.write_text(config_text({"east": east}, [Route("east")]))
        port = closed_port()
        process = serve_process(config, postgres_url, port)
        try:
            [follower] = _wait_for(lambda: _followers_of(process.pid))
            listening = _listening_inodes(port)
            assert listening & _socket_inodes(process.pid)  # the gateway's own, seen
            assert not listening & _socket_inodes(follower)
        finally:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=10)
        _wait_for(lambda: not _alive(follower), within_s=10)
        # Nothing listens on the port once the gateway is gone.
        assert not _listening_inodes(port)


KEYS = {"OPENAI_API_KEY": "k", "ANTHROPIC_API_KEY": "k"}


def test_a_read_command_where_there_is_no_ledger_creates_none(tmp_path: Path) -> None:
    import os
    import subprocess

    missing = tmp_path / "nothing-here.db"
    for command in (("verify",), ("spend",), ("explain", "req_x"), ("keys", "revoke", "k_x")):
        result = waybill(*command, database_url=f"sqlite:///{missing}")
        assert result.returncode == 1, (command, result.stdout)
        assert "no ledger at" in result.stderr and "waybill migrate" in result.stderr
        assert "Traceback" not in result.stderr
    assert not missing.exists()
    # The default, ./waybill.db, in a folder without one: not created either.
    from tests.ledger.test_cli import WAYBILL

    environ = {k: v for k, v in os.environ.items() if not k.startswith("WAYBILL_")}
    bare = subprocess.run(
        [*WAYBILL, "verify"],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bare.returncode == 1 and "no ledger at waybill.db" in bare.stderr
    assert not (tmp_path / "waybill.db").exists()
    empty = tmp_path / "empty.db"
    empty.touch()
    unmigrated = waybill("verify", database_url=f"sqlite:///{empty}")
    assert unmigrated.returncode == 1 and "holds no Waybill ledger" in unmigrated.stderr


def test_serve_no_migrate_on_an_unmigrated_database_says_so_before_serving(
    tmp_path: Path,
) -> None:
    empty = tmp_path / "empty.db"
    empty.touch()
    result = waybill(
        "serve",
        "--no-migrate",
        "--config",
        "docs/config.example.yaml",
        "--port",
        str(closed_port()),
        database_url=f"sqlite:///{empty}",
        env=KEYS,
    )
    assert result.returncode == 1
    assert "waybill migrate" in result.stderr and "serving" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_port_in_use_is_one_line_before_any_banner(tmp_path: Path) -> None:
    import socket

    url = f"sqlite:///{tmp_path / 'x.db'}"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        served = waybill(
            "serve",
            "--config",
            "docs/config.example.yaml",
            "--port",
            port,
            database_url=url,
            env=KEYS,
        )
        demo = waybill("demo", "--port", port, database_url=url)
    for result in (served, demo):
        assert result.returncode == 1
        assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
        assert "serving" not in result.stderr and "Traceback" not in result.stderr
    assert "curl" not in demo.stdout and "demo client key" not in demo.stdout


def _waybill_in(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`waybill ARGS` run in FOLDER, as a newcomer would: no database URL in the environment."""
    env = {k: v for k, v in os.environ.items() if k != "WAYBILL_DATABASE_URL"}
    return subprocess.run(
        [*WAYBILL, *args],
        env={**env, "COLUMNS": "200", "PYTHONPATH": str(Path.cwd())},
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_demo_check_leaves_no_ledger_in_the_current_folder(tmp_path: Path) -> None:
    result = _waybill_in(tmp_path, "demo", "--check", "--port", str(closed_port()))
    assert result.returncode == 0, result.stderr
    assert "buffered: 200 via demo-primary" in result.stdout
    assert "ledger at a temporary file" in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_the_demos_examples_paste_and_run_as_printed(tmp_path: Path) -> None:
    # The demo is given its ledger by a path relative to the folder it runs in...
    (tmp_path / "here").mkdir()
    (tmp_path / "elsewhere").mkdir()
    result = _waybill_in(
        tmp_path / "here",
        "demo",
        "--check",
        "--port",
        str(closed_port()),
        "--database-url",
        "sqlite:///demo.db",
    )
    assert result.returncode == 0, result.stderr
    printed = result.stdout
    start = printed.index("<<'PY'")
    command_line = printed[printed.rindex("\n", 0, start) + 1 : printed.index("\n", start)]
    script = printed[printed.index("\n", start) + 1 : printed.index("\nPY\n", start)]
    assert not script.startswith(" ")  # flush left: pastes into a shell as printed
    compile(script, "<demo example>", "exec")  # valid Python as printed
    assert command_line.split()[0].endswith(("python", "python3", "python3.11"))
    assert "curl -s http" in printed and not printed.split("curl -s")[0].endswith(" ")
    # ... and the verify line it prints works from another folder.
    verify = printed[printed.index("Then: `") + 7 :].split("`")[0]
    assert f"sqlite:///{tmp_path / 'here' / 'demo.db'}" in verify
    env = {k: v for k, v in os.environ.items() if k != "WAYBILL_DATABASE_URL"}
    ran = subprocess.run(
        verify.split(),
        env=env,
        cwd=tmp_path / "elsewhere",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 0 and "ledger OK" in ran.stdout, ran.stderr
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_serve_defaults_to_the_measured_capacity() -> None:
    import inspect

    from router.cli.serve import serve_command
    from router.http.app import DEFAULT_MAX_IN_FLIGHT, AppSettings

    default = inspect.signature(serve_command).parameters["max_in_flight"].default
    assert default == DEFAULT_MAX_IN_FLIGHT == AppSettings.max_in_flight == 256
