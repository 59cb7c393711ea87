"""What an attempt asks its driver for: the request (the core's canonical body, a resume's
partial answer added, the output bound the worst case reserved for where the provider needs
one) and the binding (the endpoint, its timeouts under the request's deadline, the trace the
upstream joins). Pure.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from otel.ids import attempt_span_id, request_trace_id, upstream_traceparent
from router.config import Defaults, Endpoint
from router.drivers import AttemptBinding, AttemptTimeouts, ChatRequest
from router.request.attempt import AttemptRoute
from router.request.call import Call
from router.request.resume import Seam, continuation_body, native_continuation

__all__ = ["attempt_binding", "chat_request", "server_address"]


def chat_request(call: Call, route: AttemptRoute, seam: Seam | None = None) -> ChatRequest:
    max_tokens = call.max_tokens
    if max_tokens is None and route.driver.requires_max_tokens:
        # The bound the worst case reserved for, not a driver's default.
        max_tokens = route.mapping.max_output_tokens
    body: Mapping[str, Any] = call.body
    native = call.native
    if seam is not None:
        body = continuation_body(body, route.mapping.resume, seam.delivered)
        if native is not None:
            native = native_continuation(native, seam.delivered)
    return ChatRequest(
        body=body,
        upstream_model=route.mapping.model,
        max_tokens=max_tokens,
        stream=call.stream,
        native=native,
        kind="embeddings" if call.requirements.kind == "embeddings" else "chat",
    )


def attempt_binding(
    endpoint: Endpoint,
    route: AttemptRoute,
    attempt_id: str,
    defaults: Defaults,
    remaining_s: float,
    request_id: str,
    call: Call,
) -> AttemptBinding:
    """The attempt's endpoint and timeouts, as of its start, none beyond ``remaining_s`` of
    the request's deadline (which bounds the attempt all the same)."""
    remaining_s = max(0.001, remaining_s)
    if endpoint.timeouts is not None:
        defaults = endpoint.timeouts.over(defaults)  # contract §2: key by key over the policy
    # contract §8: the upstream joins the request's trace (the caller's, if it sent one) as
    # a child of this attempt's span, whose id otel/ derives from the attempt id.
    trace = call.trace
    trace_id = request_trace_id(request_id, trace.trace_id if trace else None)
    return AttemptBinding(
        endpoint=endpoint,
        upstream_model=route.mapping.model,
        attempt_id=attempt_id,
        timeouts=AttemptTimeouts(
            attempt_timeout_s=min(defaults.attempt_timeout_ms / 1000, remaining_s),
            first_token_timeout_s=min(defaults.first_token_timeout_ms / 1000, remaining_s),
            stream_idle_timeout_s=defaults.stream_idle_timeout_ms / 1000,
        ),
        traceparent=upstream_traceparent(trace_id, attempt_span_id(attempt_id)),
        tracestate=trace.tracestate if trace else None,
    )


@functools.lru_cache(maxsize=256)
def server_address(base_url: str) -> tuple[str | None, int]:
    """OpenTelemetry's ``server.address`` and ``server.port`` for an endpoint (cached: the
    same few URLs, parsed on every attempt's start)."""
    parts = urlsplit(base_url)
    if parts.port is not None:
        return parts.hostname, parts.port
    return parts.hostname, 443 if parts.scheme == "https" else 80
