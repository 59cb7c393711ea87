"""The Anthropic door's answers on its wire: the core's canonical answers (chat completions
and their chunks, with the extension fields the Anthropic driver adds for what the chat shape
cannot hold: ``router/drivers/anthropic.py``) as Anthropic's message object and SSE events,
and errors as Anthropic's error object, Waybill's own ``code`` kept inside it.

Pure: a completion, the relay's bytes or a :class:`router.errors.GatewayError` in, bytes out.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from typing import Any, Final

import orjson

from ledger.types import money_str
from router.doors.rerender import Renderer, count, rerendered
from router.errors import ERRORS, GatewayError
from router.request.call import Completion, StreamingCompletion

__all__ = [
    "EventRenderer",
    "answer",
    "error_body",
    "error_status",
    "events",
    "message",
    "stream_headers",
]

_STOP_REASON: Final = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}
# A Waybill status as Anthropic's (type, status): its documented types, the overloaded 529
# for the gateway's 503s (nothing could take the request now), the rest as they are.
_ERRORS: Final[Mapping[int, tuple[str, int]]] = {
    400: ("invalid_request_error", 400),
    401: ("authentication_error", 401),
    402: ("billing_error", 402),
    403: ("permission_error", 403),
    404: ("not_found_error", 404),
    405: ("invalid_request_error", 405),
    409: ("invalid_request_error", 409),
    413: ("request_too_large", 413),
    422: ("invalid_request_error", 422),
    429: ("rate_limit_error", 429),
    431: ("invalid_request_error", 431),
    503: ("overloaded_error", 529),
    504: ("timeout_error", 504),
}


def error_status(error: GatewayError) -> int:
    """The HTTP status the door answers ``error`` with."""
    return _ERRORS.get(error.status, ("api_error", error.status))[1]


def error_body(error: GatewayError, request_id: str | None) -> dict[str, Any]:
    """Anthropic's error object; Waybill's error code under ``error.code``, the attempts and
    the offending ``param`` beside it (contract §3 "The Anthropic door")."""
    kind = _ERRORS.get(error.status, ("api_error", error.status))[0]
    inner: dict[str, Any] = {"type": kind, "message": error.message, "code": error.code}
    if error.param is not None:
        inner["param"] = error.param
    if error.attempts:
        inner["attempts"] = [a.as_json() for a in error.attempts]
    return {"type": "error", "error": inner, "request_id": request_id}


def answer(completion: Completion) -> tuple[bytes, dict[str, str]]:
    """A buffered answer: the message object, and the headers saying where it was served."""
    headers = {
        "x-waybill-endpoint": completion.endpoint,
        "x-waybill-attempts": str(completion.attempts),
    }
    if completion.cost_usd is not None:
        headers["x-waybill-cost-usd"] = money_str(completion.cost_usd)
    return orjson.dumps(message(completion.response, completion.request_id)), headers


def stream_headers(started: StreamingCompletion) -> dict[str, str]:
    return {
        "x-waybill-endpoint": started.endpoint,
        "x-waybill-attempts": str(started.attempts),
        "cache-control": "no-cache",
    }


def message(completion: Mapping[str, Any], request_id: str) -> dict[str, Any]:
    """A canonical chat completion as Anthropic's message object."""
    choices = completion.get("choices") or [{}]
    choice = choices[0]
    said = choice.get("message") or {}
    content: list[dict[str, Any]] = list(said.get("thinking_blocks") or ())
    if said.get("content"):
        content.append({"type": "text", "text": said["content"]})
    for call in said.get("tool_calls") or ():
        function = call.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id"),
                "name": function.get("name"),
                "input": _arguments(function.get("arguments")),
            }
        )
    stop_sequence = choice.get("stop_sequence")
    return {
        "id": _message_id(completion.get("id"), request_id),
        "type": "message",
        "role": "assistant",
        "model": completion.get("model"),
        "content": content,
        "stop_reason": _stop_reason(choice.get("finish_reason"), stop_sequence),
        "stop_sequence": stop_sequence,
        "usage": usage(completion.get("usage")),
    }


def usage(raw: object) -> dict[str, int]:
    """Canonical usage as Anthropic counts it: ``input_tokens`` without the tokens read from
    or written to the cache, which are counted beside it."""
    raw = raw if isinstance(raw, dict) else {}
    details = raw.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    read = count(raw.get("cache_read_input_tokens", cached))
    written = count(raw.get("cache_creation_input_tokens"))
    return {
        "input_tokens": max(0, count(raw.get("prompt_tokens")) - read - written),
        "output_tokens": count(raw.get("completion_tokens")),
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": read,
    }


def _message_id(upstream: object, request_id: str) -> str:
    if isinstance(upstream, str) and upstream.startswith("msg_"):
        return upstream
    return f"msg_{request_id.removeprefix('req_')}"


def _stop_reason(finish: object, stop_sequence: object) -> str | None:
    if finish is None:
        return None
    if isinstance(stop_sequence, str):
        return "stop_sequence"
    return _STOP_REASON.get(str(finish), "end_turn")


def _arguments(arguments: object) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = orjson.loads(arguments) if isinstance(arguments, str | bytes) else {}
    except orjson.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


# --- streams ---


def events(started: StreamingCompletion) -> AsyncGenerator[bytes, None]:
    """The committed stream's canonical SSE (the relay's bytes: ``data:`` frames, then
    ``[DONE]`` or the gateway's in-band error) as Anthropic's events."""
    return rerendered(started, EventRenderer(started.request_id))


def _event(kind: str, data: Mapping[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class EventRenderer(Renderer):
    """Canonical chunks in, Anthropic events out, keeping the open content block: a chunk of
    another kind (text, thinking, a tool call by its index) closes it and opens the next."""

    def __init__(self, request_id: str) -> None:
        self._request_id = request_id
        self._started = False
        self._index = -1
        self._open: tuple[str, int] | None = None  # (kind, tool call index)
        self._signed = False  # the open thinking block has its signature: the next is new
        self._finish: str | None = None
        self._stop_sequence: str | None = None
        self._usage: dict[str, int] = usage(None)

    def chunk(self, chunk: Mapping[str, Any]) -> bytes:
        if "error" in chunk and "choices" not in chunk:
            return self.error(chunk["error"])
        out = self._start(chunk)
        if chunk.get("usage"):
            self._usage = usage(chunk["usage"])
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            out += self._delta(choice.get("delta") or {})
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
                if isinstance(choice.get("stop_sequence"), str):
                    self._stop_sequence = choice["stop_sequence"]
        return out

    def end(self) -> bytes:
        """The stream's end: the last block closed, the stop reason and usage, the stop."""
        out = self._start({}) + self._close()
        delta = {
            "stop_reason": _stop_reason(self._finish or "stop", self._stop_sequence),
            "stop_sequence": self._stop_sequence,
        }
        out += _event(
            "message_delta", {"type": "message_delta", "delta": delta, "usage": self._usage}
        )
        return out + _event("message_stop", {"type": "message_stop"})

    def error(self, error: Mapping[str, Any]) -> bytes:
        """The gateway's in-band error after the stream committed: Anthropic's ``error``."""
        status = next((row.status for row in ERRORS if row.code == error.get("code")), 500)
        kind = _ERRORS.get(status, ("api_error", status))[0]
        inner = {"type": kind, "message": error.get("message"), "code": error.get("code")}
        body = {"type": "error", "error": inner, "request_id": error.get("request_id")}
        return _event("error", body)

    def _start(self, chunk: Mapping[str, Any]) -> bytes:
        if self._started:
            return b""
        self._started = True
        start = {
            "type": "message_start",
            "message": {
                "id": _message_id(chunk.get("id"), self._request_id),
                "type": "message",
                "role": "assistant",
                "model": chunk.get("model"),
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": usage(None),
            },
        }
        return _event("message_start", start) + _event("ping", {"type": "ping"})

    def _delta(self, delta: Mapping[str, Any]) -> bytes:
        out = b""
        for piece in delta.get("thinking_blocks") or ():
            out += self._thinking(piece)
        text = delta.get("content")
        if isinstance(text, str) and text:
            out += self._block("text", 0, {"type": "text", "text": ""})
            out += self._block_delta({"type": "text_delta", "text": text})
        for call in delta.get("tool_calls") or ():
            index = call.get("index", 0)
            function = call.get("function") or {}
            if self._open != ("tool_use", index):
                start = {"type": "tool_use", "id": call.get("id"), "name": function.get("name")}
                out += self._block("tool_use", index, {**start, "input": {}})
            arguments = function.get("arguments")
            if arguments:
                out += self._block_delta({"type": "input_json_delta", "partial_json": arguments})
        return out

    def _thinking(self, piece: Mapping[str, Any]) -> bytes:
        if piece.get("type") == "redacted_thinking":
            return self._block("redacted_thinking", -1, dict(piece), fresh=True)
        out = b""
        if self._open != ("thinking", 0) or self._signed:
            out += self._block("thinking", 0, {"type": "thinking", "thinking": ""}, fresh=True)
        if piece.get("thinking"):
            out += self._block_delta({"type": "thinking_delta", "thinking": piece["thinking"]})
        if piece.get("signature"):
            out += self._block_delta({"type": "signature_delta", "signature": piece["signature"]})
            self._signed = True
        return out

    def _block(self, kind: str, key: int, start: dict[str, Any], *, fresh: bool = False) -> bytes:
        """Open a block of ``kind`` unless it is the one open (``fresh``: always)."""
        if self._open == (kind, key) and not fresh:
            return b""
        out = self._close()
        self._index += 1
        self._open, self._signed = (kind, key), False
        body = {"type": "content_block_start", "index": self._index, "content_block": start}
        return out + _event("content_block_start", body)

    def _block_delta(self, delta: dict[str, Any]) -> bytes:
        body = {"type": "content_block_delta", "index": self._index, "delta": delta}
        return _event("content_block_delta", body)

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return _event("content_block_stop", {"type": "content_block_stop", "index": self._index})
