"""The Anthropic driver: OpenAI chat requests to the Messages API, and answers back.

A request that came through the Anthropic door carries its Messages body as it arrived
(``ChatRequest.native``): that body is sent as it is — thinking, documents, ``cache_control``
and beta fields included, ``anthropic-beta`` as a header — with the mapping's upstream model,
the resolved ``max_tokens`` and ``stream`` set.

Requests: system (and developer) messages become ``system``; ``stop`` becomes
``stop_sequences``; ``max_tokens`` (required by Anthropic) is the attempt's resolved limit.
Function ``tools``, ``tool_choice`` and ``parallel_tool_calls`` become Anthropic's tools and
tool choice; an assistant's ``tool_calls`` become ``tool_use`` blocks and ``tool`` messages
become ``tool_result`` blocks in a user turn.
Answers: ``stop_reason`` maps to an OpenAI ``finish_reason`` and ``usage`` to OpenAI token
counts; ``tool_use`` blocks become ``tool_calls``; stream events (``input_json_delta``
included) become ``chat.completion.chunk`` dicts.

What the chat shape has no field for is carried in extension fields (contract §3 "The
canonical answer"), which OpenAI clients ignore and the Anthropic door reads back: thinking
as the message's (or delta's) ``reasoning_content`` and ``thinking_blocks`` (``thinking``
with its ``signature``, or ``redacted_thinking`` with its ``data``; in a stream, each delta's
block is a piece of the current one), the matched stop sequence as the choice's
``stop_sequence``, and cache usage as ``usage.cache_creation_input_tokens`` and
``usage.cache_read_input_tokens`` (with OpenAI's ``prompt_tokens_details.cached_tokens``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from typing import Any, Final

import orjson

from ledger.events import Usage
from router.config import Endpoint
from router.drivers.base import (
    AttemptBinding,
    ChatRequest,
    Driver,
    DriverResult,
    DriverStream,
    PreparedCall,
    SSEDriverStream,
    StreamErrorEvent,
    StreamTranslator,
    optional_str,
    proxy_of,
    sanitize,
)
from router.drivers.http import HTTPError
from router.request.classify import UpstreamOutcome

__all__ = [
    "DEFAULT_ANTHROPIC_VERSION",
    "DEFAULT_MAX_TOKENS",
    "AnthropicDriver",
    "AnthropicEvents",
    "to_chat_completion",
    "to_messages_request",
]

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
    dialect = "anthropic"
    requires_max_tokens = True

    def _auth_headers(self, endpoint: Endpoint) -> dict[str, str]:
        headers = {"anthropic-version": endpoint.anthropic_version or DEFAULT_ANTHROPIC_VERSION}
        if endpoint.api_key is not None:
            headers["x-api-key"] = endpoint.api_key.get_secret_value()
        return headers

    def _url(self, binding: AttemptBinding, request: ChatRequest) -> str:
        return self._url_of(binding.endpoint)

    @staticmethod
    def _url_of(endpoint: Endpoint) -> str:
        # Like the Anthropic SDK, base_url is the API root (https://api.anthropic.com); a
        # base_url that already ends in /v1 is accepted too.
        base = endpoint.base_url.rstrip("/")
        return base + ("/messages" if base.endswith("/v1") else "/v1/messages")

    def _payload(self, request: ChatRequest) -> dict[str, Any]:
        native = request.native
        if native is not None and native.dialect == self.dialect:
            payload = dict(native.body)
            payload["model"] = request.upstream_model
            if request.max_tokens is not None:
                payload["max_tokens"] = request.max_tokens
            payload["stream"] = request.stream
            return payload
        return to_messages_request(request, stream=request.stream)

    async def complete(self, call: PreparedCall) -> DriverResult:
        request, binding = call.request, call.binding
        response = await self._open(call, stream=False)
        body, size = await self._read_body(response, binding)
        request_id = response.headers.get(self._request_id_header)
        if not isinstance(body, dict) or not isinstance(body.get("content"), list):
            raise self._transport_failure(
                binding,
                "invalid_response",
                status=response.status_code,
                request_id=request_id,
                message="response has no content",
                response_bytes=size,
            )
        completion = to_chat_completion(body, request.upstream_model)
        return DriverResult(
            response=completion,
            usage=_usage(body.get("usage")),
            finish_reason=completion["choices"][0]["finish_reason"],
            upstream_request_id=request_id,
            response_id=optional_str(body.get("id")),
            status=response.status_code,
            response_bytes=size,
        )

    async def count_tokens(
        self,
        endpoint: Endpoint,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        timeout_s: float,
    ) -> int | None:
        """The endpoint's own count of a Messages body's input tokens (Anthropic's free
        ``POST /v1/messages/count_tokens``); None if it did not answer with one in time."""
        url = self._url_of(endpoint) + "/count_tokens"
        sent = {**headers, **self._auth_headers(endpoint), "content-type": "application/json"}
        try:
            async with asyncio.timeout(timeout_s):
                response = await self._client.request(
                    "POST",
                    url,
                    headers=sent,
                    body=orjson.dumps(body),
                    proxy=proxy_of(endpoint.proxy),
                    connect_timeout=timeout_s,
                    read_timeout=timeout_s,
                )
                try:
                    raw = await response.aread()
                finally:
                    await response.aclose()
        except (HTTPError, OSError, TimeoutError):
            return None
        if response.status_code != 200:
            return None
        try:
            answer = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
        return _count(answer.get("input_tokens")) if isinstance(answer, dict) else None

    async def stream(self, call: PreparedCall) -> DriverStream:
        started_at = time.monotonic()
        response = await self._open(call, stream=True)
        translator = AnthropicEvents(call.request.upstream_model)
        return SSEDriverStream(self, response, call.binding, translator, started_at)


# --- requests ---


def to_messages_request(request: ChatRequest, *, stream: bool) -> dict[str, Any]:
    """An OpenAI chat request as an Anthropic Messages API body."""
    body = request.body
    system, messages = _conversation(body.get("messages") or ())
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
    payload.update(_tool_fields(body))
    return payload


def _conversation(raw: Iterable[Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """The system text, and the turns as Anthropic messages.

    OpenAI sends one ``tool`` message per result; Anthropic wants them all in the one user
    turn that follows the assistant's ``tool_use`` blocks, results first and any text after
    them, so consecutive results are merged and a user message right after them joins that
    turn rather than starting a second user turn in a row.
    """
    system: list[str] = []
    messages: list[dict[str, Any]] = []
    for message in raw:
        role = message.get("role")
        if role in ("system", "developer"):
            system.append(_text_of(message.get("content")))
        elif role == "tool":
            _add_tool_result(messages, message)
        elif role == "assistant":
            messages.append(_assistant_message(message))
        elif (turn := _tool_result_turn(messages)) is not None:
            turn.extend(_text_blocks(message.get("content")))
        else:
            messages.append(_to_message(message))
    return system, messages


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


def _text_blocks(content: object) -> list[dict[str, Any]]:
    # Anthropic rejects an empty text block, so empty text is left out.
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    if isinstance(content, list):
        return [
            {"type": "text", "text": str(part["text"])}
            for part in content
            if isinstance(part, dict) and part.get("type") == "text" and part.get("text")
        ]
    return []


def _to_message(message: dict[str, Any]) -> dict[str, Any]:
    role = "assistant" if message.get("role") == "assistant" else "user"
    content = message.get("content")
    if isinstance(content, list):
        return {"role": role, "content": _text_blocks(content)}
    return {"role": role, "content": content if isinstance(content, str) else ""}


def _assistant_message(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn; its ``tool_calls`` become ``tool_use`` blocks after its text."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        return _to_message(message)
    blocks = _text_blocks(message.get("content"))
    for call in calls:
        if not isinstance(call, dict):
            continue
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        blocks.append(
            {
                "type": "tool_use",
                "id": str(call.get("id") or ""),
                "name": str(function.get("name") or ""),
                "input": _tool_input(function.get("arguments")),
            }
        )
    return {"role": "assistant", "content": blocks}


def _tool_input(arguments: object) -> dict[str, Any]:
    """A tool call's ``arguments`` JSON string as the object Anthropic's ``input`` must be.

    Arguments that are not a JSON object (unparsable, an array, a number, empty) are sent as
    ``{}``, not refused. To OpenAI they are an opaque string: a model can produce broken
    JSON there and OpenAI endpoints accept the conversation back as is, so it must not
    fail only because the route chose Anthropic. Nor could a driver refuse it cleanly: by
    the time it translates, the attempt has started and holds a reservation, and only the
    core's failure path records an attempt's end; a 400 for it belongs in the request check
    before routing (router/doors/chat.py). ``{}`` keeps the turn valid (the ``tool_use`` still
    pairs with its ``tool_result``) and tells the model that call carried no input.
    """
    if isinstance(arguments, dict):
        return arguments
    if not isinstance(arguments, str):
        return {}
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _tool_result_turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The content of the last message if it is a user turn of tool results."""
    if not messages or messages[-1]["role"] != "user":
        return None
    content = messages[-1]["content"]
    if isinstance(content, list) and content and content[0].get("type") == "tool_result":
        return content
    return None


def _add_tool_result(messages: list[dict[str, Any]], message: dict[str, Any]) -> None:
    block: dict[str, Any] = {
        "type": "tool_result",
        "tool_use_id": str(message.get("tool_call_id") or ""),
    }
    content = message.get("content")
    result: str | list[dict[str, Any]] = (
        content if isinstance(content, str) else _text_blocks(content)
    )
    if result:  # content is optional; an empty one is left out rather than sent empty
        block["content"] = result
    turn = _tool_result_turn(messages)
    if turn is None:
        messages.append({"role": "user", "content": [block]})
        return
    # Results come before any text in the turn (a user message may already have joined it).
    at = next((i for i, b in enumerate(turn) if b.get("type") != "tool_result"), len(turn))
    turn.insert(at, block)


def _tool_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` in Anthropic's shape; nothing without a function tool.

    Only ``function`` tools have an Anthropic counterpart; other tool types are left out.
    ``tool_choice: "none"`` keeps the tools and sends ``{"type": "none"}`` rather than
    dropping them: a conversation that already holds ``tool_use`` blocks still refers to
    them, and the prompt stays the same whatever the choice.
    """
    raw = body.get("tools")
    tools = [
        _tool(tool["function"])
        for tool in (raw if isinstance(raw, list) else ())
        if isinstance(tool, dict)
        and tool.get("type", "function") == "function"
        and isinstance(tool.get("function"), dict)
    ]
    if not tools:
        return {}
    fields: dict[str, Any] = {"tools": tools}
    parallel = body.get("parallel_tool_calls") is not False
    choice = _tool_choice(body.get("tool_choice"), parallel=parallel)
    if choice is not None:
        fields["tool_choice"] = choice
    return fields


def _tool(function: dict[str, Any]) -> dict[str, Any]:
    tool: dict[str, Any] = {"name": str(function.get("name") or "")}
    if function.get("description"):
        tool["description"] = str(function["description"])
    # input_schema is required and must be an object schema; OpenAI's parameters may be
    # absent (a function without arguments) or leave the type implicit.
    parameters = function.get("parameters")
    schema = parameters if isinstance(parameters, dict) else {}
    tool["input_schema"] = {"type": "object", "properties": {}, **schema}
    return tool


def _tool_choice(choice: object, *, parallel: bool) -> dict[str, Any] | None:
    """OpenAI's ``tool_choice`` (and ``parallel_tool_calls``) as Anthropic's; None: default."""
    if choice == "none":
        return {"type": "none"}
    mapped: dict[str, Any]
    function = choice.get("function") if isinstance(choice, dict) else None
    if choice == "required":
        mapped = {"type": "any"}
    elif isinstance(function, dict) and function.get("name"):
        mapped = {"type": "tool", "name": str(function["name"])}
    elif choice == "auto" or not parallel:
        mapped = {"type": "auto"}
    else:
        return None  # absent or unknown: Anthropic's default is auto, as OpenAI's is
    if not parallel:
        mapped["disable_parallel_tool_use"] = True
    return mapped


# --- responses ---


def to_chat_completion(body: dict[str, Any], model: str) -> dict[str, Any]:
    """An Anthropic message as an OpenAI ``chat.completion``."""
    text = ""
    tool_calls: list[dict[str, Any]] = []
    thinking: list[dict[str, Any]] = []
    for block in body.get("content") or ():
        if not isinstance(block, dict):
            continue
        if block.get("type") == "text":
            text += str(block.get("text", ""))
        elif block.get("type") in ("thinking", "redacted_thinking"):
            thinking.append(block)
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
    if thinking:
        message["reasoning_content"] = "".join(str(b.get("thinking", "")) for b in thinking)
        message["thinking_blocks"] = thinking
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": _finish(body.get("stop_reason")),
    }
    if isinstance(body.get("stop_sequence"), str):
        choice["stop_sequence"] = body["stop_sequence"]
    completion: dict[str, Any] = {
        "id": body.get("id"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model") or model,
        "choices": [choice],
    }
    raw_usage = body.get("usage")
    usage = _usage(raw_usage)
    if usage is not None:
        completion["usage"] = _openai_usage(usage, raw_usage)
    return completion


def _finish(stop_reason: object) -> str | None:
    if stop_reason is None:
        return None
    return _FINISH.get(str(stop_reason), "stop")


def _usage(raw: object) -> Usage | None:
    """Anthropic's ``usage`` as a :class:`Usage`. Its ``input_tokens`` are only the input
    after the last cache breakpoint: tokens read from the cache and written to it are counted
    beside them, and are input all the same (thinking tokens are inside ``output_tokens``)."""
    if not isinstance(raw, dict):
        return None
    prompt, completion = _count(raw.get("input_tokens")), _count(raw.get("output_tokens"))
    if prompt is None or completion is None:
        return None
    cached = _count(raw.get("cache_read_input_tokens")) or 0
    written_5m, written_1h = _cache_writes(raw)
    return Usage(
        input_tokens=prompt + cached + written_5m + written_1h,
        output_tokens=completion,
        cached_input_tokens=cached,
        cache_write_input_tokens=written_5m,
        cache_write_1h_input_tokens=written_1h,
    )


def _cache_writes(usage: Mapping[str, Any]) -> tuple[int, int]:
    """The tokens an Anthropic ``usage`` object (an answer's, or a report's) says were
    written to the prompt cache: (for 5 minutes, for an hour).

    ``cache_creation`` splits ``cache_creation_input_tokens`` by lifetime. Without it every
    write is a 5-minute one (the default lifetime, and all there was before the split);
    writes the total counts beyond the split are taken as 5-minute ones too."""
    total = _count(usage.get("cache_creation_input_tokens")) or 0
    split = usage.get("cache_creation")
    if not isinstance(split, dict):
        return total, 0
    hour = _count(split.get("ephemeral_1h_input_tokens")) or 0
    five = _count(split.get("ephemeral_5m_input_tokens")) or 0
    return max(five, total - hour), hour


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _openai_usage(usage: Usage, raw: object = None) -> dict[str, Any]:
    """OpenAI's usage; cache reads and writes as Anthropic counted them, beside it."""
    openai: dict[str, Any] = {
        "prompt_tokens": usage.input_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": usage.input_tokens + usage.output_tokens,
    }
    if isinstance(raw, dict):
        written = _count(raw.get("cache_creation_input_tokens")) or 0
        read = _count(raw.get("cache_read_input_tokens")) or 0
        if written or read:
            openai["prompt_tokens_details"] = {"cached_tokens": read}
            openai["cache_creation_input_tokens"] = written
            openai["cache_read_input_tokens"] = read
    return openai


class AnthropicEvents(StreamTranslator):
    """Messages stream events as OpenAI chunks: role, text and tool call deltas, finish,
    usage."""

    def __init__(self, model: str) -> None:
        self._model = model
        self._created = int(time.time())
        self._start_usage: dict[str, Any] = {}  # message_start's; message_delta adds to it
        # Anthropic numbers every content block (text and tool_use alike); OpenAI numbers
        # only the tool calls, in order. Block index -> tool call index.
        self._tool_indexes: dict[object, int] = {}

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
            usage = message.get("usage")
            self._start_usage = usage if isinstance(usage, dict) else {}
            return [self._chunk({"role": "assistant", "content": ""})]
        if kind == "content_block_start":
            block = event.get("content_block") or {}
            if block.get("type") == "redacted_thinking":
                return [self._chunk({"thinking_blocks": [block]})]
            if block.get("type") == "tool_use":
                index = self._tool_indexes[event.get("index")] = len(self._tool_indexes)
                call = {
                    "index": index,
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
            if delta.get("type") == "thinking_delta":
                text = str(delta.get("thinking", ""))
                piece = {"type": "thinking", "thinking": text}
                return [self._chunk({"reasoning_content": text, "thinking_blocks": [piece]})]
            if delta.get("type") == "signature_delta":
                piece = {"type": "thinking", "signature": str(delta.get("signature", ""))}
                return [self._chunk({"thinking_blocks": [piece]})]
            tool_index = self._tool_indexes.get(event.get("index"))
            # Only a tool_use block's input is a tool call's arguments (a server tool's
            # input streams the same way but is not the client's to run).
            if delta.get("type") == "input_json_delta" and tool_index is not None:
                call = {
                    "index": tool_index,
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
        # The delta's counts are cumulative and win; the input counts may come only at the start.
        usage = _usage({**self._start_usage, **raw}) if isinstance(raw, dict) else None
        if usage is not None:
            self.usage = usage
        chunks = []
        if finish is not None:
            self.finish_reason = finish
            chunk = self._chunk({}, finish)
            if isinstance(delta.get("stop_sequence"), str):
                chunk["choices"][0]["stop_sequence"] = delta["stop_sequence"]
            chunks.append(chunk)
        if usage is not None:
            counts = _openai_usage(usage, {**self._start_usage, **raw})  # type: ignore[dict-item]
            chunks.append({**self._chunk({}), "choices": [], "usage": counts})
        return chunks
