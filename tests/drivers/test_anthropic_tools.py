"""Tool calling through the Anthropic driver: the translation both ways, then end to end
against the fake provider over real HTTP on 127.0.0.1."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from router.config import Endpoint
from router.drivers import AnthropicDriver, AttemptBinding, AttemptTimeouts, ChatRequest
from router.drivers.anthropic import AnthropicEvents, to_chat_completion, to_messages_request
from router.fake_provider import Behavior, FakeUpstream

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME: dict[str, Any] = {"type": "function", "function": {"name": "get_time"}}
ASK = {"role": "user", "content": "Weather and time in Paris?"}


def _call(id_: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


def _translate(**body: Any) -> dict[str, Any]:
    request = ChatRequest(body={"model": "m", **body}, upstream_model="claude-test")
    return to_messages_request(request, stream=False)


# --- requests ---


def test_function_tools_become_tools_with_an_input_schema():
    sent = _translate(messages=[ASK], tools=[WEATHER, TIME])

    assert sent["tools"] == [
        {
            "name": "get_weather",
            "description": "The weather in a city.",
            "input_schema": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
        # No parameters: Anthropic still needs an object schema.
        {"name": "get_time", "input_schema": {"type": "object", "properties": {}}},
    ]
    assert "tool_choice" not in sent  # Anthropic's default is auto, like OpenAI's


def test_without_tools_nothing_about_tools_is_sent():
    sent = _translate(messages=[ASK], tool_choice="required", parallel_tool_calls=False)

    assert "tools" not in sent and "tool_choice" not in sent


@pytest.mark.parametrize(
    ("choice", "parallel", "expected"),
    [
        ("auto", None, {"type": "auto"}),
        ("required", None, {"type": "any"}),
        ("none", None, {"type": "none"}),
        (
            {"type": "function", "function": {"name": "get_time"}},
            None,
            {"type": "tool", "name": "get_time"},
        ),
        (None, False, {"type": "auto", "disable_parallel_tool_use": True}),
        ("required", False, {"type": "any", "disable_parallel_tool_use": True}),
        (
            {"type": "function", "function": {"name": "get_time"}},
            False,
            {"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
        ),
        ("auto", True, {"type": "auto"}),
        ("none", False, {"type": "none"}),
    ],
    ids=[
        "auto",
        "required",
        "none",
        "named",
        "serial",
        "required_serial",
        "named_serial",
        "auto_parallel",
        "none_serial",
    ],
)
def test_tool_choice_maps_to_anthropic_tool_choice(choice, parallel, expected):
    body: dict[str, Any] = {"messages": [ASK], "tools": [WEATHER, TIME]}
    if choice is not None:
        body["tool_choice"] = choice
    if parallel is not None:
        body["parallel_tool_calls"] = parallel

    sent = _translate(**body)

    assert sent["tool_choice"] == expected
    assert [t["name"] for t in sent["tools"]] == ["get_weather", "get_time"]


def test_a_tool_conversation_becomes_tool_use_then_one_merged_tool_result_turn():
    sent = _translate(
        messages=[
            {"role": "system", "content": "Use tools."},
            ASK,
            {
                "role": "assistant",
                "content": "Let me check.",
                "tool_calls": [
                    _call("call_1", "get_weather", '{"city": "Paris"}'),
                    _call("call_2", "get_time", "{}"),
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18°C, sunny"},
            {
                "role": "tool",
                "tool_call_id": "call_2",
                "content": [{"type": "text", "text": "14:05"}],
            },
            {"role": "user", "content": "Thanks, and tomorrow?"},
        ],
        tools=[WEATHER, TIME],
    )

    assert sent["system"] == "Use tools."
    assert sent["messages"] == [
        {"role": "user", "content": "Weather and time in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me check."},
                {
                    "type": "tool_use",
                    "id": "call_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
                {"type": "tool_use", "id": "call_2", "name": "get_time", "input": {}},
            ],
        },
        # Roles alternate: both results and the user's next words are one user turn,
        # the results first.
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "call_1", "content": "18°C, sunny"},
                {
                    "type": "tool_result",
                    "tool_use_id": "call_2",
                    "content": [{"type": "text", "text": "14:05"}],
                },
                {"type": "text", "text": "Thanks, and tomorrow?"},
            ],
        },
    ]


def test_an_assistant_turn_with_only_tool_calls_has_no_text_block():
    sent = _translate(
        messages=[
            ASK,
            {"role": "assistant", "content": None, "tool_calls": [_call("c", "get_time", "")]},
            {"role": "tool", "tool_call_id": "c", "content": ""},
        ],
        tools=[TIME],
    )

    assert sent["messages"][1:] == [
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "c", "name": "get_time", "input": {}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c"}]},
    ]


def test_tool_results_stay_before_text_already_in_their_turn():
    sent = _translate(
        messages=[
            {"role": "assistant", "content": "", "tool_calls": [_call("a", "get_time", "{}")]},
            {"role": "tool", "tool_call_id": "a", "content": "one"},
            {"role": "user", "content": "and"},
            {"role": "tool", "tool_call_id": "b", "content": "two"},
        ],
        tools=[TIME],
    )

    last = sent["messages"][-1]["content"]
    assert [(b["type"], b.get("tool_use_id")) for b in last] == [
        ("tool_result", "a"),
        ("tool_result", "b"),
        ("text", None),
    ]


@pytest.mark.parametrize(
    "arguments",
    ['{"city": "Par', "[1, 2]", "null", '"Paris"', "", None],
    ids=["unparsable", "array", "null", "string", "empty", "missing"],
)
def test_arguments_that_are_not_a_json_object_are_sent_as_an_empty_input(arguments):
    call: dict[str, Any] = {"id": "c", "type": "function", "function": {"name": "get_weather"}}
    if arguments is not None:
        call["function"]["arguments"] = arguments

    sent = _translate(
        messages=[
            ASK,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": "no such city"},
        ],
        tools=[WEATHER],
    )

    assert sent["messages"][1]["content"] == [
        {"type": "tool_use", "id": "c", "name": "get_weather", "input": {}}
    ]
    assert sent["messages"][2]["content"][0]["tool_use_id"] == "c"


# --- buffered responses ---


def test_tool_use_blocks_become_tool_calls_with_json_arguments():
    message = {
        "id": "msg_1",
        "model": "claude-test",
        "content": [
            {"type": "text", "text": "Checking "},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "東京"}},
            {"type": "text", "text": "both."},
            {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {}},
        ],
        "stop_reason": "tool_use",
        "usage": {"input_tokens": 20, "output_tokens": 9},
    }

    completion = to_chat_completion(message, "claude-test")

    choice = completion["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking both."
    calls = choice["message"]["tool_calls"]
    assert [(c["id"], c["type"], c["function"]["name"]) for c in calls] == [
        ("toolu_1", "function", "get_weather"),
        ("toolu_2", "function", "get_time"),
    ]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "東京"}, {}]


def test_a_reply_of_only_tool_use_has_no_content():
    message = {
        "id": "msg_1",
        "content": [{"type": "tool_use", "id": "t", "name": "get_time", "input": {}}],
        "stop_reason": "tool_use",
    }

    choice = to_chat_completion(message, "claude-test")["choices"][0]

    assert choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == "{}"


def test_a_text_reply_has_no_tool_calls():
    message = {"id": "m", "content": [{"type": "text", "text": "Hi"}], "stop_reason": "end_turn"}

    choice = to_chat_completion(message, "claude-test")["choices"][0]

    assert choice["message"] == {"role": "assistant", "content": "Hi"}
    assert choice["finish_reason"] == "stop"


# --- stream events ---


def _events() -> list[dict[str, Any]]:
    def delta(index: int, **fields: Any) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": index, "delta": fields}

    def start(index: int, block: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_start", "index": index, "content_block": block}

    def tool(id_: str, name: str) -> dict[str, Any]:
        return {"type": "tool_use", "id": id_, "name": name, "input": {}}

    return [
        {
            "type": "message_start",
            "message": {"id": "msg_1", "model": "claude-test", "usage": {"input_tokens": 20}},
        },
        start(0, {"type": "text", "text": ""}),
        delta(0, type="text_delta", text="Checking."),
        {"type": "content_block_stop", "index": 0},
        start(1, tool("toolu_1", "get_weather")),
        delta(1, type="input_json_delta", partial_json=""),
        delta(1, type="input_json_delta", partial_json='{"city": '),
        delta(1, type="input_json_delta", partial_json='"Paris"}'),
        {"type": "content_block_stop", "index": 1},
        start(2, tool("toolu_2", "get_time")),
        delta(2, type="input_json_delta", partial_json="{}"),
        {"type": "content_block_stop", "index": 2},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use"},
            "usage": {"output_tokens": 30},
        },
        {"type": "message_stop"},
    ]


def _translate_stream(events: list[dict[str, Any]]) -> tuple[AnthropicEvents, list[Any]]:
    translator = AnthropicEvents("claude-test")
    chunks = [chunk for event in events for chunk in translator.translate(event)]
    return translator, chunks


def _tool_deltas(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        call
        for chunk in chunks
        for choice in chunk["choices"]
        for call in choice["delta"].get("tool_calls") or ()
    ]


def _arguments_by_index(chunks: list[dict[str, Any]]) -> dict[int, str]:
    arguments: dict[int, str] = {}
    for call in _tool_deltas(chunks):
        piece = call["function"]["arguments"]
        arguments[call["index"]] = arguments.get(call["index"], "") + piece
    return arguments


def test_tool_use_blocks_stream_as_indexed_tool_call_deltas():
    translator, chunks = _translate_stream(_events())

    deltas = _tool_deltas(chunks)
    starts = [d for d in deltas if "id" in d]
    assert starts == [
        {
            "index": 0,
            "id": "toolu_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": ""},
        },
        {
            "index": 1,
            "id": "toolu_2",
            "type": "function",
            "function": {"name": "get_time", "arguments": ""},
        },
    ]
    pieces = [d for d in deltas if "id" not in d]
    assert len(pieces) == 4
    assert all(
        set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in pieces
    )
    assert _arguments_by_index(chunks) == {0: '{"city": "Paris"}', 1: "{}"}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "Checking."
    assert translator.finish_reason == "tool_calls"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "tool_calls"
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "msg_1" for c in chunks)


def test_input_of_a_block_that_is_not_tool_use_is_not_a_tool_call():
    server_tool = {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search"}
    events = _events()
    events[1:1] = [
        {"type": "content_block_start", "index": 9, "content_block": server_tool},
        {
            "type": "content_block_delta",
            "index": 9,
            "delta": {"type": "input_json_delta", "partial_json": '{"query": "x"}'},
        },
    ]

    _, chunks = _translate_stream(events)

    assert _arguments_by_index(chunks) == {0: '{"city": "Paris"}', 1: "{}"}


# --- end to end, over HTTP ---

SECRET = "sk-test-anthropic-0123456789"


def _binding(up: FakeUpstream) -> AttemptBinding:
    endpoint = Endpoint.model_validate(
        {
            "id": "east",
            "driver": "anthropic",
            "base_url": up.base_url,
            "api_key": "${env:KEY}",
            "region": "eu",
            "data_classes": ["internal"],
        },
        context={"environ": {"KEY": SECRET}},
    )
    return AttemptBinding(
        endpoint=endpoint,
        upstream_model="claude-test",
        attempt_id="att_1",
        timeouts=AttemptTimeouts(5.0, 5.0, 5.0),
    )


def _tool_request(*, stream: bool = False, **extra: Any) -> ChatRequest:
    body = {"model": "gateway-model", "messages": [ASK], "tools": [WEATHER, TIME], **extra}
    return ChatRequest(body=body, upstream_model="claude-test", max_tokens=64, stream=stream)


@pytest.fixture
async def driver() -> AsyncIterator[AnthropicDriver]:
    d = AnthropicDriver()
    yield d
    await d.aclose()


async def test_a_buffered_tool_call_comes_back_as_openai_tool_calls(driver):
    async with FakeUpstream("east", plan=[Behavior.tool_call()]) as up:
        result = await driver.complete(
            driver.prepare(_tool_request(tool_choice="required"), _binding(up))
        )
        sent = up.requests[-1].json

    assert sent["tools"][0]["input_schema"] == WEATHER["function"]["parameters"]
    assert sent["tool_choice"] == {"type": "any"}
    choice = result.response["choices"][0]
    assert result.finish_reason == choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["id"] and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"  # the fake calls the first tool
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert result.usage is not None and result.usage.output_tokens > 0


async def test_a_streamed_tool_call_comes_back_as_tool_call_deltas(driver):
    plan = [Behavior.tool_call("get_time", arguments='{"zone": "日本"}')]
    async with FakeUpstream("east", plan=plan) as up:
        request = _tool_request(stream=True, parallel_tool_calls=False)
        async with await driver.stream(driver.prepare(request, _binding(up))) as stream:
            chunks = [chunk async for chunk in stream]
        sent = up.requests[-1].json

    assert sent["stream"] is True
    assert sent["tool_choice"] == {"type": "auto", "disable_parallel_tool_use": True}
    deltas = _tool_deltas(chunks)
    assert deltas[0]["id"] and deltas[0]["type"] == "function"
    assert deltas[0]["function"] == {"name": "get_time", "arguments": ""}
    assert len(deltas) > 2  # the arguments arrived in pieces
    assert _arguments_by_index(chunks) == {0: '{"zone": "日本"}'}
    assert stream.finish_reason == "tool_calls"
    assert stream.usage is not None and stream.usage.output_tokens > 0
    assert stream.invalid_events == 0


async def test_a_tool_result_conversation_reaches_the_upstream_in_its_shape(driver):
    messages = [
        ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                _call("call_1", "get_weather", '{"city": "Paris"}'),
                _call("call_2", "get_time", "{broken"),
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18°C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
    ]
    async with FakeUpstream("east") as up:
        result = await driver.complete(
            driver.prepare(_tool_request(messages=messages), _binding(up))
        )
        sent = up.requests[-1].json

    assert [m["role"] for m in sent["messages"]] == ["user", "assistant", "user"]
    assert [b["input"] for b in sent["messages"][1]["content"]] == [{"city": "Paris"}, {}]
    assert sent["messages"][2]["content"] == [
        {"type": "tool_result", "tool_use_id": "call_1", "content": "18°C"},
        {"type": "tool_result", "tool_use_id": "call_2", "content": "14:05"},
    ]
    assert result.finish_reason == "stop"
    assert result.response["choices"][0]["message"]["content"]
