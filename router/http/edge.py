"""The inference edge: the pure-ASGI :class:`Edge` in front of FastAPI, the door table (one
client API each: chat, messages, embeddings, responses) and the serving of one inference request."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import (
    AsyncGenerator,
    Awaitable,
    Callable,
    Mapping,
)
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ledger.apikeys import KeyCache
from ledger.store import EventStore
from ledger.views import all_projections
from ledger.views.projection import ProjectionRunner
from ledger.views.spend_queries import response_endpoint
from router.adapters.idempotency import Claim, RecordedAnswer
from router.config import (
    Config,
)
from router.doors import chat, embeddings, messages, messages_wire, responses, responses_wire
from router.doors.chat import MAX_BODY_BYTES
from router.doors.headers import HeaderNarrowing, read_headers
from router.errors import (
    GatewayError,
    capacity_error,
    invalid_api_key,
    invalid_request,
    model_kind_mismatch,
    model_not_found,
    response_not_found,
)
from router.http.auth import anthropic_secret, bearer_secret, caller_of_key, headers_by_name
from router.http.failures import (
    MESSAGES_PATH,
    ErrorWire,
    chat_error,
    failure_response,
    messages_error,
    refuse_nul,
    request_id_of,
)
from router.http.streaming import (
    ClientGone,
    EventStream,
    Message,
    Receive,
    Scope,
    Send,
    recorded,
    replay,
    unless_disconnected,
)
from router.request.call import Call, Completion, StreamingCompletion
from router.request.gateway import Caller, Gateway, KeyMoved
from router.serving.server import BodyWriter
from router.support.ids import new_id

_JSON: Final = "application/json"
CHAT_PATH: Final = "/v1/chat/completions"
EMBEDDINGS_PATH: Final = "/v1/embeddings"
RESPONSES_PATH: Final = "/v1/responses"

T = TypeVar("T")


class Edge:
    """Pure ASGI, in front of the FastAPI app: give every request an id and every response
    its ``X-Request-Id``, and serve ``POST /v1/chat/completions`` directly.

    The inference route is the hot path, and FastAPI's middleware stack, routing and
    dependency resolution were a large part of the CPU the gateway spends on a request of its
    own (``bench/README.md``, "Decisions"). Everything else (the other routes, and other
    methods on this path) goes through FastAPI; errors take the same shape either way
    (``failure_response``)."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_id("req")
        scope.setdefault("state", {})["request_id"] = request_id
        header = (b"x-request-id", request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(name.lower() == b"x-request-id" for name, _ in headers):
                    headers.append(header)
                message["headers"] = headers
            await send(message)

        door = _DOORS.get(scope["path"]) if scope["method"] == "POST" else None
        if door is not None:
            scope["app"] = self.app
            request = Request(scope, receive)
            try:
                await refuse_nul(request)
                response = await _serve(request, door)
            except Exception as error:
                response = failure_response(request, error, door.error)
            # The header is the response's own here, so its messages go out unwrapped (a
            # stream sends one per read of the upstream's body).
            if "x-request-id" not in response.headers:
                response.raw_headers.append(header)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send_with_id)


class Capacity:
    """Bounded in-flight requests per workspace in this process (contract §3 capacity_error)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._in_flight: dict[str, int] = {}

    def acquire(self, workspace: str) -> None:
        count = self._in_flight.get(workspace, 0)
        if count >= self._limit:
            raise capacity_error(
                f"workspace {workspace!r} has {count} requests in flight on this gateway"
            )
        self._in_flight[workspace] = count + 1

    def release(self, workspace: str) -> None:
        self._in_flight[workspace] -= 1


async def chat_route(request: Request) -> Response:
    """``POST /v1/chat/completions``: served by :class:`Edge` directly (see there), and
    declared on the FastAPI app for its schema and for any other method on the path."""
    return await _serve(request, _DOORS[CHAT_PATH])


async def messages_route(request: Request) -> Response:
    """``POST /v1/messages`` (the Anthropic door), served as the chat route is."""
    return await _serve(request, _DOORS[MESSAGES_PATH])


async def embeddings_route(request: Request) -> Response:
    """``POST /v1/embeddings`` (the embeddings door), served as the chat route is."""
    return await _serve(request, _DOORS[EMBEDDINGS_PATH])


async def responses_route(request: Request) -> Response:
    """``POST /v1/responses`` (the Responses door), served as the chat route is."""
    return await _serve(request, _DOORS[RESPONSES_PATH])


async def _serve(request: Request, door: _Door) -> Response:
    """An inference request through ``door``: the key, the body and headers read once, the
    Idempotency-Key claimed, the core asked, the answer on the door's wire."""
    request_id = request_id_of(request)
    state = request.app.state
    # One gateway (one config generation) serves this request from end to end, even if
    # a reload swaps in another meanwhile.
    gateway: Gateway = state.gateway
    config = gateway.config
    keys: KeyCache = state.keys
    named = headers_by_name(request)
    secret = door.secret(named)
    key, unconfirmed = await keys.find(secret)
    caller = caller_of_key(key, config)
    reread = functools.partial(_reread, keys, secret, config)
    try:
        call = door.parse(await _read_body(request, named), named, config)
        headers = read_headers(named)
        group = config.model_group(call.model_group)
        if call.model_group not in caller.workspace.models or not group:
            raise model_not_found(call.model_group)
        if group.kind != door.kind:
            raise model_kind_mismatch(call.model_group, group.kind, door.kind)
        if door.resolve is not None:
            call = await door.resolve(call, caller, state.store)
    except GatewayError:
        if unconfirmed:  # a revoked key hears only that, whatever else is wrong
            await reread()
        raise
    if headers.idempotency_key is not None and unconfirmed:
        # A claim is a write, and a replay an answer: neither for a revoked key.
        caller, unconfirmed = await reread(), False
    claim: Claim | None = None
    if headers.idempotency_key is not None:
        lease_s = config.policy_for(call.model_group).deadline_ms / 1000 + 30
        claimed = await state.idempotency.claim(
            caller.workspace.id,
            caller.key_id,
            headers.idempotency_key,
            call.body_sha256(),
            request_id,
            lease_s,
        )
        if isinstance(claimed, RecordedAnswer):
            return replay(claimed)
        claim = claimed
    capacity: Capacity = state.capacity
    try:
        capacity.acquire(caller.workspace.id)
    except GatewayError:
        if claim is not None:
            await state.idempotency.abandon(claim)
        if unconfirmed:
            await reread()
        raise
    gateway.begin()

    def done() -> None:
        capacity.release(caller.workspace.id)
        gateway.end()

    release = _Once(done)
    try:
        if call.stream:
            started = await unless_disconnected(
                request.scope,
                request.receive,
                _on_current_key(
                    lambda c: gateway.stream(c, door.to_core(call, headers, c), request_id),
                    caller,
                    reread,
                ),
            )
            body, response_headers, write_directly = door.stream(call, started)
            if claim is not None:  # every piece of it is recorded: all go through the body
                body = recorded(body, state.idempotency, claim, response_headers, gateway)
                write_directly = None
            return EventStream(body, response_headers, on_end=release, direct=write_directly)
        completion = await unless_disconnected(
            request.scope,
            request.receive,
            _on_current_key(
                lambda c: gateway.complete(c, door.to_core(call, headers, c), request_id),
                caller,
                reread,
            ),
        )
        payload, response_headers = door.answer(call, completion)
        if claim is not None:
            await state.idempotency.finish(
                claim, RecordedAnswer(request_id, 200, _JSON, response_headers, payload)
            )
        release()
        return Response(payload, media_type=_JSON, headers=response_headers)
    except GatewayError as error:
        release()
        if claim is not None and error.should_retry:
            # An answer the client is told to retry (every attempt refused at admission:
            # nothing was sent) is not the request's answer: the retry runs again.
            await state.idempotency.abandon(claim)
        elif claim is not None:
            status, error_body = door.error(error, request_id)
            await state.idempotency.finish(
                claim, RecordedAnswer(request_id, status, _JSON, error.headers(), error_body)
            )
        raise
    except ClientGone:
        release()
        if claim is not None:
            await state.idempotency.abandon(claim)
        return Response(status_code=499)  # nobody is listening any more
    except BaseException:
        release()
        if claim is not None:
            await state.idempotency.abandon(claim)
        raise


class _Parsed(Protocol):
    """What the edge reads of a door's parsed request."""

    model_group: str
    stream: bool

    def body_sha256(self) -> str: ...


Directly = Callable[[BodyWriter], None] | None


@dataclass(frozen=True)
class _Door:
    """One client API at the edge: how its key and body are read, its request handed to the
    core, and the core's answers and the gateway's errors written on its wire."""

    secret: Callable[[Mapping[str, str]], str]
    parse: Callable[[bytes, Mapping[str, str], Config], Any]
    to_core: Callable[[Any, HeaderNarrowing, Caller], Call]
    answer: Callable[[Any, Completion], tuple[bytes, dict[str, str]]]
    stream: Callable[
        [Any, StreamingCompletion], tuple[AsyncGenerator[bytes, None], dict[str, str], Directly]
    ]
    error: ErrorWire
    kind: str = "chat"  # the model group kind it serves; another is model_kind_mismatch
    resolve: Callable[[Any, Caller, EventStore], Awaitable[Any]] | None = None
    """What the parsed request needs read from the ledger before it is served."""


def _chat_stream(
    call: Any, started: StreamingCompletion
) -> tuple[AsyncGenerator[bytes, None], dict[str, str], Directly]:
    return started.body, chat.stream_headers(started), started.write_directly


def _messages_stream(
    call: Any, started: StreamingCompletion
) -> tuple[AsyncGenerator[bytes, None], dict[str, str], Directly]:
    # Every piece is rewritten into Anthropic's events: none goes out as the upstream's.
    return messages_wire.events(started), messages_wire.stream_headers(started), None


def _never_streams(
    call: Any, started: StreamingCompletion
) -> tuple[AsyncGenerator[bytes, None], dict[str, str], Directly]:
    raise AssertionError("an embeddings request never streams (embeddings.parse_body)")


def _responses_stream(
    call: Any, started: StreamingCompletion
) -> tuple[AsyncGenerator[bytes, None], dict[str, str], Directly]:
    # Every piece is rewritten into the Responses events.
    return responses_wire.events(call, started), responses_wire.stream_headers(started), None


async def _responses_resolve(
    call: responses.ResponsesCall, caller: Caller, store: EventStore
) -> responses.ResponsesCall:
    """A ``previous_response_id`` pinned to the endpoint that answered it, as the ledger
    recorded it (the spend read model, brought up to date if it does not know it yet)."""
    previous = call.previous_response_id
    if previous is None:
        return call
    workspace = caller.workspace.id
    endpoint = await response_endpoint(store.engine, workspace, previous)
    if endpoint is None:
        runner = ProjectionRunner(store, all_projections())
        await runner.catch_up(runner.get("spend"))
        endpoint = await response_endpoint(store.engine, workspace, previous)
    if endpoint is None:
        raise response_not_found(previous)
    return dataclasses.replace(call, affinity_endpoint=endpoint)


def _messages_parse(raw: bytes, named: Mapping[str, str], config: Config) -> Any:
    return messages.read_body(raw, named.get("anthropic-beta"))


_DOORS: Final[Mapping[str, _Door]] = {
    CHAT_PATH: _Door(
        secret=bearer_secret,
        parse=lambda raw, named, config: chat.parse_body(raw, config.limits),
        to_core=lambda call, headers, caller: chat.to_core(call, headers, caller.workspace),
        answer=lambda call, completion: chat.answer(completion),
        stream=_chat_stream,
        error=chat_error,
    ),
    MESSAGES_PATH: _Door(
        secret=anthropic_secret,
        parse=_messages_parse,
        to_core=lambda call, headers, caller: messages.to_core(call, headers, caller.workspace),
        answer=lambda call, completion: messages_wire.answer(completion),
        stream=_messages_stream,
        error=messages_error,
    ),
    EMBEDDINGS_PATH: _Door(
        secret=bearer_secret,
        parse=lambda raw, named, config: embeddings.parse_body(raw),
        to_core=lambda call, headers, caller: embeddings.to_core(call, headers, caller.workspace),
        answer=lambda call, completion: embeddings.answer(completion),
        stream=_never_streams,
        error=chat_error,
        kind=embeddings.KIND,
    ),
    RESPONSES_PATH: _Door(
        secret=bearer_secret,
        parse=lambda raw, named, config: responses.read_body(raw, config.limits),
        to_core=lambda call, headers, caller: responses.to_core(call, headers, caller.workspace),
        answer=responses_wire.answer,
        stream=_responses_stream,
        error=chat_error,
        resolve=_responses_resolve,
    ),
}


async def _reread(keys: KeyCache, secret: str, config: Config) -> Caller:
    """The caller as the ledger has its key now (401 if revoked or unknown)."""
    keys.evict(secret)
    key, _ = await keys.find(secret)
    return caller_of_key(key, config)


async def _on_current_key(
    serve: Callable[[Caller], Awaitable[T]],
    caller: Caller,
    reread: Callable[[], Awaitable[Caller]],
) -> T:
    """``serve`` the request; if its first append finds the key's stream moved since the
    key was read (``KeyMoved``: nothing was recorded), read the key again and, unless it
    was revoked (401), serve it on the key as it is now."""
    try:
        return await serve(caller)
    except KeyMoved:
        caller = await reread()
    try:
        return await serve(caller)
    except KeyMoved:
        raise invalid_api_key("the key changed while the request was served") from None


class _Once:
    def __init__(self, action: Callable[[], None]) -> None:
        self._action: Callable[[], None] | None = action

    def __call__(self) -> None:
        action, self._action = self._action, None
        if action is not None:
            action()


async def _read_body(request: Request, headers: Mapping[str, str]) -> bytes:
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise invalid_request(f"request body over {MAX_BODY_BYTES} bytes", status=413)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise invalid_request(f"request body over {MAX_BODY_BYTES} bytes", status=413)
        chunks.append(chunk)
    return b"".join(chunks)
