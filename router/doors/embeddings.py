"""The OpenAI embeddings door (``POST /v1/embeddings``): a client's embeddings request, read
once at the edge and translated into the core's request (:func:`to_core`).

Embeddings are not chat, but they walk the same core: the request says its kind
(``Requirements.kind`` ``embeddings``), so only an embeddings group's mappings — which
declare the capability ``embeddings`` — are candidates, and the driver sends the attempt to
its dialect's embeddings API. There is no stream and no output: the worst case is the
input alone (``max_output_tokens`` 0), exact for token arrays and bounded for text as the
chat door bounds it (a token covers at least one byte), settled at ``input_per_mtok``.

Pure: bytes in, a frozen :class:`EmbeddingsCall` or a 400 ``invalid_request`` naming the
field out. The body passes to the upstream as the client sent it (``model`` replaced), and
the upstream's answer goes back as it is (OpenAI's shape, ``usage.prompt_tokens`` /
``total_tokens``), with the chat route's headers (:func:`router.doors.chat.answer`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import orjson

from ledger.events import Requirements
from router.config import Workspace
from router.doors.chat import MAX_BODY_BYTES, answer
from router.doors.headers import MAX_JSON_INTEGER, HeaderNarrowing
from router.errors import invalid_request
from router.request.call import Call, trace_context

__all__ = ["KIND", "MAX_INPUTS", "EmbeddingsCall", "answer", "parse_body", "to_core"]

KIND: Final = "embeddings"
"""The model group kind this door serves (contract §2)."""
MAX_INPUTS: Final = 2048
"""The most inputs one request may carry: OpenAI's own bound, so a batch the provider
would refuse is refused here, before anything is reserved."""
ENCODING_FORMATS: Final = ("float", "base64")


@dataclass(frozen=True, slots=True)
class EmbeddingsCall:
    """One embeddings request as the gateway understands it."""

    body: dict[str, Any]
    model_group: str
    input_count: int
    input_tokens: int  # exact for token arrays, an upper bound for text
    largest_input_tokens: int  # the longest one input's tokens (each must fit the context)
    prompt_sha256: str
    prompt_bytes: int
    stream: bool = False  # never: the edge reads it of every door's request

    def body_sha256(self) -> str:
        """The body's hash, sorted-key JSON: what an ``Idempotency-Key`` is bound to."""
        return hashlib.sha256(orjson.dumps(self.body, option=orjson.OPT_SORT_KEYS)).hexdigest()

    def requirements(self, workspace: Workspace, headers: HeaderNarrowing) -> Requirements:
        """Requirements for routing: an embeddings request, its input, the headers'
        narrowing; no output (``max_output_tokens`` 0) and no stream."""
        return Requirements(
            kind=KIND,
            capabilities=tuple(sorted({KIND, *headers.capabilities})),
            regions=headers.regions,
            data_class=headers.data_class_for(workspace),
            retention=headers.retention_for(workspace),
            estimated_input_tokens=self.input_tokens,
            largest_input_tokens=self.largest_input_tokens,
            max_output_tokens=0,
            allow_failover=headers.allow_failover,
            max_cost_usd=headers.max_cost_usd,
            deadline_ms=headers.deadline_ms,
            allow_unknown_execution=headers.allow_unknown_execution,
            failover_granted=headers.failover_granted,
            endpoints=headers.endpoints,
            prefer_endpoint=headers.prefer_endpoint,
            require_endpoint=headers.require_endpoint,
        )


def to_core(call: EmbeddingsCall, headers: HeaderNarrowing, workspace: Workspace) -> Call:
    """The core's request for an embeddings request from ``workspace``'s key."""
    return Call(
        model_group=call.model_group,
        body=call.body,
        stream=False,
        include_usage=False,
        max_tokens=None,
        requirements=call.requirements(workspace, headers),
        prompt_sha256=call.prompt_sha256,
        prompt_bytes=call.prompt_bytes,
        message_count=call.input_count,
        trace=trace_context(headers.traceparent, headers.tracestate),
        api="openai.embeddings",
    )


def parse_body(raw: bytes) -> EmbeddingsCall:
    """Check a ``/v1/embeddings`` body; a 400 names the first offending field."""
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
    sizes = _input_sizes(body.get("input"))
    _check_options(body)
    prompt = orjson.dumps(body["input"])
    return EmbeddingsCall(
        body=body,
        model_group=model,
        input_count=len(sizes),
        input_tokens=sum(sizes),
        largest_input_tokens=max(sizes),
        prompt_sha256=hashlib.sha256(prompt).hexdigest(),
        prompt_bytes=len(prompt),
    )


_INPUT_SHAPES: Final = (
    "'input' must be a non-empty string, an array of non-empty strings, "
    "or an array of token arrays (non-empty arrays of token ids)"
)


def _input_sizes(value: object) -> list[int]:
    """Each input's token bound: a token array's length (exact), a string's UTF-8 bytes (a
    token covers at least one byte). A flat array of integers is one token array, as
    OpenAI reads it."""
    if isinstance(value, str):
        return [_text_tokens(value, "input")]
    if not isinstance(value, list) or not value:
        raise invalid_request(_INPUT_SHAPES, param="input")
    if _is_token(value[0]):
        return [_token_count(value, "input")]
    if len(value) > MAX_INPUTS:
        raise invalid_request(f"'input' may hold at most {MAX_INPUTS} inputs", param="input")
    sizes: list[int] = []
    for index, item in enumerate(value):
        where = f"input[{index}]"
        if isinstance(item, str):
            sizes.append(_text_tokens(item, where))
        elif isinstance(item, list):
            sizes.append(_token_count(item, where))
        else:
            raise invalid_request(_INPUT_SHAPES, param=where)
    return sizes


def _text_tokens(text: str, where: str) -> int:
    if not text:
        raise invalid_request(f"'{where}' must not be empty", param=where)
    return len(text.encode())


def _is_token(value: object) -> bool:
    """An integer as JSON carries one: 5.0 included (JSON has numbers, not ints)."""
    if isinstance(value, float):
        return value.is_integer()
    return isinstance(value, int) and not isinstance(value, bool)


def _token_count(tokens: list[Any], where: str) -> int:
    if not tokens or not all(_is_token(t) and 0 <= t <= MAX_JSON_INTEGER for t in tokens):
        raise invalid_request(
            f"'{where}' must be a non-empty array of token ids (integers from 0 to "
            f"{MAX_JSON_INTEGER})",
            param=where,
        )
    return len(tokens)


def _check_options(body: Mapping[str, Any]) -> None:
    dimensions = body.get("dimensions")
    if dimensions is not None and (
        not _is_token(dimensions) or not 0 < dimensions <= MAX_JSON_INTEGER
    ):
        raise invalid_request("'dimensions' must be a positive integer", param="dimensions")
    encoding = body.get("encoding_format")
    if encoding is not None and encoding not in ENCODING_FORMATS:
        raise invalid_request(
            "'encoding_format' must be 'float' or 'base64'", param="encoding_format"
        )
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid_request("'user' must be a string", param="user")
    if body.get("stream") not in (None, False):
        raise invalid_request("embeddings do not stream", param="stream")
