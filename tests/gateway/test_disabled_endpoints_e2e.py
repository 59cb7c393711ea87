"""Disabled endpoints end to end (contract §5 "Disabled endpoints"): a refused key disables its
endpoint for good — no probe, no cool-down — until an admin (API or CLI) enables it or the
config gives it another key; the state is the ledger's, so it survives reloads and restarts,
and with Redis every replica follows at once. The ``openai`` SDK's wire through the gateway to
fake providers over real HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from ledger import apikeys
from ledger.endpoints import ENDPOINTS_STREAM
from ledger.store import LedgerUnavailable
from router.fake_provider import Behavior
from router.http.app import AppSettings
from tests.gateway.harness import ANTHROPIC_ENV, Gateway, Route, running_gateway, serve
from tests.helpers import REDIS_URL, breaker_keys_removed, eventually, redis_up
from tests.ledger.test_cli import WAYBILL

BODY: dict[str, Any] = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
ROUTES = [Route("east", tier=0), Route("west", tier=1)]


@pytest.fixture(autouse=True)
def _secrets_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # A reload reads the file as `waybill serve` does: ${env:...} from the environment.
    for name, value in ANTHROPIC_ENV.items():
        monkeypatch.setenv(name, value)


async def _admin(gw: Gateway) -> httpx.AsyncClient:
    admin = await apikeys.create_key(gw.store, "acme", "admin")
    return httpx.AsyncClient(
        base_url=gw.url, headers={"Authorization": f"Bearer {admin.secret}"}, timeout=30
    )


async def _refuse_east_once(gw: Gateway, http: httpx.AsyncClient) -> httpx.Response:
    """East answers 401 to the one request that reaches it."""
    gw.upstreams["east"].set_plan([Behavior.unauthorized()])
    return await http.post("/v1/chat/completions", json=BODY)


def _metric(text: str, name: str, endpoint: str) -> float:
    """The value of ``name`` for ``endpoint`` in a Prometheus page."""
    found = re.search(rf'^{name}{{[^}}]*waybill_endpoint="{endpoint}"[^}}]*}} (\S+)$', text, re.M)
    assert found, f"no {name} for {endpoint}"
    return float(found.group(1))


async def _endpoint(admin: httpx.AsyncClient, endpoint: str) -> dict[str, Any]:
    listed = await admin.get("/v1/endpoints")
    assert listed.status_code == 200, listed.text
    rows: list[dict[str, Any]] = listed.json()["data"]
    return next(row for row in rows if row["id"] == endpoint)


async def test_a_refused_key_disables_the_endpoint_with_no_probe_until_an_admin_enables_it(
    sqlite_url: str,
) -> None:
    # Cool-downs of 1 ms: had the 401 opened a breaker, any later request could probe east.
    defaults = {"breaker": "{failure_threshold: 1, base_cooldown_ms: 1, max_cooldown_ms: 1}"}
    async with (
        running_gateway(sqlite_url, ["east", "west"], ROUTES, defaults=defaults) as gw,
        gw.http() as http,
    ):
        east, west = gw.upstreams["east"], gw.upstreams["west"]
        refused = await _refuse_east_once(gw, http)
        # on_credentials_error: stop (the default): the cause is named, never "all busy".
        assert refused.status_code == 502
        assert refused.json()["error"]["code"] == "upstream_credentials"

        disabled = [e.data for e in await gw.store.read_stream(ENDPOINTS_STREAM)]
        assert len(disabled) == 1
        evidence = disabled[0]
        assert (evidence["endpoint"], evidence["http_status"], evidence["error_code"]) == (
            "east",
            401,
            "invalid_api_key",
        )
        assert evidence["request_id"] == refused.headers["x-request-id"]
        assert evidence["key_check"].startswith("pbkdf2-sha256$100000$")
        assert ANTHROPIC_ENV["FAKE_KEY"] not in json.dumps(evidence)
        # No breaker counted the refused key: there is no cool-down to end.
        assert await gw.store.read_stream("breaker") == []

        for _ in range(5):
            served = await http.post("/v1/chat/completions", json=BODY)
            assert served.headers["x-waybill-endpoint"] == "west"
        assert (east.hits, west.hits) == (1, 5)
        candidates = (await gw.events(served.headers["x-request-id"]))[1].data["candidates"]
        assert candidates[0]["reason_code"] == "credentials_disabled"
        assert candidates[0]["detail"] == (
            "the upstream answered 401 invalid_api_key; "
            "enable it with: waybill endpoints enable east"
        )

        async with await _admin(gw) as admin:
            row = await _endpoint(admin, "east")
            assert (row["state"], row["enabled"], row["breaker"]["state"]) == (
                "disabled",
                True,
                "closed",
            )
            assert row["disabled"]["http_status"] == 401
            assert row["disabled"]["request_id"] == refused.headers["x-request-id"]
            assert "key_check" not in row["disabled"]
            assert (await _endpoint(admin, "west"))["state"] == "enabled"
            metrics = (await http.get("/metrics")).text
            assert _metric(metrics, "waybill_endpoints_disabled", "east") == 1
            assert _metric(metrics, "waybill_endpoint_disablings_total", "east") == 1

            enabled = await admin.post("/v1/admin/endpoints/east/enable")
            assert enabled.status_code == 200, enabled.text
            admin_key = (await gw.store.read_stream(ENDPOINTS_STREAM))[-1].data["actor"]
            assert enabled.json() == {
                "endpoint": "east",
                "cause": "operator",
                "actor": admin_key,
                "config_generation": "test-1",
            }
            assert admin_key.startswith("key_")
            again = await admin.post("/v1/admin/endpoints/east/enable")
            assert (again.status_code, again.json()["error"]["code"]) == (
                409,
                "endpoint_not_disabled",
            )
            unknown = await admin.post("/v1/admin/endpoints/nowhere/enable")
            assert (unknown.status_code, unknown.json()["error"]["code"]) == (
                404,
                "endpoint_not_found",
            )
            assert (await _endpoint(admin, "east"))["state"] == "enabled"
            metrics = (await http.get("/metrics")).text
            assert _metric(metrics, "waybill_endpoints_disabled", "east") == 0

        back = await http.post("/v1/chat/completions", json=BODY)
        assert back.headers["x-waybill-endpoint"] == "east"


async def test_only_admins_read_and_enable_endpoints(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url, ["east"], [Route("east")]) as gw, gw.http() as client:
        listed = await client.get("/v1/endpoints")
        assert (listed.status_code, listed.json()["error"]["code"]) == (403, "permission_denied")
        enabled = await client.post("/v1/admin/endpoints/east/enable")
        assert (enabled.status_code, enabled.json()["error"]["code"]) == (
            403,
            "permission_denied",
        )


async def test_a_request_that_only_disabled_endpoints_stand_in_the_way_of_is_a_502_naming_them(
    sqlite_url: str,
) -> None:
    async with (
        running_gateway(
            sqlite_url,
            ["east", "west"],
            ROUTES,
            defaults={"on_credentials_error": "failover"},
        ) as gw,
        gw.http() as http,
    ):
        # With failover allowed, the refused request still gets its answer from west...
        gw.upstreams["west"].set_plan([Behavior.forbidden()])
        first = await _refuse_east_once(gw, http)
        assert first.status_code == 502
        # ...here west refused it too: both are disabled, and nothing is sent anywhere.
        later = await http.post("/v1/chat/completions", json=BODY)
        assert later.status_code == 502
        error = later.json()["error"]
        assert error["code"] == "upstream_credentials"
        assert "east/fake-model: credentials_disabled" in error["message"]
        assert (
            "west/fake-model: credentials_disabled (the upstream answered 403" in (error["message"])
        )
        assert error["attempts"] == []
        assert (gw.upstreams["east"].hits, gw.upstreams["west"].hits) == (1, 1)


async def test_a_disabled_endpoint_stays_disabled_across_a_reload_and_a_restart_with_its_key(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config_file = tmp_path / "waybill.yaml"
    async with running_gateway(sqlite_url, ["east", "west"], ROUTES, config_file=config_file) as gw:
        async with gw.http() as http, await _admin(gw) as admin:
            await _refuse_east_once(gw, http)
            config_file.write_text(config_file.read_text().replace("test-1", "test-2"))
            assert (await admin.post("/v1/admin/config/reload")).status_code == 200
            assert (await _endpoint(admin, "east"))["state"] == "disabled"
            served = await http.post("/v1/chat/completions", json=BODY)
            assert served.headers["x-waybill-endpoint"] == "west"

        # A gateway started afresh on the same ledger, same key: still disabled.
        settings = AppSettings(gw.config, sqlite_url)
        async with (
            serve(settings) as (url, _),
            httpx.AsyncClient(
                base_url=url, headers={"Authorization": f"Bearer {gw.secret}"}
            ) as restarted,
        ):
            served = await restarted.post("/v1/chat/completions", json=BODY)
            assert served.headers["x-waybill-endpoint"] == "west"
        assert gw.upstreams["east"].hits == 1

        # A new key for it (the same reference, another value) lifts the disabling.
        monkeypatch.setenv("FAKE_KEY", "sk-fake-rotated-key")
        config_file.write_text(config_file.read_text().replace("test-2", "test-3"))
        async with await _admin(gw) as admin:
            assert (await admin.post("/v1/admin/config/reload")).status_code == 200
            assert (await _endpoint(admin, "east"))["state"] == "enabled"
        lifted = (await gw.store.read_stream(ENDPOINTS_STREAM))[-1]
        assert (lifted.type, lifted.data["cause"], lifted.data["actor"]) == (
            "EndpointEnabled",
            "key_changed",
            None,
        )
        assert lifted.data["config_generation"] == "test-3"
        async with gw.http() as http:
            back = await http.post("/v1/chat/completions", json=BODY)
            assert back.headers["x-waybill-endpoint"] == "east"


def _cli(database_url: str, *args: str, redis_url: str | None = None) -> Any:
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "WAYBILL_REDIS_URL"}
    env["WAYBILL_DATABASE_URL"] = database_url
    if redis_url is not None:
        env["WAYBILL_REDIS_URL"] = redis_url
    return subprocess.run(
        [*WAYBILL, *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


async def test_the_cli_enables_an_endpoint_and_the_gateway_follows_on_its_heartbeat(
    sqlite_url: str,
) -> None:
    async with (
        running_gateway(sqlite_url, ["east", "west"], ROUTES, heartbeat_s=0.1) as gw,
        gw.http() as http,
    ):
        await _refuse_east_once(gw, http)
        nothing = await asyncio.to_thread(_cli, sqlite_url, "endpoints", "enable", "west")
        assert nothing.returncode == 1
        assert "endpoint 'west' is not disabled: nothing to enable" in nothing.stderr

        enabled = await asyncio.to_thread(_cli, sqlite_url, "endpoints", "enable", "east", "--json")
        assert enabled.returncode == 0, enabled.stderr
        printed = json.loads(enabled.stdout)
        assert (printed["endpoint"], printed["cause"], printed["actor"]) == (
            "east",
            "operator",
            "cli",
        )
        assert printed["disabled"]["http_status"] == 401

        async def followed() -> bool:
            return "east" not in gw.app_state.gateway.disabling.states.disabled

        await eventually(followed)
        back = await http.post("/v1/chat/completions", json=BODY)
        assert back.headers["x-waybill-endpoint"] == "east"


@pytest.mark.parametrize("writer", ["gateway", "cli"])
async def test_with_redis_every_replica_follows_at_once(sqlite_url: str, writer: str) -> None:
    if not redis_up():
        pytest.skip(f"no Redis at {REDIS_URL}")
    generation = f"disabled-{uuid.uuid4().hex[:8]}"
    # Heartbeats an hour apart: only the doorbell can tell the second replica.
    with breaker_keys_removed(REDIS_URL, generation):
        await _two_replicas_follow(sqlite_url, generation, writer)


async def _two_replicas_follow(sqlite_url: str, generation: str, writer: str) -> None:
    async with running_gateway(
        sqlite_url,
        ["east", "west"],
        ROUTES,
        redis_url=REDIS_URL,
        heartbeat_s=3600,
        generation=generation,
    ) as first:
        # The second replica serves the very config the first does.
        settings = AppSettings(first.config, sqlite_url, redis_url=REDIS_URL, heartbeat_s=3600)
        async with serve(settings) as (_, second_app), first.http() as http:
            second = second_app.app.state

            async def follows(disabled: bool) -> bool:
                return ("east" in second.gateway.disabling.states.disabled) == disabled

            await _refuse_east_once(first, http)
            await eventually(lambda: follows(True))
            if writer == "gateway":
                async with await _admin(first) as admin:
                    assert (await admin.post("/v1/admin/endpoints/east/enable")).status_code == 200
            else:
                enabled = await asyncio.to_thread(
                    _cli, sqlite_url, "endpoints", "enable", "east", redis_url=REDIS_URL
                )
                assert enabled.returncode == 0, enabled.stderr
                assert "enabled east: disabled since" in enabled.stdout
            await eventually(lambda: follows(False))


async def test_a_refused_key_the_ledger_cannot_record_opens_the_breaker_at_once(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with (
        running_gateway(sqlite_url, ["east", "west"], ROUTES) as gw,
        gw.http() as http,
    ):

        async def unavailable(disabled: Any) -> bool:
            raise LedgerUnavailable("the database is down (a test)")

        monkeypatch.setattr(gw.app_state.gateway.disabling, "disable", unavailable)
        await _refuse_east_once(gw, http)
        assert await gw.store.read_stream(ENDPOINTS_STREAM) == []
        opened = [e.data for e in await gw.store.read_stream("breaker")]
        assert [(t["target"], t["to_state"], t["reason"], t["failure_class"]) for t in opened] == [
            ("east", "open", "opens_at_once", "credentials")
        ]
        served = await http.post("/v1/chat/completions", json=BODY)
        assert served.headers["x-waybill-endpoint"] == "west"
