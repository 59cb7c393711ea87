"""The core's own request (router/request/call.py): the caller's W3C trace context, and the
chat door's translation of its wire request into the core's."""

from __future__ import annotations

from decimal import Decimal

import orjson
import pytest

from router.config import Workspace
from router.doors.chat import answer, parse_body, read_headers, to_core
from router.request.call import Completion, TraceContext, trace_context

WORKSPACE = Workspace(id="acme", models=("chat",), regions=frozenset({"us"}), data_class="public")
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"


def test_a_well_formed_traceparent_is_joined_with_its_tracestate() -> None:
    assert trace_context(f"00-{TRACE}-{SPAN}-01", "v=1") == TraceContext(TRACE, SPAN, "v=1")
    upper = trace_context(f" 00-{TRACE.upper()}-{SPAN}-01 ", None)
    assert upper == TraceContext(TRACE, SPAN, None)


@pytest.mark.parametrize(
    "traceparent",
    [
        None,
        "",
        f"ff-{TRACE}-{SPAN}-01",  # the forbidden version
        f"0-{TRACE}-{SPAN}-01",
        f"00-{TRACE}-{SPAN}",  # no flags
        f"00-{TRACE[:-1]}-{SPAN}-01",
        f"00-{TRACE}-{SPAN[:-1]}x-01",
        f"00-{'0' * 32}-{SPAN}-01",
        f"00-{TRACE}-{'0' * 16}-01",
    ],
)
def test_a_malformed_traceparent_is_no_trace_and_drops_its_tracestate(
    traceparent: str | None,
) -> None:
    assert trace_context(traceparent, "v=1") is None


def test_the_chat_door_hands_the_core_its_body_requirements_and_narrowing() -> None:
    body = {
        "model": "chat",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 50,
    }
    chat = parse_body(orjson.dumps(body))
    headers = read_headers(
        {
            "x-waybill-deadline-ms": "900",
            "x-waybill-max-cost-usd": "0.25",
            "x-waybill-data-class": "internal",
            "traceparent": f"00-{TRACE}-{SPAN}-01",
            "tracestate": "v=1",
        }
    )
    call = to_core(chat, headers, WORKSPACE)
    assert call.body is chat.body, "the chat door's body is the core's canonical shape"
    assert (call.model_group, call.stream, call.include_usage, call.max_tokens) == (
        "chat",
        True,
        True,
        50,
    )
    assert call.requirements == chat.requirements(WORKSPACE, headers)
    assert call.requirements.deadline_ms == 900
    assert call.requirements.max_cost_usd == Decimal("0.25")
    assert call.requirements.data_class == "internal", "a header may raise the class"
    assert (call.prompt_sha256, call.prompt_bytes, call.message_count) == (
        chat.prompt_sha256,
        chat.prompt_bytes,
        1,
    )
    assert call.trace == TraceContext(TRACE, SPAN, "v=1")


def test_the_chat_door_answers_with_the_completion_and_where_it_was_served() -> None:
    completion = Completion("req-1", {"id": "c-1", "choices": []}, "east", 2, Decimal("0.0042"))
    payload, headers = answer(completion)
    assert orjson.loads(payload) == {"id": "c-1", "choices": []}
    assert headers == {
        "x-waybill-endpoint": "east",
        "x-waybill-attempts": "2",
        "x-waybill-cost-usd": "0.004200",  # money as the ledger writes it: six places
    }
    _, unpriced = answer(Completion("req-1", {}, "east", 1, None))
    assert "x-waybill-cost-usd" not in unpriced
