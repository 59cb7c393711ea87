"""The fake provider itself: what each behavior puts on the wire, and how tests drive it."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from router.fake_provider import PART_TOKENS, Behavior, FakeUpstream, Kind, embedding, reply_pieces

REPLY = "Hello from east: héllo 日本 🚀"
MESSAGES = [{"role": "user", "content": "x" * 40}]  # 40 chars -> 40 // 4 + 1 = 11 tokens
CHAT: dict[str, Any] = {"model": "gpt-test", "messages": MESSAGES}
STREAM: dict[str, Any] = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
ANTHROPIC: dict[str, Any] = {"model": "claude-test", "max_tokens": 100, "messages": MESSAGES}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def up() -> Iterator[FakeUpstream]:
    with FakeUpstream("east") as upstream:
        yield upstream


@pytest.fixture
def http(up: FakeUpstream) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=up.root_url) as plain:
        yield plain


@pytest.fixture
def client(up: FakeUpstream) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=up.base_url, api_key="x", max_retries=0) as sdk:
        yield sdk


# Raw HTTP helpers: the byte-level truth, with no client library in between.


def raw_exchange(up: FakeUpstream, path: str, body: object) -> bytes:
    """One request with `Connection: close`; every byte the server sent until EOF."""
    with socket.create_connection(("127.0.0.1", up.port), timeout=5) as sock:
        sock.sendall(raw_request(path, body))
        received = []
        while chunk := sock.recv(65536):
            received.append(chunk)
    return b"".join(received)


def raw_request(path: str, body: object) -> bytes:
    data = json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: fake\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    ).encode() + data


def split_head(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


def dechunk(body: bytes) -> tuple[bytes, bool]:
    """Decode a chunked body; the flag says whether the terminating chunk arrived."""
    out = bytearray()
    while body:
        size_line, sep, rest = body.partition(b"\r\n")
        if not sep:
            break
        size = int(size_line, 16)
        if size == 0:
            return bytes(out), True
        out += rest[:size]
        body = rest[size + 2 :]
    return bytes(out), False


def data_lines(sse: bytes) -> list[str]:
    text = sse.decode()
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def stream_bytes(up: FakeUpstream, behavior: Behavior, body: object = STREAM) -> bytes:
    up.set_plan([behavior])
    status, headers, chunked = split_head(raw_exchange(up, "/v1/chat/completions", body))
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    sse, _ = dechunk(chunked)
    return sse


# Success, in both dialects


def test_buffered_completion_names_the_upstream_and_counts_usage(up, client):
    raw = client.chat.completions.with_raw_response.create(**CHAT)
    completion = raw.parse()

    assert completion.choices[0].message.content == REPLY
    assert completion.choices[0].finish_reason == "stop"
    assert completion.id.startswith("chatcmpl-")
    assert completion.model == "gpt-test"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (11, 6)
    assert raw.headers["x-request-id"] == up.requests[0].request_id


def test_stream_through_the_sdk_ends_with_a_usage_chunk(client):
    chunks = list(client.chat.completions.create(**STREAM))

    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == REPLY
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (11, 6)


def test_stream_bytes_are_role_content_finish_usage_done(up):
    events = data_lines(stream_bytes(up, Behavior.ok()))

    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    assert parsed[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [p["choices"][0]["finish_reason"] for p in parsed[:-1]] == [None] * 7 + ["stop"]
    assert parsed[-1]["choices"] == []
    assert parsed[-1]["usage"]["total_tokens"] == 17


def test_stream_without_include_usage_has_no_usage_chunk(up):
    events = data_lines(stream_bytes(up, Behavior.ok(), {**CHAT, "stream": True}))

    assert all("usage" not in json.loads(e) for e in events[:-1])
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "stop"


def test_max_tokens_caps_output_and_reports_length(client):
    completion = client.chat.completions.create(**CHAT, max_completion_tokens=2)

    assert completion.choices[0].message.content == "Hello from"
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 2


def test_n_chunks_sets_the_number_of_content_events(up, client):
    up.set_plan([Behavior.ok(n_chunks=9)])
    chunks = list(client.chat.completions.create(**STREAM))

    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 9
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 9


# Billing as OpenAI bills


def test_every_choice_of_n_is_its_own_answer_and_the_usage_sums_them(client):
    completion = client.chat.completions.create(**CHAT, n=3)

    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert completion.choices[0].message.content == REPLY
    assert completion.choices[2].message.content == REPLY + " Hello from"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 6 + 7 + 8
    assert completion.usage.prompt_tokens == 11  # the input is billed once


def test_a_stream_of_n_choices_carries_each_ones_content_and_finish(client):
    chunks = list(client.chat.completions.create(**STREAM, n=2, max_completion_tokens=7))

    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {0: REPLY, 1: REPLY + " Hello"}
    assert finishes == {0: "stop", 1: "stop"}
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6 + 7


def test_reasoning_tokens_are_inside_the_completion_tokens_and_the_limit(up, client):
    up.set_plan([Behavior.ok(reasoning_tokens=100), Behavior.ok(reasoning_tokens=100)])
    free = client.chat.completions.create(**CHAT)
    assert free.usage is not None and free.usage.completion_tokens_details is not None
    details = free.usage.completion_tokens_details
    assert (free.usage.completion_tokens, details.reasoning_tokens) == (106, 100)

    capped = client.chat.completions.create(**CHAT, max_completion_tokens=102)
    assert capped.choices[0].message.content == "Hello from"
    assert capped.choices[0].finish_reason == "length"
    assert capped.usage is not None
    assert capped.usage.completion_tokens == 102


def test_cached_tokens_are_reported_inside_the_prompt_tokens(up, client):
    up.set_plan([Behavior.ok(cached_tokens=8), Behavior.ok(cached_tokens=500)])
    some = client.chat.completions.create(**CHAT)
    every = client.chat.completions.create(**CHAT)

    for completion, cached in ((some, 8), (every, 11)):
        assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
        assert completion.usage.prompt_tokens == 11
        assert completion.usage.prompt_tokens_details.cached_tokens == cached


def test_anthropic_reports_cache_reads_beside_its_input_tokens(up, http):
    up.set_plan([Behavior.ok(cached_tokens=8)])
    body = http.post("/v1/messages", json=ANTHROPIC).json()

    assert body["usage"] == {"input_tokens": 3, "cache_read_input_tokens": 8, "output_tokens": 6}


def test_images_audio_and_files_cost_their_part_tokens_whatever_their_size(client):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 9000}}
    audio = {"type": "input_audio", "input_audio": {"data": "UklG", "format": "wav"}}
    file = {"type": "file", "file": {"file_id": "file-1"}}
    content = [{"type": "text", "text": "x" * 40}, image, image, audio, file]
    completion = client.chat.completions.create(
        model="gpt-test", messages=[{"role": "user", "content": content}]
    )

    assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
    parts = 2 * PART_TOKENS["image_url"] + PART_TOKENS["input_audio"] + PART_TOKENS["file"]
    assert completion.usage.prompt_tokens == 11 + parts
    assert completion.usage.prompt_tokens_details.audio_tokens == PART_TOKENS["input_audio"]


def test_an_answer_asked_for_as_audio_is_billed_as_audio_output_tokens(up, client):
    up.set_plan([Behavior.ok(reasoning_tokens=4)] * 3)
    for spoken in ({"modalities": ["text", "audio"]}, {"audio": {"voice": "alloy"}}):
        completion = client.chat.completions.create(**CHAT, n=2, extra_body=spoken)
        assert completion.usage is not None
        details = completion.usage.completion_tokens_details
        assert details is not None
        assert completion.usage.completion_tokens == (4 + 6) + (4 + 7)
        assert details.audio_tokens == 6 + 7  # each answer; its reasoning is not audio
    plain = client.chat.completions.create(**CHAT)
    assert plain.usage is not None and plain.usage.completion_tokens_details is not None
    assert plain.usage.completion_tokens_details.audio_tokens == 0


def test_models_endpoint_lists_the_configured_models():
    with (
        FakeUpstream("west", models=["a", "b"]) as up,
        openai.OpenAI(base_url=up.base_url, api_key="x", max_retries=0) as client,
    ):
        assert [m.id for m in client.models.list()] == ["a", "b"]
        assert up.hits == 0
        assert up.hits_by_path == {"/v1/models": 1}


def test_anthropic_message_has_the_messages_api_shape(up, http):
    response = http.post("/v1/messages", json=ANTHROPIC)

    body = response.json()
    assert response.headers["request-id"] == up.requests[0].request_id
    assert body["type"] == "message"
    assert body["id"].startswith("msg_")
    assert body["content"] == [{"type": "text", "text": REPLY}]
    assert body["stop_reason"] == "end_turn"
    assert body["usage"] == {"input_tokens": 11, "output_tokens": 6}


def test_anthropic_stream_follows_the_real_event_sequence(up):
    raw = raw_exchange(up, "/v1/messages", {**ANTHROPIC, "stream": True})
    sse, complete = dechunk(split_head(raw)[2])

    names = [line[7:] for line in sse.decode().splitlines() if line.startswith("event: ")]
    assert complete
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * 6,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    payloads = [json.loads(d) for d in data_lines(sse)]
    assert [p["type"] for p in payloads] == names
    assert "".join(p["delta"]["text"] for p in payloads if p["type"] == "content_block_delta") == (
        REPLY
    )
    assert payloads[0]["message"]["usage"]["input_tokens"] == 11
    assert payloads[-2]["delta"]["stop_reason"] == "end_turn"
    assert payloads[-2]["usage"] == {"output_tokens": 6}


@pytest.mark.parametrize(
    ("behavior", "status", "error_type"),
    [
        (Behavior.rate_limited(), 429, "rate_limit_error"),
        (Behavior.unauthorized(), 401, "authentication_error"),
        (Behavior.forbidden(), 403, "permission_error"),
        (Behavior.insufficient_quota(), 402, "billing_error"),
        (Behavior.model_not_found(), 404, "not_found_error"),
        (Behavior.server_error(529), 529, "overloaded_error"),
        (Behavior.server_error(500), 500, "api_error"),
    ],
)
def test_anthropic_errors_use_the_anthropic_error_shape(up, http, behavior, status, error_type):
    up.set_plan([behavior])
    response = http.post("/v1/messages", json=ANTHROPIC)

    assert response.status_code == status
    assert response.headers["request-id"].startswith("req_east_")
    body = response.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == error_type
    assert body["error"]["message"]


def test_tool_call_names_the_requests_first_tool(up, client):
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {}}}
    up.set_plan([Behavior.tool_call(), Behavior.tool_call(arguments='{"q": "日本"}')])

    completion = client.chat.completions.create(**CHAT, tools=[tool])
    chunks = list(client.chat.completions.create(**STREAM, tools=[tool]))

    call = completion.choices[0].message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == ("lookup", '{"city": "Paris"}')
    assert completion.choices[0].finish_reason == "tool_calls"
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices]
    arguments = "".join(d[0].function.arguments or "" for d in deltas if d)
    assert arguments == '{"q": "日本"}'
    assert chunks[-2].choices[0].finish_reason == "tool_calls"


def test_anthropic_tool_call_is_a_tool_use_block(up, http):
    up.set_plan([Behavior.tool_call("search")])
    body = http.post("/v1/messages", json=ANTHROPIC).json()

    assert body["stop_reason"] == "tool_use"
    assert body["content"][0]["type"] == "tool_use"
    assert body["content"][0]["name"] == "search"
    assert body["content"][0]["input"] == {"city": "Paris"}


# Error responses


@pytest.mark.parametrize(
    ("behavior", "error", "status", "code"),
    [
        (Behavior.rate_limited(), openai.RateLimitError, 429, "rate_limit_exceeded"),
        (Behavior.insufficient_quota(), openai.RateLimitError, 429, "insufficient_quota"),
        (Behavior.unauthorized(), openai.AuthenticationError, 401, "invalid_api_key"),
        (Behavior.forbidden(), openai.PermissionDeniedError, 403, "permission_denied"),
        (Behavior.content_policy(), openai.BadRequestError, 400, "content_policy_violation"),
        (
            Behavior.context_length_exceeded(),
            openai.BadRequestError,
            400,
            "context_length_exceeded",
        ),
        (Behavior.model_not_found(), openai.NotFoundError, 404, "model_not_found"),
        (Behavior.server_error(), openai.InternalServerError, 500, None),
        (Behavior.server_error(502), openai.InternalServerError, 502, None),
        (Behavior.server_error(503), openai.InternalServerError, 503, None),
        (Behavior.server_error(504), openai.InternalServerError, 504, None),
        (Behavior.server_error(408), openai.APIStatusError, 408, None),
        (Behavior.not_started(), openai.InternalServerError, 503, "service_unavailable"),
    ],
)
def test_error_kinds_answer_with_openai_error_json(up, client, behavior, error, status, code):
    up.set_plan([behavior])

    with pytest.raises(error) as caught:
        client.chat.completions.create(**CHAT)

    assert caught.value.status_code == status
    assert caught.value.code == code
    body = caught.value.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    assert caught.value.response.headers["x-request-id"] == up.requests[0].request_id


def test_content_policy_can_be_a_403(up, client):
    up.set_plan([Behavior.content_policy(status=403)])

    with pytest.raises(openai.PermissionDeniedError) as caught:
        client.chat.completions.create(**CHAT)

    assert caught.value.code == "content_policy_violation"
    assert "content" in caught.value.message


def test_rate_limited_sends_retry_after_in_seconds_and_milliseconds(up, http):
    up.set_plan([Behavior.rate_limited(retry_after=1.5), Behavior.rate_limited()])

    first = http.post("/v1/chat/completions", json=CHAT)
    second = http.post("/v1/chat/completions", json=CHAT)

    assert first.status_code == 429
    assert (first.headers["retry-after"], first.headers["retry-after-ms"]) == ("2", "1500")
    assert "retry-after" not in second.headers


def test_not_started_says_the_execution_did_not_start(up, http):
    up.set_plan([Behavior.not_started(), Behavior.server_error(503)])

    not_started = http.post("/v1/chat/completions", json=CHAT)
    unknown = http.post("/v1/chat/completions", json=CHAT)

    assert not_started.status_code == unknown.status_code == 503
    assert not_started.headers["x-execution-state"] == "not-started"
    assert "x-execution-state" not in unknown.headers


def test_error_message_can_be_overridden(up, http):
    up.set_plan([Behavior(Kind.SERVER_ERROR, status=502, message="upstream on fire")])

    response = http.post("/v1/chat/completions", json=CHAT)

    assert response.json()["error"]["message"] == "upstream on fire"


# Transport and stream faults, checked at the byte level


def test_reset_before_bytes_sends_rst_and_nothing_else(up):
    up.set_plan([Behavior.reset_before_bytes()])

    with socket.create_connection(("127.0.0.1", up.port), timeout=5) as sock:
        sock.sendall(raw_request("/v1/chat/completions", CHAT))
        with pytest.raises(ConnectionResetError):
            sock.recv(65536)
    assert up.hits == 1


def test_reset_before_bytes_is_a_connection_error_for_the_sdk(up, client):
    up.set_plan([Behavior.reset_before_bytes()])

    with pytest.raises(openai.APIConnectionError):
        client.chat.completions.create(**CHAT)


def test_disconnect_before_first_event_sends_sse_headers_then_closes(up):
    up.set_plan([Behavior.disconnect_before_first_event()])
    status, headers, body = split_head(raw_exchange(up, "/v1/chat/completions", STREAM))

    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["transfer-encoding"] == "chunked"
    assert body == b""


def test_disconnect_before_first_event_breaks_an_httpx_stream(up):
    up.set_plan([Behavior.disconnect_before_first_event()])

    with (
        httpx.Client() as http,
        http.stream("POST", f"{up.base_url}/chat/completions", json=STREAM) as response,
    ):
        assert response.status_code == 200
        with pytest.raises(httpx.RemoteProtocolError):
            response.read()


def test_mid_stream_disconnect_stops_after_n_events_without_finish_or_done(up):
    up.set_plan([Behavior.mid_stream_disconnect(after_events=3)])
    status, _, chunked = split_head(raw_exchange(up, "/v1/chat/completions", STREAM))
    sse, complete = dechunk(chunked)

    events = data_lines(sse)
    assert status == 200
    assert not complete
    assert len(events) == 3
    assert "[DONE]" not in events
    assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events)


def test_mid_stream_disconnect_never_reaches_the_finish_event(up):
    sse = stream_bytes(up, Behavior.mid_stream_disconnect(after_events=99))

    events = data_lines(sse)
    assert len(events) == 7  # role + 6 content events
    assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events)


def test_anthropic_mid_stream_disconnect_never_sends_message_delta(up):
    up.set_plan([Behavior.mid_stream_disconnect(after_events=4)])
    raw = raw_exchange(up, "/v1/messages", {**ANTHROPIC, "stream": True})
    sse, complete = dechunk(split_head(raw)[2])

    types = [json.loads(d)["type"] for d in data_lines(sse)]
    assert not complete
    assert types == ["message_start", "content_block_start", "ping", "content_block_delta"]


def test_reply_pieces_are_the_content_events_of_the_answer(up):
    events = data_lines(stream_bytes(up, Behavior.ok(n_chunks=8)))

    contents = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[1:9]]
    assert tuple(contents) == reply_pieces("east", 8)
    assert "".join(reply_pieces("east")) == REPLY


def test_mid_stream_disconnect_after_content_delivers_that_many_pieces(up):
    sse = stream_bytes(up, Behavior.mid_stream_disconnect(after_content=3))

    parsed = [json.loads(e) for e in data_lines(sse)]
    text = "".join(p["choices"][0]["delta"].get("content") or "" for p in parsed)
    assert text == "".join(reply_pieces("east")[:3])
    assert len(parsed) == 1 + 3  # the role preamble, then three pieces


def test_anthropic_stall_after_content_counts_deltas_not_the_preamble(up):
    up.set_plan([Behavior.stall(after_content=2, stall_s=0.01)])
    raw = raw_exchange(up, "/v1/messages", {**ANTHROPIC, "stream": True})
    sse, complete = dechunk(split_head(raw)[2])

    parsed = [json.loads(d) for d in data_lines(sse)]
    assert not complete
    assert [p["type"] for p in parsed] == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_delta",
    ]
    assert "".join(p["delta"]["text"] for p in parsed[3:]) == "".join(reply_pieces("east")[:2])


def test_after_content_counts_every_choices_pieces_in_the_order_sent(up):
    body = {**STREAM, "n": 2}
    parsed = [
        json.loads(e)
        for e in data_lines(stream_bytes(up, Behavior.error_event(after_content=3), body))
    ]

    contents = [p for p in parsed if p.get("choices") and p["choices"][0]["delta"].get("content")]
    assert [(p["choices"][0]["index"], p["choices"][0]["delta"]["content"]) for p in contents] == [
        (0, "Hello"),
        (1, "Hello"),
        (0, " from"),
    ]
    assert "error" in parsed[-1]


def test_after_content_beyond_the_answer_still_stops_before_the_finish(up):
    sse = stream_bytes(up, Behavior.mid_stream_disconnect(after_content=99))

    events = data_lines(sse)
    assert len(events) == 7
    assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events)


@pytest.mark.parametrize(
    "behavior",
    [
        Behavior.disconnect_before_first_event(),
        Behavior.mid_stream_disconnect(),
        Behavior.stall(after_events=0, stall_s=0.01),
    ],
)
def test_buffered_faults_promise_a_body_they_never_finish(up, behavior):
    up.set_plan([behavior])
    status, headers, body = split_head(raw_exchange(up, "/v1/chat/completions", CHAT))

    assert status == 200
    assert len(body) < int(headers["content-length"])


def test_buffered_malformed_event_is_a_200_that_is_not_json(up, http):
    up.set_plan([Behavior.malformed_event()])

    response = http.post("/v1/chat/completions", json=CHAT)

    assert response.status_code == 200
    with pytest.raises(ValueError):
        response.json()


def test_stall_after_events_goes_silent_until_the_client_leaves(up):
    up.set_plan([Behavior.stall(after_events=2)])
    timeout = httpx.Timeout(5.0, read=0.2)

    with (
        httpx.Client(timeout=timeout) as http,
        http.stream("POST", f"{up.base_url}/chat/completions", json=STREAM) as response,
    ):
        received = b""
        chunks = response.iter_raw()
        while received.count(b"\n\n") < 2:
            received += next(chunks)
        with pytest.raises(httpx.ReadTimeout):
            next(chunks)

    assert len(data_lines(received)) == 2
    up.wait_for(lambda u: u.client_gone == 1)


def test_stall_before_headers_sends_nothing(up):
    up.set_plan([Behavior.stall()])

    with socket.create_connection(("127.0.0.1", up.port), timeout=0.2) as sock:
        sock.sendall(raw_request("/v1/chat/completions", STREAM))
        with pytest.raises(TimeoutError):
            sock.recv(65536)

    up.wait_for(lambda u: u.client_gone == 1)


def test_stall_with_a_duration_closes_the_connection_afterwards(up):
    up.set_plan([Behavior.stall(after_events=1, stall_s=0.05)])
    status, _, chunked = split_head(raw_exchange(up, "/v1/chat/completions", STREAM))
    sse, complete = dechunk(chunked)

    assert status == 200
    assert not complete
    assert len(data_lines(sse)) == 1


def test_malformed_event_is_one_invalid_data_line_among_valid_ones(up):
    events = data_lines(stream_bytes(up, Behavior.malformed_event(after_events=2)))

    invalid = []
    for index, event in enumerate(events[:-1]):
        try:
            json.loads(event)
        except ValueError:
            invalid.append(index)
    assert invalid == [2]
    assert events[-1] == "[DONE]"
    assert len(events) == 11  # role + 6 content + finish + usage + [DONE] + the bad one


def test_error_event_ends_a_complete_body_with_the_providers_error(up):
    up.set_plan([Behavior.error_event(after_events=2)])
    raw = raw_exchange(up, "/v1/chat/completions", STREAM)
    sse, complete = dechunk(split_head(raw)[2])

    events = [json.loads(line) for line in data_lines(sse)]
    assert complete  # the body ends properly: only the event says the stream failed
    assert len(events) == 3
    assert all("error" not in event for event in events[:2])
    assert events[2]["error"]["type"] == "server_error"


def test_error_event_leaves_a_buffered_reply_alone(up, http):
    up.set_plan([Behavior.error_event()])
    response = http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200
    assert response.json()["choices"][0]["finish_reason"] == "stop"


def test_no_done_ends_the_body_cleanly_after_the_finish_chunk(up):
    up.set_plan([Behavior.no_done()])
    raw = raw_exchange(up, "/v1/chat/completions", {**CHAT, "stream": True})
    sse, complete = dechunk(split_head(raw)[2])

    events = data_lines(sse)
    assert complete
    assert "[DONE]" not in events
    assert json.loads(events[-1])["choices"][0]["finish_reason"] == "stop"


def test_anthropic_no_done_drops_message_stop(up):
    up.set_plan([Behavior.no_done()])
    raw = raw_exchange(up, "/v1/messages", {**ANTHROPIC, "stream": True})
    sse, complete = dechunk(split_head(raw)[2])

    assert complete
    assert json.loads(data_lines(sse)[-1])["type"] == "message_delta"


@pytest.mark.parametrize(("line_ending", "eol"), [("lf", b"\n"), ("crlf", b"\r\n"), ("cr", b"\r")])
def test_line_endings_shape_every_sse_line(up, line_ending, eol):
    sse = stream_bytes(up, Behavior.line_endings(line_ending))

    frames = sse.split(eol + eol)
    assert frames[-1] == b""
    assert len(frames) - 1 == 10
    assert all(frame.startswith(b"data: ") and eol not in frame for frame in frames[:-1])
    if line_ending == "cr":
        assert b"\n" not in sse
    elif line_ending == "lf":
        assert b"\r" not in sse
    else:
        assert sse.count(b"\n") == sse.count(b"\r\n")


def test_split_utf8_writes_pieces_that_split_characters_and_line_ends(up):
    up.set_plan([Behavior.split_utf8(split_delay_ms=0)])

    with (
        httpx.Client() as http,
        http.stream("POST", f"{up.base_url}/chat/completions", json=STREAM) as response,
    ):
        pieces = list(response.iter_raw())

    def splits_a_character(piece: bytes) -> bool:
        try:
            piece.decode()
        except UnicodeDecodeError:
            return True
        return False

    assert any(splits_a_character(p) for p in pieces)
    assert pieces.count(b"\n") == 20  # both line ends of each of the 10 events written alone
    events = data_lines(b"".join(pieces))
    text = "".join(
        json.loads(e)["choices"][0]["delta"].get("content") or ""
        for e in events[:-1]
        if json.loads(e)["choices"]
    )
    assert text == REPLY


def test_split_utf8_stream_still_parses_through_the_sdk(up, client):
    up.set_plan([Behavior.split_utf8()])

    chunks = list(client.chat.completions.create(**STREAM))

    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY


def test_large_body_keeps_its_size_but_reports_no_more_tokens_than_asked(up, http):
    up.set_plan([Behavior.large_body(50_000)])

    response = http.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 3})

    assert len(response.content) >= 50_000
    assert response.json()["usage"]["completion_tokens"] == 3
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_first_event_delay_holds_the_first_event_not_the_headers(up):
    up.set_plan([Behavior.ok(first_event_delay_ms=100)])

    with (
        httpx.Client() as http,
        http.stream("POST", f"{up.base_url}/chat/completions", json=STREAM) as response,
    ):
        headers_at = time.monotonic()
        first = next(response.iter_raw())
        first_event_at = time.monotonic()

    assert first.startswith(b"data: ")
    assert first_event_at - headers_at >= 0.09


def test_large_body_is_at_least_min_bytes_buffered_and_streamed(up, http):
    up.set_plan([Behavior.large_body(200_000), Behavior.large_body(200_000)])

    buffered = http.post("/v1/chat/completions", json=CHAT)
    raw = raw_exchange(up, "/v1/chat/completions", STREAM)
    sse, complete = dechunk(split_head(raw)[2])

    assert len(buffered.content) >= 200_000
    assert len(buffered.json()["choices"][0]["message"]["content"].encode()) >= 200_000
    assert complete
    assert len(sse) >= 200_000


def test_latency_delays_the_response_headers(up, client):
    up.set_plan([Behavior.ok(latency_ms=100)])

    started = time.monotonic()
    client.chat.completions.create(**CHAT)

    assert time.monotonic() - started >= 0.1


# Programming the plan


def test_plan_runs_in_order_then_falls_back_to_the_default():
    plan = [Behavior.rate_limited(), Behavior.server_error(502)]
    with (
        FakeUpstream("east", plan=plan, default=Behavior.unauthorized()) as up,
        httpx.Client(base_url=up.root_url) as http,
    ):
        statuses = [http.post("/v1/chat/completions", json=CHAT).status_code for _ in range(4)]

        assert statuses == [429, 502, 401, 401]
        assert [r.behavior.kind for r in up.requests if r.behavior] == [
            Kind.RATE_LIMITED,
            Kind.SERVER_ERROR,
            Kind.UNAUTHORIZED,
            Kind.UNAUTHORIZED,
        ]


def test_set_plan_and_set_default_apply_at_runtime(up: FakeUpstream, http: httpx.Client) -> None:
    def status() -> int:
        return http.post("/v1/chat/completions", json=CHAT).status_code

    assert status() == 200
    up.set_default(Behavior.server_error(503))
    assert status() == 503
    up.set_plan([Behavior.ok()])
    assert up.plan == (Behavior.ok(),)
    assert [status(), status()] == [200, 503]
    up.reset()
    assert (status(), up.hits) == (200, 1)


def test_control_api_programs_and_reports_over_http(up):
    with httpx.Client(base_url=up.root_url) as http:
        plan = [{"kind": "rate_limited", "retry_after": 3}, "not_started"]
        assert http.post("/_fake/plan", json=plan).json()["plan_remaining"] == 2
        assert http.post("/_fake/default", json={"kind": "server_error", "status": 504})

        statuses = [http.post("/v1/chat/completions", json=CHAT).status_code for _ in range(3)]
        stats = http.get("/_fake/stats").json()
        logged = http.get("/_fake/requests").json()["data"]
        bad = http.post("/_fake/plan", json=[{"kind": "explode"}])
        reset = http.post("/_fake/reset").json()

    assert statuses == [429, 503, 504]
    assert stats["hits"] == 3
    assert stats["hits_by_path"] == {"/v1/chat/completions": 3}
    assert stats["plan_remaining"] == 0
    kinds = [r["behavior"]["kind"] for r in logged]
    assert kinds == ["rate_limited", "not_started", "server_error"]
    assert logged[0]["json"] == CHAT
    assert bad.status_code == 400
    assert "explode" in bad.json()["error"]
    assert (reset["hits"], reset["default"]) == (0, {"kind": "ok"})


def test_hit_counters_are_per_server():
    with FakeUpstream("east") as east, FakeUpstream("west") as west, httpx.Client() as http:
        for _ in range(3):
            http.post(f"{east.base_url}/chat/completions", json=CHAT)
        http.post(f"{west.root_url}/v1/messages", json=ANTHROPIC)

        assert east.port != west.port
        assert (east.hits, west.hits) == (3, 1)
        assert east.hits_by_path == {"/v1/chat/completions": 3}
        assert west.hits_by_path == {"/v1/messages": 1}


def test_request_log_keeps_headers_case_insensitive_and_the_json_body(up, client):
    client.chat.completions.create(
        **CHAT,
        extra_headers={"X-Waybill-Attempt-Id": "att_1", "traceparent": "00-abc-def-01"},
    )

    [request] = up.requests
    assert (request.method, request.path) == ("POST", "/v1/chat/completions")
    assert request.headers["x-waybill-attempt-id"] == "att_1"
    assert request.headers["TRACEPARENT"] == "00-abc-def-01"
    assert request.headers["Authorization"] == "Bearer x"
    assert request.json == CHAT
    assert request.behavior == Behavior.ok()


def test_keep_alive_serves_many_requests_over_one_connection(up):
    up.set_plan([Behavior.ok(), Behavior.rate_limited(), Behavior.server_error(503)])

    with httpx.Client(base_url=up.root_url) as http:
        statuses = [http.post("/v1/chat/completions", json=CHAT).status_code for _ in range(3)]
        streamed = http.post("/v1/chat/completions", json=STREAM)
        anthropic = http.post("/v1/messages", json={**ANTHROPIC, "stream": True})
        http.get("/v1/models")

    assert statuses == [200, 429, 503]
    assert data_lines(streamed.content)[-1] == "[DONE]"
    assert data_lines(anthropic.content)[-1] == '{"type":"message_stop"}'
    assert up.hits == 5
    assert up.connections == 1
    assert {r.connection_id for r in up.requests} == {1}


def test_the_sdk_reuses_its_pooled_connection(up, client):
    for _ in range(3):
        client.chat.completions.create(**CHAT)
    client.models.list()

    assert up.connections == 1


def test_chunked_request_bodies_are_read(up, http):
    payload = json.dumps(CHAT).encode()

    response = http.post("/v1/chat/completions", content=iter([payload[:10], payload[10:]]))

    assert response.status_code == 200
    assert up.requests[0].json == CHAT


def test_unreadable_body_and_unknown_path_are_rejected(up, http):
    not_json = http.post("/v1/chat/completions", content=b"{nope")
    unknown = http.get("/v1/embeddings")

    assert not_json.status_code == 400
    assert not_json.json()["error"]["type"] == "invalid_request_error"
    assert unknown.status_code == 404
    assert up.plan == ()


def test_behavior_round_trips_through_json_and_rejects_nonsense():
    behavior = Behavior.stall(after_events=3, stall_s=1.5)

    assert Behavior.from_json(behavior.to_json()) == behavior
    assert Behavior.from_json("no_done") == Behavior.no_done()
    assert Behavior.from_json({"kind": "line_endings", "line_ending": "cr"}).line_ending == "cr"
    for nonsense in (
        {"kind": "ok", "colour": "red"},
        {"latency_ms": 5},
        {"kind": "line_endings", "line_ending": "nel"},
        {"kind": "server_error", "status": 99},
        {"kind": "ok", "latency_ms": -1},
        {"kind": "stall", "after_events": 1, "after_content": 1},
        [1, 2],
    ):
        with pytest.raises(ValueError):
            Behavior.from_json(nonsense)


# Async use and the standalone process


async def test_async_context_manager_serves_inside_the_running_loop():
    async with (
        FakeUpstream("east", plan=[Behavior.ok(chunk_delay_ms=1)]) as up,
        openai.AsyncOpenAI(base_url=up.base_url, api_key="x", max_retries=0) as client,
    ):
        stream = await client.chat.completions.create(**STREAM)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        await up.wait_for_async(lambda u: u.hits == 1)

    assert text == REPLY


async def test_wait_for_async_sees_a_stalled_request_arrive():
    async with FakeUpstream("east", default=Behavior.stall()) as up, httpx.AsyncClient() as http:
        call = asyncio.create_task(http.post(f"{up.base_url}/chat/completions", json=CHAT))
        await up.wait_for_async(lambda u: u.hits == 1)
        call.cancel()
        await up.wait_for_async(lambda u: u.client_gone == 1)

        with pytest.raises(TimeoutError):
            await up.wait_for_async(lambda u: u.hits == 2, within=0.01)
        with pytest.raises(RuntimeError):
            up.wait_for(lambda u: True)  # would block the loop the server runs on


def test_standalone_process_prints_its_port_then_serves():
    process = subprocess.Popen(
        [sys.executable, "-m", "router.fake_provider", "--port", "0", "--name", "solo"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        first_line = process.stdout.readline().strip()
        assert first_line.startswith("listening http://127.0.0.1:")
        url = first_line.removeprefix("listening ")

        response = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=5)

        assert response.json()["choices"][0]["message"]["content"].startswith("Hello from solo")
    finally:
        process.terminate()
        assert process.wait(timeout=5) == 0


def test_embeddings_are_the_same_for_the_same_input_on_every_fake(client):
    with (
        FakeUpstream("west") as west,
        openai.OpenAI(base_url=west.base_url, api_key="x", max_retries=0) as other,
    ):
        here = client.embeddings.create(model="m", input=["a", "b"], encoding_format="float")
        there = other.embeddings.create(model="m", input=["a", "b"])  # base64, decoded
    assert [d.embedding for d in here.data] == [d.embedding for d in there.data]
    assert here.data[0].embedding == embedding("a") != embedding("b")
    assert client.embeddings.create(model="m", input="a", dimensions=3).data[0].embedding == (
        embedding("a", 3)
    )
    assert here.usage.prompt_tokens == here.usage.total_tokens == 2
