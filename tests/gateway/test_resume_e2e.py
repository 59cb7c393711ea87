"""Same-model stream resume over HTTP (contract §5 "Resume"): a committed stream that breaks
or stalls is continued by its own upstream model, and the client sees one stream."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

from ledger.store import RecordedEvent
from router.fake_provider import Behavior, reply_pieces
from tests.gateway.harness import Gateway, Route, running_gateway

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "tell me a story"}]


def _text(chunks: list[ChatCompletionChunk]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


async def _stream(gw: Gateway, **kw: Any) -> tuple[Any, list[ChatCompletionChunk]]:
    stream = await gw.client().chat.completions.create(
        model="chat", messages=MESSAGES, stream=True, **kw
    )
    return stream, [chunk async for chunk in stream]


async def _broken_stream(gw: Gateway) -> tuple[Any, list[ChatCompletionChunk]]:
    """A stream that must end with its in-band error: the chunks received before it."""
    stream = await gw.client().chat.completions.create(model="chat", messages=MESSAGES, stream=True)
    received: list[ChatCompletionChunk] = []
    with pytest.raises(openai.APIError):
        async for chunk in stream:
            received.append(chunk)
    return stream, received


def _started(events: list[RecordedEvent]) -> list[dict[str, Any]]:
    return [e.data for e in events if e.type == "AttemptStarted"]


@pytest.mark.parametrize("driver", ["openai", "anthropic"])
async def test_a_stream_cut_after_content_is_resumed_on_the_same_model(database_url, driver):
    async with running_gateway(
        database_url,
        ["east", "west"],
        [Route("east", resume="assistant_prefill"), Route("west", tier=1)],
        drivers={"east": driver},
    ) as gw:
        east = gw.upstreams["east"]
        east.set_continuation("assistant_prefill")
        east.set_plan([Behavior.mid_stream_disconnect(after_content=3)])
        stream, chunks = await _stream(gw, stream_options={"include_usage": True})
        assert _text(chunks) == "".join(reply_pieces("east"))  # whole, and only once
        assert chunks[-1].usage is not None
        assert len({c.id for c in chunks}) == 1, "one stream, one id"
        assert gw.upstreams["west"].hits == 0
        delivered = "".join(reply_pieces("east")[:3])
        continued = east.requests[-1]
        assert continued.continuation_chars == len(delivered.rstrip())
        events = await gw.events(stream.response.headers["x-request-id"])
        first, resume = _started(events)
        assert resume["kind"] == "resume" and resume["cause"] == "retry"
        assert resume["resumed_from"] == first["attempt_id"]
        assert resume["delivered_chars"] == len(delivered)
        decided = next(e.data for e in events if e.type == "FailoverDecided")
        assert (decided["action"], decided["reason"]) == ("resume", "resume_same_model")
        assert events[-1].type == "RequestCompleted"
        assert events[-1].data["attempts"] == 2
        finished = [e.data for e in events if e.type == "AttemptFinished"]
        assert [f["status"] for f in finished] == ["failed", "succeeded"]
        reservations = [e for e in events if e.type == "BudgetReserved"]
        assert len(reservations) == 2, "each resume reserves its own worst case"


async def test_a_stream_that_stalls_twice_is_resumed_twice(database_url):
    # Each stall counts against the endpoint's breaker: three in a row are allowed here.
    async with running_gateway(
        database_url,
        ["east"],
        [Route("east", resume="assistant_prefill")],
        defaults={"stream_idle_timeout_ms": "300", "breaker": "{failure_threshold: 3}"},
    ) as gw:
        east = gw.upstreams["east"]
        east.set_continuation("assistant_prefill")
        east.set_plan(
            [
                Behavior.stall(after_content=2, stall_s=5),
                Behavior.stall(after_content=2, stall_s=5),
            ]
        )
        stream, chunks = await _stream(gw)
        assert _text(chunks) == "".join(reply_pieces("east"))
        events = await gw.events(stream.response.headers["x-request-id"])
        kinds = [s["kind"] for s in _started(events)]
        assert kinds == ["call", "resume", "resume"]
        failed = [e.data for e in events if e.type == "AttemptFinished"][:2]
        assert {f["failure_class"] for f in failed} <= {"timeout", "network_error"}


async def test_a_resume_the_breaker_refuses_ends_the_stream_with_its_error(database_url):
    # Two stalls in a row open the endpoint's breaker (the default threshold): no third try.
    async with running_gateway(
        database_url,
        ["east"],
        [Route("east", resume="assistant_prefill")],
        defaults={"stream_idle_timeout_ms": "300"},
    ) as gw:
        east = gw.upstreams["east"]
        east.set_continuation("assistant_prefill")
        east.set_plan([Behavior.stall(after_content=2, stall_s=5)] * 2)
        stream, _ = await _broken_stream(gw)
        assert east.hits == 2
        events = await gw.events(stream.response.headers["x-request-id"])
        assert events[-1].type == "RequestFailed" and events[-1].data["stream_started"]


async def test_an_upstream_that_repeats_the_delivered_text_has_it_stripped(database_url):
    async with running_gateway(
        database_url, ["east"], [Route("east", resume="assistant_prefill")]
    ) as gw:
        east = gw.upstreams["east"]
        east.set_continuation("assistant_prefill")
        east.set_plan(
            [Behavior.mid_stream_disconnect(after_content=4), Behavior.ok(repeat_prefix=True)]
        )
        _, chunks = await _stream(gw)
        assert _text(chunks) == "".join(reply_pieces("east"))


async def test_an_upstream_that_refuses_the_continuation_ends_the_stream(database_url):
    # The mapping says it takes a prefill; its upstream says otherwise (400 invalid_prefill).
    async with running_gateway(database_url, ["east"], [Route("east", resume="prefix_flag")]) as gw:
        east = gw.upstreams["east"]
        east.set_plan([Behavior.mid_stream_disconnect(after_content=3)])
        stream, received = await _broken_stream(gw)
        assert _text(received) == "".join(reply_pieces("east")[:3])  # nothing spliced on
        assert east.requests[-1].continuation_refused
        events = await gw.events(stream.response.headers["x-request-id"])
        assert events[-1].type == "RequestFailed" and events[-1].data["stream_started"]
        resume = [e.data for e in events if e.type == "AttemptFinished"][-1]
        assert resume["http_status"] == 400


async def test_a_mapping_without_the_capability_is_never_sent_a_prefill(database_url):
    # The primary cannot continue; its fallback (another model) must not be asked to.
    async with running_gateway(
        database_url, ["east", "west"], [Route("east"), Route("west", tier=1, model="other")]
    ) as gw:
        gw.upstreams["east"].set_plan([Behavior.mid_stream_disconnect(after_content=3)])
        await _broken_stream(gw)
        assert gw.upstreams["west"].hits == 0
        assert gw.upstreams["east"].hits == 1


async def test_the_primary_resumes_when_the_fallback_rejects_prefill(database_url):
    # Failover Bench S14: the fallback refuses an assistant prefill; the primary takes one.
    async with running_gateway(
        database_url,
        ["east", "west"],
        [Route("east", resume="assistant_prefill"), Route("west", tier=1, model="other")],
    ) as gw:
        gw.upstreams["east"].set_continuation("assistant_prefill")
        gw.upstreams["east"].set_plan([Behavior.mid_stream_disconnect(after_content=3)])
        _, chunks = await _stream(gw)
        assert _text(chunks) == "".join(reply_pieces("east"))
        assert gw.upstreams["west"].hits == 0


async def test_explain_tells_the_resume(database_url):
    async with (
        running_gateway(database_url, ["east"], [Route("east", resume="assistant_prefill")]) as gw,
        gw.http() as http,
    ):
        gw.upstreams["east"].set_continuation("assistant_prefill")
        gw.upstreams["east"].set_plan([Behavior.mid_stream_disconnect(after_content=2)])
        stream, _ = await _stream(gw)
        request_id = stream.response.headers["x-request-id"]
        explained = (await http.get(f"/v1/requests/{request_id}/explain")).json()
        attempts = explained["attempts"]
        assert attempts[1]["kind"] == "resume"
        assert attempts[1]["resumed_from"] == attempts[0]["attempt_id"]
        assert any("a resume of attempt 1" in step["text"] for step in explained["decision_path"])
        assert "resumed on the same upstream model once" in explained["summary"]


async def test_a_strict_request_is_not_resumed_unless_it_allows_unknown_execution(
    database_url,
):
    async with running_gateway(
        database_url,
        ["east"],
        [Route("east", resume="assistant_prefill")],
        # Both requests' breaks count against the endpoint's breaker: let it stay closed.
        defaults={"on_unknown_execution": "stop", "breaker": "{failure_threshold: 3}"},
    ) as gw:
        east = gw.upstreams["east"]
        east.set_continuation("assistant_prefill")
        east.set_plan([Behavior.mid_stream_disconnect(after_content=3)])
        stream, _ = await _broken_stream(gw)
        assert east.hits == 1
        events = await gw.events(stream.response.headers["x-request-id"])
        decided = next(e.data for e in events if e.type == "FailoverDecided")
        assert (decided["action"], decided["reason"]) == ("stop", "on_unknown_execution_stop")

        east.set_plan([Behavior.mid_stream_disconnect(after_content=3)])
        _, chunks = await _stream(gw, extra_headers={"X-Waybill-Allow-Failover": "unknown"})
        assert _text(chunks) == "".join(reply_pieces("east"))
        assert east.hits == 3
