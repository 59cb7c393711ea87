"""Metrics derived from ledger events (contract §8), for OTLP and for ``GET /metrics``.

:class:`LedgerMetrics` owns the instruments and records each followed event into them; one
OpenTelemetry ``MeterProvider`` feeds two readers: a Prometheus reader on a registry of this
process's own (rendered by :meth:`MetricsPipeline.prometheus_text`) and, when the ``OTEL_*``
variables ask for it, a periodic OTLP exporter (over HTTP or gRPC).

The GenAI client metrics describe the gateway's calls to its upstreams, one per attempt:
``gen_ai.client.token.usage`` (when the usage is known), ``gen_ai.client.operation.duration``
and, for streams, ``gen_ai.client.operation.time_to_first_chunk``. The ``waybill.*``
counters count requests, failovers, breaker transitions, budget rejections, unknown-usage
settlements opened, endpoints disabled and the tokens of unattributed provider usage that
recorded reconciliations found; ``waybill.ledger.lag`` says how far each ledger follower
trails and ``waybill.endpoints.disabled`` which endpoints are disabled now.

Each gateway process records the events its own event store commits
(``otel.telemetry``), so every replica reports its own requests since it started (``sum``
across replicas counts each request once).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Final

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from ledger import events as ev
from ledger.store import RecordedEvent
from otel import semconv as sc
from otel.export import otlp_protocol, resource_from_env
from otel.tallies import Tallies

__all__ = [
    "PROMETHEUS_CONTENT_TYPE",
    "LedgerMetrics",
    "MetricsPipeline",
    "metric_exporter_from_env",
]

_MAX_OPEN_ATTEMPTS: Final = 10_000

PROMETHEUS_CONTENT_TYPE: Final = CONTENT_TYPE_PLAIN_0_0_4
"""The classic text format: the metric names are sanitized to it."""

Attributes = dict[str, str | int | bool]

METER: Final = "waybill"


class LedgerMetrics:
    """The instruments, and how each ledger event moves them."""

    def __init__(self, provider: MeterProvider, tallies: Tallies) -> None:
        meter = provider.get_meter(METER, schema_url=sc.SCHEMA_URL)
        self._token_usage = tallies.histogram(
            meter,
            sc.GEN_AI_CLIENT_TOKEN_USAGE,
            unit="{token}",
            description="Number of input and output tokens used, per upstream attempt.",
            bounds=sc.TOKEN_BUCKETS,
        )
        self._duration = tallies.histogram(
            meter,
            sc.GEN_AI_CLIENT_OPERATION_DURATION,
            unit="s",
            description="Duration of each upstream attempt.",
            bounds=sc.DURATION_BUCKETS,
        )
        self._first_chunk = tallies.histogram(
            meter,
            sc.GEN_AI_CLIENT_OPERATION_TIME_TO_FIRST_CHUNK,
            unit="s",
            description="Time from an upstream streaming call to its first chunk.",
            bounds=sc.DURATION_BUCKETS,
        )
        self._requests = tallies.counter(
            meter,
            sc.WAYBILL_REQUESTS,
            unit="{request}",
            description="Requests answered, by status.",
        )
        self._failovers = tallies.counter(
            meter,
            sc.WAYBILL_FAILOVERS,
            unit="{failover}",
            description="Failovers to another endpoint, by the failure class that caused them.",
        )
        self._breaker = tallies.counter(
            meter,
            sc.WAYBILL_BREAKER_TRANSITIONS,
            unit="{transition}",
            description="Circuit breaker transitions (to_state=open counts the openings).",
        )
        self._budget_rejections = tallies.counter(
            meter,
            sc.WAYBILL_BUDGET_REJECTIONS,
            unit="{rejection}",
            description="Budget reservations denied, by the account that could not cover them.",
        )
        self._unknown_usage = tallies.counter(
            meter,
            sc.WAYBILL_UNKNOWN_USAGE_OPENED,
            unit="{settlement}",
            description="Unknown-usage settlements opened (reservations held until reconciled).",
        )
        self._unattributed = tallies.counter(
            meter,
            sc.WAYBILL_UNATTRIBUTED_TOKENS,
            unit="{token}",
            description="Provider-reported tokens on a mapped identity that no attempt "
            "explains, by endpoint and token type (from recorded reconciliations).",
        )
        self._hedges = tallies.counter(
            meter,
            sc.WAYBILL_HEDGES,
            unit="{hedge}",
            description="Hedged second ways: launched, and whether each race was won by the "
            "hedge or lost to the way it hedged.",
        )
        self._loser_cost = tallies.counter(
            meter,
            sc.WAYBILL_HEDGE_LOSER_COST,
            unit="USD",
            description="What the ways that lost a hedged race cost (settled, or held as "
            "unknown usage until reconciled).",
        )
        self._disablings = tallies.counter(
            meter,
            sc.WAYBILL_ENDPOINT_DISABLINGS,
            unit="{disabling}",
            description="Endpoints disabled because their upstream refused the credentials.",
        )
        self._disabled: dict[str, bool] = {}
        meter.create_observable_gauge(
            sc.WAYBILL_ENDPOINTS_DISABLED,
            callbacks=[self._observe_disabled],
            unit="{endpoint}",
            description="1 while an endpoint is disabled after a credentials failure, else 0 "
            "(from the ledger's endpoints stream): alert on any 1.",
        )
        self._lag: dict[str, int] = {}
        meter.create_observable_gauge(
            sc.WAYBILL_LEDGER_LAG,
            callbacks=[self._observe_lag],
            unit="{event}",
            description="Ledger head position minus each follower's checkpoint.",
        )
        # Attempt attributes from AttemptStarted, until the attempt's AttemptFinished.
        self._open: OrderedDict[str, Attributes] = OrderedDict()
        # The operation of each request in flight that is not a chat (embeddings), from its
        # RequestReceived, which is appended with its first AttemptStarted, until it ends.
        self._operations: OrderedDict[str, str] = OrderedDict()
        # The hedges started, and the ways that lost a race (their settlement follows).
        self._hedge_ways: OrderedDict[str, None] = OrderedDict()
        self._losers: OrderedDict[str, None] = OrderedDict()

    def _reconciled(self, event: ev.ReconciliationImported) -> None:
        # Counted once: a re-import returns the recorded report and appends nothing.
        for usage in event.unattributed_provider_usage:
            endpoint = "+".join(usage.endpoints)
            for token_type, count in (
                ("input", usage.input_tokens),
                ("output", usage.output_tokens),
            ):
                if count:
                    self._unattributed.add(
                        count, {sc.WAYBILL_ENDPOINT: endpoint, sc.GEN_AI_TOKEN_TYPE: token_type}
                    )

    def set_disabled(self, disabled: Mapping[str, bool]) -> None:
        """Which endpoints the ledger has disabled now (every endpoint it ever named)."""
        self._disabled = dict(disabled)

    def _observe_disabled(self, options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(int(v), {sc.WAYBILL_ENDPOINT: k}) for k, v in sorted(self._disabled.items())
        ]

    def set_lag(self, lag: Mapping[str, int]) -> None:
        self._lag = dict(lag)

    def _observe_lag(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(v, {sc.WAYBILL_FOLLOWER: k}) for k, v in sorted(self._lag.items())]

    def record(self, recorded: RecordedEvent) -> None:
        """Move the instruments for one ledger event."""
        if recorded.type == _RECEIVED:
            # Read from the data, not decoded: every request has one, and only an
            # embeddings request's is remembered.
            operation = sc.operation_of(recorded.data.get("api", ""))
            if operation != sc.OPERATION_CHAT:
                _remember_as(self._operations, recorded.data["request_id"], operation)
            return
        if recorded.type not in _MEASURED:
            return  # most of a request's events move no instrument
        event = recorded.event()
        match event:
            case ev.AttemptStarted():
                operation = self._operations.get(event.request_id, sc.OPERATION_CHAT)
                self._open[event.attempt_id] = _attempt_attributes(event, operation)
                while len(self._open) > _MAX_OPEN_ATTEMPTS:  # attempts a crash never finished
                    self._open.popitem(last=False)
                if event.kind == "hedge":
                    self._hedges.add(1, {sc.WAYBILL_HEDGE_OUTCOME: "launched"})
                    _remember(self._hedge_ways, event.attempt_id, None)
            case ev.AttemptFinished():
                self._attempt_finished(event)
                if event.error_code == ev.HEDGE_LOST:
                    hedge = event.attempt_id in self._hedge_ways
                    self._hedges.add(1, {sc.WAYBILL_HEDGE_OUTCOME: "lost" if hedge else "won"})
                    _remember(self._losers, event.attempt_id, None)
            case ev.BudgetSettled() if self._losers.pop(event.attempt_id, 0) is None:
                self._loser_cost.add(float(event.settled_usd), {sc.WAYBILL_SETTLEMENT: "settled"})
            case ev.UnknownUsageOpened() if self._losers.pop(event.attempt_id, 0) is None:
                self._unknown_usage.add(1, {sc.WAYBILL_ENDPOINT: event.endpoint})
                held = {sc.WAYBILL_SETTLEMENT: "held_unknown"}
                self._loser_cost.add(float(event.held_usd), held)
            case ev.RequestCompleted():
                self._operations.pop(event.request_id, None)
                self._requests.add(1, {sc.WAYBILL_STATUS: "succeeded"})
            case ev.RequestFailed():
                self._operations.pop(event.request_id, None)
                status = "partial_failure" if event.stream_started else "failed"
                self._requests.add(1, {sc.WAYBILL_STATUS: status, sc.ERROR_TYPE: event.error_code})
            case ev.FailoverDecided() if event.action == "failover":
                self._failovers.add(
                    1,
                    {
                        sc.WAYBILL_FAILURE_CLASS: event.failure_class.value,
                        sc.WAYBILL_EVIDENCE: event.evidence.value,
                    },
                )
            case ev.BreakerTransitioned():
                self._breaker.add(
                    1,
                    {
                        sc.WAYBILL_BREAKER_SCOPE: event.scope,
                        sc.WAYBILL_ENDPOINT: event.target.split("/", 1)[0],
                        sc.WAYBILL_BREAKER_STATE: event.to_state,
                    },
                )
            case ev.BudgetReservationDenied():
                self._budget_rejections.add(1, {sc.WAYBILL_ACCOUNT_KIND: event.account_kind})
            case ev.UnknownUsageOpened():
                self._unknown_usage.add(1, {sc.WAYBILL_ENDPOINT: event.endpoint})
            case ev.ReconciliationImported():
                self._reconciled(event)
            case ev.EndpointDisabled():
                self._disablings.add(1, {sc.WAYBILL_ENDPOINT: event.endpoint})

    def _attempt_finished(self, event: ev.AttemptFinished) -> None:
        attributes = self._open.pop(event.attempt_id, None) or {
            sc.GEN_AI_OPERATION_NAME: sc.OPERATION_CHAT
        }
        if event.response_model:
            attributes[sc.GEN_AI_RESPONSE_MODEL] = event.response_model
        if event.usage is not None:
            for kind, tokens in (
                (sc.TOKEN_TYPE_INPUT, event.usage.input_tokens),
                (sc.TOKEN_TYPE_OUTPUT, event.usage.output_tokens),
            ):
                self._token_usage.record(tokens, {**attributes, sc.GEN_AI_TOKEN_TYPE: kind})
        if event.status == "failed":
            failure = event.failure_class.value if event.failure_class else "failed"
            attributes = {**attributes, sc.ERROR_TYPE: failure}
        self._duration.record(event.duration_ms / 1000, attributes)
        if event.time_to_first_chunk_ms is not None:
            self._first_chunk.record(event.time_to_first_chunk_ms / 1000, attributes)


# The events ``LedgerMetrics.record`` reads: a case of its match for each.
_MEASURED: Final = ev.type_names(
    ev.AttemptStarted,
    ev.AttemptFinished,
    ev.BudgetSettled,
    ev.UnknownUsageOpened,
    ev.RequestCompleted,
    ev.RequestFailed,
    ev.FailoverDecided,
    ev.BreakerTransitioned,
    ev.BudgetReservationDenied,
    ev.ReconciliationImported,
    ev.EndpointDisabled,
)


_RECEIVED: Final = ev.RequestReceived.type


def _remember_as(seen: OrderedDict[str, str], key: str, value: str) -> None:
    seen[key] = value
    while len(seen) > _MAX_OPEN_ATTEMPTS:  # a crash left the request unfinished
        seen.popitem(last=False)


def _remember(seen: OrderedDict[str, None], key: str, value: None) -> None:
    seen[key] = value
    while len(seen) > _MAX_OPEN_ATTEMPTS:  # a crash left its race unfinished
        seen.popitem(last=False)


def _attempt_attributes(event: ev.AttemptStarted, operation: str) -> Attributes:
    attributes: Attributes = {
        sc.GEN_AI_OPERATION_NAME: operation,
        sc.GEN_AI_PROVIDER_NAME: sc.PROVIDER_BY_DRIVER.get(event.driver, event.driver),
        sc.GEN_AI_REQUEST_MODEL: event.model,
    }
    if event.server_address:
        attributes[sc.SERVER_ADDRESS] = event.server_address
    if event.server_port is not None:
        attributes[sc.SERVER_PORT] = event.server_port
    return attributes


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


def metric_exporter_from_env() -> MetricReader | None:
    """A periodic OTLP metric reader when the ``OTEL_*`` variables ask for one
    (``OTEL_METRICS_EXPORTER=otlp`` or an OTLP endpoint), else None. Raises
    :class:`otel.export.OtelConfigError` for a protocol it cannot speak."""
    if _env("OTEL_SDK_DISABLED").lower() == "true":
        return None
    chosen = [v.strip() for v in _env("OTEL_METRICS_EXPORTER").lower().split(",") if v.strip()]
    endpoint = _env("OTEL_EXPORTER_OTLP_ENDPOINT") or _env("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
    if "otlp" not in chosen and (chosen or not endpoint):
        return None  # none, prometheus (GET /metrics serves it anyway), or nothing configured
    from opentelemetry.sdk.metrics.export import MetricExporter, PeriodicExportingMetricReader

    exporter: MetricExporter
    if otlp_protocol("METRICS") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
            OTLPMetricExporter as GrpcMetricExporter,
        )

        exporter = GrpcMetricExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        exporter = OTLPMetricExporter()
    # The export interval comes from OTEL_METRIC_EXPORT_INTERVAL (default 60 s).
    return PeriodicExportingMetricReader(exporter)


class MetricsPipeline:
    """One process's metrics: the instruments, a Prometheus registry, and OTLP if asked."""

    def __init__(
        self,
        resource: Resource | None = None,
        *,
        readers: Iterable[MetricReader] = (),
        otlp: bool = True,
    ) -> None:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader

        self.registry = CollectorRegistry(auto_describe=True)
        all_readers: list[MetricReader] = [PrometheusMetricReader(registry=self.registry)]
        all_readers.extend(readers)
        if otlp and (periodic := metric_exporter_from_env()) is not None:
            all_readers.append(periodic)
        resource = resource or resource_from_env()
        tallies = Tallies(InstrumentationScope(METER, schema_url=sc.SCHEMA_URL), resource)
        self.provider = MeterProvider(metric_readers=all_readers, resource=resource)
        for reader in all_readers:
            tallies.watch(reader)
        self.metrics = LedgerMetrics(self.provider, tallies)

    def prometheus_text(self) -> bytes:
        """The current values in the Prometheus text exposition format."""
        return generate_latest(self.registry)

    def shutdown(self) -> None:
        """Flush OTLP (if any) and stop the readers."""
        self.provider.shutdown()
