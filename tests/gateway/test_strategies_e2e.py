"""Selection strategies over HTTP (contract §4 "Selection"): least_cost and least_latency
choose inside the best tier by the figures recorded on the evaluation, and explain shows them."""

from __future__ import annotations

from typing import Any

from openai.types.chat import ChatCompletionMessageParam

from router.fake_provider import Behavior
from tests.gateway.harness import Route, running_gateway

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
CHEAP = "{input_per_mtok: 0.1, output_per_mtok: 0.2}"
DEAR = "{input_per_mtok: 3.0, output_per_mtok: 15.0}"


async def _served_by(gw: Any, group: str) -> tuple[str, str]:
    raw = await gw.client().chat.completions.with_raw_response.create(
        model=group, messages=MESSAGES
    )
    return raw.headers["x-waybill-endpoint"], raw.headers["x-request-id"]


async def test_least_cost_sends_every_request_to_the_cheapest_worst_case(database_url):
    routes = [Route("east", price=DEAR, weight=5), Route("west", price=CHEAP)]
    async with running_gateway(
        database_url, ["east", "west"], routes, strategies={"cheap": "least_cost"}
    ) as gw:
        served = [await _served_by(gw, "cheap") for _ in range(3)]
        assert [endpoint for endpoint, _ in served] == ["west"] * 3
        events = await gw.events(served[0][1])
        evaluation = next(e.data for e in events if e.type == "RouteEvaluated")
        assert evaluation["strategy"] == "least_cost"
        costs = {c["endpoint"]: c["worst_case_usd"] for c in evaluation["candidates"]}
        assert float(costs["west"]) < float(costs["east"])
        # The same mappings under the default strategy follow the weights.
        weighted = [await _served_by(gw, "chat") for _ in range(6)]
        assert [endpoint for endpoint, _ in weighted].count("east") == 5
        async with gw.http() as http:
            explained = (await http.get(f"/v1/requests/{served[0][1]}/explain")).json()
        steps = " ".join(step["text"] for step in explained["decision_path"])
        assert "least worst-case cost of east/fake-model $" in steps


async def test_least_latency_measures_each_mapping_then_keeps_to_the_fastest(database_url):
    routes = [Route("east"), Route("west")]
    async with running_gateway(
        database_url, ["east", "west"], routes, strategies={"fast": "least_latency"}
    ) as gw:
        gw.upstreams["east"].set_default(Behavior.ok(latency_ms=300))
        first = [endpoint for endpoint, _ in [await _served_by(gw, "fast") for _ in range(2)]]
        assert sorted(first) == ["east", "west"]  # each measured once
        later = [await _served_by(gw, "fast") for _ in range(4)]
        assert [endpoint for endpoint, _ in later] == ["west"] * 4
        events = await gw.events(later[-1][1])
        evaluation = next(e.data for e in events if e.type == "RouteEvaluated")
        figures = {c["endpoint"]: c["latency_ms"] for c in evaluation["candidates"]}
        assert figures["east"] >= 300 > figures["west"]
