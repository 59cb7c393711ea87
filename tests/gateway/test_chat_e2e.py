"""End to end through the official ``openai`` SDK: a real gateway, real fake providers, the
ledger on SQLite and on PostgreSQL."""

from __future__ import annotations

from decimal import Decimal
from importlib.metadata import version
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from ledger.store import RecordedEvent
from otel.ids import attempt_span_id
from router.fake_provider import Behavior, Kind
from tests.gateway.harness import Route, running_gateway

SECRET_PROMPT = "the-prompt-text-must-never-reach-the-ledger"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": SECRET_PROMPT}]

TRAIL_OK = [
    "RequestReceived",
    "RouteEvaluated",
    "BudgetReserved",
    "AttemptStarted",
    "AttemptFinished",
    "BudgetSettled",
    "RequestCompleted",
]
# A stream's trail: the ledger holds that it was committed to the client before its first byte.
STREAM_TRAIL_OK = [*TRAIL_OK[:4], "StreamCommitted", *TRAIL_OK[4:]]


def first(events: list[RecordedEvent], event_type: str) -> dict[str, Any]:
    return next(e.data for e in events if e.type == event_type)


async def test_buffered_completion_through_the_sdk_leaves_the_whole_trail(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw:
        raw = await gw.client().chat.completions.with_raw_response.create(
            model="chat", messages=MESSAGES
        )
        reply = raw.parse()
        assert reply.choices[0].message.content
        assert reply.usage is not None and reply.usage.completion_tokens > 0
        request_id = raw.headers["x-request-id"]
        assert raw.headers["x-waybill-endpoint"] == "east"
        assert raw.headers["x-waybill-attempts"] == "1"
        assert float(raw.headers["x-waybill-cost-usd"]) > 0
        assert gw.upstreams["east"].hits == 1
        events = await gw.events(request_id)
        assert [e.type for e in events] == TRAIL_OK
        received = events[0].data
        assert received["workspace"] == "acme" and received["key_id"] == gw.key_id
        assert received["model_group"] == "chat"
        assert received["config_generation"] == "test-1"
        assert received["message_count"] == 1
        assert events[1].data["chosen"]["endpoint"] == "east"
        finished = first(events, "AttemptFinished")
        assert finished["status"] == "succeeded" and finished["usage"]["output_tokens"] > 0
        settled = first(events, "BudgetSettled")
        assert Decimal(settled["settled_usd"]) + Decimal(settled["released_usd"]) == Decimal(
            settled["reserved_usd"]
        )
        completed = first(events, "RequestCompleted")
        assert Decimal(settled["settled_usd"]) == Decimal(completed["cost_usd"])
        assert Decimal(completed["cost_usd"]) == Decimal(raw.headers["x-waybill-cost-usd"])
        for event in events:
            assert SECRET_PROMPT.encode() not in event.payload
            assert b"sk-fake-secret" not in event.payload


async def test_attempt_id_and_traceparent_are_sent_upstream(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw:
        traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        raw = await gw.client().chat.completions.with_raw_response.create(
            model="chat", messages=MESSAGES, extra_headers={"traceparent": traceparent}
        )
        sent = gw.upstreams["east"].requests[-1]
        events = await gw.events(raw.headers["x-request-id"])
        started = next(e for e in events if e.type == "AttemptStarted")
        assert sent.headers["x-waybill-attempt-id"] == started.data["attempt_id"]
        # The upstream joins the caller's trace, as a child of this attempt's span.
        span = attempt_span_id(started.data["attempt_id"])
        assert sent.headers["traceparent"] == f"00-0af7651916cd43dd8448eb211c80319c-{span}-01"
        assert events[0].data["parent_span_id"] == "b7ad6b7169203331"
        assert sent.headers["authorization"] == "Bearer sk-fake-secret-never-logged"
        assert events[0].data["trace_id"] == "0af7651916cd43dd8448eb211c80319c"


async def test_tracestate_is_forwarded_unchanged_to_every_attempt_with_the_traceparent(
    database_url,
):
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    tracestate = "congo=t61rcWkgMzE, rojo=00f067aa0ba902b7"
    async with running_gateway(
        database_url, ["east", "west"], [Route("east", tier=0), Route("west", tier=1)]
    ) as gw:

        async def sent(headers: dict[str, str]) -> Any:
            raw = await gw.client().chat.completions.with_raw_response.create(
                model="chat", messages=MESSAGES, extra_headers=headers
            )
            return gw.upstreams[raw.headers["x-waybill-endpoint"]].requests[-1].headers

        gw.upstreams["east"].set_plan([Behavior.rate_limited()])
        answered = await sent({"traceparent": traceparent, "tracestate": tracestate})
        failed = gw.upstreams["east"].requests[-1].headers  # the attempt that failed over
        assert failed["tracestate"] == answered["tracestate"] == tracestate

        # Without a valid traceparent, a tracestate has nothing to belong to.
        for alone in ({"tracestate": tracestate}, {"traceparent": "00-bad", "tracestate": "a=b"}):
            headers = await sent(alone)
            assert "traceparent" in headers and "tracestate" not in headers

        # Over the W3C limits (32 list members, 512 characters) it is dropped, not trimmed.
        for oversize in (",".join(f"v{i}=x" for i in range(33)), "v=" + "x" * 511):
            headers = await sent({"traceparent": traceparent, "tracestate": oversize})
            assert "tracestate" not in headers


async def test_stream_with_include_usage_ends_with_the_usage_chunk(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw:
        stream = await gw.client().chat.completions.create(
            model="chat",
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
        request_id = stream.response.headers["x-request-id"]
        assert stream.response.headers["x-waybill-endpoint"] == "east"
        events = await gw.events(request_id)
        assert [e.type for e in events] == STREAM_TRAIL_OK
        committed = first(events, "StreamCommitted")
        finished = first(events, "AttemptFinished")
        assert committed["attempt_id"] == finished["attempt_id"]
        assert committed["endpoint"] == "east"
        assert committed["time_to_first_chunk_ms"] == finished["time_to_first_chunk_ms"]
        assert finished["stream_committed"] is True
        assert finished["usage"]["output_tokens"] > 0


async def test_the_read_that_ends_a_stream_goes_out_with_its_end_once_recorded(database_url):
    # The upstream's whole stream arrives in one read, [DONE] included: the client gets it
    # as one piece with the gateway's own end, and by then the completion is on the ledger.
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw:
        gw.upstreams["east"].set_default(Behavior(Kind.OK, one_write=True))
        body = {"model": "chat", "messages": MESSAGES, "stream": True}
        async with gw.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            raw = aiter(r.aiter_raw())
            piece = await anext(raw)
            types = await gw.types(r.headers["x-request-id"])
            rest = [more async for more in raw]
        assert piece.count(b"data:") >= 8 and piece.endswith(b"data: [DONE]\n\n")
        assert b'"finish_reason":"stop"' in piece
        assert rest == []
        assert types[-1] == "RequestCompleted"


async def test_a_paced_stream_reaches_the_client_as_it_arrives_not_in_one_lump(database_url):
    # The gateway never holds a frame back waiting for the next one: with the upstream
    # pausing 100 ms between its events, the client's reads must see them arrive in many
    # pieces.
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw:
        gw.upstreams["east"].set_default(Behavior.ok(chunk_delay_ms=100))
        body = {"model": "chat", "messages": MESSAGES, "stream": True}
        pieces: list[bytes] = []
        async with gw.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            pieces = [piece async for piece in r.aiter_raw() if b"data:" in piece]
        frames = b"".join(pieces).count(b"data:")
        assert frames >= 5 and b"data: [DONE]" in pieces[-1]
        assert len(pieces) >= frames - 2, [p.count(b"data:") for p in pieces]


@pytest.mark.parametrize("plain_uvicorn", [False, True], ids=["waybill_serving", "plain_uvicorn"])
async def test_a_client_that_hangs_up_mid_stream_cancels_the_upstream_and_is_recorded(
    database_url, plain_uvicorn
):
    async with running_gateway(
        database_url, ["east"], [Route("east")], plain_uvicorn=plain_uvicorn
    ) as gw:
        gw.upstreams["east"].set_default(Behavior.ok(chunk_delay_ms=200))
        body = {"model": "chat", "messages": MESSAGES, "stream": True}
        async with gw.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            request_id = r.headers["x-request-id"]
            async for piece in r.aiter_raw():
                if b"data:" in piece:
                    break  # the first content arrived: hang up
        types = await gw.wait_for_types(request_id, "RequestFailed")
        events = await gw.events(request_id)
        finished = first(events, "AttemptFinished")
        assert (finished["failure_class"], finished["stream_committed"]) == (
            "client_canceled",
            True,
        )
        failed = first(events, "RequestFailed")
        assert (failed["http_status"], failed["error_code"]) == (499, "client_canceled")
        assert failed["stream_started"] is True
        assert "BudgetSettled" in types or "UnknownUsageOpened" in types, types
        # the upstream call was dropped, not left running to completion
        await gw.upstreams["east"].wait_for_async(lambda up: up.client_gone >= 1)


async def test_stream_without_include_usage_gets_no_usage_chunk_but_usage_is_recorded(
    database_url,
):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw:
        stream = await gw.client().chat.completions.create(
            model="chat", messages=MESSAGES, stream=True
        )
        chunks = [chunk async for chunk in stream]
        assert all(c.choices for c in chunks)
        assert all(c.usage is None for c in chunks)
        # The gateway asked the upstream for usage on its own account: the books have it.
        request_id = stream.response.headers["x-request-id"]
        finished = first(await gw.events(request_id), "AttemptFinished")
        assert finished["usage"] is not None


async def test_failover_to_the_next_tier_after_a_429(database_url):
    async with running_gateway(
        database_url, ["east", "west"], [Route("east", tier=0), Route("west", tier=1)]
    ) as gw:
        gw.upstreams["east"].set_plan([Behavior.rate_limited()])
        raw = await gw.client().chat.completions.with_raw_response.create(
            model="chat", messages=MESSAGES
        )
        assert raw.headers["x-waybill-endpoint"] == "west"
        assert raw.headers["x-waybill-attempts"] == "2"
        assert gw.upstreams["east"].hits == 1 and gw.upstreams["west"].hits == 1
        events = await gw.events(raw.headers["x-request-id"])
        types = [e.type for e in events]
        assert types == [
            "RequestReceived",
            "RouteEvaluated",
            "BudgetReserved",
            "AttemptStarted",
            "AttemptFinished",
            "BudgetReleased",  # a 429 did not start: its hold is released
            "FailoverDecided",
            "RouteEvaluated",
            "BudgetReserved",
            "AttemptStarted",
            "AttemptFinished",
            "BudgetSettled",
            "RequestCompleted",
        ]
        failed = events[4].data
        assert failed["failure_class"] == "rate_limited" and failed["evidence"] == "not_started"
        decided = events[6].data
        assert decided["action"] == "failover" and decided["allowed"] is True
        second = events[7].data
        east = next(c for c in second["candidates"] if c["endpoint"] == "east")
        assert east["eligible"] is False
        assert east["reason_code"] in ("already_tried", "breaker_open")


@pytest.mark.parametrize(
    "failure",
    [
        Behavior.disconnect_before_first_event(),
        Behavior.error_event(after_events=1),  # after the role chunk, before any content
        Behavior.error_event(after_events=1, one_write=True),
    ],
    ids=["disconnect", "error_event", "error_event_one_read"],
)
async def test_a_stream_that_fails_before_its_first_content_fails_over_unseen(
    database_url, failure
):
    async with running_gateway(
        database_url, ["east", "west"], [Route("east", tier=0), Route("west", tier=1)]
    ) as gw:
        gw.upstreams["east"].set_plan([failure])
        stream = await gw.client().chat.completions.create(
            model="chat", messages=MESSAGES, stream=True
        )
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert stream.response.headers["x-waybill-endpoint"] == "west"
        assert gw.upstreams["east"].hits == 1 and gw.upstreams["west"].hits == 1


@pytest.mark.parametrize(
    "failure",
    [
        Behavior.mid_stream_disconnect(after_events=3),
        Behavior.error_event(after_events=3),
        Behavior.error_event(after_events=3, one_write=True),
    ],
    ids=["disconnect", "error_event", "error_event_one_read"],
)
async def test_a_stream_broken_after_content_ends_with_an_error_event_and_a_partial_failure(
    database_url, failure
):
    async with running_gateway(
        database_url, ["east", "west"], [Route("east", tier=0), Route("west", tier=1)]
    ) as gw:
        gw.upstreams["east"].set_plan([failure])
        stream = await gw.client().chat.completions.create(
            model="chat", messages=MESSAGES, stream=True
        )
        received = []
        with pytest.raises(openai.APIError):
            async for chunk in stream:
                received.append(chunk)
        assert received, "some content was streamed before the break"
        assert gw.upstreams["west"].hits == 0, "nothing from a second model is spliced in"
        request_id = stream.response.headers["x-request-id"]
        events = await gw.events(request_id)
        assert events[-1].type == "RequestFailed"
        assert events[-1].data["stream_started"] is True
        assert events[-1].data["endpoint"] == "east"
        finished = next(e for e in events if e.type == "AttemptFinished").data
        assert finished["status"] == "failed" and finished["stream_committed"] is True
        assert finished["usage"] is None
        # What the stream showed before it broke is on its record all the same.
        assert finished["time_to_first_chunk_ms"] is not None
        assert finished["response_id"] and finished["response_model"]


async def test_models_lists_the_groups_the_key_may_call(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw:
        models = await gw.client().models.list()
        assert [m.id for m in models.data] == ["chat"]


async def test_health_and_readiness(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw, gw.http() as http:
        alive = (await http.get("/healthz")).json()
        ready = await http.get("/readyz", headers={"Authorization": ""})
        assert ready.status_code == 200 and ready.json()["status"] == "ready"
        # Liveness names the release and the schema its code migrates to, which a migrated
        # database (readiness) is at.
        assert alive == {
            "status": "ok",
            "version": version("waybill"),
            "schema": ready.json()["migration"],
        }


async def test_anthropic_endpoint_buffered_and_streamed(database_url):
    async with running_gateway(
        database_url, ["claude"], [Route("claude")], drivers={"claude": "anthropic"}
    ) as gw:
        client = gw.client()
        reply = await client.chat.completions.create(model="chat", messages=MESSAGES)
        assert reply.choices[0].message.content
        assert gw.upstreams["claude"].hits_by_path.get("/v1/messages") == 1
        stream = await client.chat.completions.create(
            model="chat", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage is not None


async def _body_sent(gw: Any, endpoint: str, finished: dict[str, Any]) -> int:
    """What the fake wrote as the body of the answer an attempt read."""
    fake, request_id = gw.upstreams[endpoint], finished["upstream_request_id"]
    await fake.wait_for_async(lambda f: f.body_sent(request_id) is not None)
    sent = fake.body_sent(request_id)
    assert sent is not None and sent > 0
    return int(sent)


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
async def test_every_attempt_records_the_bytes_of_the_upstreams_body(database_url, stream):
    # east answers 500 with an error body, west answers in full: each attempt records the
    # body it read, byte for byte as the fake wrote it (a stream's body de-chunked).
    async with running_gateway(
        database_url, ["east", "west"], [Route("east", tier=0), Route("west", tier=1)]
    ) as gw:
        gw.upstreams["east"].set_plan([Behavior.server_error()])
        body = {"model": "chat", "messages": MESSAGES, "stream": stream}
        async with gw.http() as http:
            response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200
        events = await gw.events(response.headers["x-request-id"])
        failed, succeeded = (e.data for e in events if e.type == "AttemptFinished")
        assert failed["status"] == "failed" and succeeded["status"] == "succeeded"
        assert failed["response_bytes"] == await _body_sent(gw, "east", failed)
        assert succeeded["response_bytes"] == await _body_sent(gw, "west", succeeded)


async def test_a_broken_stream_records_the_bytes_it_read_before_the_break(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw:
        gw.upstreams["east"].set_plan([Behavior.mid_stream_disconnect(after_content=3)])
        body = {"model": "chat", "messages": MESSAGES, "stream": True}
        async with gw.http() as http:
            response = await http.post("/v1/chat/completions", json=body)
        events = await gw.events(response.headers["x-request-id"])
        finished = next(e.data for e in events if e.type == "AttemptFinished")
        assert finished["status"] == "failed" and finished["stream_committed"] is True
        # A close after the last write: every byte written arrived before the end.
        assert finished["response_bytes"] == await _body_sent(gw, "east", finished)
