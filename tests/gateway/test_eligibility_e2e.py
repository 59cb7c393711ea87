"""Hard eligibility end to end (contract §4): an endpoint that keeps requests longer than the
request's retention bound allows, or one whose measured time to first content is longer than
the request's deadline has left, is never called, and the explanation says why."""

from __future__ import annotations

import asyncio
import re

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from router.fake_provider import Behavior
from tests.gateway.harness import Route, running_gateway

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
RETENTIONS = {"keeps": "    retention: 30d", "zdr": "    retention: zero"}


async def test_an_endpoint_over_the_retention_bound_is_excluded_and_explained(database_url):
    routes = [Route("keeps", tier=0), Route("zdr", tier=1), Route("silent", tier=1, weight=9)]
    async with running_gateway(
        database_url,
        ["keeps", "zdr", "silent"],
        routes,
        endpoint_extra=RETENTIONS,
        workspace_extra="    retention: 90d",
    ) as gw:
        client = gw.client()
        # The workspace's 90-day bound admits the tier-0 endpoint that keeps 30 days.
        served = await client.chat.completions.with_raw_response.create(
            model="chat", messages=MESSAGES
        )
        assert served.headers["x-waybill-endpoint"] == "keeps"
        # The caller narrows it to zero: only the endpoint declaring zero may take it; the one
        # that does not say what it keeps satisfies no bound.
        narrowed = await client.chat.completions.with_raw_response.create(
            model="chat", messages=MESSAGES, extra_headers={"X-Waybill-Retention": "zero"}
        )
        assert narrowed.headers["x-waybill-endpoint"] == "zdr"
        assert (gw.upstreams["keeps"].hits, gw.upstreams["silent"].hits) == (1, 0)

        request_id = narrowed.headers["x-request-id"]
        await gw.wait_for_types(request_id, "RequestCompleted")
        async with gw.http() as http:
            explained = (await http.get(f"/v1/requests/{request_id}/explain")).json()
            text = (await http.get(f"/v1/requests/{request_id}/explain?format=text")).text
        assert explained["requirements"]["retention"] == "zero"
        reasons = [
            (c["endpoint"], c["reason_code"], c["detail"])
            for c in explained["candidates"]
            if c["evaluation"] == explained["candidates"][0]["evaluation"]
        ]
        assert reasons == [
            ("keeps", "retention_exceeded", "endpoint keeps keeps 30d; required zero"),
            ("zdr", None, None),
            (
                "silent",
                "retention_exceeded",
                "endpoint silent does not declare its retention; required zero",
            ),
        ]
        assert "retention_exceeded (endpoint keeps keeps 30d; required zero)" in text

        # A wider header never widens the workspace's bound, and a bad one is a 400.
        wider = await client.chat.completions.with_raw_response.create(
            model="chat", messages=MESSAGES, extra_headers={"X-Waybill-Retention": "365d"}
        )
        received = (await gw.events(wider.headers["x-request-id"]))[0]
        assert received.data["requirements"]["retention"] == "90d"
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(
                model="chat", messages=MESSAGES, extra_headers={"X-Waybill-Retention": "forever"}
            )
        assert refused.value.body["param"] == "X-Waybill-Retention"  # type: ignore[index]


async def test_a_mapping_slower_than_the_deadline_left_is_excluded_with_both_figures(
    database_url,
):
    routes = [Route("slow", tier=0), Route("fast", tier=1)]
    async with running_gateway(database_url, ["slow", "fast"], routes) as gw:
        client = gw.client()
        gw.upstreams["slow"].set_default(Behavior.ok(latency_ms=1000))
        # Twenty answers make a p95 (contract §4): every one took at least a second.
        await asyncio.gather(
            *(client.chat.completions.create(model="chat", messages=MESSAGES) for _ in range(20))
        )
        assert gw.upstreams["slow"].hits == 20
        hurried = await client.chat.completions.with_raw_response.create(
            model="chat", messages=MESSAGES, extra_headers={"X-Waybill-Deadline-Ms": "900"}
        )
        assert gw.upstreams["slow"].hits == 20, "what cannot finish is not started"
        request_id = hurried.headers["x-request-id"]
        await gw.wait_for_types(request_id, "RequestCompleted")
        async with gw.http() as http:
            explained = (await http.get(f"/v1/requests/{request_id}/explain")).json()
            text = (await http.get(f"/v1/requests/{request_id}/explain?format=text")).text
        slow = explained["candidates"][0]
        assert (slow["endpoint"], slow["reason_code"]) == ("slow", "deadline_insufficient")
        p95, left = re.fullmatch(
            r"p95 time to first content (\d+) ms > (\d+) ms left of the deadline", slow["detail"]
        ).groups()  # type: ignore[union-attr]
        assert int(p95) >= 1000 and int(left) <= 900
        assert f"deadline_insufficient ({slow['detail']})" in text
        assert [a["endpoint"] for a in explained["attempts"]] == ["fast"]


async def test_an_endpoints_own_timeouts_apply_to_its_attempts_and_are_recorded(database_url):
    # The group's policy waits 5 s for response headers (the harness's defaults); "hasty"
    # waits 300 ms, so its upstream's 2 s silence is a timeout and the request fails over.
    routes = [Route("hasty", tier=0), Route("patient", tier=1)]
    async with running_gateway(
        database_url,
        ["hasty", "patient"],
        routes,
        endpoint_extra={"hasty": "    timeouts: {attempt_timeout_ms: 300}"},
    ) as gw:
        gw.upstreams["hasty"].set_default(Behavior.ok(latency_ms=2000))
        served = await gw.client().chat.completions.with_raw_response.create(
            model="chat", messages=MESSAGES
        )
        assert served.headers["x-waybill-endpoint"] == "patient"
        request_id = served.headers["x-request-id"]
        await gw.wait_for_types(request_id, "RequestCompleted")
        events = await gw.events(request_id)
        started = [e.data for e in events if e.type == "AttemptStarted"]
        finished = [e.data for e in events if e.type == "AttemptFinished"]
        assert started[0]["timeouts"] == {
            "attempt_timeout_ms": 300,
            "first_token_timeout_ms": 3000,
            "stream_idle_timeout_ms": 3000,
        }
        assert "timeouts" not in started[1], "an endpoint without a block: the policy's"
        assert finished[0]["failure_class"] == "timeout"
        async with gw.http() as http:
            explained = (await http.get(f"/v1/requests/{request_id}/explain")).json()
            text = (await http.get(f"/v1/requests/{request_id}/explain?format=text")).text
        assert explained["attempts"][0]["timeouts"]["attempt_timeout_ms"] == 300
        assert explained["attempts"][1]["timeouts"] is None
        assert "under its endpoint's timeouts (attempt 300 ms, first token 3000 ms" in text
