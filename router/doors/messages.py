"""The Anthropic Messages door (``POST /v1/messages``): a client's Messages request, read once
at the edge — the body checked against the documented field set (and the fields of the betas
the request names in ``anthropic-beta``), the shared headers read, the requirements inferred
— and turned into the core's request (:func:`to_core`) in both forms: the canonical chat
body the drivers translate from (:mod:`router.doors.messages_translate`, which says field by
field what an OpenAI-dialect endpoint is sent, what is dropped and what excludes it), and the
body as it came (``Call.native``), which an Anthropic endpoint is sent natively. Answers go
back through :mod:`router.doors.messages_wire`; ``count_tokens`` reads its body here too.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import orjson

from ledger.events import Requirements
from router.config import Workspace
from router.doors.chat import MAX_BODY_BYTES
from router.doors.headers import HeaderNarrowing
from router.doors.messages_translate import positive_int, translate, typed
from router.drivers import NativeBody
from router.errors import invalid_request
from router.request.call import Call, trace_context

__all__ = [
    "ANTHROPIC_DIALECT",
    "BETA_FIELDS",
    "MESSAGES_FIELDS",
    "MessagesCall",
    "betas",
    "count_body",
    "estimate_tokens",
    "parse_body",
    "read_body",
    "read_count_body",
    "to_core",
]

ANTHROPIC_DIALECT: Final = "anthropic"
OPENAI_DIALECT: Final = "openai"
MESSAGES_FIELDS: Final = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "system",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
        "metadata",
        "thinking",
        "stream",
        "service_tier",
    }
)
"""The Messages API's documented request fields."""
BETA_FIELDS: Final[Mapping[str, frozenset[str]]] = {
    "context-management-2025-06-27": frozenset({"context_management"}),
    "effort-2025-11-24": frozenset({"output_config"}),
    "structured-outputs-2025-11-13": frozenset({"output_format"}),
    "mcp-client-2025-04-04": frozenset({"mcp_servers"}),
    "code-execution-2025-05-22": frozenset({"container"}),
    "code-execution-2025-08-25": frozenset({"container"}),
}
"""The body fields each beta adds: accepted only when ``anthropic-beta`` names the beta."""
_SYSTEM_TURN_BETA: Final = "mid-conversation-system-2026-04-07"  # Claude Code: role "system"
_BYTES_PER_TOKEN: Final = 1  # as the chat door: a token covers at least one byte of text
_TOKENS_PER_MESSAGE: Final = 8
# Anthropic's server tools act on the provider's side (the request is strict, contract §5);
# its other typed tools (bash, text editor, computer) are run by the client.
_SERVER_TOOL_PREFIXES: Final = ("web_search", "web_fetch", "code_execution", "tool_search")


@dataclass(frozen=True, slots=True)
class MessagesCall:
    """One Messages request as the gateway understands it."""

    native: dict[str, Any]  # the body as it came
    chat_body: dict[str, Any]  # its canonical translation
    model_group: str
    stream: bool
    max_tokens: int
    capabilities: tuple[str, ...]
    prompt_sha256: str
    prompt_bytes: int
    message_count: int
    estimated_input_tokens: int
    image_inputs: int
    file_inputs: int
    unsupported: tuple[tuple[str, str], ...]
    cache_writes: tuple[Literal["5m", "1h"], ...]  # the lifetimes cache_control asks for
    server_side_effects: bool
    beta: str | None  # the anthropic-beta header, forwarded to Anthropic endpoints

    def body_sha256(self) -> str:
        """What an ``Idempotency-Key`` is bound to: the body as sent, sorted-key JSON."""
        return hashlib.sha256(orjson.dumps(self.native, option=orjson.OPT_SORT_KEYS)).hexdigest()

    def requirements(self, workspace: Workspace, headers: HeaderNarrowing) -> Requirements:
        return Requirements(
            kind="chat",
            capabilities=tuple(sorted({*self.capabilities, *headers.capabilities})),
            regions=headers.regions,
            data_class=headers.data_class_for(workspace),
            retention=headers.retention_for(workspace),
            estimated_input_tokens=self.estimated_input_tokens,
            max_output_tokens=self.max_tokens,  # thinking's budget is inside max_tokens
            image_inputs=self.image_inputs,
            file_inputs=self.file_inputs,
            cache_writes=self.cache_writes,
            stream=self.stream,
            allow_failover=headers.allow_failover,
            max_cost_usd=headers.max_cost_usd,
            deadline_ms=headers.deadline_ms,
            allow_unknown_execution=headers.allow_unknown_execution,
            failover_granted=headers.failover_granted,
            endpoints=headers.endpoints,
            prefer_endpoint=headers.prefer_endpoint,
            require_endpoint=headers.require_endpoint,
            server_side_effects=self.server_side_effects,
            native=ANTHROPIC_DIALECT,
            unsupported=self.unsupported,
        )


def to_core(call: MessagesCall, headers: HeaderNarrowing, workspace: Workspace) -> Call:
    """The core's request for a Messages request from ``workspace``'s key."""
    forwarded = {"anthropic-beta": call.beta} if call.beta else {}
    return Call(
        model_group=call.model_group,
        body=call.chat_body,
        stream=call.stream,
        include_usage=True,  # message_delta carries the usage
        max_tokens=call.max_tokens,
        requirements=call.requirements(workspace, headers),
        prompt_sha256=call.prompt_sha256,
        prompt_bytes=call.prompt_bytes,
        message_count=call.message_count,
        trace=trace_context(headers.traceparent, headers.tracestate),
        api="anthropic.messages",
        native=NativeBody(ANTHROPIC_DIALECT, call.native, forwarded),
    )


# What Anthropic's count_tokens reads of a Messages body (the rest, max_tokens included, has
# no bearing on the input's tokens).
_COUNTED_FIELDS: Final = frozenset(
    {
        "messages",
        "system",
        "tools",
        "tool_choice",
        "thinking",
        "context_management",
        "mcp_servers",
        "output_config",
        "output_format",
    }
)
# The gateway's own count, when no Anthropic endpoint gives one: about four bytes of text a
# token (the worst case counts one), an image at Anthropic's largest (~1.15 megapixels).
_ESTIMATE_BYTES_PER_TOKEN: Final = 4
_ESTIMATE_IMAGE_TOKENS: Final = 1600


def read_count_body(raw: bytes, beta: str | None = None) -> MessagesCall:
    """Check a ``/v1/messages/count_tokens`` body: a Messages body without ``max_tokens``
    (the least one is taken for the check alone)."""
    body = _loaded(raw)
    if not isinstance(body, dict):
        raise invalid_request("request body must be a JSON object")
    # The least output bound the check accepts: a count has no output, and the bound is
    # part of what routing weighs (a context window must hold it).
    thinking = body.get("thinking")
    budget = thinking.get("budget_tokens") if isinstance(thinking, dict) else None
    least = budget + 1 if isinstance(budget, int) and not isinstance(budget, bool) else 1
    return parse_body({"max_tokens": least, **body}, beta)


def count_body(call: MessagesCall, upstream_model: str) -> dict[str, Any]:
    """The body an Anthropic endpoint's count_tokens is asked: the fields it reads, natively,
    with the mapping's upstream model."""
    counted = {name: value for name, value in call.native.items() if name in _COUNTED_FIELDS}
    return {"model": upstream_model, **counted}


def estimate_tokens(call: MessagesCall) -> int:
    """The gateway's estimate of a request's input tokens (never a bound: the worst case's
    is :attr:`MessagesCall.estimated_input_tokens`)."""
    text = math.ceil(call.estimated_input_tokens / _ESTIMATE_BYTES_PER_TOKEN)
    return text + _ESTIMATE_IMAGE_TOKENS * (call.image_inputs + call.file_inputs)


def betas(header: str | None) -> frozenset[str]:
    """The betas an ``anthropic-beta`` header names (comma-separated)."""
    if not header:
        return frozenset()
    return frozenset(part.strip() for part in header.split(",") if part.strip())


def read_body(raw: bytes, beta: str | None = None) -> MessagesCall:
    """Check a ``/v1/messages`` body as received (:func:`parse_body`)."""
    return parse_body(_loaded(raw), beta)


def _loaded(raw: bytes) -> object:
    if len(raw) > MAX_BODY_BYTES:
        raise invalid_request(f"request body over {MAX_BODY_BYTES} bytes", status=413)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise invalid_request("request body is not valid JSON") from None


def parse_body(body: object, beta: str | None = None) -> MessagesCall:
    """Check a ``/v1/messages`` body (parsed JSON); a 400 names the first offending field.
    ``beta`` is the request's ``anthropic-beta`` header."""
    if not isinstance(body, dict):
        raise invalid_request("request body must be a JSON object")
    named = betas(beta)
    allowed = MESSAGES_FIELDS.union(*(BETA_FIELDS.get(b, frozenset()) for b in named))
    for name in body:
        if name not in allowed:
            raise invalid_request(
                f"'{name}' is not a Messages API field, nor one of a beta the request "
                "names in anthropic-beta",
                param=name,
            )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_request("'model' must be a non-empty string", param="model")
    max_tokens = positive_int(body.get("max_tokens"), "max_tokens", required=True)
    assert max_tokens is not None
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid_request("'messages' must be a non-empty array", param="messages")
    stream = typed(body, "stream", bool, False)
    chat, reading, tools = translate(
        body, max_tokens=max_tokens, stream=stream, system_turns=_SYSTEM_TURN_BETA in named
    )
    system = body.get("system")
    prompt = orjson.dumps({"system": system, "messages": messages}, option=orjson.OPT_SORT_KEYS)
    text_bytes = len(prompt) - reading.binary_bytes
    if tools:
        text_bytes += len(orjson.dumps(tools))
    estimate = math.ceil(text_bytes / _BYTES_PER_TOKEN) + _TOKENS_PER_MESSAGE * len(messages)
    capabilities = {"text"}
    if tools:
        capabilities.add("tools")
    if reading.images:
        capabilities.add("vision")
    if stream:
        capabilities.add("stream")
    if "response_format" in chat:
        capabilities.add("json_schema")
    gap = reading.openai_gap
    return MessagesCall(
        native=body,
        chat_body=chat,
        model_group=model,
        stream=stream,
        max_tokens=max_tokens,
        capabilities=tuple(sorted(capabilities)),
        prompt_sha256=hashlib.sha256(prompt).hexdigest(),
        prompt_bytes=len(prompt),
        message_count=len(messages),
        estimated_input_tokens=estimate,
        image_inputs=reading.images,
        file_inputs=reading.documents,
        unsupported=((OPENAI_DIALECT, gap),) if gap is not None else (),
        cache_writes=tuple(sorted(reading.cache_writes)),  # type: ignore[arg-type]
        server_side_effects=_server_side_effects(body),
        beta=beta.strip() if beta and beta.strip() else None,
    )


def _server_side_effects(body: Mapping[str, Any]) -> bool:
    if body.get("mcp_servers") is not None or body.get("container") is not None:
        return True
    for tool in body.get("tools") or ():
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind.startswith(_SERVER_TOOL_PREFIXES):
            return True
    return False
