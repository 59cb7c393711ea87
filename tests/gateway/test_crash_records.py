"""Crash records that say what the client saw, promptly: a stream is on the ledger as
committed before the client's first byte; a gateway killed mid-request and restarted on
the same instance id records its requests' ends at start-up (a stream that delivered
content as a partial failure with its 200, anything else as failed), with the real attempt
count; another instance leaves those holds alone until the heartbeat rule says so."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from ledger import events as ev
from ledger.books.balances import holds
from ledger.books.recovery import MAX_INSTANCE_ID, check_instance_id
from ledger.store import LedgerUnavailable, RecordedEvent
from router.fake_provider import Behavior, FakeUpstream, Kind
from router.http.app import default_instance_id
from tests.gateway.harness import ANTHROPIC_ENV, Route, closed_port, config_text, running_gateway
from tests.gateway.processes import new_key, serve_process
from tests.ledger.test_cli import waybill

BODY: dict[str, Any] = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
STREAM_BODY: dict[str, Any] = {**BODY, "stream": True}


def _on_stream_commit(store: Any, commit: Callable[..., Any]) -> None:
    """Route the appends that carry ``StreamCommitted`` through ``commit`` (same arguments
    as ``store.submit``, returns the future); every other append goes as usual."""
    real_submit = store.submit

    def submit(stream_id: str, expected: int | None, events: Any, **kwargs: Any) -> Any:
        if any(isinstance(event, ev.StreamCommitted) for event in events):
            return commit(real_submit, stream_id, expected, events, **kwargs)
        return real_submit(stream_id, expected, events, **kwargs)

    store.submit = submit


async def test_a_stream_is_recorded_as_committed_before_the_client_gets_a_byte(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw:
        gw.upstreams["east"].set_default(Behavior.ok(chunk_delay_ms=200))

        def slow_commit(real_submit: Any, *args: Any, **kwargs: Any) -> Any:
            async def later() -> list[RecordedEvent]:
                await asyncio.sleep(0.3)  # a slow commit: the client must wait for it
                recorded: list[RecordedEvent] = await real_submit(*args, **kwargs)
                return recorded

            return asyncio.ensure_future(later())

        _on_stream_commit(gw.served_store, slow_commit)
        async with (
            gw.http() as http,
            http.stream("POST", "/v1/chat/completions", json=STREAM_BODY) as streamed,
        ):
            assert streamed.status_code == 200  # the headers are here: the commit is too
            on_ledger = await gw.types(streamed.headers["x-request-id"])
            await streamed.aread()
        # Recorded before the headers went out, and the stream was still going.
        assert on_ledger[3:] == ["AttemptStarted", "StreamCommitted"], on_ledger


async def test_a_stream_whose_commit_cannot_be_recorded_is_a_503_before_any_byte(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw:

        def unavailable(real_submit: Any, *args: Any, **kwargs: Any) -> Any:
            async def refused() -> list[RecordedEvent]:
                raise LedgerUnavailable("the database went away")

            return asyncio.ensure_future(refused())

        _on_stream_commit(gw.served_store, unavailable)
        async with gw.http() as http:
            response = await http.post("/v1/chat/completions", json=STREAM_BODY)
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "ledger_unavailable"
        assert b"data:" not in response.content
        assert gw.upstreams["east"].hits == 1
        request_id = response.headers["x-request-id"]
        types = await gw.wait_for_types(request_id, "RequestFailed")
        assert types[3:] == [
            "AttemptStarted",
            "AttemptFinished",
            "UnknownUsageOpened",  # the upstream did start: its usage is unknown, not free
            "RequestFailed",
        ]
        events = await gw.events(request_id)
        finished, opened, failed = (e.data for e in events[4:])
        assert (finished["evidence"], finished["error_code"], finished["stream_committed"]) == (
            "started",
            "ledger_unavailable",
            False,
        )
        assert opened["cause"] == "ledger_unavailable"
        assert (failed["http_status"], failed["stream_started"]) == (503, False)
        async with gw.store.engine.connect() as conn:
            states = [row.state for row in await conn.execute(holds())]
        assert states == ["unknown"]


# --- kill -9 and restart ---


def _holds(url: str) -> dict[str, str]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(holds())
            return {row.request_id: row.state for row in rows if row.state != "resolved"}
    finally:
        engine.dispose()


async def _kill_mid_flight(
    gateway: subprocess.Popen[bytes], west: FakeUpstream, port: int, secret: str
) -> str:
    """A stream that has delivered content and a buffered request waiting on its upstream,
    both on their second attempt, when the gateway is killed; the stream's request id."""
    async with (
        httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}",
            headers={"Authorization": f"Bearer {secret}"},
            timeout=30,
        ) as http,
        http.stream("POST", "/v1/chat/completions", json=STREAM_BODY) as streamed,
    ):
        assert streamed.status_code == 200
        pieces = streamed.aiter_raw()  # kept: a reader let go of would close the stream
        async for piece in pieces:
            if b'"content"' in piece:
                break  # content delivered
        buffered = asyncio.create_task(http.post("/v1/chat/completions", json=BODY))
        await asyncio.to_thread(west.wait_for, lambda up: up.hits == 2, 10)
        gateway.send_signal(signal.SIGKILL)
        await asyncio.to_thread(gateway.wait, 10)
        with pytest.raises(httpx.HTTPError):
            await buffered
        return streamed.headers["x-request-id"]


def _view(port: int, secret: str, request_id: str) -> dict[str, Any]:
    """The request's view once the read model has folded its end."""
    deadline = time.monotonic() + 10
    while True:
        view = httpx.get(
            f"http://127.0.0.1:{port}/v1/requests/{request_id}",
            headers={"Authorization": f"Bearer {secret}"},
        )
        if view.status_code == 200 and view.json()["status"] != "in_progress":
            return dict(view.json())
        assert time.monotonic() < deadline, view.text
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.postgres
def test_a_restart_on_the_same_instance_id_records_its_crashed_requests_at_once(
    postgres_url: str, tmp_path: Path
) -> None:
    # Heartbeats every minute: the heartbeat rule (six missed beats) cannot be what
    # recovers anything here.
    slow_beats = {"WAYBILL_HEARTBEAT_S": "60"}
    defaults = {
        "deadline_ms": "120000",
        "attempt_timeout_ms": "60000",
        "first_token_timeout_ms": "60000",
        "stream_idle_timeout_ms": "60000",
        "breaker": "{failure_threshold: 10}",
    }
    with FakeUpstream("west") as west:
        # east refuses connections: each request's first attempt fails over to west.
        config = tmp_path / "waybill.yaml"
        config.write_text(
            config_text(
                {"west": west},
                [Route("east", tier=0), Route("west", tier=1)],
                dead_endpoints=["east"],
                defaults=defaults,
            )
        )
        west.set_plan(
            [
                Behavior(Kind.STALL, after_events=3),  # role and two chunks, then silence
                Behavior.ok(latency_ms=60_000),
            ]
        )
        secret = new_key(postgres_url)
        admin = new_key(postgres_url, role="admin")
        port, other_port = closed_port(), closed_port()
        first = serve_process(config, postgres_url, port, env=slow_beats)  # default id
        stream_id = asyncio.run(_kill_mid_flight(first, west, port, secret))
        in_flight = _holds(postgres_url)
        assert sorted(in_flight.values()) == ["held", "held"], in_flight
        [buffered_id] = set(in_flight) - {stream_id}

        # Another instance does not take them: their owner is not its own, and not silent
        # for six beats yet.
        other = serve_process(
            config, postgres_url, other_port, env={**slow_beats, "WAYBILL_INSTANCE_ID": "gw-b"}
        )
        try:
            assert _holds(postgres_url) == in_flight
            # The same instance id (host name, address, port) again: before it answers
            # /readyz, its earlier run's holds are unknown-usage settlements.
            restarted = serve_process(config, postgres_url, port, env=slow_beats)
            try:
                assert _holds(postgres_url) == {stream_id: "unknown", buffered_id: "unknown"}
                streamed = _view(port, secret, stream_id)
                assert (streamed["status"], streamed["attempts"], streamed["http_status"]) == (
                    "partial_failure",
                    2,
                    200,
                )
                assert (streamed["endpoint"], streamed["error_code"]) == ("west", "gateway_lost")
                buffered = _view(port, secret, buffered_id)
                assert (buffered["status"], buffered["attempts"], buffered["http_status"]) == (
                    "failed",
                    2,
                    500,
                )
                assert buffered["error_code"] == "gateway_lost"
                events = httpx.get(
                    f"http://127.0.0.1:{port}/v1/requests/{stream_id}/events",
                    headers={"Authorization": f"Bearer {secret}"},
                ).json()["data"]
                finished = [e["data"] for e in events if e["type"] == "AttemptFinished"]
                assert [f["stream_committed"] for f in finished] == [False, True]
                failed = events[-1]["data"]
                assert (failed["attempts"], failed["stream_started"]) == (2, True)
                settlements = httpx.get(
                    f"http://127.0.0.1:{port}/v1/settlements/unknown?state=open",
                    headers={"Authorization": f"Bearer {admin}"},
                ).json()["data"]
                assert {(s["request_id"], s["cause"]) for s in settlements} == {
                    (stream_id, "crash_recovery"),
                    (buffered_id, "crash_recovery"),
                }
            finally:
                restarted.terminate()
                restarted.wait(timeout=20)
        finally:
            other.terminate()
            other.wait(timeout=20)
    assert waybill("verify", database_url=postgres_url).returncode == 0


# --- the instance id ---


def test_the_default_instance_id_is_the_host_name_and_the_address_served() -> None:
    assert default_instance_id("web-1", "127.0.0.1", 8080) == "web-1@127.0.0.1:8080"
    assert default_instance_id("web-1", "::", 8080) == "web-1@[::]:8080"
    long_a, long_b = "a" * 70 + ".example.com", "a" * 70 + ".example.org"
    odd = default_instance_id("my host/名前", "0.0.0.0", 80)
    for made in (
        default_instance_id(long_a, "0.0.0.0", 8080),
        default_instance_id(long_b, "0.0.0.0", 8080),
        odd,
    ):
        assert check_instance_id(made) == made and len(made) <= MAX_INSTANCE_ID
    # Cut down, they stay apart.
    assert default_instance_id(long_a, "0.0.0.0", 8080) != default_instance_id(
        long_b, "0.0.0.0", 8080
    )
    assert odd.startswith("my-host")


@pytest.mark.parametrize("how", ["flag", "env"])
def test_serve_refuses_an_instance_id_it_cannot_use(tmp_path: Path, how: str) -> None:
    env = ANTHROPIC_ENV | {"OPENAI_API_KEY": "k", "ANTHROPIC_API_KEY": "k"}
    args = ["serve", "--config", "docs/config.example.yaml"]
    if how == "flag":
        args += ["--instance-id", "gw/1"]
    else:
        env |= {"WAYBILL_INSTANCE_ID": "gw/1"}
    result = waybill(*args, database_url=f"sqlite:///{tmp_path / 'x.db'}", env=env)
    assert result.returncode == 1
    assert "--instance-id" in result.stderr and "Traceback" not in result.stderr
