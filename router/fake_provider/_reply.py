"""The fake upstream's answer before it has a wire format: the reply, the SSE framing, and
the Dialect interface that the OpenAI and Anthropic modules implement.

Pure values and functions from a parsed request and a Behavior; the server decides when and
how the bytes go out.
"""

from __future__ import annotations

import json
import math
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any, Literal

from router.fake_provider._continuation import Partial, continued
from router.fake_provider.behavior import Behavior, Kind, LineEnding

__all__ = [
    "PART_TOKENS",
    "THINKING_PIECES",
    "Choice",
    "Dialect",
    "ErrorResponse",
    "Prompt",
    "Reply",
    "SseEvent",
    "StreamScript",
    "dumps",
    "error_headers",
    "frame",
    "int_or_none",
    "json_object",
    "make_reply",
    "prompt_tokens",
    "reply_pieces",
    "server_error_message",
]

DEFAULT_CHUNKS = 6
THINKING_PIECES = ("Let", " me", " think.")
"""The thinking block's text, piece by piece, of a request that asks for thinking."""
# What one non-text content part costs in prompt tokens, by type, however large: OpenAI's
# and Anthropic's names. (An image of 1024x1024 at high detail is 765 tokens on gpt-4o.)
PART_TOKENS: dict[str, int] = {
    "image_url": 765,
    "image": 765,
    "input_audio": 400,
    "file": 1500,
    "document": 1500,
}
_FILLER = "héllo 日本 🚀 " * 64  # ~1.3 KiB of multibyte text per large_body piece
_EOL = {"lf": "\n", "crlf": "\r\n", "cr": "\r"}


def dumps(value: Any) -> str:
    # Raw UTF-8, not \u escapes: split_utf8 and byte-size tests depend on real multibyte text.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True)
class SseEvent:
    data: str
    event: str | None = None


def frame(event: SseEvent, line_ending: LineEnding) -> bytes:
    eol = _EOL[line_ending]
    lines = ([f"event: {event.event}"] if event.event else []) + [f"data: {event.data}"]
    return (eol.join(lines) + eol + eol).encode()


@dataclass(frozen=True)
class StreamScript:
    """The events of one stream. Faults cut it before `finish_index` (the event carrying the
    finish / stop reason) or drop `done_index` (`[DONE]` / `message_stop`); content events
    (text or tool-argument pieces) start at `content_index`, after the preamble."""

    events: list[SseEvent]
    finish_index: int
    done_index: int
    content_index: int


@dataclass(frozen=True)
class Prompt:
    """What the fake reads from a request body, whatever the dialect."""

    model: str
    prompt_tokens: int  # text, and each content part at its PART_TOKENS
    max_tokens: int | None  # per choice, reasoning included
    tool_names: tuple[str, ...]
    stream: bool
    include_usage: bool
    choices: int = 1  # OpenAI's `n`
    audio_tokens: int = 0  # of prompt_tokens, from input_audio parts
    audio_output: bool = False  # the answer is spoken (OpenAI's `modalities` / `audio`)
    thinking: bool = False  # Anthropic's `thinking` (enabled or adaptive): a thinking block first


@dataclass(frozen=True)
class Choice:
    """One choice of a reply; every choice is billed its own output tokens."""

    pieces: tuple[str, ...]  # text pieces, or tool-argument pieces for a tool call
    finish: Literal["stop", "length", "tool"]
    completion_tokens: int  # reasoning included, as OpenAI counts them
    reasoning_tokens: int = 0
    audio_tokens: int = 0  # of completion_tokens: the answer, when it is spoken

    @property
    def text(self) -> str:
        return "".join(self.pieces)


@dataclass(frozen=True)
class Reply:
    request_id: str
    message_id: str
    model: str
    choices: tuple[Choice, ...]
    prompt_tokens: int
    tool_name: str | None
    tool_call_id: str
    cached_tokens: int = 0  # of prompt_tokens, served from the cache
    cache_write_tokens: int = 0  # of prompt_tokens, written to the cache for 5 minutes
    cache_write_1h_tokens: int = 0  # of prompt_tokens, written for an hour
    audio_tokens: int = 0  # of prompt_tokens
    thinking: tuple[str, ...] = ()  # the thinking block's pieces (Anthropic's `thinking`)

    # The first choice: the only one of a dialect without `n` (Anthropic).
    @property
    def pieces(self) -> tuple[str, ...]:
        return self.choices[0].pieces

    @property
    def finish(self) -> Literal["stop", "length", "tool"]:
        return self.choices[0].finish

    @property
    def text(self) -> str:
        return self.choices[0].text

    # The usage: the sum over the choices, as OpenAI bills `n`.
    @property
    def completion_tokens(self) -> int:
        return sum(choice.completion_tokens for choice in self.choices)

    @property
    def reasoning_tokens(self) -> int:
        return sum(choice.reasoning_tokens for choice in self.choices)

    @property
    def audio_output_tokens(self) -> int:
        return sum(choice.audio_tokens for choice in self.choices)


@dataclass(frozen=True)
class ErrorResponse:
    status: int
    body: dict[str, Any]
    headers: dict[str, str]


def _text_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(_text_chars(part.get("text")) for part in content if isinstance(part, dict))
    return 0


def _parts(content: Any) -> list[str]:
    if not isinstance(content, list):
        return []
    return [str(part.get("type")) for part in content if isinstance(part, dict)]


def prompt_tokens(body: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, of which audio): a token per 4 characters of text, plus each
    non-text content part at its PART_TOKENS."""
    messages = body.get("messages")
    messages = [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
    chars = _text_chars(body.get("system"))
    chars += sum(_text_chars(m.get("content")) for m in messages)
    parts = [kind for m in messages for kind in _parts(m.get("content"))]
    audio = PART_TOKENS["input_audio"] * parts.count("input_audio")
    return chars // 4 + 1 + sum(PART_TOKENS.get(kind, 0) for kind in parts), audio


def int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def json_object(text: str) -> Any:
    try:
        return json.loads(text or "{}")
    except ValueError:
        return {"raw": text}


def _words(name: str, n: int) -> list[str]:
    base = ["Hello", " from", f" {name}:", " héllo", " 日本", " 🚀"]
    return [(" Hello" if i and i % len(base) == 0 else base[i % len(base)]) for i in range(n)]


def reply_pieces(upstream: str, n_chunks: int = DEFAULT_CHUNKS) -> tuple[str, ...]:
    """The text pieces (one a content event, one a token) of the answer an upstream named
    `upstream` gives with `n_chunks` pieces and no output limit: what a test joins to know
    what a stream cut after k content events delivered."""
    return tuple(_words(upstream, n_chunks))


def _split_arguments(arguments: str) -> list[str]:
    step = max(1, math.ceil(len(arguments) / 3))
    return [arguments[i : i + step] for i in range(0, len(arguments), step)] or [""]


def make_reply(
    upstream: str,
    request_id: str,
    message_id: str,
    prompt: Prompt,
    behavior: Behavior,
    partial: str | None = None,
) -> Reply:
    """The deterministic answer: words naming the upstream, never more tokens than asked.

    A continuation of the partial assistant text `partial` sends what `continued` says (the
    rest of the answer, by default), bounded and billed as any answer: the request's limit
    bounds the pieces sent, the partial text is billed as input (it is in the prompt). A
    tool call is made whole.

    Each of the request's ``n`` choices is its own answer: choice ``i`` wants ``i`` pieces
    more than the first. A choice reasons first (``behavior.reasoning_tokens``), and its
    reasoning counts against the request's limit like any output token: what is left of the
    limit bounds the visible answer (none left: an empty answer, finish ``length``). An
    answer asked for as audio is billed as audio output tokens (it is still sent as text:
    the fake plays the provider's bill, not its voice).
    large_body keeps its size whatever the limit (it exists to overflow the gateway's
    max_response_bytes) but still reports no more output tokens than the request allowed.
    """
    thinking: tuple[str, ...] = ()
    if prompt.thinking:
        # The model thinks first; its thinking is output within the request's limit.
        thinking = THINKING_PIECES
        reasoning = max(behavior.reasoning_tokens, len(thinking))
        behavior = replace(behavior, reasoning_tokens=reasoning)
    cached = min(behavior.cached_tokens, prompt.prompt_tokens)
    uncached = prompt.prompt_tokens - cached
    written_1h = min(behavior.cache_write_1h_tokens, uncached)
    base = Reply(
        request_id=request_id,
        message_id=message_id,
        model=prompt.model,
        choices=(),
        prompt_tokens=prompt.prompt_tokens,
        tool_name=None,
        tool_call_id=f"call_{request_id.removeprefix('req_')}",
        cached_tokens=cached,
        cache_write_1h_tokens=written_1h,
        cache_write_tokens=min(behavior.cache_write_tokens, uncached - written_1h),
        audio_tokens=prompt.audio_tokens,
        thinking=thinking,
    )
    if behavior.kind is Kind.TOOL_CALL:
        name = behavior.tool_name or (prompt.tool_names[0] if prompt.tool_names else "get_weather")
        pieces = tuple(_split_arguments(behavior.tool_arguments))
        call = Choice(pieces, "tool", completion_tokens=len(pieces) + 1)
        return replace(base, choices=(call,) * max(1, prompt.choices), tool_name=name)
    choices = [
        _choice(upstream, prompt, behavior, i, partial) for i in range(max(1, prompt.choices))
    ]
    return replace(base, choices=tuple(choices))


def _choice(
    upstream: str, prompt: Prompt, behavior: Behavior, index: int, partial: str | None
) -> Choice:
    limit = prompt.max_tokens
    reasoning = behavior.reasoning_tokens
    if limit is not None:
        reasoning = min(reasoning, max(limit, 0))
        limit = max(limit, 0) - reasoning
    large = behavior.kind is Kind.LARGE_BODY
    if large:
        words = [_FILLER] * max(1, math.ceil(behavior.min_bytes / len(_FILLER.encode())))
    elif behavior.text is not None:
        words = re.findall(r"\s*\S+", behavior.text) or [behavior.text]
    else:
        wanted = (DEFAULT_CHUNKS if behavior.n_chunks is None else behavior.n_chunks) + index
        words = _words(upstream, wanted)
    if partial is not None:
        words = continued(
            words,
            partial,
            repeat_prefix=behavior.repeat_prefix,
            mismatched=behavior.mismatched_continuation,
        )
    tokens = len(words) if limit is None else min(len(words), limit)
    capped = tokens < len(words)
    if not large:
        words = words[:tokens]
    return Choice(
        pieces=tuple(words),
        finish="length" if capped else "stop",
        completion_tokens=reasoning + tokens + behavior.overbill_output_tokens,
        reasoning_tokens=reasoning,
        audio_tokens=tokens if prompt.audio_output else 0,
    )


class Dialect(ABC):
    """One provider's wire format."""

    name: str
    request_id_header: str
    message_id_prefix: str
    # The wire continues a trailing assistant message whatever the fake's rule (Anthropic).
    continues_natively: bool = False

    @abstractmethod
    def parse(self, body: dict[str, Any]) -> Prompt:
        """What the request asks for."""

    @abstractmethod
    def partial(self, body: dict[str, Any]) -> Partial | None:
        """The partial assistant message the request asks to continue, if any."""

    @abstractmethod
    def body(self, reply: Reply) -> dict[str, Any]:
        """The buffered (non-streaming) response body."""

    @abstractmethod
    def stream(self, reply: Reply, prompt: Prompt) -> StreamScript:
        """The SSE events of a streamed response."""

    @abstractmethod
    def malformed(self, reply: Reply) -> SseEvent:
        """One event whose data is not valid JSON."""

    @abstractmethod
    def error_event(self) -> SseEvent:
        """The event a stream carries when the provider fails after the 200."""

    @abstractmethod
    def error(self, behavior: Behavior, prompt: Prompt, request_id: str) -> ErrorResponse:
        """The provider's error response for an error kind."""

    @abstractmethod
    def bad_request(
        self, message: str, request_id: str, *, code: str | None = None
    ) -> ErrorResponse:
        """A 400 for a request the fake cannot read or will not answer; `code` where the
        dialect's errors carry one."""


def _retry_headers(behavior: Behavior) -> dict[str, str]:
    if behavior.retry_after is None:
        return {}
    return {
        "retry-after": str(math.ceil(behavior.retry_after)),
        "retry-after-ms": str(round(behavior.retry_after * 1000)),
    }


def error_headers(behavior: Behavior) -> dict[str, str]:
    headers = _retry_headers(behavior)
    if behavior.kind is Kind.NOT_STARTED:
        headers["x-execution-state"] = "not-started"
    return headers


def server_error_message(status: int) -> str:
    return {
        408: "Request timed out.",
        502: "Bad gateway.",
        503: "The server is overloaded or not ready yet.",
        504: "Gateway timeout.",
    }.get(status, "The server had an error while processing your request.")
