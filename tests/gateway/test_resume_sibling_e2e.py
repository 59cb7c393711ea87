"""A broken stream resumed on a sibling mapping over HTTP (contract §5 "Resume": another
mapping of the group with the same upstream model that can continue, when the broken
attempt's own cannot), on both ledger backends."""

from __future__ import annotations

from typing import Any

from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

from router.fake_provider import Behavior, reply_pieces
from tests.gateway.harness import Route, running_gateway

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "tell me a story"}]


def _text(chunks: list[ChatCompletionChunk]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _of(events: list[Any], kind: str) -> list[dict[str, Any]]:
    return [e.data for e in events if e.type == kind]


async def test_a_stream_broken_on_a_mapping_without_resume_is_continued_by_its_sibling(
    database_url,
):
    # east serves the model and cannot continue a partial answer; west serves the same
    # upstream model (a fallback tier) and can.
    async with running_gateway(
        database_url,
        ["east", "west"],
        [Route("east"), Route("west", tier=1, resume="assistant_prefill")],
    ) as gw:
        east, west = gw.upstreams["east"], gw.upstreams["west"]
        west.set_continuation("assistant_prefill")
        # Two pieces, "Hello from", are the text both upstreams' answers begin with: west
        # continues it with the rest of its own.
        east.set_plan([Behavior.mid_stream_disconnect(after_content=2)])
        stream = await gw.client().chat.completions.create(
            model="chat", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]  # no error: one uninterrupted stream

        assert _text(chunks) == "".join(reply_pieces("west"))
        assert chunks[-1].usage is not None
        assert len({c.id for c in chunks}) == 1, "one stream, one id"
        assert stream.response.headers["x-waybill-endpoint"] == "east"
        delivered = "".join(reply_pieces("east")[:2])
        assert (east.hits, west.hits) == (1, 1)
        assert west.requests[-1].continuation == "assistant_prefill"
        assert west.requests[-1].continuation_chars == len(delivered)

        events = await gw.events(stream.response.headers["x-request-id"])
        first, resume = _of(events, "AttemptStarted")
        assert (first["endpoint"], first["kind"]) == ("east", "call")
        assert (resume["endpoint"], resume["kind"], resume["cause"]) == (
            "west",
            "resume",
            "failover",
        )
        assert resume["resumed_from"] == first["attempt_id"]
        assert resume["delivered_chars"] == len(delivered)
        decided = _of(events, "FailoverDecided")
        assert [(d["action"], d["reason"]) for d in decided] == [("resume", "resume_same_model")]
        finished = _of(events, "AttemptFinished")
        assert [(f["attempt_id"], f["status"]) for f in finished] == [
            (first["attempt_id"], "failed"),
            (resume["attempt_id"], "succeeded"),
        ]
        assert finished[0]["stream_committed"] and finished[1]["stream_committed"]
        assert events[-1].type == "RequestCompleted"
        assert (events[-1].data["endpoint"], events[-1].data["attempts"]) == ("west", 2)
