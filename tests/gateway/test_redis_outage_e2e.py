"""A gateway whose Redis cannot be reached still serves and still protects its upstreams: its
breakers are its own until Redis answers (contract §5 "Circuit breakers")."""

from __future__ import annotations

import socket
from typing import Any

from router.fake_provider import Behavior
from tests.gateway.harness import Route, running_gateway

BODY: dict[str, Any] = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
BREAKER = "{failure_threshold: 2, base_cooldown_ms: 60000, max_cooldown_ms: 60000}"


def _closed_redis() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"redis://127.0.0.1:{s.getsockname()[1]}/0"


async def test_with_redis_unreachable_requests_are_served_and_breakers_still_open(
    sqlite_url: str,
) -> None:
    async with running_gateway(
        sqlite_url,
        ["east", "west"],
        [Route("east", tier=0), Route("west", tier=1)],
        redis_url=_closed_redis(),
        defaults={
            "breaker": "{failure_threshold: 2, base_cooldown_ms: 60000, max_cooldown_ms: 60000}"
        },
    ) as gw:
        gw.upstreams["east"].set_default(Behavior.server_error())
        async with gw.http() as http:
            for _ in range(4):
                answer = await http.post("/v1/chat/completions", json=BODY)
                assert answer.status_code == 200, answer.text
                assert answer.headers["x-waybill-endpoint"] == "west"
        # east failed twice, then its breaker (this process's own) kept requests away.
        assert gw.upstreams["east"].hits == 2
        opened = [
            (e.data["scope"], e.data["target"])
            for e in await gw.store.read_stream("breaker")
            if e.data["to_state"] == "open"
        ]
        assert ("endpoint", "east") in opened, opened
