"""``POST /v1/messages/count_tokens`` (contract §3 "The Anthropic door"): a Messages request's
input tokens, counted by an eligible Anthropic endpoint of the model group when there is one
(its own free count, natively), else estimated by the gateway; ``X-Waybill-Token-Count`` says
which (``endpoint`` or ``estimate``). Never billed, never recorded: nothing is reserved and no
event is written.

A thin edge: the door reads the body (:func:`router.doors.messages.read_count_body`), routing's
eligibility checks (:func:`router.request.selection.evaluate`, without live state: a count
is no attempt) find the endpoints, the Anthropic driver asks one. Errors are the door's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from router.doors import messages
from router.doors.headers import read_headers
from router.drivers import AnthropicDriver
from router.errors import model_kind_mismatch, model_not_found
from router.http import openapi as api_doc
from router.request.gateway import Caller, Gateway
from router.request.selection import RouteContext, evaluate

__all__ = ["count_tokens_router"]

_TIMEOUT_S: Final = 10.0

Identify = Callable[[Request], Awaitable[tuple[Caller, dict[str, str]]]]
"""The caller and the request's headers by name, or a GatewayError."""
Failure = Callable[[Request, Exception], Response]
"""The door's answer to an exception."""


def count_tokens_router(identify: Identify, failure: Failure) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/messages/count_tokens", openapi_extra=api_doc.MESSAGES_COUNT_TOKENS)
    async def count_tokens(request: Request) -> Response:
        try:
            return await _count(request, identify)
        except Exception as error:  # the door's error shape, whatever it is
            return failure(request, error)

    return router


async def _count(request: Request, identify: Identify) -> Response:
    caller, named = await identify(request)
    gateway: Gateway = request.app.state.gateway
    config = gateway.config
    beta = named.get("anthropic-beta")
    call = messages.read_count_body(await request.body(), beta)
    group = config.model_group(call.model_group)
    if call.model_group not in caller.workspace.models or group is None:
        raise model_not_found(call.model_group)
    if group.kind != "chat":  # an embeddings group counts no Messages request
        raise model_kind_mismatch(call.model_group, group.kind, "chat")
    requirements = call.requirements(caller.workspace, read_headers(named))
    candidates = evaluate(
        config, caller.workspace, group, requirements, RouteContext(), breaker_open=_never_open
    )
    forwarded = {"anthropic-beta": beta} if beta else {}
    for candidate in sorted((c for c in candidates if c.eligible), key=lambda c: c.tier):
        endpoint = config.endpoint(candidate.endpoint)
        driver = gateway.driver(candidate.endpoint)
        if endpoint is None or not isinstance(driver, AnthropicDriver):
            continue
        body = messages.count_body(call, candidate.model)
        counted = await driver.count_tokens(endpoint, body, forwarded, _TIMEOUT_S)
        if counted is not None:
            headers = {"x-waybill-token-count": "endpoint", "x-waybill-endpoint": endpoint.id}
            return _answer(counted, headers)
    return _answer(messages.estimate_tokens(call), {"x-waybill-token-count": "estimate"})


def _never_open(endpoint_id: str, mapping: object) -> str | None:
    return None


def _answer(tokens: int, headers: dict[str, str]) -> Response:
    return Response(
        orjson.dumps({"input_tokens": tokens}), media_type="application/json", headers=headers
    )
