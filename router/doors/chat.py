"""The OpenAI chat completions door: a client's chat request, read once at the edge — the
body checked, the headers read, the requirements inferred (contract §3 request headers, §4
"infer requirements") — and translated into the core's request (:func:`to_core`).

Everything here is pure: bytes and header values in, a frozen :class:`ChatCall` or a
:class:`router.errors.GatewayError` (400 ``invalid_request``) out. The body is kept as the
client sent it (unknown fields pass through to an OpenAI-compatible upstream); only the
fields the gateway reads are type-checked. This door's body is already the core's
canonical shape, so :func:`to_core` hands it on unchanged, and the core's answers go back as
they are (:func:`answer`, :func:`stream_headers`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

import orjson

from ledger.events import Requirements
from ledger.support.frozen import direct_init
from ledger.types import money_str
from router.config import Limits, Workspace
from router.doors.headers import (
    ALLOW_FAILOVER_VALUES,
    MAX_JSON_INTEGER,
    HeaderNarrowing,
    read_headers,
)
from router.errors import invalid_request
from router.request.call import Call, Completion, StreamingCompletion, trace_context

__all__ = [
    "ALLOW_FAILOVER_VALUES",
    "DEFAULT_LIMITS",
    "MAX_BODY_BYTES",
    "MAX_JSON_INTEGER",
    "ChatCall",
    "HeaderNarrowing",
    "answer",
    "parse_body",
    "read_headers",
    "stream_headers",
    "to_core",
]

MAX_BODY_BYTES: Final = 4 * 1024 * 1024
DEFAULT_LIMITS: Final = Limits()
# Worst-case input (contract §4): a token covers at least one byte of text, so the byte count of
# the messages' text (JSON syntax included, which outweighs the chat template's few tokens
# per message) and of the other fields the model reads as text (tool and function
# definitions, a response format's schema) bounds the input tokens from above. Reservations
# are thus pessimistic for input; the difference is released at settlement.
_BYTES_PER_TOKEN: Final = 1
_TOKENS_PER_MESSAGE: Final = 8
_PROMPT_FIELDS: Final = ("tools", "functions", "response_format")
# Content parts by what bounds their cost. Text parts are text; an image, an audio clip or a
# file is billed for what it holds, not for its bytes here (base64 data), so each is counted
# and priced by the mapping (router/request/worst_case.py). A type not named here is recorded as
# such: no mapping can price it.
_TEXT_PARTS: Final = frozenset({"text", "refusal", "input_text"})
_PART_KINDS: Final = {
    "image_url": "image",
    "input_image": "image",
    "input_audio": "audio",
    "file": "file",
    "input_file": "file",
}
# Tools a client runs itself: the model only asks for a call (OpenAI's `function` and `custom`;
# a tool without a type is a function, as the Anthropic driver reads it). Any other type
# (`web_search`, `file_search`, `code_interpreter`, `mcp`, Anthropic's `web_search_20250305`,
# `code_execution_*`, ...) may act on the provider's side; so may these body fields (OpenAI's
# search, Anthropic's MCP connector). The gateway cannot tell which such effects an attempt
# of unknown outcome had, so a request asking for them is strict (contract §5).
_CLIENT_TOOL_TYPES: Final = frozenset({"function", "custom"})
_SERVER_SIDE_FIELDS: Final = ("web_search_options", "mcp_servers")


@direct_init
@dataclass(frozen=True, slots=True)
class ChatCall:
    """One chat request as the gateway understands it."""

    body: dict[str, Any]
    model_group: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    capabilities: tuple[str, ...]  # inferred from the body
    prompt_sha256: str
    prompt_bytes: int
    message_count: int
    estimated_input_tokens: int
    billed: _Billed
    server_side_effects: bool  # server-side tools or fields: the request is strict

    def body_sha256(self) -> str:
        """The body's hash, sorted-key JSON: what an ``Idempotency-Key`` is bound to. Only
        such requests need it, so it is computed when asked, not for every request."""
        return hashlib.sha256(orjson.dumps(self.body, option=orjson.OPT_SORT_KEYS)).hexdigest()

    def requirements(self, workspace: Workspace, headers: HeaderNarrowing) -> Requirements:
        """Requirements for routing: the body's needs plus the headers' narrowing. Built
        trusted (``Record.trusted``): :func:`parse_body` and the headers' reader have checked
        and typed every value, as validation would."""
        return Requirements.trusted(
            kind="chat",
            estimated_input_tokens=self.estimated_input_tokens,
            max_output_tokens=self.max_tokens,
            choices=self.billed.choices,
            prediction_tokens=self.billed.prediction_tokens,
            image_inputs=self.billed.image_inputs,
            audio_inputs=self.billed.audio_inputs,
            file_inputs=self.billed.file_inputs,
            audio_output=self.billed.audio_output,
            web_search=self.billed.web_search,
            unknown_inputs=self.billed.unknown_inputs,
            stream=self.stream,
            **headers.narrowing(workspace, self.capabilities),
            server_side_effects=self.server_side_effects,
        )


def to_core(call: ChatCall, headers: HeaderNarrowing, workspace: Workspace) -> Call:
    """The core's request for a chat request from ``workspace``'s key."""
    return Call(
        model_group=call.model_group,
        body=call.body,
        stream=call.stream,
        include_usage=call.include_usage,
        max_tokens=call.max_tokens,
        requirements=call.requirements(workspace, headers),
        prompt_sha256=call.prompt_sha256,
        prompt_bytes=call.prompt_bytes,
        message_count=call.message_count,
        # W3C: a tracestate goes with the traceparent it came with, never alone.
        trace=trace_context(headers.traceparent, headers.tracestate),
    )


def answer(completion: Completion) -> tuple[bytes, dict[str, str]]:
    """A buffered answer on this door's wire: the chat completion's JSON, and the headers
    that say where it was served and what it cost (contract §3)."""
    headers = {
        "x-waybill-endpoint": completion.endpoint,
        "x-waybill-attempts": str(completion.attempts),
    }
    if completion.cost_usd is not None:
        headers["x-waybill-cost-usd"] = money_str(completion.cost_usd)
    return orjson.dumps(completion.response), headers


def stream_headers(started: StreamingCompletion) -> dict[str, str]:
    """A committed stream's headers on this door's wire; its body, the core's chunks as
    SSE, goes out as it is."""
    return {
        "x-waybill-endpoint": started.endpoint,
        "x-waybill-attempts": str(started.attempts),
        "cache-control": "no-cache",
    }


@dataclass(slots=True)
class _Parts:
    """The content parts of a request that are not text, counted by kind as they are read."""

    image: int = 0
    audio: int = 0
    file: int = 0
    unknown: set[str] = field(default_factory=set)  # types the gateway does not know
    nbytes: int = 0  # their JSON, not part of the text estimate


class _Billed(NamedTuple):
    """What the request may be billed for beyond its text and output bound. (A tuple: read
    once per request, where a frozen dataclass would cost microseconds to build.)"""

    choices: int
    prediction_tokens: int
    image_inputs: int
    audio_inputs: int
    file_inputs: int
    audio_output: bool
    web_search: bool
    unknown_inputs: tuple[str, ...]


def parse_body(raw: bytes, limits: Limits = DEFAULT_LIMITS) -> ChatCall:
    """Check a ``/v1/chat/completions`` body; a 400 names the first offending field.

    ``limits`` are the config's bounds on what a request may ask for (``limits.max_n``).
    """
    if len(raw) > MAX_BODY_BYTES:
        raise invalid_request(f"request body over {MAX_BODY_BYTES} bytes", status=413)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise invalid_request("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise invalid_request("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_request("'model' must be a non-empty string", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid_request("'messages' must be a non-empty array", param="messages")
    parts = _Parts()
    for index, message in enumerate(messages):
        _check_message(message, index, parts)
    stream = _optional(body, "stream", bool, False)
    max_tokens = _max_tokens(body)
    billed = _billed(body, parts, limits)
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise invalid_request("'stream_options' must be an object", param="stream_options")
        include_usage = _optional(options, "include_usage", bool, False, "stream_options.")
    prompt = orjson.dumps(messages, option=orjson.OPT_SORT_KEYS)
    capabilities = _inferred_capabilities(body, stream=stream, images=parts.image)
    _check_forced_function(body)
    # Each non-text part's JSON appears in `prompt` byte for byte (sorting keys changes no
    # length), so taking it out leaves exactly the text's.
    text_bytes = len(prompt) - parts.nbytes
    for name in _PROMPT_FIELDS:
        value = body.get(name)
        if value:
            text_bytes += len(orjson.dumps(value))
    estimate = math.ceil(text_bytes / _BYTES_PER_TOKEN) + _TOKENS_PER_MESSAGE * len(messages)
    return ChatCall(
        body=body,
        model_group=model,
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        capabilities=capabilities,
        prompt_sha256=hashlib.sha256(prompt).hexdigest(),
        prompt_bytes=len(prompt),
        message_count=len(messages),
        estimated_input_tokens=estimate,
        billed=billed,
        server_side_effects=_server_side_effects(body),
    )


def _check_message(message: object, index: int, parts: _Parts) -> None:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid_request(f"'{where}' must be an object", param=where)
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise invalid_request(f"'{where}.role' must be a non-empty string", param=where)
    if message.get("audio") is not None:
        # An assistant turn that refers to its earlier spoken answer (`audio: {"id": ...}`):
        # the provider reads that audio back as input.
        parts.audio += 1
    content = message.get("content")
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise invalid_request(f"'{where}.content' must be a string or an array", param=where)
    for part in content:
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise invalid_request(f"'{where}.content' parts must be typed objects", param=where)
        kind = part["type"]
        if kind in _TEXT_PARTS:
            continue
        parts.nbytes += len(orjson.dumps(part))
        match _PART_KINDS.get(kind):
            case "image":
                parts.image += 1
            case "audio":
                parts.audio += 1
            case "file":
                parts.file += 1
            case _:
                parts.unknown.add(kind)


def _billed(body: Mapping[str, Any], parts: _Parts, limits: Limits) -> _Billed:
    """The request's billable dimensions beyond text; ``n`` above ``limits.max_n`` is a 400."""
    modalities = body.get("modalities")
    prediction = body.get("prediction")
    return _Billed(
        choices=_choices(body.get("n"), limits.max_n),
        # A token covers at least one byte, so the prediction's JSON bounds its tokens.
        prediction_tokens=len(orjson.dumps(prediction)) if prediction is not None else 0,
        image_inputs=parts.image,
        audio_inputs=parts.audio,
        file_inputs=parts.file,
        audio_output=body.get("audio") is not None
        or modalities == "audio"
        or (isinstance(modalities, list) and "audio" in modalities),
        web_search=body.get("web_search_options") is not None,
        unknown_inputs=tuple(sorted(parts.unknown)) if parts.unknown else (),
    )


def _server_side_effects(body: Mapping[str, Any]) -> bool:
    """Whether the request asks the provider for effects of its own (``_CLIENT_TOOL_TYPES``).
    ``tools`` is known to be an array or absent (``_inferred_capabilities``)."""
    if any(body.get(name) is not None for name in _SERVER_SIDE_FIELDS):
        return True
    tools = body.get("tools") or ()
    return any(
        isinstance(tool, dict) and tool.get("type", "function") not in _CLIENT_TOOL_TYPES
        for tool in tools
    )


def _choices(value: object, max_n: int) -> int:
    if value is None:
        return 1
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON has numbers, not ints: 2.0 is the integer 2
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= max_n:
        raise invalid_request(
            f"'n' must be an integer from 1 to {max_n} (this gateway's limits.max_n)", param="n"
        )
    return value


def _optional(
    source: Mapping[str, Any], name: str, kind: type, default: Any, prefix: str = ""
) -> Any:
    value = source.get(name)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise invalid_request(
            f"'{prefix}{name}' must be a {kind.__name__}", param=f"{prefix}{name}"
        )
    return value


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    """The output bound. Both names at once is refused, as OpenAI refuses it: which one an
    upstream would honour is not ours to guess, and the bound is what the budget reserves."""
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise invalid_request(
            "'max_tokens' and 'max_completion_tokens' may not both be set; "
            "'max_completion_tokens' bounds every output token, reasoning included",
            param="max_tokens",
        )
    found: int | None = None
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # JSON has numbers, not ints: 2799.0 is the integer 2799
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not 0 < value <= MAX_JSON_INTEGER
        ):
            raise invalid_request(
                f"'{name}' must be an integer from 1 to {MAX_JSON_INTEGER}", param=name
            )
        found = value
    return found


def _inferred_capabilities(
    body: Mapping[str, Any], *, stream: bool, images: int
) -> tuple[str, ...]:
    capabilities = {"text"}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise invalid_request("'tools' must be an array", param="tools")
        if tools:
            capabilities.add("tools")
    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict):
            raise invalid_request("'response_format' must be an object", param="response_format")
        if response_format.get("type") == "json_schema":
            capabilities.add("json_schema")
    if images:
        capabilities.add("vision")
    if stream:
        capabilities.add("stream")
    return tuple(sorted(capabilities))


def _check_forced_function(body: Mapping[str, Any]) -> None:
    """A ``tool_choice`` (or the legacy ``function_call``) that forces a function the request
    does not declare is the client's own mistake: a 400 before anything is reserved, never an
    upstream's 400 counted against a breaker other tenants share. Shapes the gateway does not
    know pass through to the upstream as they are."""
    forced = body.get("tool_choice")
    if isinstance(forced, dict) and forced.get("type") == "function":
        function = forced.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        declared = {
            tool["function"].get("name")
            for tool in body.get("tools") or ()
            if isinstance(tool, dict)
            and tool.get("type", "function") == "function"
            and isinstance(tool.get("function"), dict)
        }
        if not isinstance(name, str) or name not in declared:
            raise invalid_request(
                f"'tool_choice' forces function {name!r}, which 'tools' does not declare",
                param="tool_choice",
            )
    legacy = body.get("function_call")
    if isinstance(legacy, dict):
        name = legacy.get("name")
        declared = {f.get("name") for f in body.get("functions") or () if isinstance(f, dict)}
        if not isinstance(name, str) or name not in declared:
            raise invalid_request(
                f"'function_call' forces function {name!r}, which 'functions' does not declare",
                param="function_call",
            )
