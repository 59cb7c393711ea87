"""The Anthropic driver: OpenAI chat requests to the Messages API, and answers back.

Requests: system (and developer) messages become ``system``; ``stop`` becomes
``stop_sequences``; ``max_tokens`` (required by Anthropic) is the attempt's resolved limit.
Answers: ``stop_reason`` maps to an OpenAI ``finish_reason`` and ``usage`` to OpenAI token
counts; stream events become ``chat.completion.chunk`` dicts.
"""

from __future__ import annotations

import time
from typing import Any, Final

import orjson

from ledger.events import Usage
from router.classify import UpstreamOutcome
from router.config import Endpoint
from router.drivers.base import (
    AttemptBinding,
    ChatRequest,
    Driver,
    DriverResult,
    DriverStream,
    SSEDriverStream,
    StreamErrorEvent,
    StreamTranslator,
    optional_str,
    sanitize,
)

__all__ = ["DEFAULT_ANTHROPIC_VERSION", "DEFAULT_MAX_TOKENS", "AnthropicDriver"]

DEFAULT_ANTHROPIC_VERSION: Final = "2023-06-01"
DEFAULT_MAX_TOKENS: Final = 4096
"""Used only when neither the request nor the core gave a limit (Anthropic requires one)."""

_FINISH: Final = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}
# An error event inside a 200 stream carries a type but no status; read it as its status.
_ERROR_TYPE_STATUS: Final = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "overloaded_error": 529,
}


class AnthropicDriver(Driver):
    _request_id_header = "request-id"

    def _auth_headers(self, endpoint: Endpoint) -> dict[str, str]:
        headers = {"anthropic-version": endpoint.anthropic_version or DEFAULT_ANTHROPIC_VERSION}
        if endpoint.api_key is not None:
            headers["x-api-key"] = endpoint.api_key.get_secret_value()
        return headers

    @staticmethod
    def _url(binding: AttemptBinding) -> str:
        # Like the Anthropic SDK, base_url is the API root (https://api.anthropic.com); a
        # base_url that already ends in /v1 is accepted too.
        base = binding.endpoint.base_url.rstrip("/")
        return base + ("/messages" if base.endswith("/v1") else "/v1/messages")

    async def complete(self, request: ChatRequest, binding: AttemptBinding) -> DriverResult:
        payload = to_messages_request(request, stream=False)
        response = await self._open(self._url(binding), payload, binding, stream=False)
        body = await self._read_body(response, binding)
        request_id = response.headers.get(self._request_id_header)
        if not isinstance(body, dict) or not isinstance(body.get("content"), list):
            raise self._transport_failure(
                binding,
                "invalid_response",
                status=response.status_code,
                request_id=request_id,
                message="response has no content",
            )
        completion = to_chat_completion(body, request.upstream_model)
        return DriverResult(
            response=completion,
            usage=_usage(body.get("usage")),
            finish_reason=completion["choices"][0]["finish_reason"],
            upstream_request_id=request_id,
            response_id=optional_str(body.get("id")),
            status=response.status_code,
        )

    async def stream(self, request: ChatRequest, binding: AttemptBinding) -> DriverStream:
        started_at = time.monotonic()
        payload = to_messages_request(request, stream=True)
        response = await self._open(self._url(binding), payload, binding, stream=True)
        translator = _AnthropicEvents(request.upstream_model)
        return SSEDriverStream(self, response, binding, translator, started_at)


# --- requests ---


def to_messages_request(request: ChatRequest, *, stream: bool) -> dict[str, Any]:
    body = request.body
    system: list[str] = []
    messages: list[dict[str, Any]] = []
    for message in body.get("messages") or ():
        role = message.get("role")
        if role in ("system", "developer"):
            system.append(_text_of(message.get("content")))
        else:
            messages.append(_to_message(message))
    max_tokens = request.max_tokens
    if max_tokens is None:
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    payload: dict[str, Any] = {
        "model": request.upstream_model,
        "messages": messages,
        "max_tokens": max_tokens or DEFAULT_MAX_TOKENS,
        "stream": stream,
    }
    if system:
        payload["system"] = "\n\n".join(system)
    stop = body.get("stop")
    if stop:
        payload["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            payload[key] = body[key]
    return payload


def _text_of(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, dict) and part.get("type") == "text"
        )
    return ""


def _to_message(message: dict[str, Any]) -> dict[str, Any]:
    role = "assistant" if message.get("role") == "assistant" else "user"
    content = message.get("content")
    if isinstance(content, list):
        blocks = [
            {"type": "text", "text": str(part.get("text", ""))}
            for part in content
            if isinstance(part, dict) and part.get("type") == "text"
        ]
        return {"role": role, "content": blocks}
    return {"role": role, "content": content if isinstance(content, str) else ""}


# --- responses ---


def to_chat_completion(body: dict[str, Any], model: str) -> dict[str, Any]:
    """An Anthropic message as an OpenAI ``chat.completion``."""
    text = ""
    tool_calls: list[dict[str, Any]] = []
    for block in body.get("content") or ():
        if block.get("type") == "text":
            text += str(block.get("text", ""))
        elif block.get("type") == "tool_use":
            tool_calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {
                        "name": block.get("name"),
                        "arguments": orjson.dumps(block.get("input") or {}).decode(),
                    },
                }
            )
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    completion: dict[str, Any] = {
        "id": body.get("id"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model") or model,
        "choices": [
            {"index": 0, "message": message, "finish_reason": _finish(body.get("stop_reason"))}
        ],
    }
    usage = _usage(body.get("usage"))
    if usage is not None:
        completion["usage"] = _openai_usage(usage)
    return completion


def _finish(stop_reason: object) -> str | None:
    if stop_reason is None:
        return None
    return _FINISH.get(str(stop_reason), "stop")


def _usage(raw: object, *, input_tokens: int | None = None) -> Usage | None:
    if not isinstance(raw, dict):
        return None
    prompt = raw.get("input_tokens", input_tokens)
    completion = raw.get("output_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    cached = raw.get("cache_read_input_tokens")
    return Usage(
        input_tokens=prompt,
        output_tokens=completion,
        cached_input_tokens=cached if isinstance(cached, int) else 0,
    )


def _openai_usage(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.input_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": usage.input_tokens + usage.output_tokens,
    }


class _AnthropicEvents(StreamTranslator):
    """Messages stream events as OpenAI chunks: role, content deltas, finish, usage."""

    def __init__(self, model: str) -> None:
        self._model = model
        self._created = int(time.time())
        self._input_tokens: int | None = None
        self._cached_tokens = 0
        self._tool_index = -1

    def _chunk(
        self, delta: dict[str, Any], finish: str | None = None, **extra: Any
    ) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "chat.completion.chunk",
            "created": self._created,
            "model": self._model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            **extra,
        }

    def translate(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        kind = event.get("type")
        if kind == "message_start":
            message = event.get("message") or {}
            self.response_id = optional_str(message.get("id"))
            self._model = str(message.get("model") or self._model)
            usage = message.get("usage") or {}
            if isinstance(usage.get("input_tokens"), int):
                self._input_tokens = usage["input_tokens"]
            if isinstance(usage.get("cache_read_input_tokens"), int):
                self._cached_tokens = usage["cache_read_input_tokens"]
            return [self._chunk({"role": "assistant", "content": ""})]
        if kind == "content_block_start":
            block = event.get("content_block") or {}
            if block.get("type") == "tool_use":
                self._tool_index += 1
                call = {
                    "index": self._tool_index,
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": ""},
                }
                return [self._chunk({"tool_calls": [call]})]
            return []
        if kind == "content_block_delta":
            delta = event.get("delta") or {}
            if delta.get("type") == "text_delta":
                return [self._chunk({"content": str(delta.get("text", ""))})]
            if delta.get("type") == "input_json_delta":
                call = {
                    "index": max(self._tool_index, 0),
                    "function": {"arguments": str(delta.get("partial_json", ""))},
                }
                return [self._chunk({"tool_calls": [call]})]
            return []
        if kind == "message_delta":
            return self._message_delta(event)
        if kind == "error":
            error = event.get("error") or {}
            type_ = optional_str(error.get("type"))
            raise StreamErrorEvent(
                UpstreamOutcome(
                    http_status=_ERROR_TYPE_STATUS.get(type_ or "", 500),
                    error_type=type_,
                    error_message=sanitize(error.get("message"), None),
                )
            )
        return []  # ping, content_block_stop, message_stop and types yet unknown

    def _message_delta(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        delta = event.get("delta") or {}
        finish = _finish(delta.get("stop_reason"))
        raw = event.get("usage")
        usage = _usage(raw, input_tokens=self._input_tokens)
        if usage is not None and self._cached_tokens and not usage.cached_input_tokens:
            usage = usage.model_copy(update={"cached_input_tokens": self._cached_tokens})
        if usage is not None:
            self.usage = usage
        chunks = []
        if finish is not None:
            self.finish_reason = finish
            chunks.append(self._chunk({}, finish))
        if usage is not None:
            chunks.append({**self._chunk({}), "choices": [], "usage": _openai_usage(usage)})
        return chunks
