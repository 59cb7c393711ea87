"""OpenAI's Responses API as the OpenAI driver speaks it natively (``POST {base_url}/responses``),
for a request that needs the provider's state or effects (the Responses door's
``NativeBody`` of dialect :data:`RESPONSES_DIALECT`, routed only to mappings that declare the
capability ``responses``).

The body goes as the client sent it, the mapping's model and ``stream`` set. The answer is
read into the core's canonical shape — a chat completion (its text, function calls, finish
reason and usage, what the core settles and checks) carrying the provider's response object
under the extension field ``response``; each stream event a canonical chunk carrying the
event under ``response_event`` — so that the door gives the client the provider's own objects
and events, its ``resp_`` id among them. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from router.drivers.base import StreamErrorEvent, StreamTranslator, optional_str, sanitize
from router.request.classify import UpstreamOutcome

__all__ = [
    "NATIVE_EVENT",
    "NATIVE_RESPONSE",
    "RESPONSES_DIALECT",
    "ResponsesEvents",
    "completion",
    "payload",
]

RESPONSES_DIALECT: Final = "openai.responses"
NATIVE_RESPONSE: Final = "response"  # a canonical completion's extension: the object as sent
NATIVE_EVENT: Final = "response_event"  # a canonical chunk's extension: the event as sent
_FINISH: Final = {"max_output_tokens": "length", "content_filter": "content_filter"}


def payload(native: Mapping[str, Any], model: str, stream: bool) -> dict[str, Any]:
    body = {**native, "model": model}
    if stream:
        body["stream"] = True
    else:
        body.pop("stream", None)
    return body


def completion(response: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses object as a canonical chat completion, the object itself beside it."""
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for item in response.get("output") or ():
        if not isinstance(item, dict):
            continue
        if item.get("type") == "message":
            for part in item.get("content") or ():
                if isinstance(part, dict) and part.get("type") == "output_text":
                    text.append(str(part.get("text") or ""))
        elif item.get("type") == "function_call":
            calls.append(
                {
                    "id": item.get("call_id"),
                    "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")},
                }
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if calls:
        message["tool_calls"] = calls
    return {
        "id": response.get("id"),
        "object": "chat.completion",
        "created": response.get("created_at"),
        "model": response.get("model"),
        "choices": [{"index": 0, "message": message, "finish_reason": _finish(response, calls)}],
        "usage": _chat_usage(response.get("usage")),
        NATIVE_RESPONSE: dict(response),
    }


def _finish(response: Mapping[str, Any], calls: list[Any]) -> str:
    details = response.get("incomplete_details")
    reason = details.get("reason") if isinstance(details, dict) else None
    if reason is not None:
        return _FINISH.get(str(reason), "length")
    return "tool_calls" if calls else "stop"


def _chat_usage(raw: object) -> dict[str, Any] | None:
    """Responses usage under chat's names, which the core (and the door) read."""
    if not isinstance(raw, dict):
        return None
    input_details = raw.get("input_tokens_details")
    output_details = raw.get("output_tokens_details")
    return {
        "prompt_tokens": raw.get("input_tokens"),
        "completion_tokens": raw.get("output_tokens"),
        "total_tokens": raw.get("total_tokens"),
        "prompt_tokens_details": dict(input_details) if isinstance(input_details, dict) else {},
        "completion_tokens_details": {
            "reasoning_tokens": output_details.get("reasoning_tokens")
            if isinstance(output_details, dict)
            else 0
        },
    }


class ResponsesEvents(StreamTranslator):
    """Each Responses event as one canonical chunk carrying it: text and argument deltas as
    content (the first commits the stream), the final event's finish reason and usage."""

    def __init__(self, read_usage: Any) -> None:
        self._read_usage = read_usage
        self._model: object = None
        self._calls = 0

    def translate(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        kind = event.get("type")
        if kind in ("error", "response.failed"):
            raise StreamErrorEvent(_failure(event))
        response = event.get("response")
        if isinstance(response, dict):
            if self.response_id is None:
                self.response_id = optional_str(response.get("id"))
            self._model = response.get("model", self._model)
        delta: dict[str, Any] = {}
        choice: dict[str, Any] = {"index": 0, "delta": delta}
        chunk: dict[str, Any] = {
            "id": self.response_id,
            "object": "chat.completion.chunk",
            "model": self._model,
            "choices": [choice],
            NATIVE_EVENT: event,
        }
        if kind == "response.output_text.delta":
            delta["content"] = str(event.get("delta") or "")
        elif kind == "response.output_item.added":
            item = event.get("item")
            if isinstance(item, dict) and item.get("type") == "function_call":
                self._calls += 1
                delta["tool_calls"] = [
                    {
                        "index": self._calls - 1,
                        "id": item.get("call_id"),
                        "type": "function",
                        "function": {"name": item.get("name"), "arguments": ""},
                    }
                ]
        elif kind == "response.function_call_arguments.delta":
            delta["tool_calls"] = [
                {"index": max(0, self._calls - 1), "function": {"arguments": event.get("delta")}}
            ]
        elif kind in ("response.completed", "response.incomplete") and isinstance(response, dict):
            self.finish_reason = _finish(response, [None] * self._calls)
            choice["finish_reason"] = self.finish_reason
            usage = _chat_usage(response.get("usage"))
            chunk["usage"] = usage
            self.usage = self._read_usage(usage)
        return [chunk]


def _failure(event: Mapping[str, Any]) -> UpstreamOutcome:
    error = event.get("error") if event.get("type") == "response.failed" else event
    response = event.get("response")
    if isinstance(response, dict) and isinstance(response.get("error"), dict):
        error = response["error"]
    if not isinstance(error, Mapping):
        error = {}
    return UpstreamOutcome(
        error_code=optional_str(error.get("code")),
        error_type=optional_str(error.get("type")),
        error_message=sanitize(error.get("message"), None),
    )
