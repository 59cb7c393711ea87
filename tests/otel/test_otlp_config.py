"""The OTLP exporters the standard ``OTEL_*`` variables choose, for traces and metrics."""

from __future__ import annotations

import pytest
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
    OTLPMetricExporter as GrpcMetricExporter,
)
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcSpanExporter,
)
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

from otel.export import OtelConfigError, otlp_protocol, trace_exporter_from_env, traces_endpoint
from otel.metrics import metric_exporter_from_env


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER"):
        monkeypatch.delenv(name, raising=False)
    for signal in ("", "TRACES_", "METRICS_"):
        for setting in ("ENDPOINT", "PROTOCOL"):
            monkeypatch.delenv(f"OTEL_EXPORTER_OTLP_{signal}{setting}", raising=False)


def test_http_protobuf_is_the_default_on_port_4318(monkeypatch: pytest.MonkeyPatch) -> None:
    assert otlp_protocol("TRACES") == otlp_protocol("METRICS") == "http/protobuf"
    assert isinstance(trace_exporter_from_env(explicit=True), OTLPSpanExporter)
    assert traces_endpoint() == "http://localhost:4318/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/")
    assert traces_endpoint() == "http://collector:4318/v1/traces"
    reader = metric_exporter_from_env()
    assert reader is not None and isinstance(reader._exporter, OTLPMetricExporter)  # type: ignore[attr-defined]
    reader.shutdown()


def test_grpc_serves_both_signals_on_port_4317(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    assert isinstance(trace_exporter_from_env(explicit=True), GrpcSpanExporter)
    assert traces_endpoint() == "http://localhost:4317"  # no /v1/traces path over gRPC
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    assert traces_endpoint() == "http://collector:4317"
    reader = metric_exporter_from_env()
    assert reader is not None and isinstance(reader._exporter, GrpcMetricExporter)  # type: ignore[attr-defined]
    reader.shutdown()


def test_a_signals_own_protocol_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "http/protobuf")
    assert (otlp_protocol("TRACES"), otlp_protocol("METRICS")) == ("grpc", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    assert otlp_protocol("TRACES") == "http/protobuf"


@pytest.mark.parametrize("signal", ["TRACES", "METRICS"])
def test_any_other_protocol_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, signal: str
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    monkeypatch.setenv(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL", "http/json")
    build = trace_exporter_from_env if signal == "TRACES" else metric_exporter_from_env
    with pytest.raises(OtelConfigError, match=r"'http/json' is not supported.*grpc"):
        build()
