"""The ledger's command line, run as a real process: migrate, keys, verify, replay."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sqlalchemy import create_engine, text

from ledger.store.db import sync_url
from ledger.store.stored import payloads_of
from tests.ledger.tamper import Stored, edit_ledger

WAYBILL = [sys.executable, "-c", "from router.cli.main import main; main()"]


def waybill(
    *args: str, database_url: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **(env or {}), "WAYBILL_DATABASE_URL": database_url, "COLUMNS": "200"}
    return subprocess.run(
        [*WAYBILL, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )


def test_migrate_verify_keys_replay_round_trip(empty_database_url: str) -> None:
    url = empty_database_url
    assert waybill("migrate", database_url=url).returncode == 0
    assert waybill("migrate", database_url=url).returncode == 0  # idempotent

    created = waybill(
        "keys", "create", "--workspace", "acme", "--role", "auditor", "--json", database_url=url
    )
    assert created.returncode == 0, created.stderr
    key = json.loads(created.stdout)
    assert set(key) == {"key_id", "secret", "workspace", "role"}
    assert key["workspace"] == "acme" and key["role"] == "auditor"

    revoked = waybill("keys", "revoke", key["key_id"], database_url=url)
    assert revoked.returncode == 0, revoked.stderr

    verified = waybill("verify", "--json", database_url=url)
    assert verified.returncode == 0
    assert json.loads(verified.stdout)["ok"] is True
    assert json.loads(verified.stdout)["checked"] == 2

    replayed = waybill("replay", "--projection", "keys", database_url=url)
    assert replayed.returncode == 0 and "keys: rebuilt from 2 events" in replayed.stdout
    assert "replaying keys" in replayed.stderr  # the progress bar

    engine = create_engine(sync_url(url))
    with engine.connect() as conn:
        row = conn.execute(text("SELECT role, revoked_at, secret_sha256 FROM api_keys")).one()
        rows = conn.execute(text("SELECT payloads FROM appends")).all()
    payloads = b"".join(p for (row,) in rows for p in payloads_of(bytes(row)))
    engine.dispose()
    assert row.role == "auditor" and row.revoked_at is not None
    assert key["secret"].encode() not in payloads  # only the hash is recorded


def test_verify_exits_non_zero_naming_the_first_bad_position(database_url: str) -> None:
    for _ in range(3):
        assert (
            waybill("keys", "create", "--workspace", "acme", database_url=database_url).returncode
            == 0
        )

    def promote(events: list[Stored]) -> None:  # the bytes edited, the hash left as it was
        events[1].payload = events[1].payload.replace(b'"role":"client"', b'"role":"admin"')

    edit_ledger(database_url, promote)
    result = waybill("verify", database_url=database_url)
    assert result.returncode == 1
    assert "BROKEN at position 2" in result.stdout


def test_user_errors_are_one_line_without_traceback(sqlite_url: str) -> None:
    unknown = waybill("keys", "revoke", "key_nope", database_url=sqlite_url)
    assert unknown.returncode == 1 and "no key 'key_nope'" in unknown.stderr
    bad_url = waybill("verify", database_url="mysql://x")
    assert bad_url.returncode == 1 and "unsupported database" in bad_url.stderr
    bad_projection = waybill("replay", "--projection", "nope", database_url=sqlite_url)
    assert bad_projection.returncode == 1 and "unknown projection 'nope'" in bad_projection.stderr
    for result in (unknown, bad_url, bad_projection):
        assert "Traceback" not in result.stderr


def test_check_config_accepts_the_example_and_names_each_bad_field(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[2] / "docs" / "config.example.yaml"
    env = {"OPENAI_API_KEY": "sk-test-secret-value", "ANTHROPIC_API_KEY": "sk-ant-secret"}
    ok = waybill("check-config", str(example), database_url="sqlite://", env=env)
    assert ok.returncode == 0, ok.stderr
    assert "config OK" in ok.stdout

    bad = tmp_path / "bad.yaml"
    bad.write_text(
        example.read_text().replace("weight: 3", "weight: 0", 1).replace("tier: 1", "tier: -1", 1)
    )
    result = waybill("check-config", str(bad), database_url="sqlite://", env=env)
    assert result.returncode == 1
    assert "].weight: must be > 0" in result.stderr
    assert "].tier:" in result.stderr
    assert "Traceback" not in result.stderr
    assert "sk-test-secret-value" not in result.stderr + result.stdout


def test_check_config_refuses_malformed_retention_and_endpoint_timeouts(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[2] / "docs" / "config.example.yaml"
    env = {"OPENAI_API_KEY": "sk-test-secret-value", "ANTHROPIC_API_KEY": "sk-ant-secret"}
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        example.read_text()
        .replace("retention: 30d ", "retention: 30days ", 1)
        .replace("timeouts: {first_token_timeout_ms: 8000}", "timeouts: {connect_ms: 8000}", 1)
        .replace("# retention: 30d ", "retention: forever ", 1)
    )
    result = waybill("check-config", str(bad), database_url="sqlite://", env=env)
    assert result.returncode == 1
    assert "endpoints[0].retention: must be none, zero or a number of days" in result.stderr
    assert "endpoints[0].timeouts.connect_ms: unknown key" in result.stderr
    assert "workspaces[0].retention: must be none, zero or a number of days" in result.stderr
    assert "Traceback" not in result.stderr
