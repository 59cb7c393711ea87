"""Egress proxies end to end: the gateway → a proxy on 127.0.0.1 → fake providers.

A tunnel the proxy refuses is a failure before anything was sent (not started: fail over,
release the hold); the proxy's credentials open tunnels and appear nowhere else; and
``waybill serve`` follows the standard environment variables.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.fake_provider import FakeProxy, FakeUpstream
from tests.gateway.harness import Route, closed_port, running_gateway
from tests.gateway.processes import new_key, serve_process
from tests.ledger.test_cli import waybill

BODY: dict[str, Any] = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
PASSWORD = "pr0xy-pa55-DO-NOT-LEAK"
TOKEN = base64.b64encode(f"user:{PASSWORD}".encode()).decode()
PROXY_ENV = {"PROXY_USER": "user", "PROXY_PASSWORD": PASSWORD}


def _proxy_key(proxy: FakeProxy, *, credentials: bool = False) -> str:
    userinfo = "${env:PROXY_USER}:${env:PROXY_PASSWORD}@" if credentials else ""
    return f"    proxy: http://{userinfo}127.0.0.1:{proxy.port}\n"


async def test_a_tunnel_the_proxy_refuses_fails_over_as_not_started(sqlite_url: str) -> None:
    # 407: the proxy wants credentials it was not given. Not the provider's 401/403, so not
    # `credentials` (which would stop by default): nothing reached the provider.
    async with (
        FakeProxy(credentials=("user", PASSWORD)) as proxy,
        running_gateway(
            sqlite_url,
            ["east", "west"],
            [Route("east", tier=0), Route("west", tier=1)],
            endpoint_extra={"east": _proxy_key(proxy)},
        ) as gw,
        gw.http() as http,
    ):
        response = await http.post("/v1/chat/completions", json=BODY)
        assert response.status_code == 200, response.text
        assert response.headers["x-waybill-endpoint"] == "west"
        assert len(proxy.connects) == 1 and proxy.tunnels == 0
        assert (gw.upstreams["east"].connections, gw.upstreams["west"].hits) == (0, 1)
        events = await gw.events(response.headers["x-request-id"])
    failed = next(e.data for e in events if e.type == "AttemptFinished")
    assert (failed["failure_class"], failed["evidence"]) == ("network_error", "not_started")
    assert failed["http_status"] is None  # the proxy's 407 is not the provider's status
    decided = next(e.data for e in events if e.type == "FailoverDecided")
    assert decided["action"] == "failover"
    released = next(e.data for e in events if e.type == "BudgetReleased")
    assert (released["attempt_id"], released["reason"]) == (failed["attempt_id"], "not_started")


async def test_proxy_credentials_open_tunnels_and_appear_nowhere_else(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with (
        FakeProxy("refuse", credentials=("user", PASSWORD)) as proxy,
        running_gateway(
            sqlite_url,
            ["east", "west"],
            [Route("east", tier=0), Route("west", tier=1)],
            endpoint_extra={"east": _proxy_key(proxy, credentials=True)},
            environ=PROXY_ENV,
        ) as gw,
        gw.http() as http,
    ):
        # The credentials pass; then the proxy turns the tunnel down. The client's answer
        # says so, in the proxy's words.
        refused = await http.post(
            "/v1/chat/completions", json=BODY, headers={"X-Waybill-Allow-Failover": "false"}
        )
        assert refused.status_code == 503, refused.text
        assert "the proxy answered CONNECT with 403" in refused.json()["error"]["message"]
        proxy.mode = "open"
        for body in (BODY, {**BODY, "stream": True}):
            response = await http.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.headers["x-waybill-endpoint"] == "east"
        # Two CONNECTs (the refused one, then one tunnel for both calls), each authorized.
        assert [c.authorization for c in proxy.connects] == [f"Basic {TOKEN}"] * 2
        sent = [r for name in ("east", "west") for r in gw.upstreams[name].requests]
        events = await gw.store.read_all(limit=100_000)
    assert sent and all("proxy-authorization" not in r.headers for r in sent)
    summary = next(e.data["summary"] for e in events if e.type == "ConfigActivated")
    assert summary["endpoints"][0]["proxy"] == {
        "address": f"127.0.0.1:{proxy.port}",
        "source": "config",
        "has_credentials": True,
    }
    assert summary["endpoints"][1]["proxy"] is None
    logs = caplog.text + "".join(str(r.__dict__) for r in caplog.records)
    for secret in (PASSWORD, TOKEN):
        assert all(secret.encode() not in e.payload for e in events), secret
        assert secret not in logs, secret
        assert secret not in refused.text, secret


async def test_serve_follows_http_proxy_and_no_proxy_from_its_environment(
    sqlite_url: str, tmp_path: Path
) -> None:
    port = closed_port()
    async with (
        FakeUpstream("east") as east,
        FakeUpstream("west") as west,
        FakeProxy() as proxy,
    ):
        config = tmp_path / "waybill.yaml"
        config.write_text(
            _two_groups(f"http://127.0.0.1:{east.port}/v1", f"http://localhost:{west.port}/v1")
        )
        # Lower- and upper-case alike, so that no variable of the machine's shadows them.
        env = {
            name: value
            for base, value in (("http_proxy", proxy.url), ("no_proxy", "localhost"))
            for name in (base, base.upper())
        }
        process = await asyncio.to_thread(serve_process, config, sqlite_url, port, env=env)
        try:
            secret = await asyncio.to_thread(new_key, sqlite_url)
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}",
                headers={"Authorization": f"Bearer {secret}"},
                timeout=30,
            ) as http:
                via = await http.post("/v1/chat/completions", json={**BODY, "model": "via-proxy"})
                assert via.status_code == 200, via.text
                assert [c.target for c in proxy.connects] == [f"127.0.0.1:{east.port}"]
                direct = await http.post("/v1/chat/completions", json={**BODY, "model": "direct"})
                assert direct.status_code == 200, direct.text
                assert len(proxy.connects) == 1  # NO_PROXY: localhost went straight
                assert (east.hits, west.hits) == (1, 1)
        finally:
            process.terminate()
            await asyncio.to_thread(_wait, process)


def test_the_demo_is_all_on_this_machine_whatever_http_proxy_says(tmp_path: Path) -> None:
    nowhere = f"http://127.0.0.1:{closed_port()}"
    result = waybill(
        "demo",
        "--check",
        "--port",
        str(closed_port()),
        database_url=f"sqlite:///{tmp_path / 'demo.db'}",
        env={"HTTP_PROXY": nowhere, "http_proxy": nowhere},
    )
    assert result.returncode == 0, result.stderr
    assert "buffered: 200 via demo-primary" in result.stdout


def _wait(process: subprocess.Popen[bytes]) -> None:
    process.wait(timeout=20)


def _two_groups(east: str, west: str) -> str:
    endpoints = "".join(
        f"""  - id: {name}
    driver: openai
    base_url: {url}
    api_key: ${{env:FAKE_KEY}}
    region: us-east
    data_classes: [internal]
"""
        for name, url in (("east", east), ("west", west))
    )
    models = "".join(
        f"""  - name: {group}
    mappings:
      - endpoint: {endpoint}
        model: fake-model
        context_window: 128000
        max_output_tokens: 4096
        price: {{input_per_mtok: 1.0, output_per_mtok: 2.0}}
"""
        for group, endpoint in (("via-proxy", "east"), ("direct", "west"))
    )
    return f"""endpoints:
{endpoints}models:
{models}workspaces:
  - id: acme
    models: [via-proxy, direct]
    regions: [us-east]
    data_class: internal
"""
