"""contract §5's failure table end to end, for the rows only a socket can prove: an HTTP
client → the gateway → fake providers over real HTTP. Each row asserts the client's outcome,
the hits on each fake endpoint and the recorded decision.

Every row of the table is a pure unit test of the request core
(tests/request/test_failure_table_unit.py: class, evidence, breaker scope, the walk's next
action and reason, the answer), and the drivers' tests read each error answer of a provider
into its class (tests/drivers/test_drivers.py). What stays here is what the transport
proves: a connection reset after the request went out, a connect that never happened,
timeouts on the wire (no headers, no first event, the whole-request deadline), a stream cut
before its first event, a body over ``max_response_bytes``, and a client that hangs up; plus
the answer the executor composes when every endpoint failed (rate-limited, too large), which
no pure function gives.

Two endpoints serve the model group: ``east`` on tier 0 and ``west`` on tier 1. The table
runs on SQLite; the ledger's behaviour on PostgreSQL is covered by the other e2e tests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from router.fake_provider import Behavior
from tests.gateway.harness import Gateway, Route, running_gateway
from tests.helpers import eventually

BODY: dict[str, Any] = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}


@dataclass(frozen=True)
class Row:
    name: str
    east: list[Behavior]
    status: int  # the client's HTTP status
    code: str | None  # error code, or None on success
    hits: tuple[int, int]  # (east, west)
    failure_class: str
    evidence: str
    action: str  # FailoverDecided.action after the first attempt
    reason: str
    west: list[Behavior] = field(default_factory=list)
    stream: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    routes: tuple[Route, ...] = (Route("east", tier=0), Route("west", tier=1))


ROWS = [
    Row(
        "reset after the request was sent is unknown",
        [Behavior.reset_before_bytes()],
        200,
        None,
        (1, 1),
        "network_error",
        "unknown",
        "failover",
        "unknown_execution_policy_failover",
    ),
    Row(
        "no response headers within the attempt timeout",
        [Behavior.ok(latency_ms=3000)],
        200,
        None,
        (1, 1),
        "timeout",
        "unknown",
        "failover",
        "unknown_execution_policy_failover",
        options={"defaults": {"attempt_timeout_ms": "400"}},
    ),
    Row(
        "stream: no first event in time fails over before anything is sent",
        [Behavior.ok(first_event_delay_ms=3000)],
        200,
        None,
        (1, 1),
        "timeout",
        "unknown",
        "failover",
        "unknown_execution_policy_failover",
        stream=True,
        options={"defaults": {"first_token_timeout_ms": "400"}},
    ),
    Row(
        "stream: disconnect before the first event fails over unseen",
        [Behavior.disconnect_before_first_event()],
        200,
        None,
        (1, 1),
        "network_error",
        "unknown",
        "failover",
        "unknown_execution_policy_failover",
        stream=True,
    ),
    Row(
        "every response too large: 502 upstream_response_too_large",
        [Behavior.large_body(20000)],
        502,
        "upstream_response_too_large",
        (1, 1),
        "response_too_large",
        "started",
        "failover",
        "class_allows_failover",
        west=[Behavior.large_body(20000)],
        options={
            "endpoint_extra": {
                "east": "    max_response_bytes: 4000",
                "west": "    max_response_bytes: 4000",
            }
        },
    ),
    Row(
        "every eligible endpoint rate-limited: 429",
        [Behavior.rate_limited(retry_after=2)],
        429,
        "upstream_rate_limited",
        (1, 1),
        "rate_limited",
        "not_started",
        "failover",
        "not_started_failover",
        west=[Behavior.rate_limited(retry_after=2)],
    ),
    Row(
        "the whole-request deadline runs out",
        [Behavior.ok(latency_ms=3000)],
        504,
        "deadline_exceeded",
        (1, 0),
        "deadline_exceeded",
        "unknown",
        "stop",
        "deadline_exceeded",
        headers={"X-Waybill-Deadline-Ms": "300"},
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
async def test_failure_table_row(sqlite_url: str, row: Row) -> None:
    async with running_gateway(sqlite_url, ["east", "west"], row.routes, **row.options) as gw:
        gw.upstreams["east"].set_plan(row.east)
        gw.upstreams["west"].set_plan(row.west)
        body = {**BODY, "stream": row.stream}
        async with gw.http() as http:
            response = await http.post("/v1/chat/completions", json=body, headers=row.headers)
            await response.aread()
        assert response.status_code == row.status, response.text
        request_id = response.headers["x-request-id"]
        if row.code is None:
            assert response.headers["x-waybill-endpoint"] in ("east", "west")
            if row.stream:
                assert b"data: [DONE]" in response.content
        else:
            error = response.json()["error"]
            assert error["code"] == row.code
            assert response.headers["x-should-retry"] == "false"
            assert error["attempts"][0]["endpoint"] == "east"
            assert error["attempts"][0]["failure_class"] == row.failure_class
        assert (gw.upstreams["east"].hits, gw.upstreams["west"].hits) == row.hits
        events = await gw.events(request_id)
        first_failure = next(e.data for e in events if e.type == "AttemptFinished")
        assert first_failure["failure_class"] == row.failure_class
        assert first_failure["evidence"] == row.evidence
        decided = next(e.data for e in events if e.type == "FailoverDecided")
        assert (decided["action"], decided["reason"]) == (row.action, row.reason)
        assert decided["attempts_left"] == 3  # max_attempts 4, one made
        if row.evidence == "unknown" and row.failure_class != "deadline_exceeded":
            assert decided["policy"].startswith("on_unknown_execution=")
        assert events[-1].type == ("RequestCompleted" if row.code is None else "RequestFailed")


async def test_connect_error_before_sending_fails_over_as_not_started(sqlite_url: str) -> None:
    async with (
        running_gateway(
            sqlite_url,
            ["west"],
            [Route("east", tier=0), Route("west", tier=1)],
            dead_endpoints=["east"],
        ) as gw,
        gw.http() as http,
    ):
        response = await http.post("/v1/chat/completions", json=BODY)
        assert response.status_code == 200
        assert response.headers["x-waybill-endpoint"] == "west"
        events = await gw.events(response.headers["x-request-id"])
        failed = next(e.data for e in events if e.type == "AttemptFinished")
        assert (failed["failure_class"], failed["evidence"]) == ("network_error", "not_started")


@pytest.mark.parametrize("plain_uvicorn", [False, True], ids=["waybill_serving", "plain_uvicorn"])
async def test_client_disconnect_cancels_the_upstream_call_and_is_recorded(
    sqlite_url: str, plain_uvicorn: bool
) -> None:
    async with running_gateway(
        sqlite_url, ["east"], [Route("east")], plain_uvicorn=plain_uvicorn
    ) as gw:
        gw.upstreams["east"].set_plan([Behavior.ok(latency_ms=3000)])
        async with gw.http() as http:
            # The client leaves once the upstream has the request (not after a fixed time,
            # which a busy machine may spend before the attempt even starts).
            call = asyncio.create_task(http.post("/v1/chat/completions", json=BODY, timeout=30))
            await gw.upstreams["east"].wait_for_async(lambda up: up.hits >= 1)
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await call
        started = [e async for e in _request_streams(gw)]
        assert len(started) == 1
        types = await gw.wait_for_types(started[0], "RequestFailed")
        events = await gw.events(started[0])
        finished = next(e.data for e in events if e.type == "AttemptFinished")
        assert finished["failure_class"] == "client_canceled"
        failed = events[-1].data
        assert (failed["http_status"], failed["error_code"]) == (499, "client_canceled")
        assert types[-2:] == ["FailoverDecided", "RequestFailed"]
        # the upstream call was dropped, not left running to completion
        await gw.upstreams["east"].wait_for_async(lambda up: up.client_gone >= 1)


async def _request_streams(gw: Gateway) -> AsyncIterator[str]:
    async def received() -> bool:
        return any(e.type == "RequestReceived" for e in await gw.store.read_all())

    await eventually(received)
    for event in await gw.store.read_all():
        if event.type == "RequestReceived":
            yield event.data["request_id"]


async def test_one_response_too_large_opens_the_mapping_breaker(sqlite_url: str) -> None:
    # contract §5: mapping-scope failures open their breaker on the first failure, so the
    # next request goes straight to the other tier without trying the mapping again.
    async with running_gateway(
        sqlite_url,
        ["east", "west"],
        [Route("east", tier=0), Route("west", tier=1)],
        endpoint_extra={"east": "    max_response_bytes: 4000"},
        defaults={
            "breaker": "{failure_threshold: 5, base_cooldown_ms: 60000, max_cooldown_ms: 60000}"
        },
    ) as gw:
        gw.upstreams["east"].set_plan([Behavior.large_body(20000)])
        async with gw.http() as http:
            first = await http.post("/v1/chat/completions", json=BODY)
            second = await http.post("/v1/chat/completions", json=BODY)
        assert (first.status_code, second.status_code) == (200, 200)
        assert second.headers["x-waybill-endpoint"] == "west"
        assert (gw.upstreams["east"].hits, gw.upstreams["west"].hits) == (1, 2)
        opened = [e.data for e in await gw.store.read_stream("breaker")]
        assert [(t["scope"], t["target"], t["to_state"], t["failure_class"]) for t in opened] == [
            ("mapping", "east/fake-model", "open", "response_too_large")
        ]
        candidates = (await gw.events(second.headers["x-request-id"]))[1].data["candidates"]
        assert (candidates[0]["reason_code"], candidates[0]["detail"]) == (
            "breaker_open",
            "mapping",
        )
