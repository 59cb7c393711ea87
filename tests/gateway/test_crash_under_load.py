"""kill -9 under load, restart, and audit the ledger: every answered request is complete,
every started attempt is finished or an unknown-usage settlement, no hold is lost, and the
hash chain verifies."""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from router.fake_provider import Behavior, FakeUpstream
from tests.gateway.harness import Route, closed_port, config_text
from tests.gateway.processes import new_key, serve_process
from tests.helpers import ledger_events
from tests.ledger.test_cli import waybill

BODY: dict[str, Any] = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}


async def _load(
    port: int,
    secret: str,
    seconds: float,
    answered: list[str],
    stop: asyncio.Event,
    first: asyncio.Event,
) -> None:
    async def worker() -> None:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}",
            headers={"Authorization": f"Bearer {secret}"},
            timeout=5,
        ) as http:
            until = time.monotonic() + seconds
            while time.monotonic() < until and not stop.is_set():
                try:
                    stream = random.random() < 0.3
                    response = await http.post(
                        "/v1/chat/completions", json={**BODY, "stream": stream}
                    )
                    await response.aread()
                except httpx.HTTPError:
                    await asyncio.sleep(0.05)  # the gateway is down: try again
                    continue
                if response.status_code == 200 and (not stream or b"[DONE]" in response.content):
                    answered.append(response.headers["x-request-id"])
                    first.set()

    await asyncio.gather(*(worker() for _ in range(8)))


@pytest.mark.slow
@pytest.mark.postgres
def test_kill_9_under_load_loses_nothing(postgres_url: str, tmp_path: Path) -> None:
    rng = random.Random(7)
    with FakeUpstream("east", default=Behavior.ok(latency_ms=30, chunk_delay_ms=10)) as east:
        config = tmp_path / "waybill.yaml"
        config.write_text(
            config_text(
                {"east": east},
                [Route("east")],
                workspace_extra="    budget: {limit_usd: 1000, window: month}",
            )
        )
        secret = new_key(postgres_url)
        port = closed_port()
        answered: list[str] = []
        for _ in range(3):
            process = serve_process(config, postgres_url, port, env={"WAYBILL_HEARTBEAT_S": "0.2"})
            killer_delay = rng.uniform(0.5, 1.5)

            async def run(
                process: subprocess.Popen[bytes] = process, delay: float = killer_delay
            ) -> None:
                stop = asyncio.Event()
                first = asyncio.Event()
                load = asyncio.create_task(_load(port, secret, 30, answered, stop, first))
                # The kill comes mid-load: after the first answer of this round (on a busy
                # machine the first requests may take a while), then a random delay.
                async with asyncio.timeout(20):
                    await first.wait()
                await asyncio.sleep(delay)
                process.send_signal(signal.SIGKILL)
                await asyncio.sleep(0.5)
                stop.set()
                await load

            asyncio.run(run())
            process.wait(timeout=10)
        # A survivor recovers the dead gateways' holds.
        survivor = serve_process(config, postgres_url, port, env={"WAYBILL_HEARTBEAT_S": "0.2"})
        try:
            engine = sa.create_engine(postgres_url)
            deadline = time.monotonic() + 30
            while True:
                with engine.connect() as conn:
                    held = conn.execute(
                        sa.text("SELECT count(*) FROM budget_open_holds WHERE state = 'held'")
                    ).scalar_one()
                if held == 0:
                    break
                assert time.monotonic() < deadline, f"{held} holds never recovered"
                time.sleep(0.2)
            with engine.connect() as conn:
                rows = ledger_events(conn)
                holds: dict[str, int] = {
                    str(state): int(count)
                    for state, count in conn.execute(
                        sa.text(
                            "SELECT coalesce(o.state, 'resolved'), count(*) FROM budget_holds h "
                            "LEFT JOIN budget_open_holds o USING (reservation_id) GROUP BY 1"
                        )
                    )
                }
            engine.dispose()
        finally:
            survivor.terminate()
            survivor.wait(timeout=20)
    assert answered, "the load never got an answer"
    by_request: dict[str, list[str]] = {}
    started: set[str] = set()
    ended: set[str] = set()
    for stream_id, event_type, data in ((e.stream_id, e.type, e.data) for e in rows):
        by_request.setdefault(stream_id, []).append(event_type)
        if event_type == "AttemptStarted":
            started.add(data["attempt_id"])
        if event_type in ("AttemptFinished", "UnknownUsageOpened"):
            ended.add(data["attempt_id"])
    for request_id in answered:
        assert "RequestCompleted" in by_request[f"request-{request_id}"], request_id
    assert started <= ended, f"{len(started - ended)} attempts neither finished nor held"
    assert holds.get("held", 0) == 0 and holds.get("unknown", 0) >= 0
    verified = waybill("verify", database_url=postgres_url)
    assert verified.returncode == 0, verified.stdout
