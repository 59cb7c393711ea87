"""The OpenAI driver: any OpenAI-compatible chat completions API, passed through as is, and
its embeddings API (``/embeddings``) likewise; OpenAI's Responses API for a Responses body
sent natively (:mod:`router.drivers.responses`)."""

from __future__ import annotations

import time
from typing import Any

from ledger.events import Usage
from router.config import Endpoint
from router.drivers import responses
from router.drivers.base import (
    AttemptBinding,
    ChatRequest,
    Driver,
    DriverResult,
    DriverStream,
    PreparedCall,
    SSEDriverStream,
    StreamErrorEvent,
    StreamTranslator,
    optional_str,
    sanitize,
)
from router.request.classify import UpstreamOutcome

__all__ = ["OpenAIDriver", "embeddings_usage", "openai_usage"]


class OpenAIDriver(Driver):
    _request_id_header = "x-request-id"
    dialect = "openai"
    embeds = True

    def _auth_headers(self, endpoint: Endpoint) -> dict[str, str]:
        if endpoint.api_key is None:
            return {}
        return {"Authorization": f"Bearer {endpoint.api_key.get_secret_value()}"}

    def _url(self, binding: AttemptBinding, request: ChatRequest) -> str:
        path = "/responses" if _responses(request) else "/chat/completions"
        return binding.endpoint.base_url.rstrip("/") + path

    def _payload(self, request: ChatRequest) -> dict[str, Any]:
        stream = request.stream
        if request.native is not None and _responses(request):
            return responses.payload(request.native.body, request.upstream_model, stream)
        payload = {**request.body, "model": request.upstream_model, "stream": stream}
        if request.max_tokens is not None:
            key = "max_completion_tokens" if "max_completion_tokens" in payload else "max_tokens"
            payload[key] = request.max_tokens
        if stream:
            # Usage is what the books settle on; ask for it whatever the client asked.
            options = payload.get("stream_options")
            payload["stream_options"] = {
                **(options if isinstance(options, dict) else {}),
                "include_usage": True,
            }
        else:
            payload.pop("stream_options", None)
        return payload

    def _embeddings_url(self, binding: AttemptBinding) -> str:
        return binding.endpoint.base_url.rstrip("/") + "/embeddings"

    def _embeddings_payload(self, request: ChatRequest) -> dict[str, Any]:
        return {**request.body, "model": request.upstream_model}

    async def complete(self, call: PreparedCall) -> DriverResult:
        binding = call.binding
        response = await self._open(call, stream=False)
        body, size = await self._read_body(response, binding)
        request_id = response.headers.get(self._request_id_header)
        if call.request.kind == "embeddings":
            return self._embeddings(call, body, response.status_code, request_id, size)
        if _responses(call.request) and isinstance(body, dict) and body.get("object") == "response":
            body = responses.completion(body)
        choices = body.get("choices") if isinstance(body, dict) else None
        if not isinstance(body, dict) or not isinstance(choices, list) or not choices:
            raise self._transport_failure(
                binding,
                "invalid_response",
                status=response.status_code,
                request_id=request_id,
                message="response has no choices",
                response_bytes=size,
            )
        first = choices[0] if isinstance(choices[0], dict) else {}
        return DriverResult(
            response=body,
            usage=openai_usage(body.get("usage")),
            finish_reason=optional_str(first.get("finish_reason")),
            upstream_request_id=request_id,
            response_id=optional_str(body.get("id")),
            status=response.status_code,
            response_bytes=size,
        )

    def _embeddings(
        self, call: PreparedCall, body: Any, status: int, request_id: str | None, size: int
    ) -> DriverResult:
        """An embeddings answer: one embedding per input, in OpenAI's shape, else the
        attempt failed as an ``invalid_response``."""
        data = body.get("data") if isinstance(body, dict) else None
        wanted = _input_count(call.request.body)
        if not isinstance(data, list) or len(data) != wanted:
            raise self._transport_failure(
                call.binding,
                "invalid_response",
                status=status,
                request_id=request_id,
                message=f"response has no list of {wanted} embeddings",
                response_bytes=size,
            )
        return DriverResult(
            response=body,
            usage=embeddings_usage(body.get("usage")),
            finish_reason=None,
            upstream_request_id=request_id,
            response_id=None,
            status=status,
            response_bytes=size,
        )

    async def stream(self, call: PreparedCall) -> DriverStream:
        started_at = time.monotonic()
        response = await self._open(call, stream=True)
        translator: StreamTranslator = (
            responses.ResponsesEvents(openai_usage) if _responses(call.request) else _OpenAIChunks()
        )
        return SSEDriverStream(self, response, call.binding, translator, started_at)


def _responses(request: ChatRequest) -> bool:
    """The request is a Responses body, sent natively (router/drivers/responses.py)."""
    return request.native is not None and request.native.dialect == responses.RESPONSES_DIALECT


class _OpenAIChunks(StreamTranslator):
    """OpenAI chunks pass through; this only notes the id, finish reason and usage."""

    passthrough = True

    def translate(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        error = event.get("error")
        if isinstance(error, dict):
            raise StreamErrorEvent(
                UpstreamOutcome(
                    error_code=optional_str(error.get("code")),
                    error_type=optional_str(error.get("type")),
                    error_message=sanitize(error.get("message"), None),
                )
            )
        if self.response_id is None:
            self.response_id = optional_str(event.get("id"))
        raw_usage = event.get("usage")
        if raw_usage is not None:  # null or absent in every chunk but the last
            usage = openai_usage(raw_usage)
            if usage is not None:
                self.usage = usage
        choices = event.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if isinstance(choice, dict) and choice.get("finish_reason"):
                self.finish_reason = optional_str(choice["finish_reason"])
        return [event]


def openai_usage(raw: object) -> Usage | None:
    """An OpenAI ``usage`` object as a :class:`Usage`; None when absent or unreadable.

    OpenAI counts every billed token in ``prompt_tokens`` and ``completion_tokens``: cached,
    image and audio input inside the first (``prompt_tokens_details``), reasoning, audio and
    rejected prediction output inside the second (``completion_tokens_details``). Audio
    tokens are kept apart, for their own price; images are billed as input tokens and not
    reported apart. A compatible server that reports a detail beside its count instead (more
    reasoning or audio tokens than the count, or a ``total_tokens`` above the two counts)
    has it added: billed tokens are never understated.
    """
    if not isinstance(raw, dict):
        return None
    prompt, completion = _count(raw.get("prompt_tokens")), _count(raw.get("completion_tokens"))
    if prompt is None or completion is None:
        return None
    audio_input = _count(_detail(raw, "prompt_tokens_details", "audio_tokens")) or 0
    input_tokens = prompt + audio_input if audio_input > prompt else prompt
    output = completion
    for name in ("reasoning_tokens", "audio_tokens"):
        detail = _count(_detail(raw, "completion_tokens_details", name))
        if detail is not None and detail > completion:
            output += detail
    total = _count(raw.get("total_tokens"))
    if total is not None and total > input_tokens + output:
        output = total - input_tokens
    cached = _count(_detail(raw, "prompt_tokens_details", "cached_tokens"))
    audio_output = _count(_detail(raw, "completion_tokens_details", "audio_tokens")) or 0
    return Usage(
        input_tokens=input_tokens,
        output_tokens=output,
        cached_input_tokens=cached or 0,
        audio_input_tokens=audio_input,
        audio_output_tokens=audio_output,
    )


def embeddings_usage(raw: object) -> Usage | None:
    """An embeddings answer's ``usage`` (``prompt_tokens``, ``total_tokens``): input only.
    A ``total_tokens`` above ``prompt_tokens`` is taken as billed input: never understated.
    None when absent or unreadable."""
    if not isinstance(raw, dict):
        return None
    prompt, total = _count(raw.get("prompt_tokens")), _count(raw.get("total_tokens"))
    if prompt is None and total is None:
        return None
    return Usage(input_tokens=max(prompt or 0, total or 0), output_tokens=0)


def _input_count(body: Any) -> int:
    """How many embeddings an embeddings body asks for: one per string or token array, one
    for a string or a single token array (the door checked the shape)."""
    items = body.get("input")
    if isinstance(items, list) and items and isinstance(items[0], str | list):
        return len(items)
    return 1


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _detail(raw: dict[str, Any], details: str, name: str) -> object:
    found = raw.get(details)
    return found.get(name) if isinstance(found, dict) else None
