"""Hedged requests over HTTP (contract §5 "Hedging"): a second way to the next failover
candidate when the first has not answered after the delay; first content wins, the loser is
cancelled and its usage held unknown (or settled, when it answered in full)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from openai.types.chat import ChatCompletionMessageParam

from ledger.store import RecordedEvent
from router.fake_provider import Behavior
from tests.gateway.harness import Route, running_gateway

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
HEDGE = {"hedge": "{enabled: true, after_ms: 200}"}
ROUTES = [Route("east"), Route("west", tier=1)]


def _of(events: list[RecordedEvent], kind: str) -> list[dict[str, Any]]:
    return [e.data for e in events if e.type == kind]


async def test_a_slow_buffered_answer_is_hedged_to_the_next_candidate(database_url):
    async with running_gateway(database_url, ["east", "west"], ROUTES, defaults=HEDGE) as gw:
        gw.upstreams["east"].set_default(Behavior.ok(latency_ms=5000))
        raw = await gw.client().chat.completions.with_raw_response.create(
            model="chat", messages=MESSAGES
        )
        assert raw.headers["x-waybill-endpoint"] == "west"
        assert raw.parse().choices[0].message.content
        events = await gw.events(raw.headers["x-request-id"])
        first, hedge = _of(events, "AttemptStarted")
        assert (first["endpoint"], first["kind"]) == ("east", "call")
        assert (hedge["endpoint"], hedge["kind"], hedge["cause"]) == ("west", "hedge", "hedge")
        assert hedge["hedge_of"] == first["attempt_id"]
        evaluations = _of(events, "RouteEvaluated")
        assert evaluations[-1]["tried_endpoints"] == ["east"], "the next failover candidate"
        finished = {f["attempt_id"]: f for f in _of(events, "AttemptFinished")}
        assert finished[first["attempt_id"]]["error_code"] == "hedge_lost"
        assert finished[hedge["attempt_id"]]["status"] == "succeeded"
        held = _of(events, "UnknownUsageOpened")
        assert [(h["attempt_id"], h["cause"]) for h in held] == [
            (first["attempt_id"], "hedge_lost")
        ]
        assert events[-1].type == "RequestCompleted" and events[-1].data["endpoint"] == "west"
        async with gw.http() as http:
            explained = await http.get(f"/v1/requests/{raw.headers['x-request-id']}/explain")
            assert "was a hedge beside attempt 1" in explained.json()["summary"]
            metrics = (await http.get("/metrics", headers={"authorization": ""})).text
        for outcome in ("launched", "won"):
            counted = rf'waybill_hedges_total{{[^}}]*waybill_hedge_outcome="{outcome}"}} 1\.0'
            assert re.search(counted, metrics), outcome
        cost = re.search(r'waybill_hedge_loser_cost_USD_total{[^}]*"held_unknown"} (\S+)', metrics)
        assert cost is not None and float(cost.group(1)) > 0
        # the winner's cost, and east left out of the hedge's evaluation as already tried
        assert re.search(r"waybill_request_cost_USD_count{[^}]*} 1\.0", metrics)
        excluded = r'waybill_route_excluded_candidates_total{[^}]*"already_tried"} 1\.0'
        assert re.search(excluded, metrics)


async def test_a_slow_stream_is_hedged_and_the_first_content_wins(database_url):
    async with running_gateway(database_url, ["east", "west"], ROUTES, defaults=HEDGE) as gw:
        gw.upstreams["east"].set_default(Behavior.ok(first_event_delay_ms=5000))
        stream = await gw.client().chat.completions.create(
            model="chat", messages=MESSAGES, stream=True
        )
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert stream.response.headers["x-waybill-endpoint"] == "west"
        events = await gw.events(stream.response.headers["x-request-id"])
        committed = _of(events, "StreamCommitted")
        assert [c["endpoint"] for c in committed] == ["west"]
        lost = [f for f in _of(events, "AttemptFinished") if f["error_code"] == "hedge_lost"]
        assert len(lost) == 1 and not lost[0]["stream_committed"]
        await gw.upstreams["east"].wait_for_async(lambda up: up.client_gone >= 1)


async def test_an_answer_before_the_delay_is_never_hedged(database_url):
    async with running_gateway(database_url, ["east", "west"], ROUTES, defaults=HEDGE) as gw:
        raw = await gw.client().chat.completions.with_raw_response.create(
            model="chat", messages=MESSAGES
        )
        events = await gw.events(raw.headers["x-request-id"])
        assert [s["kind"] for s in _of(events, "AttemptStarted")] == ["call"]
        assert gw.upstreams["west"].hits == 0


async def test_a_hedged_way_that_fails_leaves_the_request_to_the_other(database_url):
    async with running_gateway(database_url, ["east", "west"], ROUTES, defaults=HEDGE) as gw:
        gw.upstreams["east"].set_default(
            dataclasses.replace(Behavior.server_error(), latency_ms=600)
        )
        gw.upstreams["west"].set_default(Behavior.ok(latency_ms=1200))
        raw = await gw.client().chat.completions.with_raw_response.create(
            model="chat", messages=MESSAGES
        )
        assert raw.headers["x-waybill-endpoint"] == "west"
        events = await gw.events(raw.headers["x-request-id"])
        decided = _of(events, "FailoverDecided")
        assert [(d["action"], d["reason"]) for d in decided] == [("failover", "other_way_running")]


async def test_a_group_policy_hedges_that_group_alone(database_url):
    async with running_gateway(
        database_url,
        ["east", "west"],
        ROUTES,
        policies={"hedged": "{hedge: {enabled: true, after_ms: 200}}"},
    ) as gw:
        gw.upstreams["east"].set_default(Behavior.ok(latency_ms=1500))
        client = gw.client()
        hedged = await client.chat.completions.with_raw_response.create(
            model="hedged", messages=MESSAGES
        )
        assert hedged.headers["x-waybill-endpoint"] == "west"
        plain = await client.chat.completions.with_raw_response.create(
            model="chat", messages=MESSAGES
        )
        assert plain.headers["x-waybill-endpoint"] == "east"
        events = await gw.events(plain.headers["x-request-id"])
        assert [s["kind"] for s in _of(events, "AttemptStarted")] == ["call"]


async def test_a_request_with_server_side_effects_is_never_hedged(database_url):
    async with running_gateway(database_url, ["east", "west"], ROUTES, defaults=HEDGE) as gw:
        gw.upstreams["east"].set_default(Behavior.ok(latency_ms=1000))
        async with gw.http() as http:
            response = await http.post(
                "/v1/chat/completions",
                json={
                    "model": "chat",
                    "messages": MESSAGES,
                    "tools": [{"type": "web_search_preview"}],
                },
            )
        assert response.status_code == 200, response.text
        assert response.headers["x-waybill-endpoint"] == "east"
        assert gw.upstreams["west"].hits == 0


async def test_a_request_that_forbids_moving_is_never_hedged(database_url):
    # A second way is always on another endpoint: X-Waybill-Allow-Failover: false forbids it.
    async with running_gateway(database_url, ["east", "west"], ROUTES, defaults=HEDGE) as gw:
        gw.upstreams["east"].set_default(Behavior.ok(latency_ms=1000))
        raw = await gw.client().chat.completions.with_raw_response.create(
            model="chat", messages=MESSAGES, extra_headers={"X-Waybill-Allow-Failover": "false"}
        )
        assert raw.headers["x-waybill-endpoint"] == "east"
        assert gw.upstreams["west"].hits == 0
        events = await gw.events(raw.headers["x-request-id"])
        assert [s["kind"] for s in _of(events, "AttemptStarted")] == ["call"]
        assert len(_of(events, "RouteEvaluated")) == 1


async def test_after_p95_waits_what_the_group_usually_takes(database_url):
    hedge = {"hedge": "{enabled: true, after_ms: 100, after_p95: true}"}
    async with running_gateway(database_url, ["east", "west"], ROUTES, defaults=hedge) as gw:
        client = gw.client()
        gw.upstreams["east"].set_default(Behavior.ok(latency_ms=400))
        # Until 20 answers were seen, after_ms stands: this one is hedged.
        first = await client.chat.completions.with_raw_response.create(
            model="chat", messages=MESSAGES
        )
        assert first.headers["x-waybill-endpoint"] == "west"
        for _ in range(20):  # the group's answers take ~400 ms from now on...
            gw.upstreams["west"].set_default(Behavior.ok(latency_ms=400))
            await client.chat.completions.create(model="chat", messages=MESSAGES)
        gw.upstreams["east"].set_default(Behavior.ok(latency_ms=200))
        # ... so one of 200 ms is waited for, not hedged after 100 ms.
        later = await client.chat.completions.with_raw_response.create(
            model="chat", messages=MESSAGES
        )
        assert later.headers["x-waybill-endpoint"] == "east"
        events = await gw.events(later.headers["x-request-id"])
        assert [s["kind"] for s in _of(events, "AttemptStarted")] == ["call"]


async def test_a_group_failing_over_on_grant_hedges_to_another_endpoint_only_with_the_grant(
    database_url,
):
    # contract §4 step 4: without X-Waybill-Allow-Failover: true no path reaches a second
    # endpoint, a hedge included; its evaluation is recorded, saying why nothing was chosen.
    policies = {"chat": "{failover: on_grant}"}
    async with running_gateway(
        database_url, ["east", "west"], ROUTES, defaults=HEDGE, policies=policies
    ) as gw:
        gw.upstreams["east"].set_default(Behavior.ok(latency_ms=3000))
        client = gw.client()
        raw = await client.chat.completions.with_raw_response.create(
            model="chat", messages=MESSAGES
        )
        assert raw.headers["x-waybill-endpoint"] == "east"
        assert gw.upstreams["west"].hits == 0
        events = await gw.events(raw.headers["x-request-id"])
        assert [s["kind"] for s in _of(events, "AttemptStarted")] == ["call"]
        first, hedge = _of(events, "RouteEvaluated")
        assert first["chosen"]["endpoint"] == "east"
        assert hedge["chosen"] is None
        reasons = {c["endpoint"]: (c["reason_code"], c["detail"]) for c in hedge["candidates"]}
        assert reasons == {
            "east": ("already_tried", "failed over from east"),
            "west": (
                "failover_not_granted",
                "another endpoint than the request's; model group chat fails over on grant "
                "only (X-Waybill-Allow-Failover: true)",
            ),
        }
        async with gw.http() as http:
            explained = await http.get(
                f"/v1/requests/{raw.headers['x-request-id']}/explain", params={"format": "text"}
            )
        assert "west/fake-model: failover_not_granted" in " ".join(explained.text.split())

        granted = await client.chat.completions.with_raw_response.create(
            model="chat", messages=MESSAGES, extra_headers={"X-Waybill-Allow-Failover": "true"}
        )
        assert granted.headers["x-waybill-endpoint"] == "west"
        started = _of(await gw.events(granted.headers["x-request-id"]), "AttemptStarted")
        assert [(s["endpoint"], s["kind"]) for s in started] == [
            ("east", "call"),
            ("west", "hedge"),
        ]
