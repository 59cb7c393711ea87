"""The Anthropic Messages dialect: message bodies, the real event sequence and errors in
Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`, `request-id`)."""

from __future__ import annotations

from typing import Any

from router.fake_provider._continuation import Partial, message_text
from router.fake_provider._reply import (
    Dialect,
    ErrorResponse,
    Prompt,
    Reply,
    SseEvent,
    StreamScript,
    dumps,
    error_headers,
    int_or_none,
    json_object,
    prompt_tokens,
    server_error_message,
)
from router.fake_provider.behavior import Behavior, Kind

__all__ = ["ANTHROPIC"]


class _Anthropic(Dialect):
    name = "anthropic"
    request_id_header = "request-id"
    message_id_prefix = "msg_"
    continues_natively = True

    def parse(self, body: dict[str, Any]) -> Prompt:
        tools = body.get("tools")
        names = tuple(
            str(t.get("name"))
            for t in (tools if isinstance(tools, list) else [])
            if isinstance(t, dict) and t.get("name")
        )
        thinking = body.get("thinking")
        return Prompt(
            model=str(body.get("model") or "fake-model"),
            prompt_tokens=prompt_tokens(body)[0],
            max_tokens=int_or_none(body.get("max_tokens")),
            tool_names=names,
            stream=body.get("stream") is True,
            include_usage=True,
            thinking=isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive"),
        )

    def partial(self, body: dict[str, Any]) -> Partial | None:
        messages = body.get("messages")
        last = messages[-1] if isinstance(messages, list) and messages else None
        if not isinstance(last, dict) or last.get("role") != "assistant":
            return None
        content = last.get("content")
        if isinstance(content, list) and any(
            isinstance(block, dict) and block.get("type") == "tool_use" for block in content
        ):
            return None  # a tool call waiting for its result, not a partial answer
        return Partial("assistant_prefill", message_text(content))

    @staticmethod
    def _input_usage(reply: Reply) -> dict[str, Any]:
        # Anthropic's input_tokens leave out what was read from the cache and written to
        # it, counted beside.
        written = reply.cache_write_tokens + reply.cache_write_1h_tokens
        uncached = reply.prompt_tokens - reply.cached_tokens - written
        usage: dict[str, Any] = {"input_tokens": uncached}
        if reply.cached_tokens:
            usage["cache_read_input_tokens"] = reply.cached_tokens
        if written:
            usage["cache_creation_input_tokens"] = written
            usage["cache_creation"] = {
                "ephemeral_5m_input_tokens": reply.cache_write_tokens,
                "ephemeral_1h_input_tokens": reply.cache_write_1h_tokens,
            }
        return usage

    @staticmethod
    def _signature(reply: Reply) -> str:
        return f"sig_{reply.request_id}"

    @staticmethod
    def _stop_reason(reply: Reply) -> str:
        return {"stop": "end_turn", "length": "max_tokens", "tool": "tool_use"}[reply.finish]

    def body(self, reply: Reply) -> dict[str, Any]:
        block: dict[str, Any] = {"type": "text", "text": reply.text}
        if reply.tool_name is not None:
            block = {
                "type": "tool_use",
                "id": reply.tool_call_id,
                "name": reply.tool_name,
                "input": json_object(reply.text),
            }
        blocks = [block]
        if reply.thinking:
            thought = "".join(reply.thinking)
            signature = self._signature(reply)
            blocks.insert(0, {"type": "thinking", "thinking": thought, "signature": signature})
        return {
            "id": reply.message_id,
            "type": "message",
            "role": "assistant",
            "model": reply.model,
            "content": blocks,
            "stop_reason": self._stop_reason(reply),
            "stop_sequence": None,
            "usage": {**self._input_usage(reply), "output_tokens": reply.completion_tokens},
        }

    def stream(self, reply: Reply, prompt: Prompt) -> StreamScript:
        def event(type_: str, **fields: Any) -> SseEvent:
            return SseEvent(dumps({"type": type_, **fields}), type_)

        message: dict[str, Any] = {
            "id": reply.message_id,
            "type": "message",
            "role": "assistant",
            "model": reply.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {**self._input_usage(reply), "output_tokens": 1},
        }
        if reply.tool_name is None:
            block: dict[str, Any] = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": piece} for piece in reply.pieces]
        else:
            block = {"type": "tool_use", "id": reply.tool_call_id, "name": reply.tool_name}
            block["input"] = {}
            deltas = [{"type": "input_json_delta", "partial_json": p} for p in reply.pieces]
        blocks: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
        if reply.thinking:
            thought = [{"type": "thinking_delta", "thinking": t} for t in reply.thinking]
            signed = {"type": "signature_delta", "signature": self._signature(reply)}
            blocks.append(({"type": "thinking", "thinking": ""}, [*thought, signed]))
        blocks.append((block, deltas))
        events = [event("message_start", message=message)]
        for at, (start, block_deltas) in enumerate(blocks):
            events.append(event("content_block_start", index=at, content_block=start))
            if at == 0:
                events.append(event("ping"))
            events += [event("content_block_delta", index=at, delta=d) for d in block_deltas]
            events.append(event("content_block_stop", index=at))
        content_index = 3  # the first block's first delta, after the start and the ping
        finish_index = len(events)
        events.append(
            event(
                "message_delta",
                delta={"stop_reason": self._stop_reason(reply), "stop_sequence": None},
                usage={"output_tokens": reply.completion_tokens},
            )
        )
        events.append(event("message_stop"))
        return StreamScript(events, finish_index, len(events) - 1, content_index)

    def malformed(self, reply: Reply) -> SseEvent:
        return SseEvent('{"type":"content_block_delta","index":0,"delta":{', "content_block_delta")

    def error_event(self) -> SseEvent:
        error = {"type": "overloaded_error", "message": "Overloaded"}
        return SseEvent(dumps({"type": "error", "error": error}), "error")

    def error(self, behavior: Behavior, prompt: Prompt, request_id: str) -> ErrorResponse:
        model = prompt.model
        tokens = prompt.prompt_tokens
        status, type_, message = {
            Kind.RATE_LIMITED: (
                429,
                "rate_limit_error",
                "Number of request tokens has exceeded your per-minute rate limit.",
            ),
            # Anthropic reports an exhausted balance as a billing error, not a 429.
            Kind.INSUFFICIENT_QUOTA: (
                402,
                "billing_error",
                "Your credit balance is too low to access the Anthropic API.",
            ),
            Kind.UNAUTHORIZED: (401, "authentication_error", "invalid x-api-key"),
            Kind.FORBIDDEN: (
                403,
                "permission_error",
                "Your API key does not have permission to use the specified resource.",
            ),
            Kind.CONTENT_POLICY: (
                400,
                "invalid_request_error",
                "Output blocked by content filtering policy.",
            ),
            Kind.CONTEXT_LENGTH_EXCEEDED: (
                400,
                "invalid_request_error",
                f"prompt is too long: {max(tokens, 200001)} tokens > 200000 maximum",
            ),
            Kind.MODEL_NOT_FOUND: (404, "not_found_error", f"model: {model}"),
            Kind.INVALID_REQUEST: (
                400,
                "invalid_request_error",
                "tools.0.custom.input_schema: JSON schema is invalid. It must match JSON Schema "
                "draft 2020-12.",
            ),
            Kind.NOT_STARTED: (503, "overloaded_error", "Overloaded; the request was not started."),
        }.get(behavior.kind, (500, "", ""))
        status = behavior.status or status
        if behavior.kind is Kind.SERVER_ERROR:
            type_ = "overloaded_error" if status in (503, 529) else "api_error"
            message = "Overloaded" if status in (503, 529) else server_error_message(status)
        body = {
            "type": "error",
            "error": {"type": type_, "message": behavior.message or message},
            "request_id": request_id,
        }
        return ErrorResponse(status, body, error_headers(behavior))

    def bad_request(
        self, message: str, request_id: str, *, code: str | None = None
    ) -> ErrorResponse:
        # Anthropic's errors carry a type, no code.
        error = {"type": "invalid_request_error", "message": message}
        return ErrorResponse(400, {"type": "error", "error": error, "request_id": request_id}, {})


ANTHROPIC: Dialect = _Anthropic()
