"""Explanations end to end: contract §5's failure paths produced through the gateway (the rows
of ``tests/gateway/test_failure_table.py``), explained by ``GET /v1/requests/{id}/explain``;
and the request views and explanations are the same after a replay from event 0."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from ledger.store import EventStore
from ledger.store.db import create_engine
from ledger.views import all_projections
from ledger.views.projection import ProjectionRunner
from router.fake_provider import Behavior
from tests.gateway.harness import Gateway, Route, running_gateway
from tests.gateway.test_failure_table import BODY, ROWS, Row
from tests.helpers import eventually

EVIDENCE_PHRASE = {
    "not_started": "before starting work",
    "unknown": "with execution unknown",
    "started": "after starting work",
}


def flat(text: str) -> str:
    return " ".join(text.split())


async def explanation(http: httpx.AsyncClient, request_id: str) -> dict[str, Any]:
    response = await http.get(f"/v1/requests/{request_id}/explain")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def check_consistent(gw: Gateway, http: httpx.AsyncClient, x: dict[str, Any]) -> None:
    """What every explanation promises, whatever the path."""
    request_id = x["request_id"]
    events = await gw.events(request_id)
    assert [s["event"] for s in x["decision_path"]] == [e.type for e in events]
    assert [s["position"] for s in x["decision_path"]] == [e.position for e in events]
    evaluations = {c["evaluation"] for c in x["candidates"]}
    assert evaluations == set(range(1, len(evaluations) + 1))
    for c in x["candidates"]:
        assert c["eligible"] == (c["reason_code"] is None)
        assert (c["selection_position"] is not None) == c["chosen"]
    text = await http.get(f"/v1/requests/{request_id}/explain", params={"format": "text"})
    assert text.status_code == 200 and text.headers["content-type"].startswith("text/plain")
    assert flat(x["summary"]) in flat(text.text)


@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
async def test_each_failure_path_is_explained_with_its_exact_codes(
    sqlite_url: str, row: Row
) -> None:
    async with running_gateway(sqlite_url, ["east", "west"], row.routes, **row.options) as gw:
        gw.upstreams["east"].set_plan(row.east)
        gw.upstreams["west"].set_plan(row.west)
        async with gw.http() as http:
            response = await http.post(
                "/v1/chat/completions", json={**BODY, "stream": row.stream}, headers=row.headers
            )
            await response.aread()
            assert response.status_code == row.status, response.text
            x = await explanation(http, response.headers["x-request-id"])
            await check_consistent(gw, http, x)

    first = x["attempts"][0]
    assert (first["endpoint"], first["failure_class"], first["evidence"]) == (
        "east",
        row.failure_class,
        row.evidence,
    )
    assert first["failover"]["action"] == row.action
    assert first["failover"]["reason"] == row.reason
    assert first["failover"]["allowed"] is (row.action != "stop")
    assert len(x["attempts"]) == sum(row.hits)

    summary = x["summary"]
    assert "tier 0's east/fake-model " in summary
    assert f"{row.failure_class} {EVIDENCE_PHRASE[row.evidence]} ({row.action}" in summary
    # The reason code, then the rule behind it in plain words where it has one.
    assert f": {row.reason})" in summary or f": {row.reason}, " in summary
    assert "config generation test-1" in summary
    if row.code is None:
        served = x["attempts"][-1]
        assert x["status"] == "succeeded" and served["status"] == "succeeded"
        assert summary.startswith(f"Request {x['request_id']} (model group chat) was served by ")
        assert f"served by {served['endpoint']}/{served['model']} on tier {served['tier']}" in (
            summary
        )
    else:
        assert x["status"] == "failed" and (x["http_status"], x["error_code"]) == (
            row.status,
            row.code,
        )
        assert f"failed with {row.status} {row.code} after tier 0's east" in summary


async def test_a_route_nobody_can_serve_names_every_reason_code(sqlite_url: str) -> None:
    routes = [Route("east"), Route("west", tier=1, capabilities=("text",))]
    async with (
        running_gateway(sqlite_url, ["east", "west"], routes) as gw,
        gw.http() as http,
    ):
        response = await http.post(
            "/v1/chat/completions", json=BODY, headers={"X-Waybill-Capabilities": "audio"}
        )
        assert response.status_code == 422
        x = await explanation(http, response.headers["x-request-id"])
        await check_consistent(gw, http, x)
        narrowed = await http.post(
            "/v1/chat/completions", json=BODY, headers={"X-Waybill-Regions": "eu-west"}
        )
        assert narrowed.status_code == 422
        y = await explanation(http, narrowed.headers["x-request-id"])
    assert x["summary"].startswith(
        f"Request {x['request_id']} (model group chat) failed with 422 no_eligible_route "
        "before any attempt: no candidate was eligible; "
        "east/fake-model was never eligible: missing_capability audio; "
        "west/fake-model was never eligible: missing_capability audio"
    )
    assert x["attempts"] == [] and gw.upstreams["east"].hits == 0
    assert {c["reason_code"] for c in y["candidates"]} == {"scope_empty"}
    assert "east/fake-model was never eligible: scope_empty regions" in y["summary"]


async def test_a_stream_that_broke_mid_way_is_explained_as_a_partial_failure(
    sqlite_url: str,
) -> None:
    async with running_gateway(
        sqlite_url, ["east", "west"], [Route("east"), Route("west", tier=1)]
    ) as gw:
        gw.upstreams["east"].set_plan([Behavior.mid_stream_disconnect(after_events=3)])
        async with gw.http() as http:
            response = await http.post("/v1/chat/completions", json={**BODY, "stream": True})
            await response.aread()
            request_id = response.headers["x-request-id"]
            await gw.wait_for_types(request_id, "RequestFailed")
            x = await explanation(http, request_id)
            await check_consistent(gw, http, x)
    assert x["status"] == "partial_failure" and x["endpoint"] == "east"
    assert "committed its stream to east/fake-model on tier 0" in x["summary"]
    assert "recorded as a partial failure (502 upstream_error)" in x["summary"]
    assert x["attempts"][0]["failover"]["reason"] == "stream_committed"
    assert x["attempts"][0]["stream_committed"] is True


async def test_a_connect_error_and_a_client_that_left_are_explained(sqlite_url: str) -> None:
    async with running_gateway(
        sqlite_url, ["west"], [Route("east"), Route("west", tier=1)], dead_endpoints=["east"]
    ) as gw:
        gw.upstreams["west"].set_plan([Behavior.ok(), Behavior.ok(latency_ms=3000)])
        async with gw.http() as http:
            connect = await http.post("/v1/chat/completions", json=BODY)
            x = await explanation(http, connect.headers["x-request-id"])
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/v1/chat/completions", json=BODY, timeout=0.5)
            left = [
                e.data["request_id"]
                for e in await gw.store.read_all()
                if e.type == "RequestReceived" and e.data["request_id"] != x["request_id"]
            ]
            await gw.wait_for_types(left[0], "RequestFailed")
            y = await explanation(http, left[0])
            await check_consistent(gw, http, y)
    assert (
        "tier 0's east/fake-model failed with network_error before starting work" in (x["summary"])
    )
    assert y["status"] == "failed" and y["error_code"] == "client_canceled"
    assert y["summary"].startswith(
        f"Request {y['request_id']} (model group chat) failed with 499 client_canceled after "
    )
    assert (
        "failed with client_canceled with execution unknown (stop: client_canceled)"
        in (y["summary"])
    )


async def test_views_and_explanations_are_identical_after_a_replay(sqlite_url: str) -> None:
    # Breakers that close at once, so that every request below reaches east first.
    breaker = "{failure_threshold: 100, base_cooldown_ms: 1, max_cooldown_ms: 1}"
    async with running_gateway(
        sqlite_url,
        ["east", "west"],
        [Route("east"), Route("west", tier=1)],
        defaults={"breaker": breaker},
    ) as gw:
        gw.upstreams["east"].set_plan(
            [
                Behavior.ok(),
                Behavior.rate_limited(),
                Behavior.server_error(),
                Behavior.insufficient_quota(),
                Behavior.mid_stream_disconnect(after_events=3),
            ]
        )
        ids = []
        async with gw.http() as http:
            for stream in (False, False, False, False, True):
                response = await http.post("/v1/chat/completions", json={**BODY, "stream": stream})
                await response.aread()
                ids.append(response.headers["x-request-id"])
            await gw.wait_for_types(ids[-1], "RequestFailed")

            async def snapshot() -> dict[str, Any]:
                views = [(await http.get(f"/v1/requests/{i}")).json() for i in ids]
                explained = [await explanation(http, i) for i in ids]
                listed = (await http.get("/v1/requests")).json()
                return {"views": views, "explained": explained, "listed": listed}

            async def views_final() -> bool:
                listed = (await http.get("/v1/requests")).json()["data"]
                return len(listed) == len(ids) and all(v["status"] != "in_progress" for v in listed)

            await eventually(views_final)
            before = await snapshot()
            engine = create_engine(sqlite_url)
            store = EventStore(engine)
            try:
                runner = ProjectionRunner(store, all_projections())
                for projection in runner.projections.values():
                    await runner.replay(projection)
            finally:
                await store.close()
                await engine.dispose()
            after = await snapshot()
    assert after == before
    statuses = [v["status"] for v in before["views"]]
    assert statuses == ["succeeded", "succeeded", "succeeded", "failed", "partial_failure"]
    assert [v["endpoint"] for v in before["views"]] == ["east", "west", "west", None, "east"]
