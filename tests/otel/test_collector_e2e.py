"""Traces and metrics end to end: a real gateway, fake providers over real HTTP, and a real
OpenTelemetry collector process (rotel) receiving OTLP over HTTP and gRPC from the gateway
and the CLI."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pytest
from opentelemetry.sdk.resources import Resource

from ledger.store import NO_STREAM, EventStore
from ledger.store.db import create_engine
from otel.export import to_readable_spans
from otel.ids import pseudonymous_tenant, request_span_id
from otel.spans import request_spans
from router.fake_provider import Behavior
from tests.gateway.harness import Gateway, Route, running_gateway
from tests.helpers import eventually
from tests.ledger import factories
from tests.ledger.test_cli import WAYBILL
from tests.otel.collector import Collector, Span

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
SECRET_PROMPT = "the-prompt-text-must-never-reach-a-span"
BODY = {"model": "chat", "messages": [{"role": "user", "content": SECRET_PROMPT}]}
SERVER, CLIENT = 2, 3  # OTLP span kinds
ERROR = 2  # OTLP status code
ROUTES = [Route("east", model="east-model"), Route("west", tier=1, model="west-model")]


@pytest.fixture
async def collector(tmp_path: Path) -> AsyncIterator[Collector]:
    async with Collector(tmp_path / "collector") as running:
        yield running


def _otel_env(
    monkeypatch: pytest.MonkeyPatch, endpoint: str, protocol: str = "http/protobuf"
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "2")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "waybill-e2e")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    for signal in ("TRACES", "METRICS"):
        for setting in ("ENDPOINT", "PROTOCOL"):
            monkeypatch.delenv(f"OTEL_EXPORTER_OTLP_{signal}_{setting}", raising=False)


async def _chat(gw: Gateway, headers: dict[str, str] | None = None) -> str:
    async with gw.http() as http:
        response = await http.post("/v1/chat/completions", json=BODY, headers=headers or {})
    assert response.status_code == 200, response.text
    return response.headers["x-request-id"]


def _one(spans: list[Span], name: str) -> Span:
    (span,) = [s for s in spans if s["name"] == name]
    return span


async def test_a_failover_reaches_the_collector_as_one_trace_in_the_callers_trace(
    database_url: str, collector: Collector, monkeypatch: pytest.MonkeyPatch
) -> None:
    _otel_env(monkeypatch, collector.endpoint)
    async with running_gateway(database_url, ["east", "west"], ROUTES) as gw:
        gw.upstreams["east"].set_plan([Behavior.server_error()])
        request_id = await _chat(gw, {"traceparent": TRACEPARENT})
        spans = await collector.wait_for_request(request_id, 3)
        events = await gw.events(request_id)

    request = _one(spans, "chat chat")
    first, second = _one(spans, "chat east-model"), _one(spans, "chat west-model")
    # One trace, the caller's; the request span hangs from the caller's span.
    assert {s["trace_id"] for s in spans} == {CALLER_TRACE}
    assert (request["kind"], request["parent_span_id"]) == (SERVER, CALLER_SPAN)
    assert request["span_id"] == request_span_id(request_id)
    assert (first["kind"], second["kind"]) == (CLIENT, CLIENT)
    assert first["parent_span_id"] == second["parent_span_id"] == request["span_id"]

    # Each upstream received the request's trace with its own attempt span as parent.
    east_sent = gw.upstreams["east"].requests[-1].headers["traceparent"]
    west_sent = gw.upstreams["west"].requests[-1].headers["traceparent"]
    assert east_sent == f"00-{CALLER_TRACE}-{first['span_id']}-01"
    assert west_sent == f"00-{CALLER_TRACE}-{second['span_id']}-01"

    attempt = first["attributes"]
    assert attempt["gen_ai.operation.name"] == "chat"
    assert attempt["gen_ai.provider.name"] == "openai"
    assert attempt["gen_ai.request.model"] == "east-model"
    assert attempt["server.address"] == "127.0.0.1"
    assert attempt["server.port"] == gw.upstreams["east"].port
    assert attempt["error.type"] == attempt["waybill.failure_class"] == "upstream_unavailable"
    assert attempt["waybill.evidence"] == "unknown"
    assert (attempt["waybill.tier"], attempt["waybill.weight"]) == (0, 1)
    assert attempt["http.response.status_code"] == 500
    assert first["status"] == {"code": ERROR, "message": "upstream_unavailable"}
    # the attempt's reservation, held as unknown usage after a 5xx (money as decimal strings)
    assert attempt["waybill.reserved_usd"] == attempt["waybill.held_unknown_usd"]
    assert Decimal(attempt["waybill.reserved_usd"]) > 0

    winner = second["attributes"]
    assert winner["waybill.tier"] == 1 and winner["waybill.evidence"] == "started"
    assert winner["gen_ai.usage.input_tokens"] > 0 and winner["gen_ai.usage.output_tokens"] > 0
    assert winner["gen_ai.response.model"] == "west-model"
    assert winner["gen_ai.response.id"].startswith("chatcmpl-")
    assert winner["gen_ai.response.finish_reasons"] == ["stop"]
    assert winner["waybill.attempt_id"] == events[-2].data["attempt_id"]
    assert second["status"]["code"] != ERROR
    assert Decimal(winner["waybill.settled_usd"]) > 0

    top = request["attributes"]
    assert top["gen_ai.request.model"] == "chat"
    assert top["waybill.request_id"] == request_id and top["waybill.attempts"] == 2
    assert top["waybill.status"] == "succeeded" and top["waybill.endpoint"] == "west"
    assert "gen_ai.system" not in top
    assert [e["name"] for e in request["events"]] == [
        "waybill.route.evaluated",
        "waybill.failover.decided",
        "waybill.route.evaluated",
        "waybill.route.candidate_excluded",
    ]
    failover = request["events"][1]["attributes"]
    assert (failover["waybill.failover.action"], failover["waybill.failover.allowed"]) == (
        "failover",
        True,
    )
    excluded = request["events"][3]["attributes"]
    assert (excluded["waybill.endpoint"], excluded["waybill.reason_code"]) == (
        "east",
        "already_tried",
    )
    assert request["resource"]["service.name"] == "waybill-e2e"
    assert {s["scope"] for s in spans} == {"waybill"}
    assert SECRET_PROMPT not in json.dumps(spans)

    # The timestamps are the ledger's, to the nanosecond.
    expected = {
        format(s.context.span_id, "016x"): (s.start_time, s.end_time)
        for s in to_readable_spans(request_spans(events), Resource({}))
        if s.context is not None
    }
    assert {s["span_id"]: (s["start"], s["end"]) for s in spans} == expected


async def test_a_request_without_traceparent_gets_a_trace_of_its_own(
    sqlite_url: str, collector: Collector, monkeypatch: pytest.MonkeyPatch
) -> None:
    _otel_env(monkeypatch, collector.endpoint)
    async with running_gateway(sqlite_url, ["east"], [Route("east")]) as gw:
        request_id = await _chat(gw)
        spans = await collector.wait_for_request(request_id, 2)
        sent = gw.upstreams["east"].requests[-1].headers["traceparent"]
    request = _one(spans, "chat chat")
    attempt = _one(spans, "chat fake-model")
    assert request["parent_span_id"] == ""  # a root span
    assert request["trace_id"] == attempt["trace_id"] != CALLER_TRACE
    assert sent == f"00-{request['trace_id']}-{attempt['span_id']}-01"


async def test_pseudonymous_tenants_name_the_workspace_by_an_hmac_only(
    sqlite_url: str, collector: Collector, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _otel_env(monkeypatch, collector.endpoint)
    secret = "tenant-secret-of-this-test-0123456789"
    otel = "{pseudonymous_tenants: true, tenant_secret: '${env:TENANT_SECRET}'}"
    environ = {"TENANT_SECRET": secret}
    config_file = tmp_path / "waybill.yaml"
    async with running_gateway(
        sqlite_url, ["east"], [Route("east")], otel=otel, environ=environ, config_file=config_file
    ) as gw:
        request_id = await _chat(gw)
        spans = await collector.wait_for_request(request_id, 2)
        ledger = [e.data for e in await gw.events(request_id)]
    top = _one(spans, "chat chat")["attributes"]
    assert top["waybill.tenant"] == pseudonymous_tenant("acme", secret.encode())
    assert "waybill.workspace" not in top
    assert "acme" not in json.dumps(spans) and secret not in json.dumps(spans)
    assert secret not in json.dumps(ledger)

    # A re-export with the config names the tenant the same way.
    monkeypatch.setenv("TENANT_SECRET", secret)
    monkeypatch.setenv("FAKE_KEY", "sk-fake")
    async with Collector(tmp_path / "replay") as replay:
        again = await _waybill(
            "otel",
            "export",
            "--config",
            str(config_file),
            database_url=sqlite_url,
            endpoint=replay.endpoint,
        )
        assert again.returncode == 0, again.stderr
        replayed = await replay.wait_for_request(request_id, 2)
    assert _one(replayed, "chat chat")["attributes"]["waybill.tenant"] == top["waybill.tenant"]
    assert "acme" not in json.dumps(replayed)


async def test_traces_and_metrics_reach_the_collector_over_grpc(
    sqlite_url: str, collector: Collector, monkeypatch: pytest.MonkeyPatch
) -> None:
    _otel_env(monkeypatch, collector.grpc_endpoint, protocol="grpc")  # rotel's gRPC receiver
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "200")
    async with running_gateway(sqlite_url, ["east"], [Route("east")]) as gw:
        request_id = await _chat(gw, {"traceparent": TRACEPARENT})
        spans = await collector.wait_for_request(request_id, 2)
        sent = gw.upstreams["east"].requests[-1].headers["traceparent"]
        await collector.wait_until(lambda c: "gen_ai.client.operation.duration" in c.metric_names())
    request = _one(spans, "chat chat")
    attempt = _one(spans, "chat fake-model")
    assert {s["trace_id"] for s in spans} == {CALLER_TRACE}
    assert (request["kind"], request["parent_span_id"]) == (SERVER, CALLER_SPAN)
    assert request["span_id"] == request_span_id(request_id)
    assert (attempt["kind"], attempt["parent_span_id"]) == (CLIENT, request["span_id"])
    assert attempt["attributes"]["gen_ai.request.model"] == "fake-model"
    assert sent == f"00-{CALLER_TRACE}-{attempt['span_id']}-01"
    assert request["resource"]["service.name"] == "waybill-e2e"


async def _lag(gw: Gateway, follower: str) -> int | None:
    async with gw.http() as http:
        response = await http.get("/metrics", headers={"authorization": ""})
    for line in response.text.splitlines():
        if line.startswith("waybill_ledger_lag{") and f'waybill_follower="{follower}"' in line:
            return int(float(line.rsplit(" ", 1)[1]))
    return None


async def test_spans_wait_in_the_ledger_while_the_collector_is_down_and_are_never_repeated(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    collector = Collector(tmp_path / "collector")  # not started yet: nothing listens
    _otel_env(monkeypatch, collector.endpoint)
    try:
        async with running_gateway(sqlite_url, ["east"], [Route("east")]) as gw:
            first = await _chat(gw)  # the request path does not wait for the collector

            async def export_failed() -> bool:
                lag = await _lag(gw, "otel_traces")
                return lag is not None and lag > 0

            await eventually(export_failed, within_s=20)
            assert collector.spans() == []
            await collector.start()
            await collector.wait_for_request(first, 2)
            second = await _chat(gw)
            await collector.wait_for_request(second, 2)

        # A restart on the same ledger exports what is new, and nothing twice.
        async with running_gateway(sqlite_url, ["east"], [Route("east")]) as gw:
            third = await _chat(gw)
            await collector.wait_for_request(third, 2)
        span_ids = [s["span_id"] for s in collector.spans()]
        assert len(span_ids) == len(set(span_ids)) == 6
        assert {s["attributes"]["waybill.request_id"] for s in collector.spans()} == {
            first,
            second,
            third,
        }
    finally:
        await collector.stop()


async def _waybill(
    *args: str, database_url: str, endpoint: str, protocol: str = "http/protobuf"
) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(_run_waybill, args, database_url, endpoint, protocol)


def _run_waybill(
    args: tuple[str, ...], database_url: str, endpoint: str, protocol: str
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "WAYBILL_DATABASE_URL": database_url,
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_EXPORTER_OTLP_TIMEOUT": "1",
        "OTEL_SERVICE_NAME": "waybill-replay",
        "COLUMNS": "200",
    }
    return subprocess.run(
        [*WAYBILL, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )


def _comparable(span: Span) -> tuple[object, ...]:
    return (
        span["trace_id"],
        span["span_id"],
        span["parent_span_id"],
        span["name"],
        span["kind"],
        span["start"],
        span["end"],
        json.dumps(span["attributes"], sort_keys=True),
        json.dumps(span["events"], sort_keys=True),
        json.dumps(span["status"], sort_keys=True),
    )


async def test_waybill_otel_export_replays_a_past_window_with_the_same_spans(
    sqlite_url: str, collector: Collector, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _otel_env(monkeypatch, collector.endpoint)
    async with running_gateway(sqlite_url, ["east", "west"], ROUTES) as gw:
        gw.upstreams["east"].set_plan([Behavior.server_error()])
        early = await _chat(gw, {"traceparent": TRACEPARENT})
        await collector.wait_for_request(early, 3)
        boundary = datetime.now(UTC)
        late = await _chat(gw)
        await collector.wait_for_request(late, 2)

    async with Collector(tmp_path / "replay") as replay:
        window = await _waybill(
            "otel",
            "export",
            "--until",
            boundary.isoformat(),
            database_url=sqlite_url,
            endpoint=replay.endpoint,
        )
        assert window.returncode == 0, window.stderr
        assert f"exported 3 spans of 1 requests to {replay.endpoint}/v1/traces" in window.stdout
        assert "exporting traces" in window.stderr  # the progress bar
        await replay.wait_for_request(early, 3)
        assert replay.spans_of(late) == []
        assert sorted(map(_comparable, replay.spans())) == sorted(
            map(_comparable, collector.spans_of(early))
        )
        assert {s["resource"]["service.name"] for s in replay.spans()} == {"waybill-replay"}

        rest = await _waybill(
            "otel",
            "export",
            "--since",
            boundary.replace(tzinfo=None).isoformat(),  # no zone: UTC
            database_url=sqlite_url,
            endpoint=replay.endpoint,
        )
        assert rest.returncode == 0, rest.stderr
        await replay.wait_for_request(late, 2)
        assert sorted(map(_comparable, replay.spans_of(late))) == sorted(
            map(_comparable, collector.spans_of(late))
        )


async def test_waybill_otel_export_speaks_grpc_and_refuses_an_unknown_protocol(
    sqlite_url: str, tmp_path: Path
) -> None:
    engine = create_engine(sqlite_url)
    store = EventStore(engine)
    trail = await store.append("request-r1", NO_STREAM, factories.succeeded_trail("r1"))
    await store.close()
    await engine.dispose()
    expected = to_readable_spans(request_spans(trail), Resource({}))

    async with Collector(tmp_path / "grpc") as collector:
        sent = await _waybill(
            "otel",
            "export",
            database_url=sqlite_url,
            endpoint=collector.grpc_endpoint,
            protocol="grpc",
        )
        assert sent.returncode == 0, sent.stderr
        assert f"exported 2 spans of 1 requests to {collector.grpc_endpoint}\n" in sent.stdout
        spans = await collector.wait_for_request("r1", 2)
    assert {(s["span_id"], s["name"], s["start"], s["end"]) for s in spans} == {
        (format(s.context.span_id, "016x"), s.name, s.start_time, s.end_time)
        for s in expected
        if s.context is not None
    }
    assert {s["resource"]["service.name"] for s in spans} == {"waybill-replay"}

    refused = await _waybill(
        "otel",
        "export",
        database_url=sqlite_url,
        endpoint=collector.endpoint,
        protocol="http/json",
    )
    assert refused.returncode == 1
    assert "OTLP protocol 'http/json' is not supported" in refused.stderr
    assert "Traceback" not in refused.stderr


async def test_waybill_otel_export_fails_in_one_line(sqlite_url: str, tmp_path: Path) -> None:
    nobody = Collector(tmp_path / "nobody")  # never started: nothing listens
    engine = create_engine(sqlite_url)
    store = EventStore(engine)
    await store.append("request-r1", NO_STREAM, factories.succeeded_trail("r1"))
    await store.close()
    await engine.dispose()

    down = await _waybill("otel", "export", database_url=sqlite_url, endpoint=nobody.endpoint)
    assert down.returncode == 1
    errors = [line for line in down.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "did not accept 2 spans" in errors[0], down.stderr
    assert "Traceback" not in down.stderr

    bad = await _waybill(
        "otel", "export", "--since", "yesterday", database_url=sqlite_url, endpoint=nobody.endpoint
    )
    assert bad.returncode == 1
    assert "--since: not an ISO 8601 date or timestamp: 'yesterday'" in bad.stderr


async def test_metrics_are_served_for_prometheus_and_exported_over_otlp(
    sqlite_url: str, collector: Collector, monkeypatch: pytest.MonkeyPatch
) -> None:
    _otel_env(monkeypatch, collector.endpoint)
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "200")
    async with running_gateway(sqlite_url, ["east", "west"], ROUTES) as gw:
        gw.upstreams["east"].set_plan([Behavior.server_error()])
        await _chat(gw)

        async def scraped() -> bool:
            async with gw.http() as http:
                response = await http.get("/metrics", headers={"authorization": ""})
            assert response.status_code == 200  # no auth, no redirect
            assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
            text = response.text
            # Counters move at commit; the lag gauge on the telemetry task's next round.
            return all(
                name in text
                for name in (
                    "waybill_failovers_total{",
                    'gen_ai_token_type="output"',
                    "waybill_ledger_lag{",
                )
            )

        await eventually(scraped, within_s=10)
        async with gw.http() as http:
            text = (await http.get("/metrics")).text
        assert "gen_ai_client_operation_duration_seconds_bucket{" in text
        assert 'error_type="upstream_unavailable"' in text
        assert "waybill_requests_total{" in text and 'waybill_status="succeeded"' in text
        await collector.wait_until(
            lambda c: {"gen_ai.client.token.usage", "waybill.failovers"} <= c.metric_names()
        )
