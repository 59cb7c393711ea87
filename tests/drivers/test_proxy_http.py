"""The drivers' HTTP client through an HTTP proxy on 127.0.0.1: CONNECT tunnels for http and
https upstreams, TLS inside them, pooling, and what each way of failing proves."""

from __future__ import annotations

import base64
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import trustme

from router.drivers.http import (
    ConnectFailed,
    ConnectionBroken,
    HTTPClient,
    Proxy,
    Response,
    TunnelFailed,
)
from router.fake_provider import Behavior, FakeProxy, FakeUpstream, RecordedConnect
from tests.gateway.harness import closed_port

PASSWORD = "pr0xy-pa55-DO-NOT-LEAK"


def via(proxy: FakeProxy, *, credentials: tuple[str, str] | None = None) -> Proxy:
    if credentials is None:
        return Proxy(proxy.host, proxy.port)
    return Proxy.basic(proxy.host, proxy.port, *credentials)


async def models(client: HTTPClient, url: str, proxy: Proxy | None, **kw: object) -> Response:
    response = await client.request("GET", f"{url}/models", proxy=proxy, **kw)  # type: ignore[arg-type]
    await response.aread()
    return response


@pytest.fixture
async def client() -> AsyncIterator[HTTPClient]:
    c = HTTPClient()
    yield c
    await c.aclose()


# --- tunnels ---


async def test_an_http_upstream_is_reached_through_a_connect_tunnel(client: HTTPClient) -> None:
    async with FakeUpstream("east") as up, FakeProxy() as proxy:
        response = await models(client, up.base_url, via(proxy))
        assert response.status_code == 200
        assert proxy.connects == [RecordedConnect(f"127.0.0.1:{up.port}", None)]
        assert proxy.tunnels == 1
        sent = up.requests[-1]
        assert (sent.method, sent.path) == ("GET", "/v1/models")
        assert sent.headers.get("host") == f"127.0.0.1:{up.port}"  # the upstream's, origin-form


async def test_a_tunnel_is_pooled_for_its_proxy_and_origin_only(client: HTTPClient) -> None:
    async with FakeUpstream("east") as up, FakeProxy() as first, FakeProxy() as second:
        for _ in range(3):
            await models(client, up.base_url, via(first))
        assert (first.tunnels, up.connections) == (1, 1)  # one tunnel, kept alive
        await models(client, up.base_url, None)  # direct: never the tunnel
        await models(client, up.base_url, via(second))  # another proxy: its own tunnel
        assert (first.tunnels, second.tunnels, up.connections) == (1, 1, 3)


async def test_proxy_authorization_goes_to_the_proxy_and_never_upstream(
    client: HTTPClient,
) -> None:
    credentials = ("user", PASSWORD)
    async with FakeUpstream("east") as up, FakeProxy(credentials=credentials) as proxy:
        response = await models(client, up.base_url, via(proxy, credentials=credentials))
        assert response.status_code == 200
        token = base64.b64encode(f"user:{PASSWORD}".encode()).decode()
        assert proxy.connects[-1].authorization == f"Basic {token}"
        sent = up.requests[-1]
        assert "proxy-authorization" not in sent.headers
        assert all(PASSWORD not in value and token not in value for value in sent.headers.values())
    assert PASSWORD not in repr(via(proxy, credentials=credentials))


# --- TLS inside the tunnel ---


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def tls_server(ca: trustme.CA, name: str, seen: list[str | None]) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert(name).configure_cert(context)
    context.sni_callback = lambda _sock, server_name, _ctx: seen.append(server_name)
    return context


def tls_client(ca: trustme.CA) -> HTTPClient:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return HTTPClient(ssl_context=context)


async def test_tls_to_the_upstream_runs_inside_the_tunnel_checked_against_its_name(
    ca: trustme.CA,
) -> None:
    # The certificate names "localhost" only; the proxy is 127.0.0.1. Checking the proxy's
    # name instead of the upstream's would fail the handshake.
    sni: list[str | None] = []
    client = tls_client(ca)
    upstream = FakeUpstream("east", tls=tls_server(ca, "localhost", sni))
    async with upstream as up, FakeProxy() as proxy:
        url = f"https://localhost:{up.port}/v1"
        for _ in range(2):
            assert (await models(client, url, via(proxy))).status_code == 200
        await client.aclose()
        assert proxy.connects[0].target == f"localhost:{up.port}"
        assert sni == ["localhost"]  # one handshake, named for the upstream
        assert (proxy.tunnels, up.connections, up.hits_by_path.get("/v1/models")) == (1, 1, 2)


async def test_an_upstream_certificate_for_another_name_fails_after_the_tunnel(
    ca: trustme.CA,
) -> None:
    client = tls_client(ca)
    upstream = FakeUpstream("east", tls=tls_server(ca, "upstream.example", []))
    async with upstream as up, FakeProxy() as proxy:
        with pytest.raises(ConnectFailed) as caught:
            await models(client, f"https://localhost:{up.port}/v1", via(proxy))
        await client.aclose()
    assert not isinstance(caught.value, TunnelFailed)  # the proxy did its part
    assert "CERTIFICATE_VERIFY_FAILED" in str(caught.value)
    assert proxy.tunnels == 1 and up.hits == 0


# --- failures, and what they prove ---


@pytest.mark.parametrize(
    ("mode", "status"),
    [("refuse", 403), ("refuse", 502), ("auth", 407), ("drop", None)],
    ids=["403", "502", "407", "dropped"],
)
async def test_a_tunnel_the_proxy_will_not_open_is_tunnel_failed_and_sends_nothing(
    client: HTTPClient, mode: str, status: int | None
) -> None:
    proxy = FakeProxy(
        "open" if mode == "auth" else mode,  # type: ignore[arg-type]
        refuse_status=status or 403,
        credentials=("user", PASSWORD) if mode == "auth" else None,
    )
    async with FakeUpstream("east") as up, proxy:
        with pytest.raises(TunnelFailed) as caught:
            await models(client, up.base_url, via(proxy))
        assert up.connections == 0  # nothing ever reached the upstream
    assert isinstance(caught.value, ConnectFailed)
    assert caught.value.status == status
    if status is not None:
        assert caught.value.detail == f"the proxy answered CONNECT with {status}"


async def test_an_unreachable_proxy_is_tunnel_failed(client: HTTPClient) -> None:
    async with FakeUpstream("east") as up:
        with pytest.raises(TunnelFailed, match="cannot connect to the proxy"):
            await models(client, up.base_url, Proxy("127.0.0.1", closed_port()))
        assert up.connections == 0


async def test_a_silent_proxy_runs_out_the_time_as_tunnel_failed_never_a_timeout(
    client: HTTPClient,
) -> None:
    async with FakeUpstream("east") as up, FakeProxy("silent") as proxy:
        with pytest.raises(TunnelFailed, match="no tunnel within the connect timeout"):
            await models(client, up.base_url, via(proxy), connect_timeout=0.1)
        # The whole call's bound expiring while the tunnel is set up: still not written.
        with pytest.raises(TunnelFailed):
            await models(client, up.base_url, via(proxy), connect_timeout=None, headers_timeout=0.1)
        assert up.connections == 0


async def test_a_stall_after_the_request_went_through_the_tunnel_is_a_timeout(
    client: HTTPClient,
) -> None:
    async with FakeUpstream("east", default=Behavior.stall(stall_s=5)) as up, FakeProxy() as p:
        with pytest.raises(TimeoutError):
            await client.request(
                "POST",
                f"{up.base_url}/chat/completions",
                body=b"{}",
                proxy=via(p),
                headers_timeout=0.2,
            )
        assert up.hits == 1


async def test_a_reset_after_the_request_went_through_the_tunnel_is_connection_broken(
    client: HTTPClient,
) -> None:
    async with FakeUpstream("east", default=Behavior.reset_before_bytes()) as up, FakeProxy() as p:
        with pytest.raises(ConnectionBroken):
            await client.request(
                "POST", f"{up.base_url}/chat/completions", body=b"{}", proxy=via(p)
            )
        assert up.hits == 1


# --- on uvloop, the loop the gateway serves on (start_tls and set_protocol are its own) ---

_ON_UVLOOP: list[Callable[[HTTPClient], Awaitable[None]]] = [
    test_an_http_upstream_is_reached_through_a_connect_tunnel,
    test_a_tunnel_is_pooled_for_its_proxy_and_origin_only,
    test_a_reset_after_the_request_went_through_the_tunnel_is_connection_broken,
]


@pytest.mark.parametrize("case", _ON_UVLOOP, ids=lambda case: case.__name__[5:])
def test_on_uvloop(case: Callable[[HTTPClient], Awaitable[None]]) -> None:
    uvloop = pytest.importorskip("uvloop")

    async def run() -> None:
        client = HTTPClient()
        try:
            await case(client)
        finally:
            await client.aclose()

    uvloop.run(run())


def test_tls_through_the_tunnel_on_uvloop(ca: trustme.CA) -> None:
    uvloop = pytest.importorskip("uvloop")
    uvloop.run(test_tls_to_the_upstream_runs_inside_the_tunnel_checked_against_its_name(ca))


# --- a proxy that is not ours: proxy.py, as its own process ---


@pytest.fixture(scope="module")
def proxy_py(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    """proxy.py on 127.0.0.1, requiring Basic credentials; the Proxy to reach it with."""
    pytest.importorskip("proxy")
    port_file = tmp_path_factory.mktemp("proxy_py") / "port"
    process = subprocess.Popen(
        [
            sys.executable, "-m", "proxy",
            "--hostname", "127.0.0.1", "--port", "0", "--port-file", str(port_file),
            "--num-acceptors", "1", "--num-workers", "1",
            "--basic-auth", f"user:{PASSWORD}", "--log-level", "WARNING",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its workers with it: stopped as one group
    )  # fmt: skip
    try:
        port = _wait_for_port(port_file, process)
        yield Proxy.basic("127.0.0.1", port, "user", PASSWORD)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _wait_for_port(port_file: Path, process: subprocess.Popen[bytes]) -> int:
    # A process of its own says nothing when it is ready but this file (then a connect).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert process.poll() is None, "proxy.py exited"
        text = port_file.read_text().strip() if port_file.exists() else ""
        if text:
            port = int(text.split()[0])
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return port
            except OSError:
                pass
        time.sleep(0.05)
    raise AssertionError("proxy.py did not start")


async def test_through_proxy_py_tls_and_plain_http_reach_the_upstream(
    proxy_py: Proxy, ca: trustme.CA
) -> None:
    client = tls_client(ca)
    sni: list[str | None] = []
    async with (
        FakeUpstream("tls", tls=tls_server(ca, "localhost", sni)) as tls_up,
        FakeUpstream("plain") as plain_up,
    ):
        assert (
            await models(client, f"https://localhost:{tls_up.port}/v1", proxy_py)
        ).status_code == 200
        assert (await models(client, plain_up.base_url, proxy_py)).status_code == 200
        await client.aclose()
        assert sni == ["localhost"]
        assert "proxy-authorization" not in plain_up.requests[-1].headers


async def test_proxy_py_refusing_wrong_credentials_is_tunnel_failed_407(
    proxy_py: Proxy, client: HTTPClient
) -> None:
    wrong = Proxy.basic(proxy_py.host, proxy_py.port, "user", "wrong")
    async with FakeUpstream("east") as up:
        with pytest.raises(TunnelFailed) as caught:
            await models(client, up.base_url, wrong)
        assert up.connections == 0
    assert caught.value.status == 407
