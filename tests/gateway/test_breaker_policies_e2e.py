"""A rolling breaker end to end (contract §5 "Circuit breakers"): the gateway tells the breakers
each attempt's latency (a stream's time to first chunk), so slow successes open the breaker,
and the transition is recorded with the figures that caused it. Run with breakers in process
and shared through Redis.

Slowness is made by the fake provider waiting before its first event, so a call is at least
that slow however busy the machine is: nothing here depends on how fast anything runs.
"""

from __future__ import annotations

from typing import Any

import pytest

from router.fake_provider import Behavior
from tests.gateway.harness import gateway_with_breakers

BODY: dict[str, Any] = {
    "model": "chat",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
}
ROLLING = (
    "{policy: rolling, window_calls: 4, minimum_calls: 2, failure_rate: 1,"
    " slow_call_ms: 300, slow_call_rate: 0.5, base_cooldown_ms: 60000, max_cooldown_ms: 60000}"
)


@pytest.mark.parametrize("shared", [False, True], ids=["in_process", "redis"])
async def test_slow_first_chunks_open_a_rolling_breaker_with_its_figures_recorded(
    sqlite_url: str, shared: bool
) -> None:
    async with gateway_with_breakers(
        sqlite_url, shared, "rolling", defaults={"breaker": ROLLING}
    ) as gw:
        east = gw.upstreams["east"]
        # Quick headers, then a first chunk at least 400 ms later: slow (>= 300 ms) by
        # its time to first chunk, whatever the rest of the stream does.
        east.set_default(Behavior.ok(first_event_delay_ms=400))
        async with gw.http() as http:
            served = []
            for _ in range(3):
                response = await http.post("/v1/chat/completions", json=BODY)
                await response.aread()
                assert response.status_code == 200, response.text
                assert response.content.endswith(b"data: [DONE]\n\n")
                served.append(response.headers["x-waybill-endpoint"])
        # Two slow answers of two calls reach slow_call_rate 0.5 at minimum_calls 2:
        # the second opens east's breakers, and the third request goes to west.
        assert served == ["east", "east", "west"]
        assert (east.hits, gw.upstreams["west"].hits) == (2, 1)
        transitions = [e.data for e in await gw.store.read_stream("breaker")]
        assert {t["scope"] for t in transitions} == {"endpoint", "mapping"}
        for opened in transitions:
            assert opened["duration_ms"] >= 400
            assert {k: opened[k] for k in _FIGURES} == {
                "from_state": "closed",
                "to_state": "open",
                "policy": "rolling",
                "reason": "slow_call_rate",
                "failure_class": None,
                "calls": 2,
                "failed_calls": 0,
                "slow_calls": 2,
                "failure_rate": "0.0000",
                "slow_call_rate": "1.0000",
                "cooldown_ms": 60000,
                "minimum_calls": 2,
                "slow_call_rate_threshold": "0.5000",
                "failure_rate_threshold": None,
                "failure_threshold": None,
            }
        third = await gw.events(response.headers["x-request-id"])
        candidates = third[1].data["candidates"]
        assert (candidates[0]["reason_code"], candidates[0]["detail"]) == (
            "breaker_open",
            "endpoint",
        )


_FIGURES = (
    "from_state",
    "to_state",
    "policy",
    "reason",
    "failure_class",
    "calls",
    "failed_calls",
    "slow_calls",
    "failure_rate",
    "slow_call_rate",
    "cooldown_ms",
    "minimum_calls",
    "slow_call_rate_threshold",
    "failure_rate_threshold",
    "failure_threshold",
)
