"""Routing over many requests, end to end: tier priority, weight shares, breakers."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from ledger.store.db import migrate
from router.fake_provider import Behavior, FakeUpstream
from tests.gateway.harness import Route, closed_port, config_text, running_gateway
from tests.gateway.processes import new_key, serve_process
from tests.helpers import REDIS_URL, breaker_keys_removed, eventually, redis_up

BODY: dict[str, Any] = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
# Cool-downs long enough that a slow machine serves the next request inside one, short
# enough to keep the tests quick.
FAST_BREAKER = {"breaker": "{failure_threshold: 2, base_cooldown_ms: 1000, max_cooldown_ms: 2000}"}


async def test_a_lower_tier_is_never_chosen_while_the_primary_is_healthy(sqlite_url: str) -> None:
    routes = [Route("east", tier=0), Route("west", tier=1)]
    async with running_gateway(sqlite_url, ["east", "west"], routes) as gw, gw.http() as http:
        for _ in range(20):
            response = await http.post("/v1/chat/completions", json=BODY)
            assert response.headers["x-waybill-endpoint"] == "east"
        assert (gw.upstreams["east"].hits, gw.upstreams["west"].hits) == (20, 0)


async def test_weights_give_exact_shares_inside_a_tier(sqlite_url: str) -> None:
    routes = [Route("east", tier=0, weight=3), Route("west", tier=0, weight=1)]
    async with running_gateway(sqlite_url, ["east", "west"], routes) as gw, gw.http() as http:
        served: Counter[str] = Counter()
        positions = []
        for _ in range(40):
            response = await http.post("/v1/chat/completions", json=BODY)
            served[response.headers["x-waybill-endpoint"]] += 1
            events = await gw.events(response.headers["x-request-id"])
            positions.append(events[1].data["chosen"]["selection_position"])
        assert served == {"east": 30, "west": 10}
        assert positions == list(range(40))  # each choice records its place in the sequence


async def test_breaker_opens_serves_from_the_fallback_and_recovers(sqlite_url: str) -> None:
    routes = [Route("east", tier=0), Route("west", tier=1)]
    async with (
        running_gateway(sqlite_url, ["east", "west"], routes, defaults=FAST_BREAKER) as gw,
        gw.http() as http,
    ):
        east = gw.upstreams["east"]
        east.set_default(Behavior.server_error())  # a flapping upstream, down for now
        for _ in range(2):  # two failures open the endpoint breaker (threshold 2)
            assert (await http.post("/v1/chat/completions", json=BODY)).status_code == 200
        assert east.hits == 2
        opened_at = time.monotonic()
        # While open: served by the fallback, the broken upstream is not called at all.
        response = await http.post("/v1/chat/completions", json=BODY)
        assert response.headers["x-waybill-endpoint"] == "west"
        assert east.hits == 2
        events = await gw.events(response.headers["x-request-id"])
        east_candidate = events[1].data["candidates"][0]
        assert (east_candidate["reason_code"], east_candidate["detail"]) == (
            "breaker_open",
            "endpoint",
        )
        east.set_default(Behavior.ok())  # it recovers

        async def back_in_rotation() -> bool:
            reply = await http.post("/v1/chat/completions", json=BODY)
            return reply.headers["x-waybill-endpoint"] == "east"

        await eventually(back_in_rotation, within_s=5, interval=0.05)
        assert time.monotonic() - opened_at < 2.0 + 1.0  # within max_cooldown_ms (+ slack)
        transitions = [
            (e.data["from_state"], e.data["to_state"])
            for e in await gw.store.read_stream("breaker")
        ]
        assert transitions == [("closed", "open"), ("open", "half_open"), ("half_open", "closed")]


async def test_a_failed_probe_reopens_the_breaker_with_a_longer_cooldown(sqlite_url: str) -> None:
    routes = [Route("east", tier=0), Route("west", tier=1)]
    async with (
        running_gateway(sqlite_url, ["east", "west"], routes, defaults=FAST_BREAKER) as gw,
        gw.http() as http,
    ):
        gw.upstreams["east"].set_default(Behavior.server_error())
        for _ in range(2):
            await http.post("/v1/chat/completions", json=BODY)

        async def probed() -> bool:
            await http.post("/v1/chat/completions", json=BODY)
            return gw.upstreams["east"].hits == 3  # exactly one probe went through

        await eventually(probed, within_s=5, interval=0.05)
        events = await gw.store.read_stream("breaker")
        reopened = events[-1].data
        assert (reopened["from_state"], reopened["to_state"]) == ("half_open", "open")
        assert reopened["cooldown_ms"] == 2000  # doubled from 1000, within max_cooldown_ms


async def test_rate_limit_retry_after_opens_the_breaker_at_once(sqlite_url: str) -> None:
    routes = [Route("east", tier=0), Route("west", tier=1)]
    async with running_gateway(sqlite_url, ["east", "west"], routes) as gw, gw.http() as http:
        gw.upstreams["east"].set_plan([Behavior.rate_limited(retry_after=30)])
        await http.post("/v1/chat/completions", json=BODY)
        for _ in range(5):
            response = await http.post("/v1/chat/completions", json=BODY)
            assert response.headers["x-waybill-endpoint"] == "west"
        assert gw.upstreams["east"].hits == 1
        opened = (await gw.store.read_stream("breaker"))[0].data
        assert opened["cooldown_ms"] == 30000 and opened["failure_class"] == "rate_limited"


@pytest.mark.slow
def test_two_gateway_processes_share_breakers_through_redis(tmp_path: Path) -> None:
    if not redis_up():
        pytest.skip(f"no Redis at {REDIS_URL}")
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    migrate(url)
    generation = f"shared-{uuid.uuid4().hex[:8]}"
    with (
        breaker_keys_removed(REDIS_URL, generation),
        FakeUpstream("east") as east,
        FakeUpstream("west") as west,
    ):
        config = tmp_path / "waybill.yaml"
        config.write_text(
            config_text(
                {"east": east, "west": west},
                [Route("east", tier=0), Route("west", tier=1)],
                defaults={
                    "breaker": "{failure_threshold: 1, base_cooldown_ms: 60000,"
                    " max_cooldown_ms: 60000}"
                },
                generation=generation,
            )
        )
        secret = new_key(url)
        ports = [closed_port(), closed_port()]
        processes = [
            serve_process(config, url, port, env={"WAYBILL_REDIS_URL": REDIS_URL}) for port in ports
        ]
        try:
            clients = [
                httpx.Client(
                    base_url=f"http://127.0.0.1:{port}",
                    headers={"Authorization": f"Bearer {secret}"},
                    timeout=20,
                )
                for port in ports
            ]
            east.set_default(Behavior.server_error())
            first = clients[0].post("/v1/chat/completions", json=BODY)
            assert first.headers["x-waybill-endpoint"] == "west"
            assert east.hits == 1
            # The other process never saw east fail, yet keeps away from it: shared state.
            second = clients[1].post("/v1/chat/completions", json=BODY)
            assert second.headers["x-waybill-endpoint"] == "west"
            assert east.hits == 1
        finally:
            for process in processes:
                process.terminate()
                process.wait(timeout=20)
