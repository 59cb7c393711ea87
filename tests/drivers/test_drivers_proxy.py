"""Drivers through an egress proxy: the endpoint's way out (the environment, its ``proxy:``
key) is followed, and every failure keeps the evidence its failure class has."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trustme

from ledger.events import Evidence, FailureClass
from router.config import Endpoint
from router.drivers import (
    AnthropicDriver,
    AttemptBinding,
    AttemptTimeouts,
    ChatRequest,
    Driver,
    OpenAIDriver,
    UpstreamFailure,
)
from router.fake_provider import Behavior, FakeProxy, FakeUpstream
from router.fake_provider.behavior import Kind
from tests.drivers.test_proxy_http import PASSWORD, tls_client, tls_server
from tests.gateway.harness import closed_port

KEY = "sk-test-very-secret-0123456789"
BODY = {"model": "m", "messages": [{"role": "user", "content": "Say hello."}]}


def _binding(
    up: FakeUpstream,
    kind: str,
    *,
    environ: dict[str, str] | None = None,
    attempt: float = 5.0,
    base_url: str | None = None,
    **extra: object,
) -> AttemptBinding:
    raw = {
        "id": "east",
        "driver": kind,
        "base_url": base_url or (up.root_url if kind == "anthropic" else up.base_url),
        "api_key": "${env:KEY}",
        "region": "eu",
        "data_classes": ["internal"],
        **extra,
    }
    endpoint = Endpoint.model_validate(raw, context={"environ": {"KEY": KEY, **(environ or {})}})
    return AttemptBinding(
        endpoint=endpoint,
        upstream_model="fake-model",
        attempt_id="att_123",
        timeouts=AttemptTimeouts(attempt, 5.0, 5.0),
    )


def _request(stream: bool = False) -> ChatRequest:
    return ChatRequest(body=BODY, upstream_model="fake-model", max_tokens=64, stream=stream)


@pytest.fixture(params=["openai", "anthropic"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def driver(kind: str) -> AsyncIterator[Driver]:
    d: Driver = AnthropicDriver() if kind == "anthropic" else OpenAIDriver()
    yield d
    await d.aclose()


async def _complete(driver: Driver, binding: AttemptBinding) -> dict[str, Any]:
    return (await driver.complete(driver.prepare(_request(), binding))).response


async def _failure(driver: Driver, binding: AttemptBinding) -> UpstreamFailure:
    with pytest.raises(UpstreamFailure) as caught:
        await driver.complete(driver.prepare(_request(), binding))
    return caught.value


# --- the way out ---


async def test_http_proxy_from_the_environment_carries_buffered_and_streamed_calls(
    driver: Driver, kind: str
) -> None:
    async with FakeUpstream("east") as up, FakeProxy() as proxy:
        binding = _binding(up, kind, environ={"HTTP_PROXY": proxy.url})
        assert (await _complete(driver, binding))["object"] == "chat.completion"
        stream = await driver.stream(driver.prepare(_request(stream=True), binding))
        async with stream:
            chunks = [chunk async for chunk in stream]
        assert chunks and stream.finish_reason == "stop"
        assert [c.target for c in proxy.connects] == [f"127.0.0.1:{up.port}"]  # one tunnel
        assert up.hits == 2


async def test_no_proxy_sends_the_endpoint_straight_to_the_upstream(
    driver: Driver, kind: str
) -> None:
    async with FakeUpstream("east") as up, FakeProxy() as proxy:
        environ = {"HTTP_PROXY": proxy.url, "NO_PROXY": "localhost,127.0.0.0/8"}
        await _complete(driver, _binding(up, kind, environ=environ))
        assert proxy.connects == [] and up.hits == 1


async def test_the_endpoints_proxy_key_beats_the_environment(driver: Driver, kind: str) -> None:
    async with FakeUpstream("east") as up, FakeProxy() as env_proxy, FakeProxy() as own:
        environ = {"HTTP_PROXY": env_proxy.url}
        await _complete(driver, _binding(up, kind, environ=environ, proxy=own.url))
        assert (len(own.connects), len(env_proxy.connects)) == (1, 0)
        await _complete(driver, _binding(up, kind, environ=environ, proxy="none"))
        assert (len(own.connects), len(env_proxy.connects)) == (1, 0)
        assert up.hits == 2


async def test_proxy_credentials_from_env_references_open_the_tunnel_and_go_no_further(
    driver: Driver, kind: str
) -> None:
    environ = {"PROXY_USER": "user", "PROXY_PASSWORD": PASSWORD}
    async with FakeUpstream("east") as up, FakeProxy(credentials=("user", PASSWORD)) as proxy:
        url = f"http://${{env:PROXY_USER}}:${{env:PROXY_PASSWORD}}@127.0.0.1:{proxy.port}"
        await _complete(driver, _binding(up, kind, environ=environ, proxy=url))
        token = base64.b64encode(f"user:{PASSWORD}".encode()).decode()
        assert [c.authorization for c in proxy.connects] == [f"Basic {token}"]
        sent = up.requests[-1]
        assert "proxy-authorization" not in sent.headers
        assert all(PASSWORD not in v and token not in v for v in sent.headers.values())


async def test_https_through_the_tunnel_checks_the_providers_certificate(kind: str) -> None:
    ca = trustme.CA()
    sni: list[str | None] = []
    driver: Driver = (AnthropicDriver if kind == "anthropic" else OpenAIDriver)(tls_client(ca))
    async with (
        FakeUpstream("east", tls=tls_server(ca, "localhost", sni)) as up,
        FakeProxy() as proxy,
    ):
        root = f"https://localhost:{up.port}"
        base_url = root if kind == "anthropic" else f"{root}/v1"
        binding = _binding(up, kind, environ={"HTTPS_PROXY": proxy.url}, base_url=base_url)
        assert (await _complete(driver, binding))["object"] == "chat.completion"
        await driver.aclose()
        assert sni == ["localhost"]
        assert [c.target for c in proxy.connects] == [f"localhost:{up.port}"]


# --- evidence ---


@pytest.mark.parametrize(
    ("proxy_kw", "detail"),
    [
        ({"mode": "refuse", "refuse_status": 403}, "the proxy answered CONNECT with 403"),
        ({"credentials": ("user", "expected")}, "the proxy answered CONNECT with 407"),
        ({"mode": "refuse", "refuse_status": 502}, "the proxy answered CONNECT with 502"),
        ({"mode": "drop"}, "the proxy closed the connection before answering CONNECT"),
    ],
    ids=["403", "407", "502", "dropped"],
)
async def test_a_tunnel_refused_is_network_error_not_started_never_the_providers_status(
    driver: Driver, kind: str, proxy_kw: dict[str, Any], detail: str
) -> None:
    async with FakeUpstream("east") as up, FakeProxy(**proxy_kw) as proxy:
        failure = await _failure(driver, _binding(up, kind, proxy=proxy.url))
        assert up.connections == 0
    assert failure.classification.failure_class is FailureClass.NETWORK_ERROR
    assert failure.classification.evidence is Evidence.NOT_STARTED
    assert failure.classification.may_fail_over == "yes"
    assert failure.outcome.http_status is None  # the proxy's status is not the provider's
    assert failure.outcome.error_message == detail


async def test_an_unreachable_proxy_is_network_error_not_started(driver: Driver, kind: str) -> None:
    async with FakeUpstream("east") as up:
        binding = _binding(up, kind, proxy=f"http://127.0.0.1:{closed_port()}")
        failure = await _failure(driver, binding)
        assert up.connections == 0
    assert (failure.classification.failure_class, failure.classification.evidence) == (
        FailureClass.NETWORK_ERROR,
        Evidence.NOT_STARTED,
    )


async def test_a_silent_proxy_past_the_attempt_timeout_is_network_error_not_started(
    driver: Driver, kind: str
) -> None:
    async with FakeUpstream("east") as up, FakeProxy("silent") as proxy:
        failure = await _failure(driver, _binding(up, kind, proxy=proxy.url, attempt=0.2))
        assert up.connections == 0
    assert failure.classification.failure_class is FailureClass.NETWORK_ERROR
    assert failure.classification.evidence is Evidence.NOT_STARTED
    assert failure.outcome.error_message == "no tunnel within the connect timeout"


@pytest.mark.parametrize(
    ("behavior", "failure_class", "evidence"),
    [
        (Behavior.stall(stall_s=10), FailureClass.TIMEOUT, Evidence.UNKNOWN),
        (Behavior.reset_before_bytes(), FailureClass.NETWORK_ERROR, Evidence.UNKNOWN),
        (Behavior.unauthorized(), FailureClass.CREDENTIALS, Evidence.NOT_STARTED),
        (Behavior.server_error(502), FailureClass.UPSTREAM_UNAVAILABLE, Evidence.UNKNOWN),
        (
            Behavior(Kind.LARGE_BODY, min_bytes=64 * 1024),
            FailureClass.RESPONSE_TOO_LARGE,
            Evidence.STARTED,
        ),
    ],
    ids=["stall", "reset", "401", "502", "too_large"],
)
async def test_inside_the_tunnel_the_providers_answers_classify_as_ever(
    driver: Driver,
    kind: str,
    behavior: Behavior,
    failure_class: FailureClass,
    evidence: Evidence,
) -> None:
    async with FakeUpstream("east", plan=[behavior]) as up, FakeProxy() as proxy:
        binding = _binding(up, kind, proxy=proxy.url, attempt=1.0, max_response_bytes=16 * 1024)
        failure = await _failure(driver, binding)
        assert proxy.tunnels == 1 and up.hits == 1
    assert (failure.classification.failure_class, failure.classification.evidence) == (
        failure_class,
        evidence,
    )
