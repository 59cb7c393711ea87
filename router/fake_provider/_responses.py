"""OpenAI's Responses API dialect (``POST /v1/responses``): the response object and its stream
events as OpenAI sends them, errors as the chat dialect's. Billed as the chat dialect bills
(cached input inside the input tokens, reasoning inside the output), under Responses' names.

The fake keeps no state: a ``previous_response_id`` is answered like any request (the tests
read which upstream was asked, not what it remembered)."""

from __future__ import annotations

import time
from typing import Any

from router.fake_provider._continuation import Partial
from router.fake_provider._openai import OPENAI
from router.fake_provider._reply import (
    Dialect,
    ErrorResponse,
    Prompt,
    Reply,
    SseEvent,
    StreamScript,
    dumps,
    int_or_none,
    prompt_tokens,
)
from router.fake_provider.behavior import Behavior

__all__ = ["RESPONSES"]


class _Responses(Dialect):
    name = "openai.responses"
    request_id_header = "x-request-id"
    message_id_prefix = "resp_"

    def parse(self, body: dict[str, Any]) -> Prompt:
        tools = body.get("tools")
        names = tuple(
            str(t.get("name"))
            for t in (tools if isinstance(tools, list) else [])
            if isinstance(t, dict) and t.get("type") == "function"
        )
        given = body.get("input")
        items = [{"role": "user", "content": given}] if isinstance(given, str) else given
        messages = [m for m in items if isinstance(m, dict)] if isinstance(items, list) else []
        counted = {"system": body.get("instructions"), "messages": messages}
        return Prompt(
            model=str(body.get("model") or "fake-model"),
            prompt_tokens=prompt_tokens(counted)[0],
            max_tokens=int_or_none(body.get("max_output_tokens")),
            tool_names=names,
            stream=body.get("stream") is True,
            include_usage=True,
        )

    def partial(self, body: dict[str, Any]) -> Partial | None:
        return None  # the Responses API continues no partial answer

    @staticmethod
    def _usage(reply: Reply) -> dict[str, Any]:
        return {
            "input_tokens": reply.prompt_tokens,
            "input_tokens_details": {"cached_tokens": reply.cached_tokens},
            "output_tokens": reply.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reply.reasoning_tokens},
            "total_tokens": reply.prompt_tokens + reply.completion_tokens,
        }

    def _item(self, reply: Reply, done: bool) -> dict[str, Any]:
        status = "completed" if done else "in_progress"
        suffix = reply.message_id.removeprefix("resp_")
        if reply.tool_name is not None:
            return {
                "type": "function_call",
                "id": f"fc_{suffix}",
                "call_id": reply.tool_call_id,
                "name": reply.tool_name,
                "arguments": reply.text if done else "",
                "status": status,
            }
        content = [_text(reply.text)] if done else []
        return {
            "type": "message",
            "id": f"msg_{suffix}",
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def _response(self, reply: Reply, created: int, *, done: bool) -> dict[str, Any]:
        incomplete = done and reply.finish == "length"
        status = "incomplete" if incomplete else "completed" if done else "in_progress"
        return {
            "id": reply.message_id,
            "object": "response",
            "created_at": created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "model": reply.model,
            "output": [self._item(reply, True)] if done else [],
            "usage": self._usage(reply) if done else None,
            "store": True,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
        }

    def body(self, reply: Reply) -> dict[str, Any]:
        return self._response(reply, int(time.time()), done=True)

    def stream(self, reply: Reply, prompt: Prompt) -> StreamScript:
        created = int(time.time())
        sequence = iter(range(10_000))

        def event(kind: str, **data: Any) -> SseEvent:
            return SseEvent(
                dumps({"type": kind, "sequence_number": next(sequence), **data}), event=kind
            )

        item = self._item(reply, False)
        where = {"item_id": item["id"], "output_index": 0}
        events = [
            event("response.created", response=self._response(reply, created, done=False)),
            event("response.in_progress", response=self._response(reply, created, done=False)),
            event("response.output_item.added", output_index=0, item=item),
        ]
        if reply.tool_name is None:
            events.append(
                event("response.content_part.added", **where, content_index=0, part=_text(""))
            )
            content_index = len(events)
            events += [
                event("response.output_text.delta", **where, content_index=0, delta=piece)
                for piece in reply.pieces
            ]
            events += [
                event("response.output_text.done", **where, content_index=0, text=reply.text),
                event(
                    "response.content_part.done", **where, content_index=0, part=_text(reply.text)
                ),
            ]
        else:
            content_index = len(events)
            events += [
                event("response.function_call_arguments.delta", **where, delta=piece)
                for piece in reply.pieces
            ]
            events.append(
                event("response.function_call_arguments.done", **where, arguments=reply.text)
            )
        events.append(
            event("response.output_item.done", output_index=0, item=self._item(reply, True))
        )
        finish_index = len(events)
        done = self._response(reply, created, done=True)
        kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
        events.append(event(kind, response=done))
        # The Responses stream has no [DONE]: its last event is the end.
        return StreamScript(events, finish_index, finish_index, content_index=content_index)

    def malformed(self, reply: Reply) -> SseEvent:
        return SseEvent('{"type":"response.output_text.delta",', event="response.output_text.delta")

    def error_event(self) -> SseEvent:
        error = {
            "type": "error",
            "code": "server_error",
            "message": "The server had an error while processing your request.",
            "param": None,
        }
        return SseEvent(dumps(error), event="error")

    def error(self, behavior: Behavior, prompt: Prompt, request_id: str) -> ErrorResponse:
        return OPENAI.error(behavior, prompt, request_id)

    def bad_request(
        self, message: str, request_id: str, *, code: str | None = None
    ) -> ErrorResponse:
        return OPENAI.bad_request(message, request_id, code=code)


def _text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


RESPONSES: Dialect = _Responses()
