"""Config reload: new requests follow the new generation, attempts in flight stay bound to
the endpoint they were given, breakers start afresh by the new settings, a bad file changes
nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from ledger import apikeys
from router.fake_provider import Behavior
from router.serving.reload import WORKER_RELOAD_HEADER
from tests.gateway.harness import ANTHROPIC_ENV, Route, config_text, running_gateway

BODY: dict[str, Any] = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(autouse=True)
def _secrets_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # A reload reads the file as `waybill serve` does: ${env:...} from the environment.
    for name, value in ANTHROPIC_ENV.items():
        monkeypatch.setenv(name, value)


async def test_reload_serves_new_requests_by_the_new_config_and_never_redirects_an_attempt(
    sqlite_url: str, tmp_path: Path
) -> None:
    config_file = tmp_path / "waybill.yaml"
    routes = [Route("east", tier=0), Route("west", tier=1)]
    async with running_gateway(sqlite_url, ["east", "west"], routes, config_file=config_file) as gw:
        admin = await apikeys.create_key(gw.store, "acme", "admin")
        east, west = gw.upstreams["east"], gw.upstreams["west"]
        east.set_plan([Behavior.ok(latency_ms=1500)])
        async with (
            gw.http() as http,
            httpx.AsyncClient(
                base_url=gw.url, headers={"Authorization": f"Bearer {admin.secret}"}
            ) as admin_http,
        ):
            in_flight = asyncio.create_task(http.post("/v1/chat/completions", json=BODY))
            await east.wait_for_async(lambda up: up.hits == 1)
            # The new generation disables east.
            config_file.write_text(
                config_text(
                    gw.upstreams, routes, endpoint_extra={"east": "    enabled: false"}
                ).replace("generation: test-1", "generation: test-2")
            )
            reloaded = await admin_http.post("/v1/admin/config/reload")
            assert reloaded.status_code == 200, reloaded.text
            assert reloaded.json() == {"previous_generation": "test-1", "generation": "test-2"}
            after = await http.post("/v1/chat/completions", json=BODY)
            assert after.headers["x-waybill-endpoint"] == "west"
            first = await in_flight
            assert first.status_code == 200
            assert first.headers["x-waybill-endpoint"] == "east"  # bound before the reload
            assert (east.hits, west.hits) == (1, 1)
        activated = [e.data["generation"] for e in await gw.store.read_stream("config")]
        assert activated == ["test-1", "test-2"]
        received = (await gw.events(after.headers["x-request-id"]))[0].data
        assert received["config_generation"] == "test-2"


async def test_a_new_generation_resets_the_breakers(sqlite_url: str, tmp_path: Path) -> None:
    config_file = tmp_path / "waybill.yaml"
    routes = [Route("east", tier=0), Route("west", tier=1)]
    async with running_gateway(sqlite_url, ["east", "west"], routes, config_file=config_file) as gw:
        admin = await apikeys.create_key(gw.store, "acme", "admin")
        east = gw.upstreams["east"]
        east.set_plan([Behavior.server_error(), Behavior.server_error()])
        async with gw.http() as http:
            for _ in range(2):
                await http.post("/v1/chat/completions", json=BODY)
            opened = await http.post("/v1/chat/completions", json=BODY)
            assert opened.headers["x-waybill-endpoint"] == "west" and east.hits == 2
            config_file.write_text(config_file.read_text().replace("test-1", "test-2"))
            async with httpx.AsyncClient(
                base_url=gw.url, headers={"Authorization": f"Bearer {admin.secret}"}
            ) as admin_http:
                assert (await admin_http.post("/v1/admin/config/reload")).status_code == 200
            fresh = await http.post("/v1/chat/completions", json=BODY)
            assert fresh.headers["x-waybill-endpoint"] == "east"


async def test_a_reload_that_gives_an_endpoint_breaker_settings_holds_for_new_requests(
    sqlite_url: str, tmp_path: Path
) -> None:
    config_file = tmp_path / "waybill.yaml"
    routes = [Route("east", tier=0), Route("west", tier=1)]
    async with running_gateway(sqlite_url, ["east", "west"], routes, config_file=config_file) as gw:
        admin = await apikeys.create_key(gw.store, "acme", "admin")
        east = gw.upstreams["east"]
        east.set_default(Behavior.server_error())
        config_file.write_text(
            config_text(
                gw.upstreams, routes, endpoint_extra={"east": "    breaker: {failure_threshold: 1}"}
            ).replace("generation: test-1", "generation: test-2")
        )
        async with httpx.AsyncClient(
            base_url=gw.url, headers={"Authorization": f"Bearer {admin.secret}"}
        ) as admin_http:
            assert (await admin_http.post("/v1/admin/config/reload")).status_code == 200
        async with gw.http() as http:
            served = [
                (await http.post("/v1/chat/completions", json=BODY)).headers["x-waybill-endpoint"]
                for _ in range(2)
            ]
        # One failure opens east now (the defaults' threshold is 2): the second request
        # goes straight to west.
        assert served == ["west", "west"] and east.hits == 1
        activated = (await gw.store.read_stream("config"))[-1].data
        assert activated["summary"]["endpoints"][0]["breaker"] == {
            "failure_threshold": 1,
            "base_cooldown_ms": 5000,
            "max_cooldown_ms": 30000,
        }


async def test_a_bad_config_file_is_refused_and_the_old_one_keeps_serving(
    sqlite_url: str, tmp_path: Path
) -> None:
    config_file = tmp_path / "waybill.yaml"
    async with running_gateway(
        sqlite_url, ["east"], [Route("east")], config_file=config_file
    ) as gw:
        admin = await apikeys.create_key(gw.store, "acme", "admin")
        config_file.write_text(config_file.read_text().replace("weight: 1", "weight: 0"))
        async with httpx.AsyncClient(
            base_url=gw.url, headers={"Authorization": f"Bearer {admin.secret}"}
        ) as admin_http:
            refused = await admin_http.post("/v1/admin/config/reload")
        assert refused.status_code == 400
        assert "models[0].mappings[0].weight" in refused.json()["error"]["message"]
        async with gw.http() as http:
            assert (await http.post("/v1/chat/completions", json=BODY)).status_code == 200
            client_try = await http.post("/v1/admin/config/reload")
            assert client_try.status_code == 403


async def test_a_worker_reload_asked_over_tcp_is_an_ordinary_reload_with_its_checks(
    sqlite_url: str, tmp_path: Path
) -> None:
    # The header one worker sends another on its own Unix socket (router.serving.reload)
    # grants nothing on the gateway's port: the call is authenticated as any reload.
    config_file = tmp_path / "waybill.yaml"
    async with running_gateway(
        sqlite_url, ["east"], [Route("east")], config_file=config_file
    ) as gw:
        config_file.write_text(config_file.read_text().replace("test-1", "test-2"))
        headers = {WORKER_RELOAD_HEADER: "test-2"}
        async with httpx.AsyncClient(base_url=gw.url) as anonymous:
            refused = await anonymous.post("/v1/admin/config/reload", headers=headers)
        assert refused.status_code == 401
        async with gw.http() as http:
            refused = await http.post("/v1/admin/config/reload", headers=headers)
        assert refused.status_code == 403
        assert [e.data["generation"] for e in await gw.store.read_stream("config")] == ["test-1"]
