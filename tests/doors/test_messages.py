"""The Anthropic door's pure translations (router/doors/messages.py, messages_wire.py): the
Messages body checked and translated into the canonical chat body, and the canonical answers
rendered back as Anthropic's; with the Anthropic driver's translation (router/drivers/
anthropic.py), an Anthropic upstream's answer survives the trip whole (property tests)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.config import parse_config
from router.doors import messages_wire
from router.doors.headers import HeaderNarrowing
from router.doors.messages import parse_body, read_count_body, to_core
from router.drivers.anthropic import AnthropicEvents, to_chat_completion
from router.errors import ErrorCode, GatewayError, invalid_request

HI: Any = [{"role": "user", "content": "hi"}]


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "chat", "max_tokens": 100, "messages": HI, **fields}


def refused(raw: Any, beta: str | None = None) -> GatewayError:
    with pytest.raises(GatewayError) as raised:
        parse_body(raw, beta)
    assert raised.value.code is ErrorCode.INVALID_REQUEST
    return raised.value


# --- the request ---


def test_a_field_outside_the_api_is_refused_naming_it():
    error = refused(body(context_management={"edits": []}))
    assert error.param == "context_management"
    assert error.status == 400


@pytest.mark.parametrize("ttl", [{"minutes": 5}, ["1h"], 5, None, "2h"])
def test_a_cache_marker_whose_ttl_is_not_a_lifetime_is_refused_naming_where(ttl: Any):
    marked = {"type": "text", "text": "a", "cache_control": {"type": "ephemeral", "ttl": ttl}}
    assert refused(body(system=[marked])).param == "system"


def test_a_beta_named_in_the_header_admits_its_fields():
    call = parse_body(
        body(context_management={"edits": []}),
        "claude-code-20250219, context-management-2025-06-27",
    )
    assert call.native["context_management"] == {"edits": []}
    assert call.beta == "claude-code-20250219, context-management-2025-06-27"
    assert refused(body(output_config={}), "context-management-2025-06-27").param == (
        "output_config"
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"model": ""}, "model"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0]"),
        ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "sometimes"}}, "thinking"),
        ({"tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
        ({"stop_sequences": "stop"}, "stop_sequences"),
        ({"stream": "yes"}, "stream"),
        ({"temperature": "hot"}, "temperature"),
        ({"tools": [{"name": "t"}]}, "tools[0]"),
    ],
)
def test_a_malformed_field_is_a_400_naming_it(fields, param):
    assert refused(body(**fields)).param == param


def test_a_system_turn_needs_its_beta():
    turns = [*HI, {"role": "system", "content": "be brief"}, {"role": "user", "content": "ok"}]
    call = parse_body(body(messages=turns), "mid-conversation-system-2026-04-07")
    assert [m["role"] for m in call.chat_body["messages"]] == ["user", "system", "user"]


def test_the_canonical_body_translates_system_tools_results_and_choices():
    tools = [{"name": "w", "description": "weather", "input_schema": {"type": "object"}}]
    turns = [
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"},
                {"type": "text", "text": "checking"},
                {"type": "tool_use", "id": "tu_1", "name": "w", "input": {"city": "Oslo"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "also"},
                {"type": "tool_result", "tool_use_id": "tu_1", "content": "cold", "is_error": True},
            ],
        },
    ]
    call = parse_body(
        body(
            system=[{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}],
            messages=turns,
            tools=tools,
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            stop_sequences=["END"],
            temperature=0.5,
            top_k=5,
            metadata={"user_id": "u1"},
            stream=True,
        )
    )
    chat = call.chat_body
    assert chat["messages"] == [
        {"role": "system", "content": "a"},
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {
            "role": "assistant",
            "content": "checking",
            "tool_calls": [
                {
                    "id": "tu_1",
                    "type": "function",
                    "function": {"name": "w", "arguments": '{"city":"Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "tu_1", "content": "Error: cold"},
        {"role": "user", "content": [{"type": "text", "text": "also"}]},
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {"name": "w", "parameters": {"type": "object"}, "description": "weather"},
        }
    ]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["stop"] == ["END"] and chat["temperature"] == 0.5 and "top_k" not in chat
    assert chat["user"] == "u1"
    assert chat["stream_options"] == {"include_usage": True}
    assert call.unsupported == ()  # nothing here an OpenAI endpoint cannot carry
    assert call.capabilities == ("stream", "text", "tools")


@pytest.mark.parametrize(
    ("fields", "beta", "feature"),
    [
        (
            {"thinking": {"type": "enabled", "budget_tokens": 50}, "max_tokens": 60},
            None,
            "thinking",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "document", "source": {"type": "text", "data": "x"}},
                        ],
                    }
                ]
            },
            None,
            "document",
        ),
        ({"stop_sequences": ["a", "b", "c", "d", "e"]}, None, "stop_sequences over 4"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, None, "tool type bash_20250124"),
        (
            {"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
            "context-management-2025-06-27",
            "context_management clear_tool_uses_20250919",
        ),
        ({"output_config": {"effort": "max"}}, "effort-2025-11-24", "output_config.effort"),
        ({"mcp_servers": []}, "mcp-client-2025-04-04", "mcp_servers"),
    ],
)
def test_what_an_openai_endpoint_cannot_carry_is_named(fields, beta, feature):
    call = parse_body(body(**fields), beta)
    assert call.unsupported == (("openai", feature),)


def test_what_dropping_cannot_change_is_dropped_or_translated():
    call = parse_body(
        body(
            thinking={"type": "adaptive"},
            context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            output_config={
                "effort": "high",
                "format": {"type": "json_schema", "schema": {"type": "object"}},
            },
        ),
        "context-management-2025-06-27,effort-2025-11-24",
    )
    assert call.unsupported == ()
    assert call.chat_body["reasoning_effort"] == "high"
    assert call.chat_body["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert "json_schema" in call.capabilities


def test_requirements_count_images_and_documents_and_name_the_native_dialect():
    image = {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}
    document = {"type": "document", "source": {"type": "base64", "data": "A" * 10_000}}
    call = parse_body(body(messages=[{"role": "user", "content": [image, document]}]))
    workspace = parse_config(_CONFIG, environ={}).workspaces[0]
    core = to_core(call, HeaderNarrowing(), workspace)
    r = core.requirements
    assert (r.image_inputs, r.file_inputs, r.native, r.max_output_tokens) == (
        1,
        1,
        "anthropic",
        100,
    )
    assert r.estimated_input_tokens < 10_000  # base64 data is not counted as text
    assert core.api == "anthropic.messages"
    assert core.native is not None and core.native.body is call.native
    assert core.include_usage  # message_delta carries the usage
    assert core.body["messages"][0]["content"][0] == {
        "type": "image_url",
        "image_url": {"url": "https://x/y.png"},
    }


def test_server_tools_make_the_request_strict():
    assert parse_body(
        body(tools=[{"type": "web_search_20250305", "name": "s"}])
    ).server_side_effects
    assert not parse_body(body(tools=[{"type": "bash_20250124", "name": "b"}])).server_side_effects


def test_count_tokens_takes_a_body_without_max_tokens():
    raw = orjson.dumps({"model": "chat", "messages": HI})
    assert read_count_body(raw).max_tokens == 1
    thinking = {"type": "enabled", "budget_tokens": 2000}
    raw = orjson.dumps({"model": "chat", "messages": HI, "thinking": thinking})
    assert read_count_body(raw).max_tokens == 2001


_CONFIG = """
endpoints:
  - id: e
    driver: openai
    base_url: https://e.invalid/v1
    region: r
    data_classes: [internal]
models:
  - name: chat
    mappings:
      - endpoint: e
        model: m
        capabilities: [text]
        context_window: 1000
        max_output_tokens: 100
        price: {input_per_mtok: 1, output_per_mtok: 1}
workspaces:
  - id: w
    models: [chat]
    regions: [r]
    data_class: internal
"""


# --- the answers ---


@pytest.mark.parametrize(
    ("status", "anthropic_status", "kind"),
    [
        (400, 400, "invalid_request_error"),
        (401, 401, "authentication_error"),
        (402, 402, "billing_error"),
        (403, 403, "permission_error"),
        (404, 404, "not_found_error"),
        (413, 413, "request_too_large"),
        (429, 429, "rate_limit_error"),
        (500, 500, "api_error"),
        (502, 502, "api_error"),
        (503, 529, "overloaded_error"),
        (504, 504, "timeout_error"),
    ],
)
def test_errors_are_anthropics_types_and_statuses(status, anthropic_status, kind):
    error = invalid_request("nope", status=status, param="x")
    assert messages_wire.error_status(error) == anthropic_status
    body = messages_wire.error_body(error, "req_1")
    assert body == {
        "type": "error",
        "error": {"type": kind, "message": "nope", "code": "invalid_request", "param": "x"},
        "request_id": "req_1",
    }


def test_a_completion_from_an_openai_upstream_is_a_message():
    completion = {
        "id": "chatcmpl-1",
        "model": "gpt",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "hi",
                    "tool_calls": [
                        {"id": "c1", "function": {"name": "w", "arguments": '{"a": 1}'}}
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {
            "prompt_tokens": 10,
            "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 4},
        },
    }
    message = messages_wire.message(completion, "req_abc")
    assert message["id"] == "msg_abc"
    assert message["content"] == [
        {"type": "text", "text": "hi"},
        {"type": "tool_use", "id": "c1", "name": "w", "input": {"a": 1}},
    ]
    assert message["stop_reason"] == "tool_use"
    assert message["usage"] == {
        "input_tokens": 6,
        "output_tokens": 3,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 4,
    }


def test_the_stop_reasons():
    def stop(finish: str | None, sequence: str | None = None) -> Any:
        choice = {"message": {"content": "x"}, "finish_reason": finish, "stop_sequence": sequence}
        return messages_wire.message({"choices": [choice]}, "req_1")["stop_reason"]

    assert stop("stop") == "end_turn"
    assert stop("stop", "END") == "stop_sequence"
    assert stop("length") == "max_tokens"
    assert stop("tool_calls") == "tool_use"
    assert stop("content_filter") == "refusal"


# An Anthropic message's blocks in the order a model gives them: thinking, text, tool calls.
_TEXT = st.text(min_size=1, max_size=20)
_THINKING = st.builds(
    lambda t, s: {"type": "thinking", "thinking": t, "signature": s}, _TEXT, _TEXT
)
_TOOL = st.builds(
    lambda i, n, a: {"type": "tool_use", "id": f"tu_{i}", "name": n, "input": {"a": a}},
    st.integers(0, 10**6),
    _TEXT,
    st.integers(-(2**53), 2**53),  # what JSON carries exactly
)


@st.composite
def anthropic_messages(draw: st.DrawFn) -> dict[str, Any]:
    blocks = draw(st.lists(_THINKING, max_size=1))
    if draw(st.booleans()):
        blocks.append({"type": "text", "text": draw(_TEXT)})
    tools = draw(st.lists(_TOOL, max_size=3, unique_by=lambda b: b["id"]))
    blocks += tools
    usage = {
        "input_tokens": draw(st.integers(0, 10**6)),
        "output_tokens": draw(st.integers(0, 10**6)),
        "cache_creation_input_tokens": draw(st.integers(0, 10**6)),
        "cache_read_input_tokens": draw(st.integers(0, 10**6)),
    }
    sequence = draw(st.sampled_from([None, "END"])) if not tools else None
    reason = "tool_use" if tools else ("stop_sequence" if sequence else "end_turn")
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude",
        "content": blocks,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage,
    }


@settings(max_examples=200, deadline=None)
@given(anthropic_messages())
def test_an_anthropic_message_survives_the_canonical_shape(message):
    canonical = to_chat_completion(message, "claude")
    assert messages_wire.message(canonical, "req_1") == message


def _events(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream Anthropic sends for ``message``."""
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None}
    start["usage"] = {**message["usage"], "output_tokens": 1}
    events: list[dict[str, Any]] = [{"type": "message_start", "message": start}]
    for index, block in enumerate(message["content"]):
        kind = block["type"]
        opened: dict[str, Any]
        if kind == "thinking":
            opened = {"type": "thinking", "thinking": ""}
            deltas = [
                {"type": "thinking_delta", "thinking": block["thinking"]},
                {"type": "signature_delta", "signature": block["signature"]},
            ]
        elif kind == "text":
            opened = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": c} for c in block["text"]]
        else:
            opened = {**block, "input": {}}
            text = orjson.dumps(block["input"]).decode()
            half = len(text) // 2
            deltas = [
                {"type": "input_json_delta", "partial_json": text[:half]},
                {"type": "input_json_delta", "partial_json": text[half:]},
            ]
        events.append({"type": "content_block_start", "index": index, "content_block": opened})
        events += [{"type": "content_block_delta", "index": index, "delta": d} for d in deltas]
        events.append({"type": "content_block_stop", "index": index})
    delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    usage = {"output_tokens": message["usage"]["output_tokens"]}
    events.append({"type": "message_delta", "delta": delta, "usage": usage})
    events.append({"type": "message_stop"})
    return events


def _accumulated(sse: bytes) -> dict[str, Any]:
    """What a client makes of the door's events (the SDK's accumulation, in brief)."""
    message: dict[str, Any] = {}
    partial: dict[int, str] = {}
    names: list[str] = []
    for frame in sse.split(b"\n\n"):
        if not frame:
            continue
        name, data = frame.split(b"\n")
        event = orjson.loads(data.removeprefix(b"data: "))
        names.append(event["type"])
        assert name == b"event: " + event["type"].encode()
        kind = event["type"]
        if kind == "message_start":
            message = event["message"]
        elif kind == "content_block_start":
            assert event["index"] == len(message["content"])
            message["content"].append(event["content_block"])
        elif kind == "content_block_delta":
            block, delta = message["content"][event["index"]], event["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            else:
                partial[event["index"]] = partial.get(event["index"], "") + delta["partial_json"]
        elif kind == "content_block_stop":
            if event["index"] in partial:
                message["content"][event["index"]]["input"] = orjson.loads(partial[event["index"]])
        elif kind == "message_delta":
            message.update(event["delta"])
            message["usage"] = event["usage"]
    assert names[0] == "message_start" and names[1] == "ping"
    assert names[-2:] == ["message_delta", "message_stop"]
    return message


@settings(max_examples=200, deadline=None)
@given(anthropic_messages())
def test_an_anthropic_stream_survives_the_canonical_chunks(message):
    translator = AnthropicEvents("claude")
    renderer = messages_wire.EventRenderer("req_1")
    out = b""
    for event in _events(message):
        for chunk in translator.translate(event):
            out += renderer.chunk(chunk)
    out += renderer.end()
    assert _accumulated(out) == message


@settings(max_examples=100, deadline=None)
@given(st.lists(_TEXT, min_size=1, max_size=8))
def test_the_relays_bytes_become_events_whatever_their_pieces(pieces):
    chunks = [
        {"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"content": p}}]}
        for p in pieces
    ]
    chunks.append(
        {"id": "c", "model": "m", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    )
    sse = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    renderer = messages_wire.EventRenderer("req_1")
    # Cut anywhere: frames are joined again before they are read.
    out = b""
    buffer = b""
    for piece in [sse[i : i + 7] for i in range(0, len(sse), 7)]:
        buffer += piece
        frames = buffer.split(b"\n\n")
        buffer = frames.pop()
        out += renderer.frames(frames)
    message = _accumulated(out)
    assert message["content"] == [{"type": "text", "text": "".join(pieces)}]
    assert message["stop_reason"] == "end_turn"


def test_an_in_band_error_is_an_error_event():
    renderer = messages_wire.EventRenderer("req_1")
    error = {
        "code": "upstream_error",
        "message": "broke",
        "type": "upstream_error",
        "request_id": "r",
    }
    out = renderer.frames([b"data: " + orjson.dumps({"error": error})])
    name, data = out.strip().split(b"\n")
    assert name == b"event: error"
    assert orjson.loads(data.removeprefix(b"data: ")) == {
        "type": "error",
        "error": {"type": "api_error", "message": "broke", "code": "upstream_error"},
        "request_id": "r",
    }
