"""The config's ``otel`` block (contract §2, §8): pseudonymous tenants need a secret, read
from a file or the environment and never shown."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from router.config import ConfigError, load_config, parse_config
from tests.config.test_checkpoint_config import BASE

SECRET = "a-tenant-secret-nobody-may-see-42"


def test_the_secret_comes_from_a_file_beside_the_config_and_is_never_shown(
    tmp_path: Path,
) -> None:
    (tmp_path / "tenant.secret").write_text(SECRET + "\n")
    config_file = tmp_path / "waybill.yaml"
    config_file.write_text(
        BASE + "otel: {pseudonymous_tenants: true, tenant_secret: tenant.secret}\n"
    )
    config = load_config(config_file)
    assert config.otel.tenant_key == SECRET.encode()
    summary = config.redacted_summary()
    assert summary["otel"] == {"pseudonymous_tenants": True}
    assert SECRET.encode() not in orjson.dumps(summary) + repr(config).encode()
    # Without the block spans carry the workspace id, and a summary is what it was.
    plain = parse_config(BASE)
    assert plain.otel.tenant_key is None and "otel" not in plain.redacted_summary()


def test_the_secret_may_come_from_the_environment() -> None:
    config = parse_config(
        BASE + "otel: {pseudonymous_tenants: true, tenant_secret: '${env:TENANT_SECRET}'}\n",
        environ={"TENANT_SECRET": SECRET},
    )
    assert config.otel.tenant_key == SECRET.encode()


@pytest.mark.parametrize(
    ("block", "error"),
    [
        ("{pseudonymous_tenants: true}", "otel: pseudonymous_tenants needs a tenant_secret"),
        ("{tenant_secret: '${env:S}'}", "otel: tenant_secret is used only with"),
        ("{pseudonymous_tenants: true, tenant_secret: '${env:SHORT}'}",
         "otel.tenant_secret: must be at least 16 bytes"),
        ("{pseudonymous_tenants: true, tenant_secret: /nowhere/secret}",
         "otel.tenant_secret: cannot read the secret file /nowhere/secret"),
        ("{pseudonymous_tenants: yes-please}", "otel.pseudonymous_tenants"),
    ],
)  # fmt: skip
def test_a_bad_block_is_refused_without_echoing_the_secret(block: str, error: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config(BASE + f"otel: {block}\n", environ={"S": SECRET, "SHORT": "tiny-secret"})
    message = str(refused.value)
    assert error in message, message
    assert SECRET not in message and "tiny-secret" not in message
