"""The core's own request: everything the request path reads of one, whatever client API it
came through, and who sent it; and the core's answers (:class:`Completion`,
:class:`StreamingCompletion`), which the door renders for its client.

A door (:mod:`router.doors`) reads its API's wire format and hands the core a :class:`Call`;
the core never sees a door's types. W3C trace context is the same for every door, so its
header is read here (:func:`trace_context`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Final, Literal

from ledger.events import Api, Requirements
from ledger.support.frozen import direct_init
from router.config import RateLimits, Workspace
from router.drivers import NativeBody

__all__ = ["Call", "Caller", "Completion", "StreamingCompletion", "TraceContext", "trace_context"]

_HEX: Final = frozenset("0123456789abcdef")


@direct_init
@dataclass(frozen=True, slots=True)
class Caller:
    """The authenticated key behind a request."""

    key_id: str
    workspace: Workspace
    role: str
    key_budget: tuple[Decimal, Literal["day", "month", "total"]] | None = None  # own budget
    key_version: int | None = None
    """The key's ledger stream's version when it was read unrevoked: the request's first
    append requires the stream still there (None: requires nothing)."""
    key_endpoints: tuple[str, ...] | None = None
    """The key's standing endpoint scope (``keys create --endpoints``); None: unrestricted."""
    key_limits: RateLimits | None = None
    """The key's own rate limits (``KeyCreated.limits``), over its workspace's ``key_limits``;
    None: the workspace's apply."""

    def narrowing(self, requirements: Requirements) -> Requirements:
        """``requirements`` with the key's standing scope, which every request of the key
        is narrowed by (contract §4 "Endpoint scope"), whatever door it came through."""
        if self.key_endpoints is None:
            return requirements
        return requirements.model_copy(update={"key_endpoints": self.key_endpoints})


@direct_init
@dataclass(frozen=True, slots=True)
class TraceContext:
    """The caller's W3C trace context: the request joins its trace (contract §8)."""

    trace_id: str
    parent_span_id: str
    tracestate: str | None = None  # opaque, forwarded only beside the traceparent it came with


@direct_init
@dataclass(frozen=True, slots=True)
class Call:
    """One request as the core reads it.

    ``body`` is the canonical body the drivers translate from: today the OpenAI chat
    completions shape (``messages``, ``tools``, ``response_format``, ...), which a door of
    another API translates its own into. ``requirements`` are what routing needs, inferred
    from the body and narrowed by the caller (contract §3 headers, §4): they carry the
    caller's deadline (``deadline_ms``) and cost limit (``max_cost_usd``) too, which may only
    narrow the group's.
    """

    model_group: str
    body: Mapping[str, Any]
    stream: bool
    include_usage: bool  # a stream: the client asked for the final usage chunk
    max_tokens: int | None  # the output bound the client asked for
    requirements: Requirements
    prompt_sha256: str
    prompt_bytes: int
    message_count: int
    trace: TraceContext | None = None
    api: Api = "openai.chat_completions"  # the door it came through (RequestReceived.api)
    native: NativeBody | None = None
    """The body as it arrived, where the door's API is an upstream dialect too (the
    Anthropic door's Messages body): an endpoint of that dialect is sent it rather than
    ``body``'s translation (``Requirements.native`` names the dialect for the worst case)."""


def trace_context(traceparent: str | None, tracestate: str | None) -> TraceContext | None:
    """The caller's trace context from a W3C ``traceparent`` (and the ``tracestate`` that
    came with it), if the traceparent is well formed; None otherwise."""
    if not traceparent:
        return None
    parts = traceparent.strip().lower().split("-")
    if len(parts) < 4 or len(parts[0]) != 2 or parts[0] == "ff":
        return None
    trace_id, span_id = parts[1], parts[2]
    if len(trace_id) != 32 or len(span_id) != 16 or not set(trace_id + span_id) <= _HEX:
        return None
    if trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    return TraceContext(trace_id, span_id, tracestate)


@direct_init
@dataclass(frozen=True, slots=True)
class Completion:
    """A buffered answer (``response``: the canonical chat completion)."""

    request_id: str
    response: dict[str, Any]
    endpoint: str
    attempts: int
    cost_usd: Decimal | None


@direct_init
@dataclass(frozen=True, slots=True)
class StreamingCompletion:
    """A stream committed to one endpoint: its headers are final, its body is to be sent
    (the canonical chunks as SSE, :mod:`router.request.relay`)."""

    request_id: str
    endpoint: str
    attempts: int
    body: AsyncGenerator[bytes, None]
    write_directly: Callable[[Callable[[bytes], bool]], None]
    """Given the server's writer of the started response's body (``router.serving.server``
    ``BodyWriter``), the body's reads that pass through unchanged go to the client from the
    upstream connection's callback, through it, rather than through ``body`` (whose pieces
    then are the rest, in order): the relay's cost per read is then a parse and a write."""
