"""The ledger's command line, run as a real process: migrate, keys, verify, replay."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

from sqlalchemy import create_engine, text

from ledger.store.db import head_revision, sync_url
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
    assert set(key) == {
        "key_id",
        "name",
        "secret",
        "workspace",
        "role",
        "endpoints",
        "expires_at",
        "limits",
    }
    assert key["workspace"] == "acme" and key["role"] == "auditor"
    assert key["endpoints"] is None  # unrestricted

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


def test_a_key_created_with_endpoints_keeps_its_scope_through_a_replay(sqlite_url: str) -> None:
    created = waybill(
        "keys",
        "create",
        "--workspace",
        "acme",
        "--endpoints",
        "west, provider:anthropic,west",
        "--json",
        database_url=sqlite_url,
    )
    assert created.returncode == 0, created.stderr
    assert json.loads(created.stdout)["endpoints"] == ["provider:anthropic", "west"]
    assert waybill("replay", "--projection", "keys", database_url=sqlite_url).returncode == 0
    engine = create_engine(sync_url(sqlite_url))
    with engine.connect() as conn:
        (scope,) = conn.execute(text("SELECT endpoints FROM api_keys")).one()
    engine.dispose()
    assert json.loads(scope) == ["provider:anthropic", "west"]
    plain = waybill("keys", "create", "--workspace", "other", database_url=sqlite_url)
    assert plain.returncode == 0, plain.stderr
    listed = waybill("keys", "list", "--json", database_url=sqlite_url)
    assert listed.returncode == 0, listed.stderr
    assert [(k["workspace"], k["endpoints"]) for k in json.loads(listed.stdout)] == [
        ("acme", ["provider:anthropic", "west"]),
        ("other", None),
    ]
    assert "secret" not in listed.stdout and "wb_" not in listed.stdout
    text_list = waybill("keys", "list", "--workspace", "acme", database_url=sqlite_url)
    assert "endpoints provider:anthropic, west" in text_list.stdout
    assert "other" not in text_list.stdout


def test_keys_create_refuses_an_unknown_provider_or_an_empty_scope(sqlite_url: str) -> None:
    for endpoints in ("provider:gemini", " , "):
        refused = waybill(
            "keys", "create", "--workspace", "acme", "--endpoints", endpoints,
            database_url=sqlite_url,
        )  # fmt: skip
        assert refused.returncode == 2, refused.stderr
        assert "--endpoints must name endpoint ids or provider:NAME" in refused.stderr
        assert "Traceback" not in refused.stderr


def test_keys_create_with_a_config_refuses_an_endpoint_it_does_not_have(sqlite_url: str) -> None:
    example = Path(__file__).resolve().parents[2] / "docs" / "config.example.yaml"
    env = {"OPENAI_API_KEY": "sk-test-secret-value", "ANTHROPIC_API_KEY": "sk-ant-secret"}
    args = ("keys", "create", "--workspace", "acme", "--config", str(example), "--json")
    known = waybill(*args, "--endpoints", "openai-east", database_url=sqlite_url, env=env)
    assert known.returncode == 0, known.stderr
    unknown = waybill(*args, "--endpoints", "openai-west", database_url=sqlite_url, env=env)
    assert unknown.returncode == 1
    assert "'openai-west'" in unknown.stderr and "Traceback" not in unknown.stderr


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


def test_version_names_the_release_and_the_schema_it_migrates_to(empty_database_url: str) -> None:
    shown = waybill("--version", database_url=empty_database_url)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == f"waybill {version('waybill')} (schema {head_revision()})\n"


def test_help_shows_flags_without_a_value_type(empty_database_url: str) -> None:
    # A flag takes no value: `--json <bool>` read as if it did.
    for command in ([], ["keys", "create"], ["verify"], ["reconcile", "fetch"], ["spend"]):
        shown = waybill(*command, "--help", database_url=empty_database_url)
        assert shown.returncode == 0, shown.stderr
        assert "--help" in shown.stdout and "<bool>" not in shown.stdout, shown.stdout


def test_check_config_counts_agree_with_their_nouns(tmp_path: Path) -> None:
    one = tmp_path / "one.yaml"
    one.write_text(
        """
endpoints:
  - {id: local, driver: openai, base_url: "http://127.0.0.1:9/v1", region: local,
     data_classes: [public]}
models:
  - name: chat
    mappings:
      - {endpoint: local, model: m, capabilities: [text], context_window: 8000,
         max_output_tokens: 1000, price: {input_per_mtok: 1, output_per_mtok: 2}}
workspaces:
  - {id: acme, models: [chat], regions: [local], data_class: public}
"""
    )
    ok = waybill("check-config", str(one), database_url="sqlite://")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.endswith(", 1 endpoint, 1 model group, 1 workspace\n"), ok.stdout


def waybill_in_terminal(*args: str, database_url: str, columns: int = 80) -> str:
    """`waybill ARGS` with its output on a terminal COLUMNS wide (a pseudo-terminal), as a
    person reads it; returns what the terminal showed, without its styling."""
    import pty
    import re

    env = {**os.environ, "WAYBILL_DATABASE_URL": database_url, "COLUMNS": str(columns)}
    env.pop("NO_COLOR", None)
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        [*WAYBILL, *args], stdout=follower, stderr=follower, env=env, cwd=Path.cwd()
    )
    os.close(follower)
    shown = bytearray()
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed: the process is gone
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    assert process.wait(timeout=120) == 0, shown.decode()
    return re.sub(r"\x1b\[[0-9;]*m", "", shown.decode()).replace("\r\n", "\n")


def test_keys_create_names_a_key_and_its_expiry_and_list_shows_them(sqlite_url: str) -> None:
    created = waybill(
        "keys", "create", "--workspace", "acme", "--name", "nightly batch",
        "--expires-at", "2031-01-31T18:00:00+01:00", "--tokens-per-minute", "9000", "--json",
        database_url=sqlite_url,
    )  # fmt: skip
    assert created.returncode == 0, created.stderr
    key = json.loads(created.stdout)
    assert (key["name"], key["expires_at"]) == ("nightly batch", "2031-01-31T17:00:00Z")
    assert key["limits"] == {"tokens_per_minute": 9000}
    listed = json.loads(waybill("keys", "list", "--json", database_url=sqlite_url).stdout)
    assert [(k["name"], k["expires_at"], k["state"]) for k in listed] == [
        ("nightly batch", "2031-01-31T17:00:00Z", "active")
    ]
    text_list = waybill("keys", "list", database_url=sqlite_url).stdout
    assert "nightly batch" in text_list and "expires 2031-01-31T17:00:00Z" in text_list
    assert "limits 9000 tokens/min" in text_list
    shown = waybill("keys", "create", "--workspace", "acme", "--name", "x", database_url=sqlite_url)
    assert "name:      x" in shown.stdout


def test_keys_create_refuses_a_past_expiry_or_a_blank_name(sqlite_url: str) -> None:
    for option, value, why in (
        ("--expires-at", "2001-01-01", "not in the future"),
        ("--expires-at", "next week", "ISO 8601"),
        ("--name", " ", "must not be empty"),
        ("--requests-per-minute", "0", "greater than or equal to 1"),
    ):
        refused = waybill(
            "keys", "create", "--workspace", "acme", option, value, database_url=sqlite_url
        )
        assert refused.returncode == 2, refused.stderr
        assert option in refused.stderr and why in refused.stderr
        assert "Traceback" not in refused.stderr
