"""The tallied instruments report what the SDK's own instruments report for the same values."""

from __future__ import annotations

import sys
import threading
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    ExponentialHistogram,
    InMemoryMetricReader,
)
from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from otel.tallies import CARDINALITY_LIMIT, Tallies

BOUNDS = (0.01, 0.1, 1.0, 10.0)
ATTRIBUTES = [{"a": "x"}, {"a": "y", "b": 1}, {"b": 1, "a": "y", "c": True}, {}]
RESOURCE = Resource({"service.name": "t"})


def _reader(delta: bool, **kwargs: Any) -> InMemoryMetricReader:
    temporality = AggregationTemporality.DELTA if delta else AggregationTemporality.CUMULATIVE
    return InMemoryMetricReader(
        preferred_temporality={Histogram: temporality, Counter: temporality}, **kwargs
    )


def _sdk(delta: bool) -> tuple[InMemoryMetricReader, Any, Any]:
    reader = _reader(delta)
    meter = MeterProvider(metric_readers=[reader], resource=RESOURCE).get_meter("sdk")
    histogram = meter.create_histogram("h", explicit_bucket_boundaries_advisory=list(BOUNDS))
    return reader, histogram, meter.create_counter("c")


def _tallied(delta: bool, **kwargs: Any) -> tuple[InMemoryMetricReader, Any, Any]:
    reader = _reader(delta, **kwargs)
    provider = MeterProvider(metric_readers=[reader], resource=RESOURCE)
    tallies = Tallies(InstrumentationScope("ours"), RESOURCE)
    tallies.watch(reader)
    meter = provider.get_meter("ours")
    histogram = tallies.histogram(meter, "h", unit="", description="", bounds=BOUNDS)
    return reader, histogram, tallies.counter(meter, "c", unit="", description="")


def _points(reader: InMemoryMetricReader) -> dict[str, dict[tuple[Any, ...], Any]]:
    data = reader.get_metrics_data()
    found: dict[str, dict[tuple[Any, ...], Any]] = {}
    for resource in data.resource_metrics if data is not None else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    key = tuple(sorted((point.attributes or {}).items()))
                    found.setdefault(metric.name, {})[key] = point
    return found


def _histogram_view(point: Any) -> tuple[Any, ...]:
    return (
        point.count,
        round(point.sum, 9),
        tuple(point.bucket_counts),
        tuple(point.explicit_bounds),
        point.min,
        point.max,
    )


values = st.one_of(
    st.sampled_from(BOUNDS),  # a value on a boundary belongs to the bucket it closes
    st.floats(min_value=0, max_value=100, allow_nan=False),
    st.integers(min_value=0, max_value=1000),
)
batches = st.lists(
    st.lists(st.tuples(values, st.integers(0, len(ATTRIBUTES) - 1)), max_size=20),
    min_size=1,
    max_size=4,
)


@settings(max_examples=60, deadline=None)
@given(batches=batches, delta=st.booleans())
def test_a_distribution_and_a_count_report_what_the_sdk_reports(
    batches: list[list[tuple[float, int]]], delta: bool
) -> None:
    sdk_reader, sdk_histogram, sdk_counter = _sdk(delta)
    our_reader, our_histogram, our_counts = _tallied(delta)
    for batch in batches:  # a collection after each: a delta reader starts again
        for value, which in batch:
            for histogram, counter in ((sdk_histogram, sdk_counter), (our_histogram, our_counts)):
                histogram.record(value, ATTRIBUTES[which])
                counter.add(value, ATTRIBUTES[which])
        sdk, ours = _points(sdk_reader), _points(our_reader)
        assert {k: _histogram_view(p) for k, p in ours.get("h", {}).items()} == {
            k: _histogram_view(p) for k, p in sdk.get("h", {}).items()
        }
        counted = {k: round(p.value, 9) for k, p in ours.get("c", {}).items()}
        assert counted == {k: round(p.value, 9) for k, p in sdk.get("c", {}).items()}


def test_a_delta_reader_gets_each_interval_and_a_cumulative_one_the_whole() -> None:
    cumulative, delta = _reader(False), _reader(True)
    provider = MeterProvider(metric_readers=[cumulative, delta], resource=RESOURCE)
    tallies = Tallies(InstrumentationScope("ours"), RESOURCE)
    for reader in (cumulative, delta):
        tallies.watch(reader)
    histogram = tallies.histogram(
        provider.get_meter("ours"), "h", unit="s", description="d", bounds=BOUNDS
    )
    histogram.record(0.5, {"a": "x"})
    assert _points(delta)["h"][(("a", "x"),)].count == 1
    histogram.record(2, {"a": "x"})
    first = _points(cumulative)["h"][(("a", "x"),)]
    assert (first.count, first.sum, first.min, first.max) == (2, 2.5, 0.5, 2)
    second = _points(delta)["h"][(("a", "x"),)]
    assert (second.count, second.sum, second.min, second.max) == (1, 2, 2, 2)
    assert _points(delta) == {}  # nothing new since


def test_a_reader_that_wants_another_histogram_aggregation_gets_it_from_the_sdk() -> None:
    exponential = {Histogram: ExponentialBucketHistogramAggregation()}
    reader, histogram, _ = _tallied(False, preferred_aggregation=exponential)
    histogram.record(0.5, {"a": "x"})
    data = reader.get_metrics_data()
    assert data is not None
    (metric,) = [m for r in data.resource_metrics for s in r.scope_metrics for m in s.metrics]
    assert isinstance(metric.data, ExponentialHistogram)
    assert metric.data.data_points[0].count == 1


def test_attribute_sets_beyond_the_limit_are_counted_as_overflow() -> None:
    reader, histogram, counts = _tallied(False)
    for i in range(CARDINALITY_LIMIT + 5):
        histogram.record(1, {"i": i})
        counts.add(1, {"i": i})
    points = _points(reader)
    overflow = (("otel.metric.overflow", True),)
    assert points["h"][overflow].count == 5
    assert len(points["h"]) == CARDINALITY_LIMIT + 1
    assert points["c"][overflow].value == 5


def test_a_reader_collecting_from_another_thread_loses_and_tears_nothing() -> None:
    # A periodic OTLP reader collects from a thread of its own while the loop records.
    cumulative, delta = _reader(False), _reader(True)
    provider = MeterProvider(metric_readers=[cumulative, delta], resource=RESOURCE)
    tallies = Tallies(InstrumentationScope("ours"), RESOURCE)
    for reader in (cumulative, delta):
        tallies.watch(reader)
    meter = provider.get_meter("ours")
    histogram = tallies.histogram(meter, "h", unit="", description="", bounds=BOUNDS)
    counter = tallies.counter(meter, "c", unit="", description="")
    stop = threading.Event()
    seen: list[dict[str, dict[tuple[Any, ...], Any]]] = []
    torn: list[Any] = []

    def collect() -> None:
        while not stop.is_set():
            seen.append(_points(delta))
            for point in _points(cumulative).get("h", {}).values():
                if sum(point.bucket_counts) != point.count:
                    torn.append(point)

    collector = threading.Thread(target=collect)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads take turns as often as they can
    collector.start()
    try:
        for i in range(20_000):
            histogram.record(1, {"i": i % 50})
            counter.add(1, {"i": i % 50})
    finally:
        stop.set()
        collector.join()
        sys.setswitchinterval(interval)
    seen.append(_points(delta))
    assert not torn
    assert sum(p.count for points in seen for p in points.get("h", {}).values()) == 20_000
    assert sum(p.value for points in seen for p in points.get("c", {}).values()) == 20_000
    assert sum(p.count for p in _points(cumulative)["h"].values()) == 20_000


def test_the_suite_runs_on_the_sdk_release_pyproject_bounds() -> None:
    # Tallies lean on the SDK's MetricReader internals, so pyproject.toml bounds the SDK to
    # the releases these tests ran on: the installed one must be among them.
    import tomllib
    from importlib.metadata import version
    from pathlib import Path

    from packaging.requirements import Requirement

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    sdk = next(
        Requirement(spec)
        for spec in pyproject["project"]["dependencies"]
        if Requirement(spec).name == "opentelemetry-sdk"
    )
    assert any(s.operator == "<" for s in sdk.specifier), "the SDK's range has no upper bound"
    assert sdk.specifier.contains(version("opentelemetry-sdk")), (sdk, version("opentelemetry-sdk"))


def test_tallies_find_each_readers_preferences_for_the_sdks_public_instrument_classes() -> None:
    # The reader keys its preferences by the SDK's private instrument classes; tallies find
    # them by the public ones. A delta reader's counter gets delta points, hence found.
    reader = _reader(delta=True)
    provider = MeterProvider(metric_readers=[reader], resource=RESOURCE)
    tallies = Tallies(InstrumentationScope("t"), RESOURCE)
    tallies.watch(reader)
    meter = provider.get_meter("t")
    counter = tallies.counter(meter, "c", unit="1", description="")
    histogram = tallies.histogram(meter, "h", unit="s", description="", bounds=BOUNDS)
    counter.add(2, {"a": "x"})
    histogram.record(0.5, {"a": "x"})
    # Tallied, not handed to the SDK (which a reader's other preference would ask for).
    assert counter.sinks and histogram.sinks
    collected = reader.get_metrics_data()
    assert collected is not None
    metrics: dict[str, Any] = {
        m.name: m for r in collected.resource_metrics for s in r.scope_metrics for m in s.metrics
    }
    assert metrics["c"].data.aggregation_temporality is AggregationTemporality.DELTA
    assert metrics["h"].data.aggregation_temporality is AggregationTemporality.DELTA
    assert [p.value for p in metrics["c"].data.data_points] == [2]
