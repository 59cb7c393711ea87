"""Two gateway processes sharing PostgreSQL and Redis under concurrent load: the budget is
never exceeded, breakers are shared, and the read models agree with the ledger."""

from __future__ import annotations

import asyncio
import time
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from router.fake_provider import Behavior, FakeUpstream
from tests.gateway.harness import Route, closed_port, config_text
from tests.gateway.processes import new_key, serve_process
from tests.helpers import REDIS_URL, breaker_keys_removed, ledger_events, redis_up
from tests.ledger.test_cli import waybill

BODY: dict[str, Any] = {
    "model": "chat",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 100,
}
# About 4 worst cases of 0.00024 at once, and about 45 requests' actual cost: some of the 60
# requests of the load are refused (402) even if a busy machine serves them one at a time.
LIMIT = Decimal("0.0010")


@pytest.mark.slow
@pytest.mark.postgres
def test_two_replicas_share_budget_breakers_and_agree_on_the_books(
    postgres_url: str, tmp_path: Path
) -> None:
    if not redis_up():
        pytest.skip(f"no Redis at {REDIS_URL}")
    generation = f"replicas-{uuid.uuid4().hex[:8]}"
    with (
        breaker_keys_removed(REDIS_URL, generation),
        # east refuses before starting work (429): its holds are released, so the budget
        # goes to the fallback; it opens the shared breaker at once.
        FakeUpstream("east", default=Behavior.rate_limited()) as east,
        FakeUpstream("west", default=Behavior.ok(latency_ms=50)) as west,
    ):
        config = tmp_path / "waybill.yaml"
        config.write_text(
            config_text(
                {"east": east, "west": west},
                [Route("east", tier=0), Route("west", tier=1)],
                defaults={
                    "breaker": "{failure_threshold: 2, base_cooldown_ms: 60000,"
                    " max_cooldown_ms: 60000}"
                },
                workspace_extra=f"    key_budget: {{limit_usd: {LIMIT}, window: day}}",
                generation=generation,
            )
        )
        secret = new_key(postgres_url)
        ports = [closed_port(), closed_port()]
        env = {"WAYBILL_REDIS_URL": REDIS_URL}
        processes = [serve_process(config, postgres_url, port, env=env) for port in ports]
        engine = sa.create_engine(postgres_url)
        over: list[Any] = []
        try:

            async def opening() -> int:
                # Breakers are shared: requests through the first replica until it stops
                # trying east (its breaker opened; each falls back to west), then the second
                # replica routes around east without ever trying it.
                async with httpx.AsyncClient(
                    headers={"Authorization": f"Bearer {secret}"}, timeout=30
                ) as http:

                    async def ask(port: int) -> None:
                        url = f"http://127.0.0.1:{port}/v1/chat/completions"
                        answer = await http.post(url, json=BODY)
                        assert answer.status_code == 200, answer.text

                    hits = -1
                    while east.hits != hits:
                        hits = east.hits
                        await ask(ports[0])
                    assert 1 <= hits <= 2, hits  # the breaker's threshold is 2
                    for _ in range(2):
                        await ask(ports[1])
                    assert east.hits == hits, (east.hits, hits)
                return hits

            async def load() -> list[int]:
                stop = asyncio.Event()

                async def sample() -> None:
                    while not stop.is_set():
                        with engine.connect() as conn:
                            for row in conn.execute(sa.text("SELECT * FROM budget_accounts")):
                                if row.held_usd + row.settled_usd > row.limit_usd:
                                    over.append(row)
                        await asyncio.sleep(0.01)

                sampler = asyncio.create_task(sample())
                async with httpx.AsyncClient(
                    headers={"Authorization": f"Bearer {secret}"}, timeout=30
                ) as http:
                    responses = await asyncio.gather(
                        *(
                            http.post(
                                f"http://127.0.0.1:{ports[n % 2]}/v1/chat/completions", json=BODY
                            )
                            for n in range(60)
                        )
                    )
                stop.set()
                await sampler
                return [r.status_code for r in responses]

            opened_after = asyncio.run(opening())
            before_load = west.hits
            statuses = asyncio.run(load())
            assert set(statuses) <= {200, 402, 503}, statuses
            assert statuses.count(200) > 0 and statuses.count(402) > 0
            assert not over, "settled + held went over the limit"
            # The breaker stays open (a minute's cool-down) for both replicas under load.
            assert east.hits == opened_after, (east.hits, opened_after)

            # Both replicas' read models follow the same ledger: they must agree with it.
            deadline = time.monotonic() + 30
            while True:
                with engine.connect() as conn:
                    recorded = ledger_events(conn)
                    received = sum(1 for e in recorded if e.type == "RequestReceived")
                    views = conn.execute(sa.text("SELECT count(*) FROM request_views")).scalar_one()
                    settled = sum(
                        (
                            Decimal(e.data["settled_usd"])
                            for e in recorded
                            if e.type == "BudgetSettled"
                        ),
                        Decimal(0),
                    )
                    spent = conn.execute(
                        sa.text("SELECT coalesce(sum(settled_usd), 0) FROM spend_attempts")
                    ).scalar_one()
                if received == views == 60 + before_load and settled == spent:
                    break
                assert time.monotonic() < deadline, (received, views, settled, spent)
                time.sleep(0.2)
        finally:
            engine.dispose()
            for process in processes:
                process.terminate()
                process.wait(timeout=20)
    assert waybill("verify", database_url=postgres_url).returncode == 0
    assert west.hits == statuses.count(200) + before_load
