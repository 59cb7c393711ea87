"""The config's ``checkpoints`` block (contract §2): checked at load with exact paths, the
key read once and never shown."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from ledger.audit.checkpoints import generate_key
from router.config import ConfigError, load_config, parse_config

BASE = """
endpoints:
  - {id: east, driver: openai, base_url: "http://127.0.0.1:9/v1", region: us,
     data_classes: [public]}
models:
  - name: chat
    mappings:
      - endpoint: east
        model: m
        context_window: 1000
        max_output_tokens: 100
        price: {input_per_mtok: 1, output_per_mtok: 2}
workspaces:
  - {id: acme, models: [chat], regions: [us], data_class: public}
"""


def test_relative_paths_are_the_config_files_and_the_summary_names_only_the_key_id(
    tmp_path: Path,
) -> None:
    key = generate_key()
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "signing.key").write_bytes(key.private_pem())
    config_file = tmp_path / "conf" / "waybill.yaml"
    config_file.write_text(BASE + "checkpoints: {signing_key: signing.key, out: sink}\n")
    config = load_config(config_file)
    assert config.checkpoints is not None
    assert config.checkpoints.out == (tmp_path / "conf" / "sink").resolve()
    assert config.checkpoints.key.key_id == key.key_id
    assert (config.checkpoints.every_events, config.checkpoints.every_seconds) == (10_000, 60.0)
    summary = config.redacted_summary()
    assert summary["checkpoints"] == {
        "out": str(tmp_path / "conf" / "sink"),
        "key_id": key.key_id,
        "every_events": 10_000,
        "every_seconds": 60.0,
    }
    dumped = orjson.dumps(summary) + repr(config).encode()
    assert b"PRIVATE KEY" not in dumped and key.private_pem()[40:80] not in dumped
    # Without the block, a summary is what it was.
    assert "checkpoints" not in parse_config(BASE).redacted_summary()


def test_the_signing_key_may_come_from_the_environment() -> None:
    key = generate_key()
    config = parse_config(
        BASE + "checkpoints: {signing_key: '${env:CHECKPOINT_KEY}', out: /tmp, every_seconds: 5}",
        environ={"CHECKPOINT_KEY": key.private_pem().decode()},
    )
    assert config.checkpoints is not None and config.checkpoints.key.key_id == key.key_id


@pytest.mark.parametrize(
    ("block", "errors"),
    [
        (
            "{signing_key: /nowhere/signing.key, out: /nowhere/sink}",
            [
                "checkpoints.signing_key: cannot read the key file /nowhere/signing.key",
                "checkpoints.out: /nowhere does not exist",
            ],
        ),
        (
            "{signing_key: '${env:NOT_SET_ANYWHERE}', out: /etc/hostname}",
            [
                "checkpoints.signing_key: unresolvable ${env:NOT_SET_ANYWHERE}",
                "checkpoints.out: /etc/hostname is not a directory",
            ],
        ),
        (
            "{signing_key: /etc/hostname, out: /tmp, every_events: 0, every_seconds: true}",
            [
                "checkpoints.signing_key: must hold an Ed25519 private key",
                "checkpoints.every_events: must be > 0",
                "checkpoints.every_seconds: must be a number of seconds",
            ],
        ),
        ("{out: /tmp, every_minutes: 1}", ["checkpoints.signing_key: required",
                                           "checkpoints.every_minutes: unknown key"]),
    ],
)  # fmt: skip
def test_a_bad_block_is_refused_naming_each_field(block: str, errors: list[str]) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config(BASE + f"checkpoints: {block}\n")
    message = str(refused.value)
    for error in errors:
        assert error in message, message
