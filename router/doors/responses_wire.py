"""The Responses door's answers on its wire: the core's canonical answers (chat completions
and their chunks) as OpenAI's response object and its stream events (``response.created`` …
``response.completed``; a failure after the stream committed is ``response.failed``, never a
silent end). Errors before a commit are OpenAI's error object, as the chat door's.

Pure: a completion, the relay's bytes or an error in, bytes out.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Mapping
from typing import Any, Final

import orjson

from ledger.types import money_str
from router.doors.rerender import Renderer, count, rerendered
from router.doors.responses import ResponsesCall, echoed
from router.drivers.responses import NATIVE_EVENT, NATIVE_RESPONSE
from router.request.call import Completion, StreamingCompletion

__all__ = ["EventRenderer", "answer", "events", "response", "stream_headers", "usage"]

_TERMINAL: Final = frozenset({"response.completed", "response.incomplete", "response.failed"})
# Why an answer stopped short, as Responses says it (`incomplete_details.reason`).
_INCOMPLETE: Final = {"length": "max_output_tokens", "content_filter": "content_filter"}


def answer(call: ResponsesCall, completion: Completion) -> tuple[bytes, dict[str, str]]:
    """A buffered answer: the response object, and the headers saying where it was served."""
    headers = {
        "x-waybill-endpoint": completion.endpoint,
        "x-waybill-attempts": str(completion.attempts),
    }
    if completion.cost_usd is not None:
        headers["x-waybill-cost-usd"] = money_str(completion.cost_usd)
    native = completion.response.get(NATIVE_RESPONSE)
    if isinstance(native, dict):  # served natively: the provider's own object, its id
        return orjson.dumps(native), headers
    return orjson.dumps(response(call, completion.response, completion.request_id)), headers


def stream_headers(started: StreamingCompletion) -> dict[str, str]:
    return {
        "x-waybill-endpoint": started.endpoint,
        "x-waybill-attempts": str(started.attempts),
        "cache-control": "no-cache",
    }


def response_id(request_id: str) -> str:
    """A translated answer's id: the request's own (no provider holds the response)."""
    return f"resp_{request_id.removeprefix('req_')}"


def response(call: ResponsesCall, completion: Mapping[str, Any], request_id: str) -> dict[str, Any]:
    """A canonical chat completion as OpenAI's response object."""
    choice = (completion.get("choices") or [{}])[0]
    said = choice.get("message") or {}
    suffix = request_id.removeprefix("req_")
    output: list[dict[str, Any]] = []
    content = _content(said)
    if content:
        output.append(_message_item(f"msg_{suffix}", content, "completed"))
    for index, tool_call in enumerate(said.get("tool_calls") or ()):
        function = tool_call.get("function") or {}
        output.append(
            _function_item(
                f"fc_{suffix}_{index}",
                tool_call.get("id"),
                function.get("name"),
                function.get("arguments") or "",
                "completed",
            )
        )
    created = completion.get("created")
    return _shell(
        call,
        response_id(request_id),
        created if isinstance(created, int) else int(time.time()),
        completion.get("model"),
        output,
        choice.get("finish_reason"),
        usage(completion.get("usage")),
    )


def _shell(
    call: ResponsesCall,
    rid: str,
    created: int,
    model: object,
    output: list[dict[str, Any]],
    finish: object,
    counted: dict[str, Any] | None,
    *,
    status: str | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    reason = _INCOMPLETE.get(str(finish)) if finish is not None else None
    if status is None:
        status = "incomplete" if reason else "completed"
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": reason} if reason and status == "incomplete" else None,
        "model": model,
        "output": output,
        "usage": counted,
        **echoed(call),
        "store": False,  # translated: no provider keeps it (module docstring of the door)
    }


def _content(said: Mapping[str, Any]) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    if said.get("content"):
        parts.append(_text_part(said["content"]))
    if said.get("refusal"):
        parts.append({"type": "refusal", "refusal": said["refusal"]})
    return parts


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, content: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _function_item(
    item_id: str, call_id: object, name: object, arguments: str, status: str
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def usage(raw: object) -> dict[str, Any] | None:
    """Canonical usage as Responses counts it: cached tokens inside the input, reasoning
    tokens inside the output, each named beside its count."""
    if not isinstance(raw, dict):
        return None
    prompt_details = raw.get("prompt_tokens_details")
    completion_details = raw.get("completion_tokens_details")
    cached = prompt_details.get("cached_tokens") if isinstance(prompt_details, dict) else None
    if cached is None:
        cached = raw.get("cache_read_input_tokens")
    reasoning = (
        completion_details.get("reasoning_tokens") if isinstance(completion_details, dict) else None
    )
    input_tokens = count(raw.get("prompt_tokens"))
    output_tokens = count(raw.get("completion_tokens"))
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": count(cached)},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": count(reasoning)},
        "total_tokens": input_tokens + output_tokens,
    }


# --- streams ---


def events(call: ResponsesCall, started: StreamingCompletion) -> AsyncGenerator[bytes, None]:
    """The committed stream's canonical SSE (the relay's bytes: ``data:`` frames, then
    ``[DONE]`` or the gateway's in-band error) as the Responses events."""
    return rerendered(started, EventRenderer(call, started.request_id))


class EventRenderer(Renderer):
    """Canonical chunks in, Responses events out, keeping the open output item: a chunk of
    another kind (text, a tool call by its index) closes it and opens the next."""

    def __init__(self, call: ResponsesCall, request_id: str) -> None:
        self._call = call
        self._suffix = request_id.removeprefix("req_")
        self._id = response_id(request_id)
        self._created = int(time.time())
        self._model: object = None
        self._sequence = 0
        self._started = False
        self._ended = False
        self._output: list[dict[str, Any]] = []
        self._open: tuple[str, int] | None = None  # ("text", 0) or ("tool", call index)
        self._text = ""
        self._finish: object = None
        self._usage: dict[str, Any] | None = None
        self._native_seen = False

    def chunk(self, chunk: Mapping[str, Any]) -> bytes:
        if "error" in chunk and "choices" not in chunk:
            return self.failed(chunk["error"])
        native = chunk.get(NATIVE_EVENT)
        if isinstance(native, dict):
            return self._native(native)
        out = self._start(chunk)
        if chunk.get("usage"):
            self._usage = usage(chunk["usage"])
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            out += self._delta(choice.get("delta") or {})
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return out

    def _native(self, event: Mapping[str, Any]) -> bytes:
        """A native stream's event, as the provider sent it (its id, its numbering)."""
        self._started = self._native_seen = True
        kind = str(event.get("type"))
        shell = event.get("response")
        if isinstance(shell, dict) and isinstance(shell.get("id"), str):
            self._id, self._model = shell["id"], shell.get("model")
        number = event.get("sequence_number")
        if isinstance(number, int):
            self._sequence = number + 1
        if kind in _TERMINAL:
            self._ended = True
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"

    def end(self) -> bytes:
        """The stream's end: the open item closed, then ``response.completed`` (or
        ``response.incomplete`` where the answer stopped short)."""
        if self._ended:
            return b""
        if self._native_seen:  # a native stream ends with the provider's own last event
            return self.unfinished()
        out = self._start({}) + self._close()
        self._ended = True
        shell = self._response(None)
        kind = "response.incomplete" if shell["status"] == "incomplete" else "response.completed"
        return out + self._event(kind, {"response": shell})

    def unfinished(self) -> bytes:
        """A stream whose body ended with neither ``[DONE]`` nor an error (never expected:
        the relay ends every stream with one): said as a failure, never a silent end."""
        if self._ended:
            return b""
        return self.failed({"code": "upstream_error", "message": "the stream ended early"})

    def failed(self, error: Mapping[str, Any]) -> bytes:
        """The gateway's in-band error after the stream committed: ``response.failed``."""
        if self._ended:
            return b""
        out = self._start({})
        self._ended = True
        detail = {"code": error.get("code"), "message": error.get("message")}
        shell = self._response(detail, status="failed")
        return out + self._event("response.failed", {"response": shell})

    def _response(
        self, error: dict[str, Any] | None, *, status: str | None = None
    ) -> dict[str, Any]:
        return _shell(
            self._call,
            self._id,
            self._created,
            self._model,
            list(self._output),
            self._finish,
            self._usage,
            status=status,
            error=error,
        )

    def _event(self, kind: str, data: Mapping[str, Any]) -> bytes:
        body = {"type": kind, "sequence_number": self._sequence, **data}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"

    def _start(self, chunk: Mapping[str, Any]) -> bytes:
        if self._started:
            return b""
        self._started = True
        self._model = chunk.get("model")
        shell = self._response(None, status="in_progress")
        shell["usage"] = None
        return self._event("response.created", {"response": shell}) + self._event(
            "response.in_progress", {"response": shell}
        )

    def _delta(self, delta: Mapping[str, Any]) -> bytes:
        out = b""
        text = delta.get("content")
        if isinstance(text, str) and text:
            if self._open != ("text", 0):
                out += self._close() + self._open_text()
            self._text += text
            out += self._event(
                "response.output_text.delta",
                {
                    "item_id": self._item()["id"],
                    "output_index": len(self._output) - 1,
                    "content_index": 0,
                    "delta": text,
                    "logprobs": [],
                },
            )
        for tool_call in delta.get("tool_calls") or ():
            index = tool_call.get("index", 0)
            function = tool_call.get("function") or {}
            if self._open != ("tool", index):
                out += self._close()
                item = _function_item(
                    f"fc_{self._suffix}_{index}",
                    tool_call.get("id"),
                    function.get("name"),
                    "",
                    "in_progress",
                )
                self._output.append(item)
                self._open = ("tool", index)
                out += self._added(item)
            arguments = function.get("arguments")
            if arguments:
                item = self._item()
                item["arguments"] += arguments
                out += self._event(
                    "response.function_call_arguments.delta",
                    {
                        "item_id": item["id"],
                        "output_index": len(self._output) - 1,
                        "delta": arguments,
                    },
                )
        return out

    def _item(self) -> dict[str, Any]:
        return self._output[-1]

    def _added(self, item: Mapping[str, Any]) -> bytes:
        return self._event(
            "response.output_item.added",
            {"output_index": len(self._output) - 1, "item": dict(item)},
        )

    def _open_text(self) -> bytes:
        item = _message_item(f"msg_{self._suffix}_{len(self._output)}", [], "in_progress")
        self._output.append(item)
        self._open, self._text = ("text", 0), ""
        where = {"item_id": item["id"], "output_index": len(self._output) - 1, "content_index": 0}
        return self._added(item) + self._event(
            "response.content_part.added", {**where, "part": _text_part("")}
        )

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        kind, _ = self._open
        self._open = None
        item = self._item()
        index = len(self._output) - 1
        item["status"] = "completed"
        out = b""
        if kind == "text":
            part = _text_part(self._text)
            item["content"] = [part]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out += self._event(
                "response.output_text.done", {**where, "text": self._text, "logprobs": []}
            )
            out += self._event("response.content_part.done", {**where, "part": part})
        else:
            out += self._event(
                "response.function_call_arguments.done",
                {"item_id": item["id"], "output_index": index, "arguments": item["arguments"]},
            )
        return out + self._event(
            "response.output_item.done", {"output_index": index, "item": dict(item)}
        )
