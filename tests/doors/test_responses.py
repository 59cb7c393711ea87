"""The Responses door's reading and rendering, pure: a body to the canonical chat body and
what needs the provider (router/doors/responses_translate.py), canonical answers to the
response object and events (router/doors/responses_wire.py)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from router.config import Limits, Workspace
from router.doors import responses, responses_wire
from router.doors.headers import HeaderNarrowing
from router.errors import GatewayError


def read(**body: Any) -> responses.ResponsesCall:
    return responses.parse_body({"model": "chat", "input": "hi", **body}, Limits())


def test_items_become_chat_messages():
    call = read(
        instructions="be brief",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "let me see"}],
            },
            {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "rain"}],
            },
        ],
        max_output_tokens=50,
        reasoning={"effort": "low", "summary": "auto"},
        metadata={"team": "a"},
    )
    body = call.chat.body
    assert body["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {
            "role": "assistant",
            "content": "let me see",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "w", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]
    assert body["max_completion_tokens"] == 50 and body["reasoning_effort"] == "low"
    assert "metadata" not in body
    assert call.needs_provider == () and not call.server_side_effects
    assert call.chat.max_tokens == 50


def test_function_tools_and_text_format_translate():
    schema = {"type": "object"}
    call = read(
        tools=[{"type": "function", "name": "w", "parameters": schema, "strict": True}],
        tool_choice={"type": "function", "name": "w"},
        parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "p", "schema": schema, "strict": True}},
    )
    body = call.chat.body
    assert body["tools"] == [
        {"type": "function", "function": {"name": "w", "parameters": schema, "strict": True}}
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "w"}}
    assert body["parallel_tool_calls"] is False
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "p", "schema": schema, "strict": True},
    }
    assert {"tools", "json_schema"} <= set(call.chat.capabilities)


@pytest.mark.parametrize(
    ("body", "need"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store: true"),
        ({"background": True}, "background: true"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"tools": [{"type": "web_search"}]}, "tool web_search"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input item item_reference"),
    ],
)
def test_what_needs_the_provider_is_named(body, need):
    call = read(**body)
    assert need in call.needs_provider
    core = responses.to_core(call, HeaderNarrowing(), _workspace())
    assert "responses" in core.requirements.capabilities
    assert core.native is not None and core.native.dialect == "openai.responses"


def test_store_false_and_absent_are_stateless():
    for body in ({}, {"store": False}):
        call = read(**body)
        core = responses.to_core(call, HeaderNarrowing(), _workspace())
        assert "responses" not in core.requirements.capabilities
        assert core.native is None and core.api == "openai.responses"


def test_built_in_tools_are_server_side_effects():
    call = read(tools=[{"type": "code_interpreter", "container": {"type": "auto"}}])
    core = responses.to_core(call, HeaderNarrowing(), _workspace())
    assert core.requirements.server_side_effects


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"nope": 1}, "nope"),
        ({"input": []}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0]"),
        ({"tool_choice": {"type": "function", "name": "x"}}, "tool_choice"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0]"),
    ],
)
def test_a_bad_body_is_a_400_naming_the_field(body, param):
    with pytest.raises(GatewayError) as caught:
        read(**body)
    assert caught.value.status == 400 and caught.value.param == param


def test_a_completion_becomes_a_response_object():
    completion = {
        "id": "chatcmpl-1",
        "created": 7,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "message": {
                    "role": "assistant",
                    "content": "hi",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "w", "arguments": "{}"},
                        }
                    ],
                },
            }
        ],
        "usage": {
            "prompt_tokens": 10,
            "completion_tokens": 4,
            "prompt_tokens_details": {"cached_tokens": 6},
            "completion_tokens_details": {"reasoning_tokens": 2},
        },
    }
    out = responses_wire.response(read(), completion, "req_abc")
    assert out["id"] == "resp_abc" and out["status"] == "incomplete"
    assert out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [item["type"] for item in out["output"]] == ["message", "function_call"]
    assert out["output"][1]["call_id"] == "c1"
    assert out["usage"] == {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 6},
        "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 2},
        "total_tokens": 14,
    }


def _events(raw: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line[5:]) for line in raw.split(b"\n") if line.startswith(b"data:")]


def test_chunks_become_events_in_order_with_sequence_numbers():
    renderer = responses_wire.EventRenderer(read(), "req_abc")
    chunk = {"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"content": "he"}}]}
    out = renderer.chunk(chunk)
    out += renderer.chunk({"choices": [{"index": 0, "delta": {"content": "llo"}}]})
    out += renderer.chunk(
        {
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2},
        }
    )
    out += renderer.end()
    events = _events(out)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    completed = events[-1]["response"]
    assert completed["output"][0]["content"][0]["text"] == "hello"
    assert completed["usage"]["output_tokens"] == 2


def test_an_in_band_error_is_response_failed_and_nothing_follows():
    renderer = responses_wire.EventRenderer(read(), "req_abc")
    out = renderer.chunk({"choices": [{"index": 0, "delta": {"content": "he"}}]})
    out += renderer.chunk({"error": {"code": "upstream_error", "message": "broke"}})
    out += renderer.end() + renderer.unfinished()
    events = _events(out)
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == {"code": "upstream_error", "message": "broke"}


def test_a_body_that_ends_silently_still_ends_in_a_failure():
    renderer = responses_wire.EventRenderer(read(), "req_abc")
    out = renderer.chunk({"choices": [{"index": 0, "delta": {"content": "he"}}]})
    assert _events(out + renderer.unfinished())[-1]["type"] == "response.failed"


def _workspace() -> Workspace:
    return Workspace(
        id="acme", models=("chat",), regions=frozenset({"us-east"}), data_class="internal"
    )


@pytest.mark.parametrize("previous", ["", "resp_\x00", "r" * 201])
def test_a_previous_response_id_the_ledger_cannot_hold_is_a_400(previous):
    with pytest.raises(GatewayError) as caught:
        read(previous_response_id=previous)
    assert caught.value.param == "previous_response_id"


@pytest.mark.parametrize(
    "item",
    [{"role": {"a": 1}, "content": "x"}, {"type": {"a": 1}}, {"type": ["message"]}],
)
def test_an_item_of_the_wrong_shape_is_a_400_never_a_crash(item):
    with pytest.raises(GatewayError) as caught:
        read(input=[item])
    assert caught.value.param == "input[0]"


def test_a_web_search_tool_is_priced_per_search_and_excludes_anthropic():
    call = read(tools=[{"type": "web_search"}])
    requirements = responses.to_core(call, HeaderNarrowing(), _workspace()).requirements
    assert requirements.web_search and requirements.server_side_effects
    assert requirements.unsupported == (("anthropic", "tool web_search"),)
    assert not read(tools=[{"type": "file_search"}]).web_search
