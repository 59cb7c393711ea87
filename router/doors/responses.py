"""The OpenAI Responses door (``POST /v1/responses``): a client's Responses request, read once
at the edge — the body checked against the documented field set, translated into the core's
canonical chat body (:mod:`router.doors.responses_translate`, which says what needs the
provider's own Responses API), the requirements inferred as the chat door infers them from
that body — and turned into the core's request (:func:`to_core`), the body as it came kept
beside it (``Call.native``) for an endpoint that serves the Responses API natively. Answers
go back through :mod:`router.doors.responses_wire`.

What Waybill does with ``store`` (OpenAI's default is true): Waybill keeps no content, so it
reads an absent ``store`` as not asking for state — the request is stateless and any eligible
mapping may serve it, translated; only ``store: true`` (with the other stateful fields) needs
a mapping that declares ``responses`` (contract §3 "The Responses door").
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import orjson

from ledger.events import Requirements
from router.config import Limits, Workspace
from router.doors import chat
from router.doors.chat import MAX_BODY_BYTES, ChatCall
from router.doors.headers import HeaderNarrowing
from router.doors.messages_translate import typed
from router.doors.responses_translate import RESPONSES_FIELDS, translate
from router.drivers import NativeBody
from router.drivers.responses import RESPONSES_DIALECT
from router.errors import invalid_request
from router.request.call import Call, trace_context

__all__ = ["RESPONSES_CAPABILITY", "RESPONSES_DIALECT", "ResponsesCall", "read_body", "to_core"]

RESPONSES_CAPABILITY: Final = "responses"
"""The capability of a mapping whose endpoint serves the Responses API natively."""
_TOKENS_PER_ITEM: Final = 8


@dataclass(frozen=True, slots=True)
class ResponsesCall:
    """One Responses request as the gateway understands it: its chat translation (read as
    the chat door reads a body), and what only the provider can serve."""

    native: dict[str, Any]  # the body as it came
    chat: ChatCall  # its canonical translation, read by the chat door
    needs_provider: tuple[str, ...]  # what needs a native endpoint (state, built-in tools)
    server_side_effects: bool
    estimated_input_tokens: int
    previous_response_id: str | None
    affinity_endpoint: str | None = None  # the endpoint that answered previous_response_id
    web_search: bool = False  # a built-in web search tool

    @property
    def model_group(self) -> str:
        return self.chat.model_group

    @property
    def stream(self) -> bool:
        return self.chat.stream

    def body_sha256(self) -> str:
        """What an ``Idempotency-Key`` is bound to: the body as sent."""
        return hashlib.sha256(orjson.dumps(self.native, option=orjson.OPT_SORT_KEYS)).hexdigest()

    def requirements(self, workspace: Workspace, headers: HeaderNarrowing) -> Requirements:
        found = self.chat.requirements(workspace, headers)
        capabilities = set(found.capabilities)
        if self.needs_provider:
            capabilities.add(RESPONSES_CAPABILITY)
        return found.model_copy(
            update={
                "capabilities": tuple(sorted(capabilities)),
                "estimated_input_tokens": self.estimated_input_tokens,
                "server_side_effects": found.server_side_effects or self.server_side_effects,
                "native": RESPONSES_DIALECT if self.needs_provider else None,
                # Only the OpenAI driver speaks the Responses API natively.
                "unsupported": (("anthropic", self.needs_provider[0]),)
                if self.needs_provider
                else (),
                "affinity_endpoint": self.affinity_endpoint,
                # Billed per search, as web_search_options is on chat (its price key).
                "web_search": found.web_search or self.web_search,
            }
        )


def to_core(call: ResponsesCall, headers: HeaderNarrowing, workspace: Workspace) -> Call:
    """The core's request for a Responses request from ``workspace``'s key."""
    translated = call.chat
    return Call(
        model_group=translated.model_group,
        body=translated.body,
        stream=translated.stream,
        include_usage=True,  # response.completed carries the usage
        max_tokens=translated.max_tokens,
        requirements=call.requirements(workspace, headers),
        prompt_sha256=translated.prompt_sha256,
        prompt_bytes=translated.prompt_bytes,
        message_count=translated.message_count,
        trace=trace_context(headers.traceparent, headers.tracestate),
        api="openai.responses",
        # Sent natively only where the translation cannot serve it (module docstring).
        native=NativeBody(RESPONSES_DIALECT, call.native) if call.needs_provider else None,
    )


def read_body(raw: bytes, limits: Limits) -> ResponsesCall:
    """Check a ``/v1/responses`` body; a 400 names the first offending field."""
    if len(raw) > MAX_BODY_BYTES:
        raise invalid_request(f"request body over {MAX_BODY_BYTES} bytes", status=413)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise invalid_request("request body is not valid JSON") from None
    return parse_body(body, limits)


def parse_body(body: object, limits: Limits) -> ResponsesCall:
    """Check a ``/v1/responses`` body (parsed JSON)."""
    if not isinstance(body, dict):
        raise invalid_request("request body must be a JSON object")
    for name in body:
        if name not in RESPONSES_FIELDS:
            raise invalid_request(f"'{name}' is not a Responses API field", param=name)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_request("'model' must be a non-empty string", param="model")
    stream = typed(body, "stream", bool, False)
    translated, reading = translate(body, stream=stream)
    chat_call = chat.parse_body(orjson.dumps(translated), limits)
    # Items that only a native endpoint reads are not in the translation: the whole input's
    # bytes bound the input tokens of either (a token covers at least one byte).
    seen = {name: body.get(name) for name in ("instructions", "input", "tools", "text")}
    native_bytes = len(orjson.dumps(seen))
    items = body["input"] if isinstance(body["input"], list) else [body["input"]]
    estimate = max(
        chat_call.estimated_input_tokens,
        math.ceil(native_bytes) + _TOKENS_PER_ITEM * len(items),
    )
    previous = body.get("previous_response_id")
    return ResponsesCall(
        native=body,
        chat=chat_call,
        needs_provider=tuple(reading.needs_provider),
        server_side_effects=reading.server_side_effects,
        estimated_input_tokens=estimate,
        previous_response_id=previous if isinstance(previous, str) else None,
        web_search=reading.web_search,
    )


def echoed(call: ResponsesCall) -> Mapping[str, Any]:
    """The request's parameters a response object repeats (OpenAI's response echoes them)."""
    body = call.native
    given = body.get("text")
    text: Mapping[str, Any] = given if isinstance(given, dict) else {}
    return {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "store": body.get("store", False) is True,
        "temperature": body.get("temperature"),
        "text": {"format": {"type": "text"}, **text},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "truncation": body.get("truncation", "disabled"),
        "user": body.get("user"),
    }
