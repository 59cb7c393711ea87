"""Screenshots of the console for README.md, taken from a demo ledger made on the spot.

    .venv/bin/python scripts/console_screenshots.py [--out docs] [--days 14]

Runs the gateway in this process in front of two fake providers (a primary on tier 0 that
now and then answers 429 or 500, a fallback on tier 1), sends a few hundred requests spread
over the last ``--days`` days (each day's events are recorded with that day's time: the
store's clock is moved back for them, nothing else is changed), then signs in with an admin
key in headless Chromium (Debian's ``/usr/bin/chromium``, through Playwright) and saves
``console-requests.png``, ``console-request.png``, ``console-spend.png``,
``console-unknown.png`` and ``console-health.png`` in ``--out``. The ledger is a temporary
SQLite file, deleted afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from playwright.async_api import async_playwright

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ledger.store.event_store
from ledger import apikeys
from ledger.audit.verify import record_verification, verify_chain
from ledger.store import EventStore
from ledger.store.db import create_engine, migrate
from router.config import parse_config
from router.fake_provider import Behavior, FakeUpstream
from router.http.app import AppSettings, create_app
from router.serving.server import UVICORN_OPTIONS

CHROMIUM = "/usr/bin/chromium"
BODY = {"model": "chat-default", "messages": [{"role": "user", "content": "Hello"}]}


class _Shifted(datetime):
    """``datetime`` whose ``now`` runs ``offset`` behind: the store stamps events with it."""

    offset = timedelta(0)

    @classmethod
    def now(cls, tz: Any = None) -> _Shifted:
        return super().now(tz) - cls.offset


def _config(primary: str, fallback: str) -> str:
    mapping = """      - endpoint: {endpoint}
        model: {model}
        tier: {tier}
        weight: 1
        capabilities: [text, stream, tools, json_schema]
        context_window: 128000
        max_output_tokens: 4096
        price: {{input_per_mtok: {input}, output_per_mtok: {output}}}
"""
    return f"""generation: screenshots
defaults:
  deadline_ms: 20000
  attempt_timeout_ms: 5000
  breaker: {{failure_threshold: 3, base_cooldown_ms: 50, max_cooldown_ms: 200}}
  retry_same_endpoint: {{rate_limited: {{max: 0}}, upstream_unavailable: {{max: 0}}}}
endpoints:
  - {{id: openai-east, driver: openai, base_url: "{primary}", region: us-east,
      data_classes: [public, internal], proxy: none}}
  - {{id: eu-west, driver: openai, base_url: "{fallback}", region: us-east,
      data_classes: [public, internal], proxy: none}}
models:
  - name: chat-default
    mappings:
{mapping.format(endpoint="openai-east", model="gpt-4o-mini", tier=0, input=150, output=600)}\
{mapping.format(endpoint="eu-west", model="gpt-4o-mini", tier=1, input=300, output=1200)}\
workspaces:
  - {{id: acme, models: [chat-default], regions: [us-east], data_class: internal,
      budget: {{limit_usd: 500, window: month}}}}
  - {{id: research, models: [chat-default], regions: [us-east], data_class: internal}}
"""


async def _traffic(url: str, clients: list[str], primary: FakeUpstream, days: int) -> list[str]:
    """Requests over ``days`` days; the ids of those that failed over."""
    rng = random.Random(7)
    failed_over: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        for day in range(days, -1, -1):
            _Shifted.offset = timedelta(days=day)
            count = rng.randint(10, 26)
            plan = [
                rng.choices(
                    [Behavior.ok(), Behavior.rate_limited(), Behavior.server_error()],
                    weights=[86, 9, 5],
                )[0]
                for _ in range(count)
            ]
            primary.set_plan(plan)
            for _ in range(count):
                answer = await http.post(
                    "/v1/chat/completions",
                    json=BODY,
                    headers={"Authorization": f"Bearer {rng.choice(clients)}"},
                )
                if answer.headers.get("x-waybill-attempts", "1") != "1":
                    failed_over.append(answer.headers["x-request-id"])
                await asyncio.sleep(0.06)  # let the primary's breaker cool down
    _Shifted.offset = timedelta(0)
    return failed_over


async def _shoot(url: str, admin: str, failed_over: str, out: Path, days: int) -> None:
    since = (datetime.now(UTC) - timedelta(days=days)).date().isoformat()
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = await browser.new_page(viewport={"width": 1280, "height": 860})
        await page.goto(f"{url}/console/sign-in")
        await page.fill("#api_key", admin)
        await page.click("button[type=submit]")
        await page.wait_for_url("**/console/requests")
        shots = [
            ("console-requests.png", "/console/requests", False),
            ("console-request.png", f"/console/requests/{failed_over}", True),
            ("console-spend.png", f"/console/spend?since={since}&group=endpoint", False),
            ("console-unknown.png", "/console/unknown", False),
            ("console-health.png", "/console/health", False),
        ]
        for name, path, full in shots:
            await page.goto(url + path)
            await page.screenshot(path=str(out / name), full_page=full)
            print(f"wrote {out / name}")
        await browser.close()


async def main(out: Path, days: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        database_url = f"sqlite:///{folder}/demo.db"
        migrate(database_url)
        setattr(ledger.store.event_store, "datetime", _Shifted)  # noqa: B010 - the store's clock
        async with FakeUpstream("openai-east") as primary, FakeUpstream("eu-west") as fallback:
            config = parse_config(_config(primary.base_url, fallback.base_url))
            engine = create_engine(database_url)
            store = EventStore(engine)
            admin = await apikeys.create_key(store, "acme", "admin")
            await apikeys.create_key(store, "acme", "finance")
            clients = [
                (await apikeys.create_key(store, workspace, "client")).secret
                for workspace in ("acme", "acme", "research")
            ]
            app = create_app(AppSettings(config, database_url))
            server = uvicorn.Server(
                uvicorn.Config(app, host="127.0.0.1", port=0, **UVICORN_OPTIONS)
            )
            serving = asyncio.create_task(server.serve())
            while not server.started:  # noqa: ASYNC110 - uvicorn offers no event to await
                await asyncio.sleep(0.05)
            url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
            try:
                failed_over = await _traffic(url, clients, primary, days)
                await asyncio.sleep(1.5)  # the read models follow within moments
                # As `waybill verify` would, so that Health shows its last result.
                await record_verification(
                    engine, await verify_chain(store), verified_by="cli", books_ok=True
                )
                await _shoot(url, admin.secret, failed_over[-1], out, days)
            finally:
                server.should_exit = True
                await serving
                await store.close()
                await engine.dispose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs"))
    parser.add_argument("--days", type=int, default=14)
    arguments = parser.parse_args()
    asyncio.run(main(arguments.out, arguments.days))
