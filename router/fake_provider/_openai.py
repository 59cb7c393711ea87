"""The OpenAI chat completions dialect: bodies, chunk streams and error JSON as OpenAI sends
them (`{"error": {"message", "type", "param", "code"}}`, `x-request-id`).

Billed as OpenAI bills: `n` choices, each with its own completion tokens, the usage their
sum; reasoning tokens, and an answer asked for as audio (`modalities` with "audio", or an
`audio` parameter), inside the completion tokens (`completion_tokens_details`); cached and
audio input inside the prompt tokens (`prompt_tokens_details`), as are images and files,
which are not reported apart. Web search is billed per call and not in the usage."""

from __future__ import annotations

import time
from typing import Any

from router.fake_provider._continuation import Form, Partial, message_text
from router.fake_provider._reply import (
    Choice,
    Dialect,
    ErrorResponse,
    Prompt,
    Reply,
    SseEvent,
    StreamScript,
    dumps,
    error_headers,
    int_or_none,
    prompt_tokens,
    server_error_message,
)
from router.fake_provider.behavior import Behavior, Kind

__all__ = ["OPENAI"]


class _OpenAI(Dialect):
    name = "openai"
    request_id_header = "x-request-id"
    message_id_prefix = "chatcmpl-"

    def parse(self, body: dict[str, Any]) -> Prompt:
        tools = body.get("tools")
        names = tuple(
            str(t["function"].get("name"))
            for t in (tools if isinstance(tools, list) else [])
            if isinstance(t, dict) and isinstance(t.get("function"), dict)
        )
        options = body.get("stream_options")
        limit = int_or_none(body.get("max_completion_tokens"))
        tokens, audio = prompt_tokens(body)
        modalities = body.get("modalities")
        return Prompt(
            model=str(body.get("model") or "fake-model"),
            prompt_tokens=tokens,
            max_tokens=limit if limit is not None else int_or_none(body.get("max_tokens")),
            tool_names=names,
            stream=body.get("stream") is True,
            include_usage=isinstance(options, dict) and options.get("include_usage") is True,
            choices=max(1, int_or_none(body.get("n")) or 1),
            audio_tokens=audio,
            audio_output=body.get("audio") is not None
            or modalities == "audio"
            or (isinstance(modalities, list) and "audio" in modalities),
        )

    def partial(self, body: dict[str, Any]) -> Partial | None:
        messages = body.get("messages")
        last = messages[-1] if isinstance(messages, list) and messages else None
        if not isinstance(last, dict) or last.get("role") != "assistant" or last.get("tool_calls"):
            last = None  # a tool call waiting for its results is no partial answer
        text = message_text(last.get("content")) if last is not None else ""
        if body.get("continue_final_message") is True:
            # vLLM's own complaints about an incomplete request.
            problem = None
            if last is None:
                problem = (
                    "continue_final_message is set but the final message is not the assistant's."
                )
            elif body.get("add_generation_prompt") is not False:
                problem = (
                    "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
                )
            return Partial("continue_final_message", text, problem)
        if last is None:
            return None
        form: Form = "prefix_flag" if last.get("prefix") is True else "assistant_prefill"
        return Partial(form, text)

    @staticmethod
    def _usage(reply: Reply) -> dict[str, Any]:
        return {
            "prompt_tokens": reply.prompt_tokens,
            "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens,
            "prompt_tokens_details": {
                "cached_tokens": reply.cached_tokens,
                "audio_tokens": reply.audio_tokens,
            },
            "completion_tokens_details": {
                "reasoning_tokens": reply.reasoning_tokens,
                "audio_tokens": reply.audio_output_tokens,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        }

    @staticmethod
    def _finish(choice: Choice) -> str:
        return "tool_calls" if choice.finish == "tool" else choice.finish

    def body(self, reply: Reply) -> dict[str, Any]:
        return {
            "id": reply.message_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": reply.model,
            "system_fingerprint": "fp_fake",
            "choices": [
                {
                    "index": index,
                    "message": self._message(reply, choice),
                    "logprobs": None,
                    "finish_reason": self._finish(choice),
                }
                for index, choice in enumerate(reply.choices)
            ],
            "usage": self._usage(reply),
        }

    @staticmethod
    def _message(reply: Reply, choice: Choice) -> dict[str, Any]:
        if reply.tool_name is None:
            return {"role": "assistant", "content": choice.text, "refusal": None}
        call = {
            "id": reply.tool_call_id,
            "type": "function",
            "function": {"name": reply.tool_name, "arguments": choice.text},
        }
        return {"role": "assistant", "content": None, "refusal": None, "tool_calls": [call]}

    def stream(self, reply: Reply, prompt: Prompt) -> StreamScript:
        """Each choice's role chunk, their pieces taken in turns, then each one's finish."""
        created = int(time.time())

        def chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> SseEvent:
            payload: dict[str, Any] = {
                "id": reply.message_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": reply.model,
                "system_fingerprint": "fp_fake",
                "choices": [
                    {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
                ],
            }
            if prompt.include_usage:
                payload["usage"] = None
            return SseEvent(dumps(payload))

        choices = list(enumerate(reply.choices))
        if reply.tool_name is None:
            events = [chunk(i, {"role": "assistant", "content": ""}) for i, _ in choices]
            events += [
                chunk(i, {"content": choice.pieces[step]})
                for step in range(max(len(c.pieces) for c in reply.choices))
                for i, choice in choices
                if step < len(choice.pieces)
            ]
        else:
            start = {
                "index": 0,
                "id": reply.tool_call_id,
                "type": "function",
                "function": {"name": reply.tool_name, "arguments": ""},
            }
            role = {"role": "assistant", "content": None, "tool_calls": [start]}
            events = [chunk(i, role) for i, _ in choices]
            events += [
                chunk(i, {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
                for piece in reply.pieces
                for i, _ in choices
            ]
        finish_index = len(events)
        events += [chunk(i, {}, self._finish(choice)) for i, choice in choices]
        if prompt.include_usage:
            usage = {
                "id": reply.message_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": reply.model,
                "system_fingerprint": "fp_fake",
                "choices": [],
                "usage": self._usage(reply),
            }
            events.append(SseEvent(dumps(usage)))
        events.append(SseEvent("[DONE]"))
        return StreamScript(events, finish_index, len(events) - 1, content_index=len(choices))

    def malformed(self, reply: Reply) -> SseEvent:
        return SseEvent('{"id":"' + reply.message_id + '","object":"chat.completion.chunk",')

    def error_event(self) -> SseEvent:
        error = {
            "message": "The server had an error while processing your request.",
            "type": "server_error",
            "param": None,
            "code": None,
        }
        return SseEvent(dumps({"error": error}))

    def error(self, behavior: Behavior, prompt: Prompt, request_id: str) -> ErrorResponse:
        model = prompt.model
        tokens = prompt.prompt_tokens
        status, type_, code, param, message = {
            Kind.RATE_LIMITED: (
                429,
                "requests",
                "rate_limit_exceeded",
                None,
                f"Rate limit reached for {model} on requests per min (RPM): Limit 3, Used 3.",
            ),
            Kind.INSUFFICIENT_QUOTA: (
                429,
                "insufficient_quota",
                "insufficient_quota",
                None,
                "You exceeded your current quota, please check your plan and billing details.",
            ),
            Kind.UNAUTHORIZED: (
                401,
                "invalid_request_error",
                "invalid_api_key",
                None,
                "Incorrect API key provided.",
            ),
            Kind.FORBIDDEN: (
                403,
                "invalid_request_error",
                "permission_denied",
                None,
                "You do not have access to this project.",
            ),
            Kind.CONTENT_POLICY: (
                400,
                "invalid_request_error",
                "content_policy_violation",
                "messages",
                "Your request was rejected as a result of our safety system "
                "(content filter: content management policy).",
            ),
            Kind.CONTEXT_LENGTH_EXCEEDED: (
                400,
                "invalid_request_error",
                "context_length_exceeded",
                "messages",
                "This model's maximum context length is 8192 tokens. However, your messages "
                f"resulted in {max(tokens, 8193)} tokens. "
                "Please reduce the length of the messages.",
            ),
            Kind.MODEL_NOT_FOUND: (
                404,
                "invalid_request_error",
                "model_not_found",
                None,
                f"The model `{model}` does not exist or you do not have access to it.",
            ),
            Kind.INVALID_REQUEST: (
                400,
                "invalid_request_error",
                "invalid_function_parameters",
                "tools[0].function.parameters",
                "Invalid schema for function 'f': In context=(), 'additionalProperties' is "
                "required to be supplied and to be false.",
            ),
            Kind.NOT_STARTED: (
                503,
                "server_error",
                "service_unavailable",
                None,
                "The server is not ready; the request was not started.",
            ),
        }.get(behavior.kind, (500, "server_error", None, None, ""))
        status = behavior.status or status
        message = behavior.message or message or server_error_message(status)
        body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
        return ErrorResponse(status, body, error_headers(behavior))

    def bad_request(
        self, message: str, request_id: str, *, code: str | None = None
    ) -> ErrorResponse:
        error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
        return ErrorResponse(400, {"error": error}, {})


OPENAI: Dialect = _OpenAI()
