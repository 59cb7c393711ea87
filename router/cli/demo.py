"""``waybill demo``: the gateway in front of two bundled local demo providers, offline.

Two fake providers (the test kit's :class:`router.fake_provider.FakeUpstream`) play a
primary on tier 0 and a fallback on tier 1; a client key is created in the ``demo``
workspace; a ready ``curl`` and ``openai`` SDK example is printed; then the gateway serves.
The fake providers and the gateway are imported when the command runs, not with the CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ledger import apikeys
from ledger.store import EventStore
from ledger.store.db import (
    absolute_url,
    create_engine,
    migrate,
    redacted_url,
    resolve_database_url,
)
from router.cli._shared import DatabaseUrl, friendly_errors, listening_socket, out, serve_app

if TYPE_CHECKING:
    from router.config import Config
    from router.http.app import AppSettings

__all__ = ["demo_command", "demo_config"]

_MODEL_GROUP = "chat-default"


def demo_command(
    database_url: DatabaseUrl = None,
    port: Annotated[int, typer.Option("--port")] = 8080,
    check: Annotated[
        bool,
        typer.Option("--check", help="Send one request through the demo, print it and exit."),
    ] = False,
) -> None:
    """Serve a demo config in front of a bundled local demo provider (works offline).

    `--check` without a database URL keeps its ledger in a temporary folder, removed when it
    exits: a check leaves no `waybill.db` behind in the current folder.
    """
    with contextlib.ExitStack() as cleanup, friendly_errors():
        if database_url is None and check:
            folder = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="waybill-demo-"))
            url, kept = f"sqlite:///{folder}/waybill.db", False
        else:
            url, kept = absolute_url(resolve_database_url(database_url)), True
        migrate(url)
        listening = listening_socket("127.0.0.1", port)
        _run_demo(url, listening, check=check, kept=kept)


def demo_config(primary_url: str, fallback_url: str) -> Config:
    from router.config import parse_config

    return parse_config(
        f"""
generation: demo
defaults:
  deadline_ms: 20000
  attempt_timeout_ms: 5000
  first_token_timeout_ms: 3000
endpoints:
  - id: demo-primary
    driver: openai
    base_url: {primary_url}
    region: local
    data_classes: [public, internal]
    proxy: none  # a fake provider on this machine, whatever HTTP_PROXY says
  - id: demo-fallback
    driver: openai
    base_url: {fallback_url}
    region: local
    data_classes: [public, internal]
    proxy: none  # a fake provider on this machine, whatever HTTP_PROXY says
models:
  - name: {_MODEL_GROUP}
    mappings:
      - endpoint: demo-primary
        model: fake-model
        tier: 0
        weight: 1
        capabilities: [text, stream, tools, json_schema]
        context_window: 128000
        max_output_tokens: 4096
        price: {{input_per_mtok: 0.15, output_per_mtok: 0.60}}
      - endpoint: demo-fallback
        model: fake-model
        tier: 1
        weight: 1
        capabilities: [text, stream, tools, json_schema]
        context_window: 128000
        max_output_tokens: 4096
        price: {{input_per_mtok: 0.30, output_per_mtok: 1.20}}
workspaces:
  - id: demo
    models: [{_MODEL_GROUP}]
    regions: [local]
    data_class: internal
""",
        source="<demo config>",
    )


def _create_key(database_url: str) -> apikeys.NewKey:
    async def create() -> apikeys.NewKey:
        engine = create_engine(database_url)
        store = EventStore(engine)
        try:
            return await apikeys.create_key(store, "demo", "client", created_by="demo")
        finally:
            await store.close()
            await engine.dispose()

    return asyncio.run(create())


def _examples(base: str, secret: str, database_url: str | None) -> str:
    # Flush left, so that each block pastes into a shell as printed; the Python example runs
    # with an interpreter that has the openai package, this one's if it does.
    python = sys.executable if importlib.util.find_spec("openai") else "python3"
    needs = "" if python == sys.executable else "  (needs: pip install openai)"
    # `waybill` as this shell can run it: by name when it is on PATH, else by its path.
    beside = os.path.join(os.path.dirname(sys.executable), "waybill")
    waybill = "waybill" if shutil.which("waybill") == beside else beside
    # The ledger by its absolute URL, so the line works from any folder (password masked).
    then = (
        f"Then: `{waybill} verify --database-url {redacted_url(database_url)}` walks the hash "
        "chain of everything recorded."
        if database_url is not None
        else "The ledger is temporary: give --database-url to keep it."
    )
    return f"""
Try it (in another terminal):

curl -s {base}/v1/chat/completions \\
  -H "Authorization: Bearer {secret}" -H "Content-Type: application/json" \\
  -d '{{"model": "{_MODEL_GROUP}", "messages": [{{"role": "user", "content": "Hello"}}]}}' -i

{python} - <<'PY'{needs}
from openai import OpenAI
client = OpenAI(base_url="{base}/v1", api_key="{secret}")
reply = client.chat.completions.create(
    model="{_MODEL_GROUP}", messages=[{{"role": "user", "content": "Hello"}}])
print(reply.choices[0].message.content)
for chunk in client.chat.completions.create(model="{_MODEL_GROUP}", stream=True,
        messages=[{{"role": "user", "content": "Hello"}}]):
    print(chunk.choices[0].delta.content or "", end="") if chunk.choices else None
PY

{then}
"""


def _run_demo(database_url: str, listening: socket.socket, *, check: bool, kept: bool) -> None:
    from router.fake_provider import FakeUpstream
    from router.http.app import AppSettings

    with FakeUpstream("demo-primary") as primary, FakeUpstream("demo-fallback") as fallback:
        settings = AppSettings(
            config=demo_config(primary.base_url, fallback.base_url), database_url=database_url
        )
        key = _create_key(database_url)
        port = listening.getsockname()[1]
        base = f"http://127.0.0.1:{port}"
        out.print(f"demo providers on {primary.base_url} (tier 0) and {fallback.base_url} (tier 1)")
        where = redacted_url(database_url) if kept else "a temporary file, removed on exit"
        out.print(
            f"ledger at {where}; demo client key {key.key_id} (workspace demo)",
            soft_wrap=True,
            markup=False,
        )
        examples = _examples(base, key.secret, database_url if kept else None)
        out.print(examples, highlight=False, markup=False, soft_wrap=True)
        if check:
            _check(settings, listening, key.secret)
            return
        serve_app(settings, "127.0.0.1", port, listening)


def _check(settings: AppSettings, listening: socket.socket, secret: str) -> None:
    """Serve in a thread, send one buffered and one streamed request, stop."""
    import httpx
    import uvicorn

    from router.http.app import create_app
    from router.serving.server import UVICORN_OPTIONS

    port = listening.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, **UVICORN_OPTIONS)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listening]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the demo gateway did not start")
            time.sleep(0.05)
        base = f"http://127.0.0.1:{port}/v1"
        headers = {"Authorization": f"Bearer {secret}"}
        body: dict[str, Any] = {
            "model": _MODEL_GROUP,
            "messages": [{"role": "user", "content": "Hello"}],
        }
        # The gateway is on this machine: never through an HTTP_PROXY the shell may set.
        with httpx.Client(headers=headers, timeout=20, trust_env=False) as client:
            reply = client.post(f"{base}/chat/completions", json=body)
            reply.raise_for_status()
            answer = reply.json()["choices"][0]["message"]["content"]
            out.print(
                f"buffered: {reply.status_code} via {reply.headers['x-waybill-endpoint']}, "
                f"cost ${reply.headers.get('x-waybill-cost-usd')}: {answer!r}",
                highlight=False,
            )
            with client.stream(
                "POST", f"{base}/chat/completions", json={**body, "stream": True}
            ) as streamed:
                streamed.raise_for_status()
                frames = sum(1 for line in streamed.iter_lines() if line.startswith("data: "))
        out.print(f"streamed: {streamed.status_code}, {frames} SSE events", highlight=False)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
