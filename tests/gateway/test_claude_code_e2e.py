"""Claude Code itself through the Anthropic door (contract §3 "The Anthropic door"): `claude -p`
with ``ANTHROPIC_BASE_URL`` at the gateway, ``ANTHROPIC_API_KEY`` a Waybill key and
``ANTHROPIC_MODEL`` a model group, answered by the fake kit's Anthropic upstream (natively)
and by its OpenAI upstream (through the translation).

Claude Code is installed with npm into a folder of the test session (or the one
``WAYBILL_CLAUDE_CODE_DIR`` names, kept between runs); the test skips, saying why, only when
npm cannot install it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ledger import events as ev
from tests.gateway.harness import Gateway, Route, running_gateway

pytestmark = pytest.mark.slow

_PACKAGE = "@anthropic-ai/claude-code"


@pytest.fixture(scope="session")
def claude(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `claude` executable, installed with npm."""
    folder = Path(os.environ.get("WAYBILL_CLAUDE_CODE_DIR") or tmp_path_factory.mktemp("cc"))
    binary = folder / "node_modules" / ".bin" / "claude"
    if binary.exists():
        return binary
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: cannot install Claude Code")
    folder.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--prefix", str(folder), _PACKAGE],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.skip(f"npm install {_PACKAGE} took over 10 minutes")
    if done.returncode != 0 or not binary.exists():
        pytest.skip(f"npm cannot install {_PACKAGE}: {done.stderr.strip()[-500:]}")
    return binary


async def _claude_says(claude: Path, gw: Gateway, folder: Path) -> str:
    """What `claude -p` prints, pointed at ``gw`` with its key and model group ``chat``."""
    environ = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(folder),  # a fresh Claude Code: no settings, no login
        "ANTHROPIC_BASE_URL": gw.url,
        "ANTHROPIC_API_KEY": gw.secret,
        "ANTHROPIC_MODEL": "chat",
        # Its background model too (else it asks for a Haiku the workspace does not have).
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": "chat",
        "ANTHROPIC_SMALL_FAST_MODEL": "chat",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    process = await asyncio.create_subprocess_exec(
        str(claude),
        "-p",
        "Say hello.",
        cwd=folder,
        env=environ,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=240)
    said = out.decode()
    assert process.returncode == 0, (said, err.decode()[-2000:])
    return said


async def test_claude_code_answers_through_the_gateway(database_url, claude, tmp_path):
    async with running_gateway(
        database_url,
        ["claude-up"],
        [
            Route(
                "claude-up",
                model="claude-fake",
                max_output_tokens=64000,
                context_window=200000,
                # Claude Code marks its prompt for caching: the writes need their price.
                price="{input_per_mtok: 3, output_per_mtok: 15, cache_write_per_mtok: 3.75, "
                "cache_write_1h_per_mtok: 6, cached_input_per_mtok: 0.3}",
            )
        ],
        drivers={"claude-up": "anthropic"},
    ) as gw:
        said = await _claude_says(claude, gw, tmp_path)
        assert "Hello from claude-up" in said
        upstream = gw.upstreams["claude-up"]
        asked = [r for r in upstream.requests if r.path == "/v1/messages"]
        assert asked, "Claude Code's request reached the Anthropic upstream"
        first = asked[0]
        assert first.json["model"] == "claude-fake"
        assert first.json["stream"] is True
        assert first.json["tools"], "its tools, natively"
        assert "claude-code-20250219" in first.headers.get("anthropic-beta", "")
        assert first.headers.get("x-waybill-attempt-id"), "an attempt of the gateway's"
        received = [e.event() for e in await gw.store.read_all() if e.type == "RequestReceived"]
        assert received and all(isinstance(r, ev.RequestReceived) for r in received)
        assert {r.api for r in received if isinstance(r, ev.RequestReceived)} == {
            "anthropic.messages"
        }


async def test_claude_code_answers_from_an_openai_endpoint_through_the_translation(
    database_url, claude, tmp_path
):
    """Claude Code's betas are translated or dropped where that cannot change the answer
    (adaptive thinking, clearing thinking, effort as reasoning_effort), so an OpenAI-dialect
    endpoint can serve it too."""
    async with running_gateway(
        database_url,
        ["gpt-up"],
        [Route("gpt-up", model="gpt-fake", max_output_tokens=64000, context_window=200000)],
    ) as gw:
        said = await _claude_says(claude, gw, tmp_path)
        assert "Hello from gpt-up" in said
        asked = [r for r in gw.upstreams["gpt-up"].requests if r.path == "/v1/chat/completions"]
        assert asked and asked[0].json["model"] == "gpt-fake"
        assert asked[0].json["tools"][0]["type"] == "function"
        assert "context_management" not in asked[0].json
