"""The OpenAI driver's Responses API, pure (router/drivers/responses.py): a response object
and its events read into the core's canonical shape, the provider's own kept beside it."""

from __future__ import annotations

from typing import Any

import pytest

from router.drivers.base import StreamErrorEvent
from router.drivers.openai import openai_usage
from router.drivers.responses import NATIVE_EVENT, NATIVE_RESPONSE, ResponsesEvents, completion

USAGE = {
    "input_tokens": 10,
    "input_tokens_details": {"cached_tokens": 4},
    "output_tokens": 7,
    "output_tokens_details": {"reasoning_tokens": 3},
    "total_tokens": 17,
}
RESPONSE: dict[str, Any] = {
    "id": "resp_1",
    "object": "response",
    "created_at": 5,
    "model": "m",
    "status": "completed",
    "output": [
        {"type": "web_search_call", "id": "ws_1", "status": "completed"},
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "hi", "annotations": []}],
        },
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "w", "arguments": "{}"},
    ],
    "usage": USAGE,
}


def test_a_response_object_reads_as_a_completion_carrying_it():
    read = completion(RESPONSE)
    (choice,) = read["choices"]
    assert choice["message"]["content"] == "hi"
    assert choice["message"]["tool_calls"][0]["id"] == "c1"
    assert choice["finish_reason"] == "tool_calls"
    assert read[NATIVE_RESPONSE] == RESPONSE
    usage = openai_usage(read["usage"])
    assert usage is not None
    assert (usage.input_tokens, usage.cached_input_tokens, usage.output_tokens) == (10, 4, 7)


def test_an_incomplete_response_finishes_as_length():
    cut = {
        **RESPONSE,
        "status": "incomplete",
        "incomplete_details": {"reason": "max_output_tokens"},
    }
    assert completion(cut)["choices"][0]["finish_reason"] == "length"


def test_events_read_as_chunks_each_carrying_its_event():
    events = ResponsesEvents(openai_usage)
    created = {"type": "response.created", "response": {**RESPONSE, "status": "in_progress"}}
    (first,) = events.translate(created)
    assert first[NATIVE_EVENT] == created and first["choices"][0]["delta"] == {}
    assert events.response_id == "resp_1"
    (text,) = events.translate({"type": "response.output_text.delta", "delta": "he"})
    assert text["choices"][0]["delta"] == {"content": "he"}
    (done,) = events.translate({"type": "response.completed", "response": RESPONSE})
    assert done["choices"][0]["finish_reason"] == "stop"
    assert events.usage is not None and events.usage.output_tokens == 7


@pytest.mark.parametrize(
    "event",
    [
        {"type": "error", "code": "server_error", "message": "boom"},
        {
            "type": "response.failed",
            "response": {"error": {"code": "server_error", "message": "x"}},
        },
    ],
)
def test_a_failure_event_is_the_providers_error(event):
    with pytest.raises(StreamErrorEvent) as caught:
        ResponsesEvents(openai_usage).translate(event)
    assert caught.value.outcome.error_code == "server_error"
