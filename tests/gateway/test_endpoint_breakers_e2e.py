"""An endpoint's own breaker settings end to end (contract §2 `endpoints[].breaker`, §5
"Circuit breakers"): laid over `defaults.breaker`, they decide when that endpoint's breaker
opens while every other endpoint keeps the defaults', and the transition records them. Run
with breakers in process and shared through Redis.

Every failure here is a 503 the fake provider answers at once, and the breakers' cool-downs
are a minute, so nothing depends on how fast anything runs.
"""

from __future__ import annotations

from typing import Any

import pytest

from ledger import apikeys
from router.fake_provider import Behavior
from tests.gateway.harness import gateway_with_breakers

BODY: dict[str, Any] = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
DEFAULTS = "{failure_threshold: 3, base_cooldown_ms: 60000, max_cooldown_ms: 60000}"


@pytest.mark.parametrize("shared", [False, True], ids=["in_process", "redis"])
async def test_an_endpoint_breaker_of_its_own_opens_at_its_threshold_and_another_at_the_defaults(
    sqlite_url: str, shared: bool
) -> None:
    async with gateway_with_breakers(
        sqlite_url,
        shared,
        "endpoint-breaker",
        defaults={"breaker": DEFAULTS},
        endpoint_extra={"east": "    breaker: {failure_threshold: 1}"},
    ) as gw:
        east, west = gw.upstreams["east"], gw.upstreams["west"]
        east.set_default(Behavior.server_error(503))
        west.set_default(Behavior.server_error(503))
        async with gw.http() as http:
            for _ in range(4):
                response = await http.post("/v1/chat/completions", json=BODY)
                assert response.status_code == 503, response.text
        # The first request opens east after its one failure and fails over to west;
        # west takes three requests to open; the fourth finds both open.
        assert (east.hits, west.hits) == (1, 3)
        # Nothing was sent for the fourth: a retry is worth it once a breaker admits its
        # probe, a minute away, and Retry-After is bounded (contract §3).
        assert response.headers["retry-after"] == "30"
        assert response.headers["x-should-retry"] == "true"
        transitions = [e.data for e in await gw.store.read_stream("breaker")]
        assert [{k: t[k] for k in _RECORDED} for t in transitions] == [
            _opened("east", consecutive_failures=1),  # its own threshold, 1
            _opened("west", consecutive_failures=3),  # the defaults', 3
        ]


def _opened(target: str, *, consecutive_failures: int) -> dict[str, Any]:
    return {
        "scope": "endpoint",
        "target": target,
        "from_state": "closed",
        "to_state": "open",
        "policy": "consecutive",
        "reason": "failure_threshold",
        "failure_class": "upstream_unavailable",
        "consecutive_failures": consecutive_failures,
        "cooldown_ms": 60000,
        "failure_threshold": consecutive_failures,  # what it opened at: the threshold
        "minimum_calls": None,
    }


_RECORDED = tuple(_opened("", consecutive_failures=0))


async def test_the_endpoints_list_names_each_endpoints_own_breaker_policy(sqlite_url: str) -> None:
    rolling = "{policy: rolling, window_calls: 4, minimum_calls: 2, failure_rate: 1}"
    async with gateway_with_breakers(
        sqlite_url,
        False,
        "endpoint-breaker",
        defaults={"breaker": DEFAULTS},
        endpoint_extra={"east": f"    breaker: {rolling}"},
    ) as gw:
        admin = (await apikeys.create_key(gw.store, "acme", "admin")).secret
        async with gw.http() as http:
            listed = await http.get("/v1/endpoints", headers={"Authorization": f"Bearer {admin}"})
        assert listed.status_code == 200, listed.text
        policies = {row["id"]: row["breaker_policy"] for row in listed.json()["data"]}
        assert policies == {"east": "rolling", "west": "consecutive"}
        assert listed.json()["breaker_policy"] == "consecutive"  # defaults.breaker's
        east = next(row for row in listed.json()["data"] if row["id"] == "east")
        assert east["breaker"]["calls"] == 0  # a rolling breaker's window
