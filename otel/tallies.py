"""The gateway's per-request instruments, tallied in plain dictionaries.

The OpenTelemetry SDK (1.45) cleans and hashes a measurement's attributes, recursively, on
every ``add`` and ``record``, four of them per request, which made the commit listener that
records them a noticeable part of a buffered request's instructions
(``bench/instructions_bench.py``; bench/README.md, "Decisions"). The
SDK stays in charge of everything else — readers, their preferences, Prometheus and OTLP
export — and :class:`Tallies` only changes where the numbers wait until a reader collects
them: a counter's sums and a histogram's count, sum, min, max and count per bucket (a value
on a boundary counted in the bucket it closes) are kept per attribute set, for each reader
in the temporality that reader prefers for the SDK's own counters and histograms, and are
added to what it collects. A delta reader's points are emptied at each collection, and an
attribute set with nothing new is left out, as the SDK does. One lock guards the tallies:
a periodic OTLP reader collects from a thread of its own while the event loop records.

A reader that prefers another aggregation for counters or histograms (an OTLP exporter told
``base2_exponential_bucket_histogram``) makes every instrument of that kind record through
the SDK instead, so that what it asks for is what it gets. As in the SDK, a metric keeps at
most :data:`CARDINALITY_LIMIT` attribute sets per reader; values of further sets are counted
under ``otel.metric.overflow=true``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from opentelemetry.metrics import Instrument, Meter
from opentelemetry.sdk.metrics import Counter as SdkCounter
from opentelemetry.sdk.metrics import Histogram as SdkHistogram
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricReader,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.metrics.view import DefaultAggregation
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

__all__ = ["CARDINALITY_LIMIT", "TalliedCounter", "TalliedHistogram", "Tallies"]

CARDINALITY_LIMIT: Final = 2000
_OVERFLOW: Final = (("otel.metric.overflow", True),)

Key = tuple[tuple[str, Any], ...]
"""An attribute set, sorted by name."""

Collect = Callable[..., MetricsData | None]


def _key(attributes: Mapping[str, Any]) -> Key:
    return tuple(sorted(attributes.items()))


class _Point:
    """One attribute set's values since ``start``: a sum, or a histogram's aggregate."""

    __slots__ = ("buckets", "count", "max", "min", "start", "sum")

    def __init__(self, start: int, buckets: int) -> None:
        self.start = start
        self.count = 0
        self.sum: int | float = 0
        self.min = float("inf")
        self.max = float("-inf")
        self.buckets = [0] * buckets


class _Sink:
    """One reader's points of one instrument."""

    __slots__ = ("delta", "points", "since")

    def __init__(self, delta: bool, since: int) -> None:
        self.delta = delta
        self.points: dict[Key, _Point] = {}
        self.since = since  # a delta reader's last collection

    def point(self, key: Key, buckets: int) -> _Point:
        points = self.points
        point = points.get(key)
        if point is None:
            at = key if len(points) < CARDINALITY_LIMIT else _OVERFLOW
            point = points.get(at)
            if point is None:
                point = points[at] = _Point(time.time_ns(), buckets)
        return point

    def take(self, now: int) -> tuple[list[tuple[Key, _Point, int]], AggregationTemporality]:
        """The points with their start times; emptied if delta."""
        if not self.delta:
            taken = [(key, p, p.start) for key, p in self.points.items()]
            return taken, AggregationTemporality.CUMULATIVE
        taken = [(key, p, self.since) for key, p in self.points.items()]
        self.points, self.since = {}, now
        return taken, AggregationTemporality.DELTA


class _Instrument:
    def __init__(
        self, meter: Meter, name: str, unit: str, description: str, lock: threading.Lock
    ) -> None:
        self.name, self.unit, self.description = name, unit, description
        self.sinks: dict[int, _Sink] = {}  # by id of the reader
        self._meter = meter
        self._lock = lock
        self._sdk: Any = None  # the SDK's instrument, when a reader wants it aggregated its way

    def collected(self, sink: _Sink, now: int) -> Metric | None:
        """A reader's points as a metric (None if it has none); a delta sink is emptied."""
        with self._lock:
            taken, temporality = sink.take(now)
            points = [self._point(dict(key), p, start, now) for key, p, start in taken]
        if not points:
            return None
        data = self._data(points, temporality)
        return Metric(name=self.name, description=self.description, unit=self.unit, data=data)

    def _point(self, attributes: dict[str, Any], p: _Point, start: int, now: int) -> Any:
        raise NotImplementedError

    def _data(self, points: list[Any], temporality: AggregationTemporality) -> Any:
        raise NotImplementedError


class TalliedCounter(_Instrument):
    """A monotonic counter."""

    def add(self, amount: int | float, attributes: Mapping[str, Any]) -> None:
        if self._sdk is not None:
            self._sdk.add(amount, attributes)
            return
        key = _key(attributes)
        with self._lock:
            for sink in self.sinks.values():
                sink.point(key, 0).sum += amount

    def use_sdk(self) -> None:
        self._sdk = self._meter.create_counter(
            self.name, unit=self.unit, description=self.description
        )

    def _point(self, attributes: dict[str, Any], p: _Point, start: int, now: int) -> Any:
        return NumberDataPoint(
            attributes=attributes, start_time_unix_nano=start, time_unix_nano=now, value=p.sum
        )

    def _data(self, points: list[Any], temporality: AggregationTemporality) -> Any:
        return Sum(data_points=points, aggregation_temporality=temporality, is_monotonic=True)


class TalliedHistogram(_Instrument):
    """An explicit-bucket histogram."""

    def __init__(
        self,
        meter: Meter,
        name: str,
        unit: str,
        description: str,
        lock: threading.Lock,
        bounds: Sequence[float],
    ) -> None:
        super().__init__(meter, name, unit, description, lock)
        self.bounds = tuple(float(b) for b in bounds)

    def record(self, value: int | float, attributes: Mapping[str, Any]) -> None:
        if self._sdk is not None:
            self._sdk.record(value, attributes)
            return
        key = _key(attributes)
        bucket = bisect_left(self.bounds, value)
        with self._lock:
            for sink in self.sinks.values():
                point = sink.point(key, len(self.bounds) + 1)
                point.count += 1
                point.sum += value
                if value < point.min:
                    point.min = value
                if value > point.max:
                    point.max = value
                point.buckets[bucket] += 1

    def use_sdk(self) -> None:
        self._sdk = self._meter.create_histogram(
            self.name,
            unit=self.unit,
            description=self.description,
            explicit_bucket_boundaries_advisory=list(self.bounds),
        )

    def _point(self, attributes: dict[str, Any], p: _Point, start: int, now: int) -> Any:
        return HistogramDataPoint(
            attributes=attributes,
            start_time_unix_nano=start,
            time_unix_nano=now,
            count=p.count,
            sum=p.sum,
            bucket_counts=tuple(p.buckets),
            explicit_bounds=self.bounds,
            min=p.min,
            max=p.max,
        )

    def _data(self, points: list[Any], temporality: AggregationTemporality) -> Any:
        return Histogram(data_points=points, aggregation_temporality=temporality)


class Tallies:
    """The counters and histograms of one meter, and the readers that collect them."""

    def __init__(self, scope: InstrumentationScope, resource: Resource) -> None:
        self._scope = scope
        self._resource = resource
        self._instruments: list[_Instrument] = []
        self._readers: list[MetricReader] = []
        self._lock = threading.Lock()

    def watch(self, reader: MetricReader) -> None:
        """Add this reader's points to what it collects. Call once its ``MeterProvider``
        has handed it the SDK's collect function, before any instrument is made."""
        collect: Collect | None = reader._collect  # type: ignore[assignment]
        if collect is None:
            raise ValueError("a reader is watched once its MeterProvider has it")

        def merged(reader_: MetricReader, *args: Any, **kwargs: Any) -> MetricsData | None:
            return self._merged(reader_, collect(reader_, *args, **kwargs))

        # (The SDK annotates it as returning metrics; it returns a MetricsData.)
        reader._collect = merged  # type: ignore[assignment]
        self._readers.append(reader)

    def counter(self, meter: Meter, name: str, *, unit: str, description: str) -> TalliedCounter:
        counter = TalliedCounter(meter, name, unit, description, self._lock)
        self._add(counter, SdkCounter)
        return counter

    def histogram(
        self, meter: Meter, name: str, *, unit: str, description: str, bounds: Sequence[float]
    ) -> TalliedHistogram:
        histogram = TalliedHistogram(meter, name, unit, description, self._lock, bounds)
        self._add(histogram, SdkHistogram)
        return histogram

    def _add(self, instrument: TalliedCounter | TalliedHistogram, kind: type[Instrument]) -> None:
        """A sink per reader, in the temporality it prefers for the SDK's instruments of
        ``kind``; or the SDK's own instrument, if a reader wants them aggregated its way."""
        if any(
            not isinstance(
                _preferred(reader._instrument_class_aggregation, kind), DefaultAggregation
            )
            for reader in self._readers
        ):
            instrument.use_sdk()
        else:
            now = time.time_ns()
            for reader in self._readers:
                delta = _preferred(reader._instrument_class_temporality, kind)
                instrument.sinks[id(reader)] = _Sink(delta is AggregationTemporality.DELTA, now)
        self._instruments.append(instrument)

    def _merged(self, reader: MetricReader, data: MetricsData | None) -> MetricsData | None:
        now = time.time_ns()
        ours = [
            metric
            for instrument in self._instruments
            if (sink := instrument.sinks.get(id(reader))) is not None
            and (metric := instrument.collected(sink, now)) is not None
        ]
        if not ours:
            return data
        resources = list(data.resource_metrics) if data is not None else []
        schema_url = self._scope.schema_url or ""
        mine = ScopeMetrics(scope=self._scope, metrics=ours, schema_url=schema_url)
        if not resources:
            only = ResourceMetrics(resource=self._resource, scope_metrics=[mine], schema_url="")
            return MetricsData(resource_metrics=[only])
        scopes = list(resources[0].scope_metrics)
        for i, scope_metrics in enumerate(scopes):
            if scope_metrics.scope.name == self._scope.name:
                metrics = [*scope_metrics.metrics, *ours]
                scopes[i] = dataclasses.replace(scope_metrics, metrics=metrics)
                break
        else:
            scopes.append(mine)
        resources[0] = dataclasses.replace(resources[0], scope_metrics=scopes)
        return MetricsData(resource_metrics=resources)


def _preferred(by_class: Mapping[type[Instrument], Any], kind: type[Instrument]) -> Any:
    """A reader's preference for the SDK's instruments of ``kind`` (its public class): the
    reader keys them by the SDK's private subclasses, which are not imported here."""
    return next((value for cls, value in by_class.items() if issubclass(cls, kind)), None)
