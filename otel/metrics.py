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
from dataclasses import dataclass
from datetime import datetime
from typing import Final, TypeVar

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
from otel.tallies import TalliedCounter, Tallies

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
        self._open_time = tallies.counter(
            meter,
            sc.WAYBILL_BREAKER_OPEN_TIME,
            unit="s",
            description="Seconds circuit breakers spent open, by scope, endpoint and (for a "
            "mapping's breaker) model, counted when the breaker leaves the open state.",
        )
        self._request_cost = tallies.histogram(
            meter,
            sc.WAYBILL_REQUEST_COST,
            unit="USD",
            description="What each successful request cost (every attempt it settled).",
            bounds=sc.COST_BUCKETS,
        )
        self._excluded = tallies.counter(
            meter,
            sc.WAYBILL_EXCLUDED_CANDIDATES,
            unit="{candidate}",
            description="Candidates a route evaluation excluded, by reason code.",
        )
        self._canceled_tokens = tallies.counter(
            meter,
            sc.WAYBILL_CANCELED_TOKENS,
            unit="{token}",
            description="Tokens upstreams billed for attempts the client cancelled, by "
            "token type (from their settlement).",
        )
        self._canceled_cost = tallies.counter(
            meter,
            sc.WAYBILL_CANCELED_COST,
            unit="USD",
            description="What attempts the client cancelled cost (settled, or held as "
            "unknown usage until reconciled).",
        )
        self._loser_tokens = tallies.counter(
            meter,
            sc.WAYBILL_HEDGE_LOSER_TOKENS,
            unit="{token}",
            description="Tokens of the ways that lost a hedged race, by token type (from "
            "their settlement).",
        )
        self._rate_limited = tallies.counter(
            meter,
            sc.WAYBILL_RATE_LIMIT_REJECTIONS,
            unit="{rejection}",
            description="Requests refused at admission by a rate limit, by the limit and "
            "whether it was a workspace's or a key's.",
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
        # The hedges started; the attempts whose settlement (which follows) is watched apart:
        # the ways that lost a race and those the client cancelled, with their counters.
        self._hedge_ways: OrderedDict[str, None] = OrderedDict()
        self._watched: OrderedDict[str, _Costs] = OrderedDict()
        # When each breaker (scope, target) this process saw open opened.
        self._opened_at: dict[tuple[str, str], datetime] = {}

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
                    losers = _Costs(self._loser_cost, self._loser_tokens)
                    _remember(self._watched, event.attempt_id, losers)
                elif event.failure_class is ev.FailureClass.CLIENT_CANCELED:
                    canceled = _Costs(self._canceled_cost, self._canceled_tokens)
                    _remember(self._watched, event.attempt_id, canceled)
            case ev.BudgetSettled() if costs := self._watched.pop(event.attempt_id, None):
                costs.usd.add(float(event.settled_usd), {sc.WAYBILL_SETTLEMENT: "settled"})
                _count_tokens(costs.tokens, event.usage)
            case ev.UnknownUsageOpened() if costs := self._watched.pop(event.attempt_id, None):
                self._unknown_usage.add(1, {sc.WAYBILL_ENDPOINT: event.endpoint})
                costs.usd.add(float(event.held_usd), {sc.WAYBILL_SETTLEMENT: "held_unknown"})
            case ev.BudgetReleased():
                self._watched.pop(event.attempt_id, None)  # nothing was used
            case ev.RouteEvaluated():
                for candidate in event.candidates:
                    if not candidate.eligible and candidate.reason_code is not None:
                        reason = {sc.WAYBILL_REASON_CODE: candidate.reason_code.value}
                        self._excluded.add(1, reason)
            case ev.RequestCompleted():
                self._operations.pop(event.request_id, None)
                self._requests.add(1, {sc.WAYBILL_STATUS: "succeeded"})
                if event.cost_usd is not None:
                    self._request_cost.record(float(event.cost_usd), {})
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
                self._breaker_open_time(event, recorded.recorded_at)
            case ev.BudgetReservationDenied():
                self._budget_rejections.add(1, {sc.WAYBILL_ACCOUNT_KIND: event.account_kind})
            case ev.RateLimitExceeded():
                subject = event.subject.split(":", 1)[0]  # never the id: a bounded label
                limited = {sc.WAYBILL_RATE_LIMIT: event.limit_name}
                self._rate_limited.add(1, {**limited, sc.WAYBILL_RATE_LIMIT_SUBJECT: subject})
            case ev.UnknownUsageOpened():
                self._unknown_usage.add(1, {sc.WAYBILL_ENDPOINT: event.endpoint})
            case ev.ReconciliationImported():
                self._reconciled(event)
            case ev.EndpointDisabled():
                self._disablings.add(1, {sc.WAYBILL_ENDPOINT: event.endpoint})

    def _breaker_open_time(self, event: ev.BreakerTransitioned, at: datetime) -> None:
        """Count the seconds a breaker spent open when it leaves the open state. An opening
        this process did not see (before it started, or recorded by another replica) counts
        nothing: a replica counts the open time it saw begin and end."""
        breaker = (event.scope, event.target)
        opened_at = self._opened_at.pop(breaker, None)
        if event.to_state == "open":
            self._opened_at[breaker] = at
            if len(self._opened_at) > _MAX_OPEN_ATTEMPTS:  # a config's worth of breakers
                self._opened_at.pop(next(iter(self._opened_at)))
        if opened_at is None or event.from_state != "open":
            return
        endpoint, _, model = event.target.partition("/")
        attributes: Attributes = {
            sc.WAYBILL_BREAKER_SCOPE: event.scope,
            sc.WAYBILL_ENDPOINT: endpoint,
        }
        if model:
            attributes[sc.WAYBILL_MODEL] = model
        self._open_time.add(max(0.0, (at - opened_at).total_seconds()), attributes)

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
    ev.BudgetReleased,
    ev.RouteEvaluated,
    ev.RequestCompleted,
    ev.RequestFailed,
    ev.FailoverDecided,
    ev.BreakerTransitioned,
    ev.BudgetReservationDenied,
    ev.RateLimitExceeded,
    ev.ReconciliationImported,
    ev.EndpointDisabled,
)


_RECEIVED: Final = ev.RequestReceived.type


def _remember_as(seen: OrderedDict[str, str], key: str, value: str) -> None:
    seen[key] = value
    while len(seen) > _MAX_OPEN_ATTEMPTS:  # a crash left the request unfinished
        seen.popitem(last=False)


_V = TypeVar("_V")


@dataclass(frozen=True, slots=True)
class _Costs:
    """Where a watched attempt's settlement is counted: its USD and its tokens."""

    usd: TalliedCounter
    tokens: TalliedCounter


def _remember(seen: OrderedDict[str, _V], key: str, value: _V) -> None:
    seen[key] = value
    while len(seen) > _MAX_OPEN_ATTEMPTS:  # a crash left its race or settlement unfinished
        seen.popitem(last=False)


def _count_tokens(counter: TalliedCounter, usage: ev.Usage) -> None:
    for token_type, count in (
        (sc.TOKEN_TYPE_INPUT, usage.input_tokens),
        (sc.TOKEN_TYPE_OUTPUT, usage.output_tokens),
    ):
        if count:
            counter.add(count, {sc.GEN_AI_TOKEN_TYPE: token_type})


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
