"""What the fake upstream does with one inference request: a frozen, JSON-friendly Behavior.

A Behavior names one outcome (`kind`) plus the few parameters that shape it. The same value
is built in-process (`Behavior.rate_limited(retry_after=2)`) or from JSON sent to the control
API (`{"kind": "rate_limited", "retry_after": 2}`).

Stream events are counted from the first SSE event the server writes, role preamble
included: an OpenAI stream is `role, content x n, finish, [usage], [DONE]`; an Anthropic one
is `message_start, content_block_start, ping, content_block_delta x n, content_block_stop,
message_delta, message_stop`. `after_content` counts the content events alone (the
`content` chunks, the `content_block_delta`s), whatever the dialect's preamble: a stream cut
after `after_content=k` has delivered the reply's first k pieces.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal, cast

__all__ = ["ERROR_KINDS", "Behavior", "Kind", "LineEnding"]

LineEnding = Literal["lf", "crlf", "cr"]


class Kind(StrEnum):
    """Every outcome the fake upstream can produce."""

    OK = "ok"
    TOOL_CALL = "tool_call"
    # HTTP error responses, with the provider's error body.
    RATE_LIMITED = "rate_limited"
    INSUFFICIENT_QUOTA = "insufficient_quota"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    CONTENT_POLICY = "content_policy"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    MODEL_NOT_FOUND = "model_not_found"
    INVALID_REQUEST = "invalid_request"  # a 400 for the client's own error: a bad tool schema
    SERVER_ERROR = "server_error"
    NOT_STARTED = "not_started"
    # Transport and stream faults.
    RESET_BEFORE_BYTES = "reset_before_bytes"
    DISCONNECT_BEFORE_FIRST_EVENT = "disconnect_before_first_event"
    MID_STREAM_DISCONNECT = "mid_stream_disconnect"
    STALL = "stall"
    MALFORMED_EVENT = "malformed_event"
    ERROR_EVENT = "error_event"
    NO_DONE = "no_done"
    LINE_ENDINGS = "line_endings"
    SPLIT_UTF8 = "split_utf8"
    LARGE_BODY = "large_body"


# Kinds answered with an HTTP error status and the provider's JSON error body.
ERROR_KINDS = frozenset(
    {
        Kind.RATE_LIMITED,
        Kind.INSUFFICIENT_QUOTA,
        Kind.UNAUTHORIZED,
        Kind.FORBIDDEN,
        Kind.CONTENT_POLICY,
        Kind.CONTEXT_LENGTH_EXCEEDED,
        Kind.MODEL_NOT_FOUND,
        Kind.INVALID_REQUEST,
        Kind.SERVER_ERROR,
        Kind.NOT_STARTED,
    }
)

_LINE_ENDINGS = ("lf", "crlf", "cr")


@dataclass(frozen=True)
class Behavior:
    """One planned outcome. Parameters a kind does not use are ignored.

    - status, message: error kinds; override the HTTP status / error message.
    - retry_after: seconds; error kinds send `Retry-After` (whole seconds, rounded up)
      and `retry-after-ms`.
    - latency_ms: wait before the response headers (every kind).
    - first_event_delay_ms: streams; wait after the headers before the first event.
    - chunk_delay_ms: streams; wait between events.
    - n_chunks: content pieces in the reply (default 6), capped by the request's max tokens.
    - after_events: mid_stream_disconnect / stall / malformed_event / error_event; how many
      events go out first. For stall, None (and no after_content) means "before the
      headers".
    - after_content: the same kinds; how many content events go out first, after the
      dialect's preamble (with `n`, the choices' content events in the order sent). Never
      with after_events.
    - stall_s: how long a stall lasts before the server closes the connection (None: until
      the client goes away or the server stops).
    - line_ending: SSE line ending, for every streaming kind.
    - one_write: streams; every event in one socket write at the end, as a proxy that
      buffers the stream delivers it (the client then reads them all at once).
    - split_delay_ms: split_utf8; pause between the tiny writes.
    - min_bytes: large_body; the response body is at least this long.
    - tool_name, tool_arguments: tool_call; the function called (default: the first tool
      of the request) and its JSON arguments.
    - reasoning_tokens: replies; each choice reasons this many tokens before it answers,
      within the request's output limit, reported inside the completion tokens
      (`completion_tokens_details.reasoning_tokens`), as OpenAI bills them.
    - cached_tokens: replies; this many prompt tokens (at most all) are reported as served
      from the cache (`prompt_tokens_details.cached_tokens`; Anthropic's
      `cache_read_input_tokens`, beside its `input_tokens`).
    - cache_write_tokens, cache_write_1h_tokens: replies; this many prompt tokens (at most
      what the cache did not serve) are reported as written to the prompt cache for 5
      minutes and for an hour (Anthropic's `cache_creation_input_tokens` and its
      `cache_creation` split, beside its `input_tokens`); an OpenAI answer reports none.
    - overbill_output_tokens: ok and its streams; the usage reports this many output tokens
      more than were sent, whatever the request's bound: a provider whose bill exceeds
      anything the gateway could have reserved.
    - repeat_prefix: continuations; the reply sends the partial assistant text again before
      the continuation (cut where the answer's pieces are cut, billed as output), as an
      upstream that echoes the prefill does.
    - text: ok and its streams; the answer's text instead of the words naming the upstream,
      one piece (a content event, a token) per word with the whitespace before it (for a
      test that needs, say, JSON that satisfies or breaks a schema).
    - mismatched_continuation: continuations; the continuation starts with
      `MISMATCHED_SEAM`, which neither repeats nor continues the partial text (after the
      echo, with repeat_prefix), so a seam cannot be verified.

    A continuation (a request ending with a partial assistant message, in the form the
    fake's `continuation` rule takes) is answered with the rest of the answer; n_chunks is
    the length of the whole answer, the partial text included.
    """

    kind: Kind = Kind.OK
    status: int | None = None
    message: str | None = None
    retry_after: float | None = None
    latency_ms: float = 0.0
    first_event_delay_ms: float = 0.0
    chunk_delay_ms: float = 0.0
    n_chunks: int | None = None
    after_events: int | None = None
    after_content: int | None = None
    stall_s: float | None = None
    line_ending: LineEnding = "lf"
    one_write: bool = False
    split_delay_ms: float = 1.0
    min_bytes: int = 0
    tool_name: str | None = None
    tool_arguments: str = '{"city": "Paris"}'
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    cache_write_1h_tokens: int = 0
    overbill_output_tokens: int = 0
    repeat_prefix: bool = False
    mismatched_continuation: bool = False
    text: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Kind(self.kind))
        if self.status is not None and not 100 <= self.status <= 599:
            raise ValueError(f"status: {self.status} is not an HTTP status")
        if self.line_ending not in _LINE_ENDINGS:
            raise ValueError(f"line_ending: must be one of {', '.join(_LINE_ENDINGS)}")
        for name in ("latency_ms", "first_event_delay_ms", "chunk_delay_ms", "split_delay_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0")
        if self.after_events is not None and self.after_content is not None:
            raise ValueError("after_events, after_content: give one or the other")
        for opt in ("retry_after", "n_chunks", "after_events", "after_content", "stall_s"):
            value = getattr(self, opt)
            if value is not None and value < 0:
                raise ValueError(f"{opt}: must be >= 0")
        counts = (
            "min_bytes",
            "reasoning_tokens",
            "cached_tokens",
            "cache_write_tokens",
            "cache_write_1h_tokens",
            "overbill_output_tokens",
        )
        for count in counts:
            if getattr(self, count) < 0:
                raise ValueError(f"{count}: must be >= 0")

    # JSON

    @classmethod
    def from_json(cls, data: Any) -> Behavior:
        """Build from a JSON object; a bare string is a kind. Raises ValueError."""
        if isinstance(data, str):
            data = {"kind": data}
        if not isinstance(data, dict):
            raise ValueError("a behavior is a JSON object with a 'kind'")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(f"unknown behavior field(s): {', '.join(unknown)}")
        if "kind" not in data:
            raise ValueError("kind: required")
        try:
            kind = Kind(data["kind"])
        except ValueError:
            raise ValueError(f"kind: unknown behavior kind {data['kind']!r}") from None
        try:
            return cls(**{**cast(dict[str, Any], data), "kind": kind})
        except TypeError as exc:
            raise ValueError(str(exc)) from None

    def to_json(self) -> dict[str, Any]:
        """The fields that differ from the defaults, plus `kind`."""
        out: dict[str, Any] = {"kind": str(self.kind)}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "kind" and value != f.default:
                out[f.name] = value
        return out

    # Convenience constructors, one per kind.

    @classmethod
    def ok(
        cls,
        *,
        latency_ms: float = 0.0,
        chunk_delay_ms: float = 0.0,
        n_chunks: int | None = None,
        first_event_delay_ms: float = 0.0,
        reasoning_tokens: int = 0,
        cached_tokens: int = 0,
        cache_write_tokens: int = 0,
        cache_write_1h_tokens: int = 0,
        repeat_prefix: bool = False,
        mismatched_continuation: bool = False,
        text: str | None = None,
    ) -> Behavior:
        return cls(
            Kind.OK,
            text=text,
            latency_ms=latency_ms,
            chunk_delay_ms=chunk_delay_ms,
            n_chunks=n_chunks,
            first_event_delay_ms=first_event_delay_ms,
            reasoning_tokens=reasoning_tokens,
            cached_tokens=cached_tokens,
            cache_write_tokens=cache_write_tokens,
            cache_write_1h_tokens=cache_write_1h_tokens,
            repeat_prefix=repeat_prefix,
            mismatched_continuation=mismatched_continuation,
        )

    @classmethod
    def tool_call(cls, name: str | None = None, arguments: str = '{"city": "Paris"}') -> Behavior:
        return cls(Kind.TOOL_CALL, tool_name=name, tool_arguments=arguments)

    @classmethod
    def rate_limited(cls, retry_after: float | None = None) -> Behavior:
        return cls(Kind.RATE_LIMITED, retry_after=retry_after)

    @classmethod
    def insufficient_quota(cls) -> Behavior:
        return cls(Kind.INSUFFICIENT_QUOTA)

    @classmethod
    def unauthorized(cls) -> Behavior:
        return cls(Kind.UNAUTHORIZED)

    @classmethod
    def forbidden(cls) -> Behavior:
        return cls(Kind.FORBIDDEN)

    @classmethod
    def content_policy(cls, status: int = 400) -> Behavior:
        return cls(Kind.CONTENT_POLICY, status=status)

    @classmethod
    def context_length_exceeded(cls) -> Behavior:
        return cls(Kind.CONTEXT_LENGTH_EXCEEDED)

    @classmethod
    def model_not_found(cls) -> Behavior:
        return cls(Kind.MODEL_NOT_FOUND)

    @classmethod
    def invalid_request(cls, message: str | None = None) -> Behavior:
        return cls(Kind.INVALID_REQUEST, message=message)

    @classmethod
    def server_error(cls, status: int = 500, retry_after: float | None = None) -> Behavior:
        return cls(Kind.SERVER_ERROR, status=status, retry_after=retry_after)

    @classmethod
    def not_started(cls) -> Behavior:
        return cls(Kind.NOT_STARTED)

    @classmethod
    def reset_before_bytes(cls) -> Behavior:
        return cls(Kind.RESET_BEFORE_BYTES)

    @classmethod
    def disconnect_before_first_event(cls) -> Behavior:
        return cls(Kind.DISCONNECT_BEFORE_FIRST_EVENT)

    @classmethod
    def mid_stream_disconnect(
        cls, after_events: int | None = None, *, after_content: int | None = None
    ) -> Behavior:
        """Close the stream after `after_events` events (default 2) or `after_content`
        content events."""
        if after_events is None and after_content is None:
            after_events = 2
        return cls(
            Kind.MID_STREAM_DISCONNECT, after_events=after_events, after_content=after_content
        )

    @classmethod
    def stall(
        cls,
        after_events: int | None = None,
        stall_s: float | None = None,
        *,
        after_content: int | None = None,
    ) -> Behavior:
        """Go silent before the headers, or after `after_events` events or `after_content`
        content events."""
        return cls(
            Kind.STALL, after_events=after_events, stall_s=stall_s, after_content=after_content
        )

    @classmethod
    def malformed_event(
        cls, after_events: int | None = None, *, after_content: int | None = None
    ) -> Behavior:
        if after_events is None and after_content is None:
            after_events = 1
        return cls(Kind.MALFORMED_EVENT, after_events=after_events, after_content=after_content)

    @classmethod
    def error_event(
        cls,
        after_events: int | None = None,
        *,
        after_content: int | None = None,
        one_write: bool = False,
    ) -> Behavior:
        """A 200 stream that reports a provider error in an event and ends there, as an
        overloaded provider does mid-stream; a buffered request gets the usual reply."""
        if after_events is None and after_content is None:
            after_events = 1
        return cls(
            Kind.ERROR_EVENT,
            after_events=after_events,
            after_content=after_content,
            one_write=one_write,
        )

    @classmethod
    def no_done(cls) -> Behavior:
        return cls(Kind.NO_DONE)

    @classmethod
    def line_endings(cls, line_ending: LineEnding) -> Behavior:
        return cls(Kind.LINE_ENDINGS, line_ending=line_ending)

    @classmethod
    def split_utf8(cls, split_delay_ms: float = 1.0) -> Behavior:
        return cls(Kind.SPLIT_UTF8, split_delay_ms=split_delay_ms)

    @classmethod
    def large_body(cls, min_bytes: int) -> Behavior:
        return cls(Kind.LARGE_BODY, min_bytes=min_bytes)
