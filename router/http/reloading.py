"""A config's activation and its reload: ``ConfigActivated`` recorded, a new gateway swapped in
(SIGHUP, the admin API, or another worker's reload), and the breakers and checkpointing a
generation runs with."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import signal
import threading
from collections.abc import (
    Callable,
)

import orjson
from fastapi import FastAPI, Request

from ledger import events as ev
from ledger.audit.checkpointer import CheckpointTask, Schedule
from ledger.endpoints import EndpointStates
from ledger.store import EventStore, WrongExpectedVersion
from otel.telemetry import Telemetry
from router.adapters.breakers import BreakerBoard, breaker_board
from router.adapters.latency import latency_board
from router.config import (
    Checkpoints,
    Config,
    ConfigError,
    load_config,
    parse_config_file,
    read_config_file,
)
from router.errors import (
    GatewayError,
    reload_incomplete,
    reload_unavailable,
)
from router.http.settings import AppSettings
from router.request.gateway import Gateway
from router.serving.reload import (
    one_reload_at_a_time,
    read_accepted,
    reload_siblings,
    write_accepted,
)

log = logging.getLogger("waybill.app")


def checkpointing(
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


def breakers_for(config: Config, settings: AppSettings) -> BreakerBoard:
    """The breakers of ``config``'s generation, each endpoint's run by its own settings or
    by ``defaults.breaker``: a reload builds them afresh, so new settings hold at once."""
    return breaker_board(
        config.defaults.breaker,
        config.generation,
        settings.redis_url,
        endpoints=config.endpoint_breakers(),
    )


def serving_config(app: FastAPI, settings: AppSettings) -> Config:
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


def on_own_socket(request: Request) -> bool:
    """Whether ``request`` came on this worker's own Unix socket (uvicorn gives a Unix
    socket's scope no port), where only the other workers reach it."""
    server = request.scope.get("server")
    return server is not None and server[1] is None


async def take_accepted_config(app: FastAPI, generation: str) -> None:
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
    breakers = breakers_for(config, settings)
    latency = latency_board(config.generation, settings.redis_url)
    app.state.gateway = Gateway(
        config,
        store,
        breakers,
        instance_id=old.instance_id,
        latency=latency,
        slots=app.state.slots,
        disabling=old.disabling,
        rate_counters=app.state.rate_counters,
    )
    retiring = asyncio.create_task(old.retire())
    app.state.retiring.add(retiring)
    retiring.add_done_callback(app.state.retiring.discard)
    if config.checkpoints != old.config.checkpoints:
        # One writer per sink: the old task lets go of its sink before the new one starts.
        if app.state.checkpoints is not None:
            await app.state.checkpoints.stop()
        app.state.checkpoints = checkpointing(store, config.checkpoints, settings)
    await activate_config(store, config)
    # Disabled endpoints outlive the generation (contract §5); those whose key it changed
    # are enabled (the new gateway already tells their old key's disabling from its own).
    await old.disabling.activate(config)
    log.warning("config reloaded: generation %s -> %s", old.config.generation, config.generation)
    return old.config.generation, config.generation


def on_hangup(app: FastAPI) -> Callable[[], None]:
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


def disabled_gauge(telemetry: Telemetry, states: EndpointStates) -> None:
    """The ``waybill.endpoints.disabled`` gauge, from the fold of the ``endpoints`` stream."""
    telemetry.pipeline.metrics.set_disabled(
        {endpoint: endpoint in states.disabled for endpoint in states.named}
    )


async def activate_config(store: EventStore, config: Config) -> None:
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
