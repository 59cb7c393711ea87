"""README's month end, offline: docs/examples/month-end.yaml in front of `waybill fake-provider`,
whose admin API reports as usage what it billed, so `reconcile fetch` matches the traffic."""

from __future__ import annotations

import json
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import openai
from openai.types.chat import ChatCompletionMessageParam

from tests.gateway.harness import closed_port
from tests.gateway.processes import new_key, serve_process
from tests.ledger.test_cli import WAYBILL, waybill

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "docs" / "examples"


def test_the_offline_month_end_matches_the_fakes_usage_to_the_ledger(
    tmp_path: Path, sqlite_url: str
) -> None:
    fake_port, admin_port, gateway_port = closed_port(), closed_port(), closed_port()
    config = tmp_path / "month-end.yaml"
    config.write_text(
        (EXAMPLES / "month-end.yaml")
        .read_text()
        .replace("8901", str(fake_port))
        .replace("8911", str(admin_port))
    )
    env = {"FAKE_ADMIN_KEY": "sk-admin-fake", "WAYBILL_CONFIG": str(config)}
    assert waybill("migrate", database_url=sqlite_url).returncode == 0
    fake = subprocess.Popen(
        [*WAYBILL, "fake-provider", "--port", str(fake_port), "--admin-port", str(admin_port)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert fake.stdout is not None and fake.stdout.readline().startswith("listening")
        gateway = serve_process(config, sqlite_url, gateway_port, env=env)
        try:
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{gateway_port}/v1",
                api_key=new_key(sqlite_url),
                max_retries=0,
            )
            hello: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello"}]
            for group in ("chat-default", "claude-default"):
                client.chat.completions.create(model=group, messages=hello)
            streamed = client.chat.completions.create(
                model="chat-default", messages=hello, stream=True
            )
            assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        finally:
            gateway.terminate()
            gateway.wait(timeout=30)

        today = datetime.now(UTC).date().isoformat()
        for endpoint, requests in (("openai-east", 2), ("claude", 1)):
            fetched = waybill(
                "reconcile",
                "fetch",
                "--endpoint",
                endpoint,
                "--since",
                today,
                "--until",
                today,
                "--save",
                str(tmp_path / "pages"),
                "--json",
                database_url=sqlite_url,
                env=env,
            )
            assert fetched.returncode == 0, fetched.stderr
            report = json.loads(fetched.stdout)
            assert report["buckets"], report
            assert {b["status"] for b in report["buckets"]} == {"matched"}, report
            assert sum(b["provider_requests"] for b in report["buckets"]) == requests
            assert not report["unattributed_provider_usage"]
    finally:
        fake.terminate()
        fake.wait(timeout=10)
