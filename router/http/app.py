"""The HTTP edge (contract §3): authentication, the OpenAI-compatible inference routes, health.

Thin by design: read the request, call :class:`router.request.gateway.Gateway`, write the answer.
Every error a client can see is a :class:`router.errors.GatewayError` rendered as the
contract's JSON body; anything unexpected becomes a bare 500 ``internal_error`` without a
stack trace (and is logged). Every response carries ``X-Request-Id``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import re
import signal
import threading
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Mapping,
    MutableMapping,
)
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar

import httpx
import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from sqlalchemy.exc import DBAPIError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ledger import events as ev
from ledger.apikeys import ApiKey, KeyCache, find_key, find_key_by_id
from ledger.audit.checkpointer import CheckpointTask, Schedule
from ledger.books.recovery import (
    MAX_INSTANCE_ID,
    check_instance_id,
    heartbeat,
    incarnation_owner,
    recover_abandoned_holds,
    recover_earlier_incarnations,
    register_instance,
    stop_instance,
)
from ledger.endpoints import EndpointStates
from ledger.store import EventStore, LedgerUnavailable, WrongExpectedVersion
from ledger.store.db import create_engine, current_revision, head_revision, is_unavailable
from ledger.store.shared_appends import AppendClient, AppendServer
from ledger.views import all_projections
from ledger.views.follow import SETTLE_S, follow_in_child
from ledger.views.projection import ProjectionRunner
from otel.merge import merge_expositions
from otel.metrics import PROMETHEUS_CONTENT_TYPE
from otel.telemetry import Telemetry
from router.adapters.breakers import BreakerBoard, breaker_board
from router.adapters.disabling import Disabling
from router.adapters.idempotency import Claim, IdempotencyStore, RecordedAnswer
from router.adapters.latency import latency_board
from router.adapters.slots import endpoint_slots
from router.config import (
    Checkpoints,
    Config,
    ConfigError,
    load_config,
    parse_config_file,
    read_config_file,
)
from router.doors import chat, embeddings, messages, messages_wire
from router.doors.chat import MAX_BODY_BYTES
from router.doors.headers import HeaderNarrowing, read_headers
from router.errors import (
    ErrorCode,
    GatewayError,
    capacity_error,
    client_canceled,
    internal_error,
    invalid_api_key,
    invalid_request,
    ledger_unavailable,
    model_kind_mismatch,
    model_not_found,
    permission_denied,
    reload_incomplete,
    reload_unavailable,
    route_not_found,
)
from router.http import openapi as api_doc
from router.http.console import Identify, console_router, secret_from
from router.http.count_tokens import count_tokens_router
from router.http.endpoints import endpoints_router
from router.http.proofs import proof_router
from router.http.queries import queries_router
from router.http.reconcile import reconcile_router
from router.http.spend import spend_router
from router.request.call import Call, Completion, StreamingCompletion
from router.request.gateway import Caller, Gateway, KeyMoved
from router.serving.reload import (
    WORKER_RELOAD_HEADER,
    one_reload_at_a_time,
    read_accepted,
    reload_siblings,
    write_accepted,
)
from router.serving.server import BODY_EXTENSION, HANGUP_EXTENSION, BodyWriter, Hangup
from router.support.ids import new_id
from router.support.version import package_version

__all__ = [
    "DEFAULT_MAX_IN_FLIGHT",
    "AppSettings",
    "authenticate",
    "create_app",
    "default_instance_id",
]

log = logging.getLogger("waybill.app")

_JSON: Final = "application/json"
_OWN_METRICS: Final = "x-waybill-own-metrics"
"""Asks ``GET /metrics`` for this process's metrics alone (a sibling worker asks so)."""
_SSE: Final = "text/event-stream"
_CHAT_PATH: Final = "/v1/chat/completions"
_MESSAGES_PATH: Final = "/v1/messages"
_COUNT_TOKENS_PATH: Final = "/v1/messages/count_tokens"
_EMBEDDINGS_PATH: Final = "/v1/embeddings"
_MAX_RECORDED_STREAM: Final = 8 * 1024 * 1024

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


DEFAULT_MAX_IN_FLIGHT: Final = 256
"""Requests in flight per workspace in one process before new ones get 503 capacity_error
(``waybill serve --max-in-flight``). What an LLM gateway carries is long streams, and the
number of them open is its load. The default comes from a sweep of ``bench/streams_bench.py``
on a 2-core machine (``bench/README.md``, "Capacity"): past it, the time to first token the
gateway adds grows with every stream more, for all of them, and a fast 503 serves a client
better than a slower stream for everyone. Derive it for other machines the same way."""


@dataclass(frozen=True)
class AppSettings:
    config: Config
    database_url: str
    redis_url: str | None = None
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT  # per workspace and process; then: 503
    heartbeat_s: float = 5.0  # a gateway silent for 6 heartbeats is presumed dead
    config_path: str | None = None  # where a reload (SIGHUP, or the admin API) reads from
    follower_process: bool = False  # on PostgreSQL: read models in a child (ledger.views.follow)
    # Who this gateway is across restarts (ledger.books.recovery): at start-up it recovers the
    # holds its own earlier incarnations left. None: a new id, so it has no earlier ones.
    instance_id: str | None = None
    # Signs the console's session cookies (WAYBILL_CONSOLE_SECRET). None: a random secret
    # of this process, so sessions end when it does.
    console_secret: bytes | None = None
    # Whether this process also keeps the read models, takes the checkpoints and exports
    # traces: one worker of `waybill serve --workers N` does (router.serving.workers), the others
    # only serve.
    background: bool = True
    # The Unix sockets of the other workers of the same `waybill serve --workers N`, whose
    # metrics GET /metrics adds to this process's own.
    siblings: tuple[str, ...] = ()
    # The Unix socket where the first worker of `waybill serve --workers N` commits the
    # others' appends (ledger.store.shared_appends): it listens there (``background``), they send.
    appends_socket: str | None = None
    # Where the workers of `waybill serve --workers N` keep the config bytes the last reload
    # accepted: a reload reloads every worker (router.serving.reload). None: one process.
    accepted_config: str | None = None
    # Where `waybill archive` put the archived months (WAYBILL_ARCHIVE_DIR): the events and
    # explanation of a request recorded in one are read there. None: such a request's
    # events answer 404, saying why.
    archive_dir: Path | None = None


def default_instance_id(host_name: str, bind_host: str, port: int) -> str:
    """``waybill serve``'s instance id when none is given: ``<host name>@<address>:<port>``,
    a socket address only one process on a machine can listen on at a time. One that an
    instance id cannot hold (too long, odd characters) is cut down to what it can, with a
    hash of the whole to keep it unique."""
    address = f"[{bind_host}]" if ":" in bind_host else bind_host  # IPv6, as in a URL
    wanted = f"{host_name}@{address}:{port}"
    try:
        return check_instance_id(wanted)
    except ValueError:
        digest = hashlib.sha256(wanted.encode()).hexdigest()[:8]
        kept = re.sub(r"[^A-Za-z0-9._:@\[\]-]+", "-", wanted).lstrip("._:@[]-")
        return f"{kept[: MAX_INSTANCE_ID - 9]}-{digest}" if kept else digest


class _Edge:
    """Pure ASGI, in front of the FastAPI app: give every request an id and every response
    its ``X-Request-Id``, and serve ``POST /v1/chat/completions`` directly.

    The inference route is the hot path, and FastAPI's middleware stack, routing and
    dependency resolution were a large part of the CPU the gateway spends on a request of its
    own (``bench/README.md``, "Decisions"). Everything else (the other routes, and other
    methods on this path) goes through FastAPI; errors take the same shape either way
    (``_failure_response``)."""

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
                await _refuse_nul(request)
                response = await _serve(request, door)
            except Exception as error:
                response = _failure_response(request, error, door.error)
            # The header is the response's own here, so its messages go out unwrapped (a
            # stream sends one per read of the upstream's body).
            if "x-request-id" not in response.headers:
                response.raw_headers.append(header)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send_with_id)


class _Capacity:
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


ErrorWire = Callable[[GatewayError, str | None], tuple[int, bytes]]
"""A door's error on its wire: (status, body)."""


def _chat_error(error: GatewayError, request_id: str | None) -> tuple[int, bytes]:
    return error.status, orjson.dumps(error.body(request_id))


def _messages_error(error: GatewayError, request_id: str | None) -> tuple[int, bytes]:
    body = messages_wire.error_body(error, request_id)
    return messages_wire.error_status(error), orjson.dumps(body)


def _error_response(
    error: GatewayError, request_id: str | None, wire: ErrorWire = _chat_error
) -> Response:
    status, body = wire(error, request_id)
    return Response(body, status_code=status, media_type=_JSON, headers=error.headers())


async def authenticate(request: Request) -> Caller:
    """The caller behind ``Authorization: Bearer <key>``; 401 ``invalid_api_key`` otherwise.

    The key is looked up in the keys read model on every request, so a revocation (which
    brings that model up to date before it returns) is refused at once.
    """
    gateway: Gateway = request.app.state.gateway
    return await _authenticate(request, gateway.config)


async def _authenticate(request: Request, config: Config) -> Caller:
    _refuse_repeated(request.scope["headers"])
    return _caller(await find_key(request.app.state.store, _secret(request.headers)), config)


async def _identify_anthropic(request: Request) -> tuple[Caller, dict[str, str]]:
    """The caller of an Anthropic-door route other than inference (its key read from the
    ledger every time), and the request's headers by name."""
    named = _headers_by_name(request)
    gateway: Gateway = request.app.state.gateway
    key = await find_key(request.app.state.store, _anthropic_secret(named))
    return _caller(key, gateway.config), named


async def _caller_of_secret(request: Request, secret: str) -> Caller:
    """The console's sign-in: the key given in its form, read as a Bearer key is."""
    gateway: Gateway = request.app.state.gateway
    return _caller(await find_key(request.app.state.store, secret), gateway.config)


async def _caller_of_key_id(request: Request, key_id: str) -> Caller:
    """A console session's key, read again on each request (a revoked key: 401)."""
    gateway: Gateway = request.app.state.gateway
    return _caller(await find_key_by_id(request.app.state.store, key_id), gateway.config)


def _secret(headers: Mapping[str, str]) -> str:
    header = headers.get("authorization", "")
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise invalid_api_key("missing API key: send Authorization: Bearer <key>")
    return secret.strip()


def _anthropic_secret(headers: Mapping[str, str]) -> str:
    """The Anthropic door's key: ``x-api-key``, as Anthropic's clients send it, or a Bearer
    key (``ANTHROPIC_AUTH_TOKEN``); both at once is refused as ambiguous."""
    key = headers.get("x-api-key")
    if key is None:
        return _secret(headers)
    if "authorization" in headers:
        raise invalid_api_key("send the key once: x-api-key or Authorization, not both")
    if not key.strip():
        raise invalid_api_key("missing API key: send x-api-key: <key>")
    return key.strip()


def _caller(key: ApiKey | None, config: Config) -> Caller:
    if key is None or key.revoked:
        raise invalid_api_key()
    workspace = config.workspace(key.workspace)
    if workspace is None:
        raise invalid_api_key(f"the key's workspace {key.workspace!r} is not configured")
    return Caller(key.key_id, workspace, key.role, key.budget, key.version, key.endpoints)


async def _refuse_nul(request: Request) -> None:
    """PostgreSQL text cannot hold NUL, so no id, name or filter contains one: a URL that
    does is malformed, refused here rather than failing a query in the database."""
    if "\x00" in request.scope["path"] or b"%00" in request.scope["query_string"]:
        raise invalid_request("the URL contains a NUL character (%00)")


def _wire_of(request: Request) -> ErrorWire:
    """The error wire of the door a path belongs to: the Anthropic door's routes answer
    Anthropic's error object whatever went wrong (a 405 included)."""
    path = request.scope["path"]
    if path == _MESSAGES_PATH or path.startswith(_MESSAGES_PATH + "/"):
        return _messages_error
    return _chat_error


def _failure_response(
    request: Request, error: Exception, wire: ErrorWire = _chat_error
) -> Response:
    """The answer to an exception a handler raised, on the door's ``wire``: its own for a
    :class:`GatewayError`, 503 when the ledger's database could not do the work now
    (``ledger.store.db.is_unavailable``), else a bare 500 (logged, never shown): a
    constraint violated is a bug, not an outage."""
    if isinstance(error, GatewayError):
        if error.code is ErrorCode.LEDGER_UNAVAILABLE:
            _refused_in_outage(request, error)
        return _error_response(error, _request_id(request), wire)
    if isinstance(error, ClientDisconnect):
        # The client left before its body arrived: nobody reads the answer, nothing to log.
        return _error_response(client_canceled(), _request_id(request), wire)
    if is_unavailable(error):
        _refused_in_outage(request, error)
        return _error_response(ledger_unavailable(), _request_id(request), wire)
    log.exception("unexpected error serving %s", request.url.path, exc_info=error)
    return _error_response(internal_error(), _request_id(request), wire)


def _refused_in_outage(request: Request, error: Exception) -> None:
    """Counted, not logged: the outage is said once, with its count (ledger.store.outage)."""
    store: EventStore | None = getattr(request.app.state, "store", None)
    if store is not None:
        store.outage.refused(error)


async def _siblings_metrics(sockets: tuple[str, ...]) -> list[bytes]:
    """The other workers' own expositions, read on their Unix sockets (router.serving.workers); a
    worker that does not answer (being started again) is left out."""

    async def one(path: str) -> bytes | None:
        transport = httpx.AsyncHTTPTransport(uds=path)
        try:
            async with httpx.AsyncClient(transport=transport, timeout=2.0) as client:
                response = await client.get("http://worker/metrics", headers={_OWN_METRICS: "1"})
                response.raise_for_status()
                return response.content
        except httpx.HTTPError as error:
            log.warning("metrics of the worker at %s left out: %s", path, type(error).__name__)
            return None

    return [text for text in await asyncio.gather(*map(one, sockets)) if text is not None]


async def _share_appends(
    store: EventStore, settings: AppSettings
) -> AppendServer | AppendClient | None:
    """The workers of `waybill serve --workers N` commit through one appender, the first
    worker's (ledger.store.shared_appends)."""
    path = settings.appends_socket
    if path is None:
        return None
    if not settings.background:
        client = AppendClient(path)
        store.forward_to(client)
        return client
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # an earlier run's
    server = AppendServer(store, path)
    await server.start()
    return server


def _request_id(request: Request) -> str:
    return str(request.scope.get("state", {}).get("request_id") or new_id("req"))


def create_app(settings: AppSettings) -> FastAPI:
    config = settings.config

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = create_engine(settings.database_url)
        store = EventStore(engine)
        sharing = await _share_appends(store, settings)
        # Traces and metrics (contract §8), in the background, never on the request path.
        telemetry = Telemetry.from_env(store, export_traces=settings.background)
        app.state.telemetry = telemetry
        breakers = _breakers(config, settings)
        owner = incarnation_owner(settings.instance_id or new_id("gw"), new_id("inc"))
        latency = latency_board(config.generation, settings.redis_url)
        slots = endpoint_slots(settings.redis_url)  # one for the app: every generation's
        app.state.slots = slots
        disabling = Disabling(
            store,
            redis_url=settings.redis_url,
            on_change=functools.partial(_disabled_gauge, telemetry),
        )
        gateway = Gateway(
            config,
            store,
            breakers,
            instance_id=owner,
            latency=latency,
            slots=slots,
            disabling=disabling,
        )
        await register_instance(engine, owner)
        if settings.instance_id is not None:
            # Before serving: an earlier run of this instance is dead (we replaced it), so
            # its holds need not wait for six missed heartbeats.
            recovered = await recover_earlier_incarnations(store, settings.instance_id, owner)
            if recovered:
                log.warning("recovered %d holds of earlier runs of this instance", recovered)
        app.state.settings = settings
        app.state.retiring = set()
        app.state.store = store
        app.state.gateway = gateway
        app.state.idempotency = IdempotencyStore(engine)
        app.state.keys = KeyCache(store)
        app.state.capacity = _Capacity(settings.max_in_flight)
        # Read models (request views, keys, ...) follow the ledger while the gateway runs:
        # from a child process when `waybill serve` runs on PostgreSQL (ledger.views.follow).
        stop = asyncio.Event()
        following: asyncio.Task[Any]
        if not settings.background:  # another worker keeps them
            following = asyncio.create_task(stop.wait())
        elif settings.follower_process and store.engine.dialect.name == "postgresql":
            following = asyncio.create_task(follow_in_child(settings.database_url, stop))
        else:
            runner = ProjectionRunner(store, all_projections())
            following = asyncio.create_task(runner.run(stop, settle_s=SETTLE_S))
        telemetry_task = asyncio.create_task(telemetry.run(stop))
        # Signed checkpoints of the ledger's tree, outside the database (contract §7).
        app.state.checkpoints = _checkpointing(store, config.checkpoints, settings)
        # Holds left by gateways that died mid-attempt become unknown-usage settlements.
        keeping = asyncio.create_task(
            _keep_alive(store, owner, settings.heartbeat_s, stop, disabling)
        )
        # Disabled endpoints: another gateway's changes, as soon as it rings (with Redis).
        listening = asyncio.create_task(disabling.listen(stop))
        hangup = _on_hangup(app)
        try:
            await _activate_config(store, config)
            await disabling.activate(config)
            yield
        finally:
            hangup()
            stop.set()
            await keeping
            await listening
            if app.state.checkpoints is not None:
                await app.state.checkpoints.stop()  # its last checkpoint needs the store
            telemetry.abort()
            await following
            await telemetry_task
            telemetry.shutdown()
            await asyncio.gather(*app.state.retiring, return_exceptions=True)
            await app.state.gateway.aclose()
            await slots.aclose()
            await disabling.aclose()
            await stop_instance(engine, owner)
            await store.close()
            if sharing is not None:
                await sharing.close()
            await engine.dispose()

    app = FastAPI(
        title="Waybill",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        dependencies=[Depends(_refuse_nul)],
    )
    # The schema states the serving config's limits (a reload may change them).
    api_doc.install_openapi(app, lambda: _serving_config(app, settings).limits)

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, error: GatewayError) -> Response:
        return _failure_response(request, error)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> Response:
        if error.status_code == 404:
            answer = route_not_found()
        else:  # e.g. a 405, for a method the route does not take
            answer = invalid_request(str(error.detail), status=error.status_code)
        response = _error_response(answer, _request_id(request), _wire_of(request))
        response.headers.update(error.headers or {})  # a 405's Allow (RFC 9110)
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> Response:
        return _error_response(
            invalid_request("invalid request"), _request_id(request), _wire_of(request)
        )

    @app.exception_handler(LedgerUnavailable)
    @app.exception_handler(DBAPIError)
    @app.exception_handler(Exception)
    async def _failed(request: Request, error: Exception) -> Response:
        return _failure_response(request, error)

    # Liveness touches no database: `schema` is the revision this code migrates to (its
    # Alembic head); /readyz says whether the database is at it (contract §3).
    alive = orjson.dumps({"status": "ok", "version": package_version(), "schema": head_revision()})

    @app.get("/healthz", openapi_extra=api_doc.HEALTHZ)
    async def healthz() -> Response:
        return Response(alive, media_type=_JSON)

    @app.get("/metrics", openapi_extra=api_doc.METRICS)
    async def metrics(request: Request) -> Response:
        telemetry: Telemetry = request.app.state.telemetry
        own = telemetry.prometheus_text()
        siblings = settings.siblings
        if siblings and _OWN_METRICS not in request.headers:
            own = merge_expositions([own, *await _siblings_metrics(siblings)])
        return Response(own, media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/readyz", openapi_extra=api_doc.READYZ)
    async def readyz(request: Request) -> Response:
        store: EventStore = request.app.state.store
        try:
            revision = await current_revision(store.engine)
        except Exception as exc:  # any database failure means "not ready", said plainly
            body = {"status": "unavailable", "database": f"unreachable: {type(exc).__name__}"}
            return Response(orjson.dumps(body), status_code=503, media_type=_JSON)
        head = head_revision()
        if revision != head:
            body = {"status": "unavailable", "database": f"at migration {revision}, need {head}"}
            return Response(orjson.dumps(body), status_code=503, media_type=_JSON)
        return Response(orjson.dumps({"status": "ready", "migration": head}), media_type=_JSON)

    @app.post("/v1/admin/config/reload", openapi_extra=api_doc.ADMIN_RELOAD)
    async def reload(request: Request) -> Response:
        """Reload the config file (admin keys): the same as SIGHUP, with an answer."""
        generation = request.headers.get(WORKER_RELOAD_HEADER)
        if generation is not None and _on_own_socket(request):
            await _take_accepted_config(request.app, generation)
            return Response(orjson.dumps({"generation": generation}), media_type=_JSON)
        caller = await authenticate(request)
        if caller.role != "admin":
            raise permission_denied("reloading the config takes an admin key")
        try:
            previous, current = await reload_config(request.app)
        except ConfigError as error:
            raise invalid_request(f"config is invalid, keeping the current one: {error}") from None
        body = {"previous_generation": previous, "generation": current}
        return Response(orjson.dumps(body), media_type=_JSON)

    @app.get("/v1/models", openapi_extra=api_doc.MODELS)
    async def models(request: Request) -> Response:
        caller = await authenticate(request)
        gateway: Gateway = request.app.state.gateway
        data = [
            {"id": group.name, "object": "model", "created": 0, "owned_by": "waybill"}
            for group in gateway.models_for(caller.workspace)
        ]
        return Response(orjson.dumps({"object": "list", "data": data}), media_type=_JSON)

    app.post("/v1/chat/completions", openapi_extra=api_doc.CHAT_COMPLETIONS)(_chat_completions)
    app.post("/v1/messages", openapi_extra=api_doc.MESSAGES)(_messages)
    app.post(_EMBEDDINGS_PATH, openapi_extra=api_doc.EMBEDDINGS)(_embeddings)
    app.include_router(
        count_tokens_router(
            _identify_anthropic,
            lambda request, error: _failure_response(request, error, _messages_error),
        )
    )
    app.include_router(queries_router(authenticate))
    app.include_router(spend_router(authenticate))
    app.include_router(reconcile_router(authenticate))
    app.include_router(proof_router(authenticate, lambda: _serving_config(app, settings)))
    app.include_router(
        console_router(
            Identify(by_secret=_caller_of_secret, by_key_id=_caller_of_key_id),
            settings.console_secret or secret_from(None),
            lambda: _serving_config(app, settings),
        )
    )
    app.include_router(endpoints_router(authenticate, lambda: app.state.gateway))
    return _Edge(app)  # type: ignore[return-value]


async def _chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``: served by :class:`_Edge` directly (see there), and
    declared on the FastAPI app for its schema and for any other method on the path."""
    return await _serve(request, _DOORS[_CHAT_PATH])


async def _messages(request: Request) -> Response:
    """``POST /v1/messages`` (the Anthropic door), served as the chat route is."""
    return await _serve(request, _DOORS[_MESSAGES_PATH])


async def _embeddings(request: Request) -> Response:
    """``POST /v1/embeddings`` (the embeddings door), served as the chat route is."""
    return await _serve(request, _DOORS[_EMBEDDINGS_PATH])


async def _serve(request: Request, door: _Door) -> Response:
    """An inference request through ``door``: the key, the body and headers read once, the
    Idempotency-Key claimed, the core asked, the answer on the door's wire."""
    request_id = _request_id(request)
    state = request.app.state
    # One gateway (one config generation) serves this request from end to end, even if
    # a reload swaps in another meanwhile.
    gateway: Gateway = state.gateway
    config = gateway.config
    keys: KeyCache = state.keys
    named = _headers_by_name(request)
    secret = door.secret(named)
    key, unconfirmed = await keys.find(secret)
    caller = _caller(key, config)
    reread = functools.partial(_reread, keys, secret, config)
    try:
        call = door.parse(await _read_body(request, named), named, config)
        headers = read_headers(named)
        group = config.model_group(call.model_group)
        if call.model_group not in caller.workspace.models or not group:
            raise model_not_found(call.model_group)
        if group.kind != door.kind:
            raise model_kind_mismatch(call.model_group, group.kind, door.kind)
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
            return _replay(claimed)
        claim = claimed
    capacity: _Capacity = state.capacity
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
            started = await _unless_disconnected(
                request.scope,
                request.receive,
                _on_current_key(
                    lambda c: gateway.stream(c, door.to_core(call, headers, c), request_id),
                    caller,
                    reread,
                ),
            )
            body, response_headers, write_directly = door.stream(started)
            if claim is not None:  # every piece of it is recorded: all go through the body
                body = _recorded(body, state.idempotency, claim, response_headers, gateway)
                write_directly = None
            return _EventStream(body, response_headers, on_end=release, direct=write_directly)
        completion = await _unless_disconnected(
            request.scope,
            request.receive,
            _on_current_key(
                lambda c: gateway.complete(c, door.to_core(call, headers, c), request_id),
                caller,
                reread,
            ),
        )
        payload, response_headers = door.answer(completion)
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
    except _ClientGone:
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
    answer: Callable[[Completion], tuple[bytes, dict[str, str]]]
    stream: Callable[
        [StreamingCompletion], tuple[AsyncGenerator[bytes, None], dict[str, str], Directly]
    ]
    error: ErrorWire
    kind: str = "chat"  # the model group kind it serves; another is model_kind_mismatch


def _chat_stream(
    started: StreamingCompletion,
) -> tuple[AsyncGenerator[bytes, None], dict[str, str], Directly]:
    return started.body, chat.stream_headers(started), started.write_directly


def _messages_stream(
    started: StreamingCompletion,
) -> tuple[AsyncGenerator[bytes, None], dict[str, str], Directly]:
    # Every piece is rewritten into Anthropic's events: none goes out as the upstream's.
    return messages_wire.events(started), messages_wire.stream_headers(started), None


def _never_streams(
    started: StreamingCompletion,
) -> tuple[AsyncGenerator[bytes, None], dict[str, str], Directly]:
    raise AssertionError("an embeddings request never streams (embeddings.parse_body)")


def _messages_parse(raw: bytes, named: Mapping[str, str], config: Config) -> Any:
    return messages.read_body(raw, named.get("anthropic-beta"))


_DOORS: Final[Mapping[str, _Door]] = {
    _CHAT_PATH: _Door(
        secret=_secret,
        parse=lambda raw, named, config: chat.parse_body(raw, config.limits),
        to_core=lambda call, headers, caller: chat.to_core(call, headers, caller.workspace),
        answer=chat.answer,
        stream=_chat_stream,
        error=_chat_error,
    ),
    _MESSAGES_PATH: _Door(
        secret=_anthropic_secret,
        parse=_messages_parse,
        to_core=lambda call, headers, caller: messages.to_core(call, headers, caller.workspace),
        answer=messages_wire.answer,
        stream=_messages_stream,
        error=_messages_error,
    ),
    _EMBEDDINGS_PATH: _Door(
        secret=_secret,
        parse=lambda raw, named, config: embeddings.parse_body(raw),
        to_core=lambda call, headers, caller: embeddings.to_core(call, headers, caller.workspace),
        answer=embeddings.answer,
        stream=_never_streams,
        error=_chat_error,
        kind=embeddings.KIND,
    ),
}


async def _reread(keys: KeyCache, secret: str, config: Config) -> Caller:
    """The caller as the ledger has its key now (401 if revoked or unknown)."""
    keys.evict(secret)
    key, _ = await keys.find(secret)
    return _caller(key, config)


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


def _headers_by_name(request: Request) -> dict[str, str]:
    """The request's headers by (lowercase) name: one pass, where each Starlette
    ``Headers.get`` scans them all (the chat route reads a dozen). A single-valued header
    sent twice is refused (:func:`_refuse_repeated`)."""
    named: dict[str, str] = {}
    for name, value in request.scope["headers"]:
        key = name.decode("latin-1")
        if key in named and _single_valued(key):
            raise _repeated(key)
        named[key] = value.decode("latin-1")
    return named


def _single_valued(name: str) -> bool:
    """A header that must come once (contract §3): with two, which one wins is a guess — a
    proxy adding a stricter cost limit would be ignored, a second key silently dropped."""
    return name in _SINGLE_VALUED or name.startswith("x-waybill-")


_SINGLE_VALUED: Final = frozenset({"authorization", "x-api-key", "idempotency-key"})


def _refuse_repeated(raw: Iterable[tuple[bytes, bytes]]) -> None:
    seen: set[str] = set()
    for name, _ in raw:
        key = name.decode("latin-1")
        if _single_valued(key):
            if key in seen:
                raise _repeated(key)
            seen.add(key)


def _repeated(name: str) -> GatewayError:
    shown = "-".join(part.capitalize() for part in name.split("-"))
    return invalid_request(f"header {shown}: sent more than once; send it once", param=shown)


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


T = TypeVar("T")


class _ClientGone(Exception):
    pass


async def _unless_disconnected(scope: Scope, receive: Receive, work: Coroutine[Any, Any, T]) -> T:
    """Run ``work`` in this task; if the client disconnects first, cancel it (the gateway
    records the attempt in flight as ``client_canceled``, and the upstream call is dropped)
    and raise :class:`_ClientGone`. Served by Waybill's own protocol, the server calls back
    on a hang-up (``router.serving.server``); under another server, a task waits on ``receive``
    (a second task for the work as well, and waiting on both, cost more: ``bench/README.md``,
    "Decisions")."""
    this = asyncio.current_task()
    assert this is not None
    gone = False

    def hang_up() -> None:
        nonlocal gone
        gone = True
        this.cancel()

    watch: Hangup | None = scope.get("extensions", {}).get(HANGUP_EXTENSION, {}).get("watch")
    unwatch = (watch or _watch_receive(receive))(hang_up)
    try:
        return await work
    except asyncio.CancelledError:
        if gone:
            this.uncancel()  # our cancellation, not one from outside: the request ends here
            raise _ClientGone from None
        raise
    finally:
        unwatch()
        if gone and this.cancelling():  # the work ended before our cancellation reached it
            this.uncancel()


def _watch_receive(receive: Receive) -> Hangup:
    """A :data:`Hangup` for any ASGI server: a task reading the next message."""

    def watch(callback: Callable[[], None]) -> Callable[[], None]:
        def done(task: asyncio.Future[None]) -> None:
            if not task.cancelled() and task.exception() is None:
                callback()

        task = asyncio.ensure_future(_disconnected(receive))
        task.add_done_callback(done)

        def unwatch() -> None:
            task.remove_done_callback(done)
            task.cancel()

        return unwatch

    return watch


async def _disconnected(receive: Receive) -> None:
    # The body has been read: the next message from the server is the disconnect (or,
    # once the response is complete, the end of the exchange).
    while (await receive())["type"] != "http.disconnect":
        pass


class _EventStream(Response):
    """The committed stream, sent as it comes; a client that disconnects cancels it.

    What Starlette's StreamingResponse does, without its anyio task group: delivering the
    group's cancellation polls the task on every turn of the loop, a cost every streamed
    request paid (``bench/README.md``, "Decisions")."""

    media_type = _SSE

    def __init__(
        self,
        body: AsyncGenerator[bytes, None],
        headers: Mapping[str, str],
        *,
        on_end: Callable[[], None],
        direct: Callable[[BodyWriter], None] | None = None,
    ) -> None:
        self._body = body
        self._on_end = on_end
        self._direct = direct
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with contextlib.suppress(_ClientGone):
            await _unless_disconnected(scope, receive, self._send(scope, send))

    async def _send(self, scope: Scope, send: Send) -> None:
        body = self._body
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            # Served by Waybill's protocol, reads the gateway passes on unchanged are written
            # straight from the upstream connection's callback (router.serving.server
            # BODY_EXTENSION).
            writer = scope.get("extensions", {}).get(BODY_EXTENSION, {}).get("write")
            if writer is not None and self._direct is not None:
                self._direct(writer)
            async for piece in body:
                await send({"type": "http.response.body", "body": piece, "more_body": True})
                del piece  # not held while the next one is awaited: most of a stream's life
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            # Cancelled while sending, the body is left at a yield: close it now, so that
            # its own cleanup (the request's end on the ledger) runs at once.
            try:
                await body.aclose()
            finally:
                self._on_end()


def _replay(answer: RecordedAnswer) -> Response:
    headers = {**answer.headers, "x-request-id": answer.request_id, "idempotent-replayed": "true"}
    return Response(
        answer.body,
        status_code=answer.status_code,
        media_type=answer.content_type,
        headers=headers,
    )


async def _recorded(
    body: AsyncIterator[bytes],
    idempotency: IdempotencyStore,
    claim: Claim,
    headers: dict[str, str],
    gateway: Gateway,
) -> AsyncGenerator[bytes, None]:
    """The committed stream's bytes, for an Idempotency-Key: the answer is recorded before
    its last piece goes out, so a client that saw the whole stream and retries gets the
    replay, never a 409. Each piece is held until the next one exists (one piece of delay,
    paid only by idempotent streams)."""
    recorded: list[bytes] | None = []
    size = 0
    held: bytes | None = None
    completed = False
    try:
        async for piece in body:
            if held is not None:
                yield held
            held = piece
            if recorded is not None:
                size += len(piece)
                if size <= _MAX_RECORDED_STREAM:
                    recorded.append(piece)
                else:
                    recorded = None
        if recorded is not None:
            answer = RecordedAnswer(claim.request_id, 200, _SSE, headers, b"".join(recorded))
            await idempotency.finish(claim, answer)
            completed = True
        if held is not None:
            yield held
    finally:
        if not completed:
            # Cut short by the client (or too long to keep): a retry runs again.
            gateway._keep(idempotency.abandon(claim))


async def _keep_alive(
    store: EventStore, owner: str, interval_s: float, stop: asyncio.Event, disabling: Disabling
) -> None:
    """Heartbeat, recover the holds of gateways that stopped heartbeating, and catch up with
    the disabled endpoints (whoever changed them, rung or not)."""
    while not stop.is_set():
        try:
            await heartbeat(store.engine, owner)
            store.outage.succeeded()
            await recover_abandoned_holds(store, stale_after_s=interval_s * 6)
            await disabling.sync()
        except Exception as error:  # the next beat retries; recovery must never stop the gateway
            if is_unavailable(error):
                store.outage.failed(error)  # said once per outage
            else:
                log.exception("heartbeat or hold recovery failed")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(interval_s):
                await stop.wait()


def _checkpointing(
    store: EventStore, checkpoints: Checkpoints | None, settings: AppSettings
) -> CheckpointTask | None:
    """The config's checkpointing, if any: in a child process where the read models have
    one (``waybill serve`` on PostgreSQL), else in this process."""
    if checkpoints is None or not settings.background:
        return None
    schedule = Schedule(checkpoints.every_events, checkpoints.every_seconds)
    in_child = settings.follower_process and store.engine.dialect.name == "postgresql"
    return CheckpointTask(
        store,
        checkpoints.key,
        checkpoints.out,
        schedule,
        database_url=settings.database_url if in_child else None,
    )


def _breakers(config: Config, settings: AppSettings) -> BreakerBoard:
    """The breakers of ``config``'s generation, each endpoint's run by its own settings or
    by ``defaults.breaker``: a reload builds them afresh, so new settings hold at once."""
    return breaker_board(
        config.defaults.breaker,
        config.generation,
        settings.redis_url,
        endpoints=config.endpoint_breakers(),
    )


def _serving_config(app: FastAPI, settings: AppSettings) -> Config:
    """The config new requests follow: the gateway's, once it runs; else the settings'."""
    gateway: Gateway | None = getattr(app.state, "gateway", None)
    return settings.config if gateway is None else gateway.config


async def reload_config(app: FastAPI) -> tuple[str, str]:
    """Swap in the config file's current content, in this process or, for the workers of
    ``waybill serve --workers N``, in every worker (``router.serving.reload``). Returns
    (previous generation, new generation). Raises ConfigError (nothing changed), or
    ``reload_incomplete`` naming the workers that did not take it."""
    settings: AppSettings = app.state.settings
    path = settings.config_path
    if path is None:
        raise reload_unavailable()
    accepted = settings.accepted_config
    if accepted is None:
        return await _swap_config(app, await asyncio.to_thread(load_config, path))
    async with one_reload_at_a_time(accepted):
        raw = await asyncio.to_thread(read_config_file, path)
        config = await asyncio.to_thread(parse_config_file, raw, path)
        await asyncio.to_thread(write_accepted, accepted, raw)
        previous, generation = await _swap_config(app, config)
        missing = await reload_siblings(settings.siblings, generation)
    if missing:
        raise reload_incomplete(
            f"generation {generation} is served by this worker but not yet by every other: "
            + "; ".join(missing)
            + " (a worker started again serves it; reload again)"
        )
    return previous, generation


def _on_own_socket(request: Request) -> bool:
    """Whether ``request`` came on this worker's own Unix socket (uvicorn gives a Unix
    socket's scope no port), where only the other workers reach it."""
    server = request.scope.get("server")
    return server is not None and server[1] is None


async def _take_accepted_config(app: FastAPI, generation: str) -> None:
    """Another worker's reload (``router.serving.reload``): swap in the config it accepted,
    which must be of ``generation``."""
    settings: AppSettings = app.state.settings
    accepted, path = settings.accepted_config, settings.config_path
    raw = None if accepted is None else await asyncio.to_thread(read_accepted, accepted)
    if raw is None or path is None:
        raise reload_incomplete("it has no accepted config to take")
    try:
        config = await asyncio.to_thread(parse_config_file, raw, path)
    except ConfigError as error:
        raise reload_incomplete(f"it refused the accepted config: {error}") from None
    if config.generation != generation:
        raise reload_incomplete(f"it found generation {config.generation}, not {generation}")
    await _swap_config(app, config)


async def _swap_config(app: FastAPI, config: Config) -> tuple[str, str]:
    """Swap in ``config``: a new gateway (drivers, breakers of the new generation,
    round-robin state) serves new requests; the old one finishes its own and closes.
    Returns (previous generation, new generation)."""
    settings: AppSettings = app.state.settings
    old: Gateway = app.state.gateway
    store: EventStore = app.state.store
    breakers = _breakers(config, settings)
    latency = latency_board(config.generation, settings.redis_url)
    app.state.gateway = Gateway(
        config,
        store,
        breakers,
        instance_id=old.instance_id,
        latency=latency,
        slots=app.state.slots,
        disabling=old.disabling,
    )
    retiring = asyncio.create_task(old.retire())
    app.state.retiring.add(retiring)
    retiring.add_done_callback(app.state.retiring.discard)
    if config.checkpoints != old.config.checkpoints:
        # One writer per sink: the old task lets go of its sink before the new one starts.
        if app.state.checkpoints is not None:
            await app.state.checkpoints.stop()
        app.state.checkpoints = _checkpointing(store, config.checkpoints, settings)
    await _activate_config(store, config)
    # Disabled endpoints outlive the generation (contract §5); those whose key it changed
    # are enabled (the new gateway already tells their old key's disabling from its own).
    await old.disabling.activate(config)
    log.warning("config reloaded: generation %s -> %s", old.config.generation, config.generation)
    return old.config.generation, config.generation


def _on_hangup(app: FastAPI) -> Callable[[], None]:
    """SIGHUP reloads the config (when serving from a file, in the main thread)."""
    settings: AppSettings = app.state.settings
    if settings.config_path is None or threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()

    async def reload() -> None:
        try:
            await reload_config(app)
        except ConfigError as error:  # keep serving the config that works
            log.error("config reload refused, keeping the current one:\n%s", error)
        except GatewayError as error:  # reload_incomplete: the workers it names did not
            log.error("config reload: %s", error.message)

    def on_signal() -> None:
        task = asyncio.ensure_future(reload())
        app.state.retiring.add(task)
        task.add_done_callback(app.state.retiring.discard)

    loop.add_signal_handler(signal.SIGHUP, on_signal)

    def forget() -> None:
        loop.remove_signal_handler(signal.SIGHUP)

    return forget


def _disabled_gauge(telemetry: Telemetry, states: EndpointStates) -> None:
    """The ``waybill.endpoints.disabled`` gauge, from the fold of the ``endpoints`` stream."""
    telemetry.pipeline.metrics.set_disabled(
        {endpoint: endpoint in states.disabled for endpoint in states.named}
    )


async def _activate_config(store: EventStore, config: Config) -> None:
    """Record ``ConfigActivated`` when this generation differs from the last one recorded
    (once, when several workers or replicas start with it at the same time)."""
    summary = config.redacted_summary()
    digest = hashlib.sha256(orjson.dumps(summary, option=orjson.OPT_SORT_KEYS)).hexdigest()
    activated = ev.ConfigActivated(
        generation=config.generation, config_sha256=digest, summary=summary
    )
    while True:
        history = await store.read_stream("config")
        if history:
            last = history[-1].event()
            if isinstance(last, ev.ConfigActivated) and (
                last.config_sha256 == digest and last.generation == config.generation
            ):
                return
        try:
            await store.append("config", len(history), [activated])
            return
        except WrongExpectedVersion:
            continue  # another process recorded one meanwhile: is it this one?
