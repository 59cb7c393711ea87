"""``waybill serve`` and ``waybill demo`` as real processes."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

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
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 401
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
