"""`waybill fake-provider` as a real process: both dialects on one port, faults in order,
the admin report API from saved pages."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.ledger.test_cli import WAYBILL

ROOT = Path(__file__).resolve().parents[2]
REPORTS = ROOT / "tests" / "ledger" / "reports"


@contextmanager
def fake_provider(*args: str) -> Iterator[list[str]]:
    """The command's announced URLs (`listening URL`, then `admin API URL` if asked)."""
    process = subprocess.Popen(
        [*WAYBILL, "fake-provider", "--port", "0", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline().strip()]
        if "--admin-port" in args:
            lines.append(process.stdout.readline().strip())
        yield lines
    finally:
        process.terminate()
        assert process.wait(timeout=10) == 0


def test_one_port_speaks_both_dialects_and_answers_the_faults_in_order() -> None:
    with fake_provider("--name", "mine", "--fault", "rate_limited", "--fault", "server_error") as (
        listening,
    ):
        assert listening.startswith("listening http://127.0.0.1:")
        root = listening.removeprefix("listening ")
        client = openai.OpenAI(base_url=f"{root}/v1", api_key="sk-x", max_retries=0)
        chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(**chat)  # type: ignore[call-overload]
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(**chat)  # type: ignore[call-overload]
        reply = client.chat.completions.create(**chat)  # type: ignore[call-overload]
        assert reply.choices[0].message.content.startswith("Hello from mine")
        claude = anthropic.Anthropic(base_url=root, api_key="sk-ant-x", max_retries=0)
        message = claude.messages.create(
            model="fake-model", max_tokens=50, messages=[{"role": "user", "content": "hi"}]
        )
        assert message.usage.output_tokens > 0


def test_the_admin_api_serves_saved_pages_to_its_admin_key() -> None:
    usage = f"openai-usage={REPORTS / 'openai-usage.json'}"
    with fake_provider("--admin-port", "0", "--admin-report", usage) as (_, announced):
        assert announced.startswith("admin API http://127.0.0.1:")
        admin = announced.removeprefix("admin API ")
        url = f"{admin}/v1/organization/usage/completions?start_time=0&bucket_width=1h"
        refused = httpx.get(url, headers={"Authorization": "Bearer nope"})
        answered = httpx.get(url, headers={"Authorization": "Bearer sk-admin-fake"})
    assert refused.status_code == 401
    assert answered.status_code == 200 and answered.json()["data"][0]["results"]


def test_a_bad_fault_or_report_is_one_line_and_exit_1() -> None:
    for args in (("--fault", "on_fire"), ("--admin-report", "openai-usage=x.json")):
        ran = subprocess.run(
            [*WAYBILL, "fake-provider", "--port", "0", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert ran.returncode == 1 and "Traceback" not in ran.stderr, ran.stderr
        assert ran.stderr.startswith("error:"), ran.stderr
