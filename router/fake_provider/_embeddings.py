"""OpenAI's embeddings API as the fake answers it (``POST /v1/embeddings``): deterministic
vectors — the same input and ``dimensions`` give the same vector on every fake, whatever its
name — in ``float`` or ``base64`` (float32, little-endian, as OpenAI encodes them), with
``usage.prompt_tokens`` / ``total_tokens``: a token per 4 characters of text (at least one),
a token array's length exactly.

A request is answered through the same :func:`router.fake_provider._respond.respond` as a
chat completion, so every fault of the plan (errors, latency, resets, cut or garbled bodies)
applies alike; an embeddings request never streams.
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
from typing import Any, Final

from router.fake_provider._continuation import Partial
from router.fake_provider._openai import OPENAI
from router.fake_provider._reply import (
    Dialect,
    ErrorResponse,
    Prompt,
    Reply,
    SseEvent,
    StreamScript,
    int_or_none,
)
from router.fake_provider.behavior import Behavior

__all__ = ["DEFAULT_DIMENSIONS", "EmbeddingsDialect", "embedding", "input_tokens"]

DEFAULT_DIMENSIONS: Final = 8
"""A vector's length when the request does not say ``dimensions``."""


def embedding(item: str | list[int], dimensions: int = DEFAULT_DIMENSIONS) -> list[float]:
    """The fake's vector for one input: values in [-1, 1) from the input's SHA-256, each
    exactly a float32, so ``base64`` and ``float`` answers decode to the same numbers."""
    seed = hashlib.sha256(json.dumps(item, separators=(",", ":")).encode()).digest()
    stream = hashlib.shake_256(seed).digest(2 * dimensions)
    return [
        (int.from_bytes(stream[2 * i : 2 * i + 2], "little") - 32768) / 32768
        for i in range(dimensions)
    ]


def input_tokens(item: str | list[int]) -> int:
    """What the fake bills one input: a token per 4 characters (at least one), or a token
    array's length."""
    if isinstance(item, str):
        return len(item) // 4 + 1
    return len(item)


def _inputs(body: dict[str, Any]) -> list[str | list[int]]:
    value = body.get("input")
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and isinstance(value[0], int | float):
        return [value]
    if isinstance(value, list):
        return [item for item in value if isinstance(item, str | list)]
    return []


class EmbeddingsDialect(Dialect):
    """The embeddings API of one request (it holds the request's inputs): OpenAI's errors,
    its own body."""

    name = "openai"
    request_id_header = "x-request-id"
    message_id_prefix = "emb-"

    def __init__(self, body: dict[str, Any]) -> None:
        self._inputs = _inputs(body)
        self._dimensions = int_or_none(body.get("dimensions")) or DEFAULT_DIMENSIONS
        self._base64 = body.get("encoding_format") == "base64"

    def parse(self, body: dict[str, Any]) -> Prompt:
        return Prompt(
            model=str(body.get("model") or "fake-embedding"),
            prompt_tokens=sum(input_tokens(item) for item in self._inputs),
            max_tokens=None,
            tool_names=(),
            stream=False,
            include_usage=False,
        )

    def partial(self, body: dict[str, Any]) -> Partial | None:
        return None

    def body(self, reply: Reply) -> dict[str, Any]:
        data = [
            {"object": "embedding", "index": index, "embedding": self._encoded(item)}
            for index, item in enumerate(self._inputs)
        ]
        usage = {"prompt_tokens": reply.prompt_tokens, "total_tokens": reply.prompt_tokens}
        return {"object": "list", "data": data, "model": reply.model, "usage": usage}

    def _encoded(self, item: str | list[int]) -> list[float] | str:
        vector = embedding(item, self._dimensions)
        if not self._base64:
            return vector
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()

    def stream(self, reply: Reply, prompt: Prompt) -> StreamScript:
        raise AssertionError("an embeddings request never streams")

    def malformed(self, reply: Reply) -> SseEvent:
        return OPENAI.malformed(reply)

    def error_event(self) -> SseEvent:
        return OPENAI.error_event()

    def error(self, behavior: Behavior, prompt: Prompt, request_id: str) -> ErrorResponse:
        return OPENAI.error(behavior, prompt, request_id)

    def bad_request(
        self, message: str, request_id: str, *, code: str | None = None
    ) -> ErrorResponse:
        return OPENAI.bad_request(message, request_id, code=code)
