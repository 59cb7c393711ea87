"""Several processes' Prometheus expositions as one (``waybill serve --workers N``)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from otel.merge import merge_expositions
from otel.metrics import MetricsPipeline
from tests.otel.test_metrics import _pipeline
from tests.otel.trails import failover_trail, quota_trail


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    # An empty label is the label absent (Prometheus).
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if v))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def _fed(*trails: str) -> MetricsPipeline:
    pipeline, _ = _pipeline()
    for name in trails:
        trail = failover_trail(name) if name.startswith("f") else quota_trail(name)
        for event in trail:
            pipeline.metrics.record(event)
    pipeline.metrics.set_disabled({"east": True, "west": False})
    pipeline.metrics.set_lag({"requests": 3})
    return pipeline


def test_the_merge_of_two_processes_equals_one_process_that_served_both_shares():
    one, two, both = _fed("f1", "q1"), _fed("f2"), _fed("f1", "q1", "f2")
    merged = merge_expositions([one.prometheus_text(), two.prometheus_text()])
    # Counters and histograms add up; gauges (a state both processes see) are not doubled.
    assert _samples(merged) == _samples(both.prometheus_text())
    assert b"waybill_failovers_total{" in merged
    for pipeline in (one, two, both):
        pipeline.shutdown()


def test_a_sample_only_one_process_has_is_kept_and_one_exposition_is_itself():
    one, two = _fed("q1"), _fed("f1")
    merged = merge_expositions([one.prometheus_text(), two.prometheus_text()])
    assert _samples(one.prometheus_text()).keys() | _samples(two.prometheus_text()).keys() == (
        _samples(merged).keys()
    )
    assert _samples(merge_expositions([one.prometheus_text()])) == _samples(one.prometheus_text())
    for pipeline in (one, two):
        pipeline.shutdown()
