"""Ramp-up after a breaker closes end to end (contract §5 "Circuit breakers", ``ramp_up_ms``):
once a probe closes east's breaker, east's evaluations record an effective weight that starts
at ``ramp_up_floor`` of its weight, explain and the console say so, and a breaker that never
opened is ranked at its full weight. Run on both ledger backends, with breakers in process
and shared through Redis.

The ramp lasts an hour, so the effective weights read here are near the floor however slow
the machine is; the only wait is for the 200 ms cool-down before the probe, polled through
``GET /v1/endpoints``.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from decimal import Decimal
from typing import Any

import httpx
import pytest

from ledger import apikeys
from router.fake_provider import Behavior
from tests.console.support import browser, sign_in
from tests.gateway.harness import Gateway, Route, gateway_with_breakers, running_gateway
from tests.helpers import REDIS_URL, breaker_keys_removed, eventually, redis_up

BODY: dict[str, Any] = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
BREAKER = (
    "{failure_threshold: 1, base_cooldown_ms: 200, max_cooldown_ms: 200,"
    " ramp_up_ms: 3600000, ramp_up_floor: 0.1}"
)
PREFER_EAST = {"X-Waybill-Prefer-Endpoint": "east"}


@asynccontextmanager
async def _gateway(database_url: str, shared: bool) -> AsyncIterator[Gateway]:
    """East and west on one tier, weight 2 each, breakers ramping up for an hour."""
    routes = (Route("east", weight=2), Route("west", weight=2))
    async with gateway_with_breakers(
        database_url, shared, "ramp", routes, defaults={"breaker": BREAKER}
    ) as gw:
        yield gw


async def _candidates(gw: Gateway, response: httpx.Response) -> list[dict[str, Any]]:
    events = await gw.events(response.headers["x-request-id"])
    evaluation = next(e for e in events if e.type == "RouteEvaluated")
    return list(evaluation.data["candidates"])


@pytest.mark.parametrize("shared", [False, True], ids=["in_process", "redis"])
async def test_a_recovered_endpoint_is_ranked_from_its_ramp_up_floor_and_it_is_recorded(
    database_url: str, shared: bool
) -> None:
    async with _gateway(database_url, shared) as gw:
        east = gw.upstreams["east"]
        admin = (await apikeys.create_key(gw.store, "acme", "admin")).secret
        async with gw.http() as http:
            # Both breakers closed and never opened: full weight, nothing recorded for it.
            steady = await http.post("/v1/chat/completions", json=BODY)
            assert steady.status_code == 200, steady.text
            assert [c.get("effective_weight") for c in await _candidates(gw, steady)] == [
                None,
                None,
            ]
            # East fails once: its breaker opens (threshold 1), the request fails over.
            east.set_plan([Behavior.server_error(503)])
            failed_over = await http.post("/v1/chat/completions", json=BODY, headers=PREFER_EAST)
            assert failed_over.status_code == 200, failed_over.text
            assert failed_over.headers["x-waybill-endpoint"] == "west"

            async def east_cooled_down() -> bool:
                listed = await http.get(
                    "/v1/endpoints", headers={"Authorization": f"Bearer {admin}"}
                )
                row = next(r for r in listed.json()["data"] if r["id"] == "east")
                return row["breaker"]["state"] == "open" and not row["breaker"]["blocked"]

            await eventually(east_cooled_down, within_s=30)
            # The probe goes to east and succeeds: the breaker closes and its ramp starts.
            probe = await http.post("/v1/chat/completions", json=BODY, headers=PREFER_EAST)
            assert probe.status_code == 200, probe.text
            assert probe.headers["x-waybill-endpoint"] == "east"
            ramping = await http.post("/v1/chat/completions", json=BODY)
            assert ramping.status_code == 200, ramping.text
            listed = await http.get("/v1/endpoints", headers={"Authorization": f"Bearer {admin}"})
            explained = await http.get(
                f"/v1/requests/{ramping.headers['x-request-id']}/explain",
                params={"format": "text"},
            )
        reasons = [e.data["reason"] for e in await gw.store.read_stream("breaker")]
        assert reasons == ["failure_threshold", "probe", "probe_succeeded"]
        east_row, west_row = await _candidates(gw, ramping)
        # East's weight 2 from its floor 0.1 (an hour's ramp has barely begun); west's full.
        effective = Decimal(east_row["effective_weight"])
        assert Decimal("0.2") <= effective < 2
        assert east_row["weight"] == 2 and east_row["eligible"]
        assert "effective_weight" not in west_row
        assert explained.status_code == 200, explained.text
        assert f"2 (ramping up: {east_row['effective_weight']})" in explained.text
        # GET /v1/endpoints and the console's health page show the breaker ramping up.
        rows = {row["id"]: row for row in listed.json()["data"]}
        assert Decimal("0.1") <= Decimal(rows["east"]["breaker"]["ramp_share"]) < 1
        assert rows["west"]["breaker"]["ramp_share"] is None
        async with browser(gw) as console:
            await sign_in(console, admin)
            page = await console.get(f"/console/requests/{ramping.headers['x-request-id']}")
            health = await console.get("/console/health")
        assert page.status_code == 200
        assert f"(ramping up: {east_row['effective_weight']})" in page.text
        assert health.status_code == 200
        assert "ramping up: 0.1" in health.text and " of its weight" in health.text


@pytest.mark.parametrize("shared", [False, True], ids=["in_process", "redis"])
async def test_without_ramp_up_ms_a_recovered_endpoint_is_ranked_at_full_weight_at_once(
    sqlite_url: str, shared: bool
) -> None:
    if shared and not redis_up():
        pytest.skip(f"no Redis at {REDIS_URL}")
    generation = f"noramp-{uuid.uuid4().hex[:8]}"
    breaker = "{failure_threshold: 1, base_cooldown_ms: 200, max_cooldown_ms: 200}"
    with breaker_keys_removed(REDIS_URL, generation):
        async with running_gateway(
            sqlite_url,
            ["east", "west"],
            [Route("east"), Route("west")],
            redis_url=REDIS_URL if shared else None,
            generation=generation,
            defaults={"breaker": breaker},
        ) as gw:
            gw.upstreams["east"].set_plan([Behavior.server_error(503)])
            async with gw.http() as http:
                first = await http.post("/v1/chat/completions", json=BODY, headers=PREFER_EAST)
                assert first.headers["x-waybill-endpoint"] == "west"

                async def east_probed() -> bool:
                    probe = await http.post("/v1/chat/completions", json=BODY, headers=PREFER_EAST)
                    return bool(probe.headers["x-waybill-endpoint"] == "east")

                await eventually(east_probed, within_s=30, interval=0.05)
                after = await http.post("/v1/chat/completions", json=BODY)
            reasons = [e.data["reason"] for e in await gw.store.read_stream("breaker")]
            assert reasons[-1] == "probe_succeeded"
            assert all("effective_weight" not in c for c in await _candidates(gw, after))
