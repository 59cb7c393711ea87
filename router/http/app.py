"""The HTTP app (contract §3), its composition root: the lifespan, the routes, health.

The parts are its siblings: the inference edge and door table (``edge``), the answer streamed
(``streaming``), errors on the wire (``failures``), the caller (``auth``), a config's reload and
activation (``reloading``), the process settings (``settings``).

Thin by design: read the request, call :class:`router.request.gateway.Gateway`, write the answer.
Every error a client can see is a :class:`router.errors.GatewayError` rendered as the
contract's JSON body; anything unexpected becomes a bare 500 ``internal_error`` without a
stack trace (and is logged). Every response carries ``X-Request-Id``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import (
    AsyncIterator,
)
from contextlib import asynccontextmanager
from typing import Any, Final

import httpx
import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from sqlalchemy.exc import DBAPIError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from ledger.apikeys import KeyCache
from ledger.books.recovery import (
    heartbeat,
    incarnation_owner,
    recover_abandoned_holds,
    recover_earlier_incarnations,
    register_instance,
    stop_instance,
)
from ledger.store import EventStore, LedgerUnavailable
from ledger.store.db import create_engine, current_revision, head_revision, is_unavailable
from ledger.store.shared_appends import AppendClient, AppendServer
from ledger.views import all_projections
from ledger.views.follow import SETTLE_S, follow_in_child, vacuum_open_tables
from ledger.views.projection import ProjectionRunner
from otel.merge import merge_expositions
from otel.metrics import PROMETHEUS_CONTENT_TYPE
from otel.telemetry import Telemetry
from router.adapters.disabling import Disabling
from router.adapters.idempotency import IdempotencyStore
from router.adapters.latency import latency_board
from router.adapters.rate_counters import rate_counters
from router.adapters.slots import endpoint_slots
from router.config import (
    ConfigError,
)
from router.errors import (
    GatewayError,
    invalid_request,
    permission_denied,
    route_not_found,
)
from router.http import openapi as api_doc
from router.http.auth import authenticate, caller_of_key_id, caller_of_secret, identify_anthropic
from router.http.console import Identify, console_router, secret_from
from router.http.count_tokens import count_tokens_router
from router.http.edge import (
    EMBEDDINGS_PATH,
    RESPONSES_PATH,
    Capacity,
    Edge,
    chat_route,
    embeddings_route,
    messages_route,
    responses_route,
)
from router.http.endpoints import endpoints_router
from router.http.failures import (
    error_response,
    failure_response,
    messages_error,
    refuse_nul,
    request_id_of,
    wire_of,
)
from router.http.keys import keys_router
from router.http.proofs import proof_router
from router.http.queries import queries_router
from router.http.reconcile import reconcile_router
from router.http.reloading import (
    activate_config,
    breakers_for,
    checkpointing,
    disabled_gauge,
    on_hangup,
    on_own_socket,
    reload_config,
    serving_config,
    take_accepted_config,
)
from router.http.settings import DEFAULT_MAX_IN_FLIGHT, AppSettings, default_instance_id
from router.http.spend import spend_router
from router.request.gateway import Gateway
from router.serving.reload import WORKER_RELOAD_HEADER
from router.support.ids import new_id
from router.support.version import package_version

__all__ = [
    "DEFAULT_MAX_IN_FLIGHT",
    "AppSettings",
    "authenticate",
    "create_app",
    "default_instance_id",
    "reload_config",
]

log = logging.getLogger("waybill.app")

_JSON: Final = "application/json"
_OWN_METRICS: Final = "x-waybill-own-metrics"
"""Asks ``GET /metrics`` for this process's metrics alone (a sibling worker asks so)."""


def _allowed(app: FastAPI, request: Request) -> str:
    """Every method the request's path takes, for a 405's ``Allow``: Starlette names only the
    first route of the path, where ``/v1/admin/keys`` has two (GET and POST)."""
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))


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


def create_app(settings: AppSettings) -> FastAPI:
    config = settings.config

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = create_engine(settings.database_url)
        store = EventStore(engine)
        sharing = await _share_appends(store, settings)
        # Traces and metrics (contract §8), in the background, never on the request path.
        telemetry = Telemetry.from_env(
            store, export_traces=settings.background, tenant_key=config.otel.tenant_key
        )
        app.state.telemetry = telemetry
        breakers = breakers_for(config, settings)
        owner = incarnation_owner(settings.instance_id or new_id("gw"), new_id("inc"))
        latency = latency_board(config.generation, settings.redis_url)
        slots = endpoint_slots(settings.redis_url)  # one for the app: every generation's
        app.state.slots = slots
        rates = rate_counters(settings.redis_url)  # the app's: a window outlives a generation
        app.state.rate_counters = rates
        disabling = Disabling(
            store,
            redis_url=settings.redis_url,
            on_change=functools.partial(disabled_gauge, telemetry),
        )
        gateway = Gateway(
            config,
            store,
            breakers,
            instance_id=owner,
            latency=latency,
            slots=slots,
            disabling=disabling,
            rate_counters=rates,
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
        app.state.capacity = Capacity(settings.max_in_flight)
        # Read models (request views, keys, ...) follow the ledger while the gateway runs:
        # from a child process when `waybill serve` runs them (ledger.views.follow).
        stop = asyncio.Event()
        following: asyncio.Task[Any]
        if not settings.background:  # another worker keeps them
            following = asyncio.create_task(stop.wait())
        elif settings.follower_process:
            following = asyncio.create_task(follow_in_child(settings.database_url, stop))
        else:
            runner = ProjectionRunner(store, all_projections())
            following = asyncio.create_task(_follow_here(runner, store, stop))
        telemetry_task = asyncio.create_task(telemetry.run(stop))
        # Signed checkpoints of the ledger's tree, outside the database (contract §7).
        app.state.checkpoints = checkpointing(store, config.checkpoints, settings)
        # Holds left by gateways that died mid-attempt become unknown-usage settlements.
        keeping = asyncio.create_task(
            _keep_alive(store, owner, settings.heartbeat_s, stop, disabling)
        )
        # Disabled endpoints: another gateway's changes, as soon as it rings (with Redis).
        listening = asyncio.create_task(disabling.listen(stop))
        hangup = on_hangup(app)
        try:
            await activate_config(store, config)
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
            await rates.aclose()
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
        dependencies=[Depends(refuse_nul)],
    )
    # The schema states the serving config's limits (a reload may change them).
    api_doc.install_openapi(app, lambda: serving_config(app, settings).limits)

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, error: GatewayError) -> Response:
        return failure_response(request, error)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> Response:
        if error.status_code == 404:
            answer = route_not_found()
        else:  # e.g. a 405, for a method the route does not take
            answer = invalid_request(str(error.detail), status=error.status_code)
        response = error_response(answer, request_id_of(request), wire_of(request))
        response.headers.update(error.headers or {})  # a 405's Allow (RFC 9110)
        if error.status_code == 405:
            response.headers["allow"] = _allowed(app, request)
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> Response:
        return error_response(
            invalid_request("invalid request"), request_id_of(request), wire_of(request)
        )

    @app.exception_handler(LedgerUnavailable)
    @app.exception_handler(DBAPIError)
    @app.exception_handler(Exception)
    async def _failed(request: Request, error: Exception) -> Response:
        return failure_response(request, error)

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
        if generation is not None and on_own_socket(request):
            await take_accepted_config(request.app, generation)
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

    app.post("/v1/chat/completions", openapi_extra=api_doc.CHAT_COMPLETIONS)(chat_route)
    app.post("/v1/messages", openapi_extra=api_doc.MESSAGES)(messages_route)
    app.post(EMBEDDINGS_PATH, openapi_extra=api_doc.EMBEDDINGS)(embeddings_route)
    app.post(RESPONSES_PATH, openapi_extra=api_doc.RESPONSES)(responses_route)
    app.include_router(
        count_tokens_router(
            identify_anthropic,
            lambda request, error: failure_response(request, error, messages_error),
        )
    )
    app.include_router(queries_router(authenticate))
    app.include_router(spend_router(authenticate))
    app.include_router(reconcile_router(authenticate))
    app.include_router(proof_router(authenticate, lambda: serving_config(app, settings)))
    app.include_router(
        console_router(
            Identify(by_secret=caller_of_secret, by_key_id=caller_of_key_id),
            settings.console_secret or secret_from(None),
            lambda: serving_config(app, settings),
        )
    )
    app.include_router(endpoints_router(authenticate, lambda: app.state.gateway))
    app.include_router(keys_router(authenticate, lambda: app.state.gateway))
    return Edge(app)  # type: ignore[return-value]


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


async def _follow_here(runner: ProjectionRunner, store: EventStore, stop: asyncio.Event) -> None:
    """The read models kept in this process, and the open tables vacuumed (PostgreSQL)."""
    await asyncio.gather(runner.run(stop, settle_s=SETTLE_S), vacuum_open_tables(store, stop))
