"""A real gateway for end-to-end tests: uvicorn on 127.0.0.1, fake providers over real HTTP,
the ledger on the test's database, and the ``openai`` SDK as the client."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import httpx
import pytest
import uvicorn
from openai import AsyncOpenAI

from ledger import apikeys
from ledger.store import EventStore, RecordedEvent
from ledger.store.db import create_engine
from router.config import Config, parse_config
from router.fake_provider import FakeUpstream
from router.http.app import AppSettings, create_app
from router.serving.server import UVICORN_OPTIONS
from tests.helpers import REDIS_URL, breaker_keys_removed, eventually, redis_up

ANTHROPIC_ENV = {"FAKE_KEY": "sk-fake-secret-never-logged"}


BASE_DEFAULTS = {
    "deadline_ms": "20000",
    "attempt_timeout_ms": "5000",
    "first_token_timeout_ms": "3000",
    "stream_idle_timeout_ms": "3000",
    # Same-endpoint retries are off unless a test turns them on, so hit counts are exact.
    "retry_same_endpoint": "{rate_limited: {max: 0}, upstream_unavailable: {max: 0}}",
}


@dataclass
class Route:
    """One mapping of the test's model group, to a fake provider named ``upstream``."""

    upstream: str
    tier: int = 0
    weight: int = 1
    model: str = "fake-model"
    capabilities: Sequence[str] = ("text", "stream", "tools", "json_schema", "vision")
    context_window: int = 128000
    max_output_tokens: int = 4096
    price: str = "{input_per_mtok: 1.0, output_per_mtok: 2.0}"
    resume: str = "none"


@dataclass
class Gateway:
    url: str
    secret: str
    key_id: str
    store: EventStore
    upstreams: dict[str, FakeUpstream]
    config: Config
    served_store: EventStore  # the serving app's own store (for fault injection)
    clients: list[AsyncOpenAI] = field(default_factory=list)
    app_state: Any = None  # the serving app's state (its gateway, its disabled endpoints)

    def client(self, secret: str | None = None, **kw: Any) -> AsyncOpenAI:
        client = AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=secret or self.secret, max_retries=0, **kw
        )
        self.clients.append(client)
        return client

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.url, headers={"Authorization": f"Bearer {self.secret}"}, timeout=30
        )

    async def events(self, request_id: str) -> list[RecordedEvent]:
        return await self.store.read_stream(f"request-{request_id}")

    async def types(self, request_id: str) -> list[str]:
        return [e.type for e in await self.events(request_id)]

    async def wait_for_types(self, request_id: str, last: str) -> list[str]:
        async def done() -> bool:
            types = await self.types(request_id)
            return bool(types) and types[-1] == last

        await eventually(done)
        return await self.types(request_id)


def config_text(
    upstreams: dict[str, FakeUpstream],
    routes: Sequence[Route],
    *,
    defaults: dict[str, str] | None = None,
    generation: str = "test-1",
    drivers: dict[str, str] | None = None,
    trust_not_started: Sequence[str] = (),
    workspace_extra: str = "",
    endpoint_extra: dict[str, str] | None = None,
    dead_endpoints: Sequence[str] = (),
    limits: str = "",
    checkpoints: str = "",
    otel: str = "",
    policies: dict[str, str] | None = None,
    strategies: dict[str, str] | None = None,
    groups: dict[str, str] | None = None,
    workspace_models: dict[str, Sequence[str]] | None = None,
    embedding_routes: Sequence[Route] = (),
) -> str:
    """``policies``, ``strategies``: model group name → its ``policy:`` block (a YAML flow
    mapping), its ``strategy``. ``chat`` always exists; any other name is one more group
    with the same mappings. ``groups``: more model groups, name → the YAML of the rest of
    the group (:func:`mappings_yaml` writes mappings); ``workspace_models``: a workspace's
    model groups, when not every group's. ``embedding_routes``: the mappings of one more
    group, ``embed``, of kind ``embeddings``."""
    drivers = drivers or {}
    policies = policies or {}
    endpoint_extra = endpoint_extra or {}
    endpoints = []
    bases = {
        name: up.root_url if drivers.get(name) == "anthropic" else up.base_url
        for name, up in upstreams.items()
    }
    for name in dead_endpoints:
        bases[name] = f"http://127.0.0.1:{closed_port()}/v1"  # nothing listens: connect error
    for name, base in bases.items():
        driver = drivers.get(name, "openai")
        endpoints.append(
            f"""  - id: {name}
    driver: {driver}
    base_url: {base}
    api_key: ${{env:FAKE_KEY}}
    region: us-east
    data_classes: [public, internal]
    trust_not_started: {"true" if name in trust_not_started else "false"}
{endpoint_extra.get(name, "")}
"""
        )
    mappings = [mappings_yaml(routes)]
    settings = {**BASE_DEFAULTS, **(defaults or {})}
    defaults_yaml = "".join(f"  {key}: {value}\n" for key, value in settings.items())
    limits_yaml = f"limits: {limits}\n" if limits else ""
    if checkpoints:
        limits_yaml += f"checkpoints: {checkpoints}\n"
    if otel:
        limits_yaml += f"otel: {otel}\n"
    strategies = strategies or {}
    names = list(dict.fromkeys(["chat", *policies, *strategies]))
    more = groups or {}
    group_yaml = "".join(
        f"  - name: {name}\n"
        + (f"    policy: {policies[name]}\n" if name in policies else "")
        + (f"    strategy: {strategies[name]}\n" if name in strategies else "")
        + (more[name] if name in more else f"    mappings:\n{''.join(mappings)}")
        for name in names
    ) + "".join(f"  - name: {name}\n{rest}" for name, rest in more.items() if name not in names)
    names = list(dict.fromkeys([*names, *more]))
    if embedding_routes:
        embed = mappings_yaml(embedding_routes)
        group_yaml += f"  - name: embed\n    kind: embeddings\n    mappings:\n{embed}"
        names.append("embed")
    allowed = {"acme": names, "other": names, **(workspace_models or {})}
    return f"""generation: {generation}
{limits_yaml}defaults:
{defaults_yaml}
endpoints:
{"".join(endpoints)}
models:
{group_yaml}
workspaces:
  - id: acme
    models: [{", ".join(allowed["acme"])}]
    regions: [us-east]
    data_class: internal
{workspace_extra}
  - id: other
    models: [{", ".join(allowed["other"])}]
    regions: [us-east]
    data_class: internal
"""


def mappings_yaml(routes: Sequence[Route]) -> str:
    """The ``mappings:`` items of a model group, one per route."""
    mappings = []
    for route in routes:
        mappings.append(
            f"""      - endpoint: {route.upstream}
        model: {route.model}
        tier: {route.tier}
        weight: {route.weight}
        capabilities: [{", ".join(route.capabilities)}]
        context_window: {route.context_window}
        max_output_tokens: {route.max_output_tokens}
        resume: {route.resume}
        price: {route.price}
"""
        )
    return "".join(mappings)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def serve(
    settings: AppSettings, *, plain_uvicorn: bool = False
) -> AsyncIterator[tuple[str, Any]]:
    """The served app's URL, and the app (its ``.app.state`` holds the gateway's own store).
    ``plain_uvicorn``: served by uvicorn's own HTTP protocol, as another server would serve
    the app, without Waybill's (``router.serving.server``)."""
    app = create_app(settings)
    options = {**UVICORN_OPTIONS, "http": "httptools"} if plain_uvicorn else UVICORN_OPTIONS
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, **options))
    task = asyncio.create_task(server.serve())

    async def started() -> bool:
        if task.done():
            task.result()  # surface a start-up failure
        return server.started

    await eventually(started, within_s=20)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        await task


@asynccontextmanager
async def running_gateway(
    database_url: str,
    upstream_names: Sequence[str],
    routes: Sequence[Route],
    *,
    redis_url: str | None = None,
    max_in_flight: int = 512,
    config_file: Path | None = None,
    plain_uvicorn: bool = False,
    environ: dict[str, str] | None = None,
    heartbeat_s: float = 5.0,
    console_secret: bytes | None = None,
    archive_dir: Path | None = None,
    **config_options: Any,
) -> AsyncIterator[Gateway]:
    """``environ``: more of the environment the config is read in (``${env:...}``, proxies);
    ``console_secret``: the console's signing secret (gateways given one share sessions);
    ``archive_dir``: where the archived months are (``WAYBILL_ARCHIVE_DIR``)."""
    async with AsyncExitStack() as stack:
        upstreams = {
            name: await stack.enter_async_context(FakeUpstream(name)) for name in upstream_names
        }
        text = config_text(upstreams, routes, **config_options)
        config = parse_config(text, environ={**ANTHROPIC_ENV, **(environ or {})})
        if config_file is not None:  # served from a file, so that it can be reloaded
            await asyncio.to_thread(config_file.write_text, text)
        engine = create_engine(database_url)
        store = EventStore(engine)
        stack.push_async_callback(engine.dispose)
        stack.push_async_callback(store.close)
        key = await apikeys.create_key(store, "acme", "client")
        settings = AppSettings(
            config,
            database_url,
            redis_url=redis_url,
            max_in_flight=max_in_flight,
            config_path=str(config_file) if config_file else None,
            heartbeat_s=heartbeat_s,
            console_secret=console_secret,
            archive_dir=archive_dir,
        )
        url, app = await stack.enter_async_context(serve(settings, plain_uvicorn=plain_uvicorn))
        gateway = Gateway(
            url,
            key.secret,
            key.key_id,
            store,
            upstreams,
            config,
            served_store=app.app.state.store,
            app_state=app.app.state,
        )
        try:
            yield gateway
        finally:
            for client in gateway.clients:
                await client.close()


@asynccontextmanager
async def gateway_with_breakers(
    database_url: str,
    shared: bool,
    name: str,
    routes: Sequence[Route] = (Route("east", tier=0), Route("west", tier=1)),
    **options: Any,
) -> AsyncIterator[Gateway]:
    """:func:`running_gateway` (by default east on tier 0, west on tier 1) with its breakers
    in process, or ``shared`` through the test Redis (the test is skipped when none answers),
    under a config generation of its own (``name`` and a random suffix) whose Redis keys are
    deleted afterwards."""
    if shared and not redis_up():
        pytest.skip(f"no Redis at {REDIS_URL}")
    generation = f"{name}-{uuid.uuid4().hex[:8]}"
    with breaker_keys_removed(REDIS_URL, generation):
        async with running_gateway(
            database_url,
            ["east", "west"],
            list(routes),
            redis_url=REDIS_URL if shared else None,
            generation=generation,
            **options,
        ) as gw:
            yield gw


class Upstream(Protocol):
    """Where a provider the test runs itself listens (what ``config_text`` reads of one)."""

    root_url: str
    base_url: str


@asynccontextmanager
async def gateway_before(
    database_url: str, upstream: Upstream, *, max_in_flight: int = 512
) -> AsyncIterator[tuple[str, str, EventStore]]:
    """A gateway whose group ``chat`` has one mapping, endpoint ``raw`` model ``m``, to a
    provider the test runs itself: its URL, an API key's secret and the ledger."""
    text = config_text({"raw": cast(FakeUpstream, upstream)}, [Route("raw", model="m")])
    config = parse_config(text, environ=ANTHROPIC_ENV)
    engine = create_engine(database_url)
    store = EventStore(engine)
    try:
        key = await apikeys.create_key(store, "acme", "client")
        settings = AppSettings(config, database_url, max_in_flight=max_in_flight)
        async with serve(settings) as (url, _):
            yield url, key.secret, store
    finally:
        await store.close()
        await engine.dispose()
