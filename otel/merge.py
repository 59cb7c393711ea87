"""One Prometheus exposition from several processes' own: what ``GET /metrics`` answers when
``waybill serve --workers N`` runs N serving processes behind one port.

Each process counts only the requests it served (``otel.telemetry``), so a scrape that
reached one of them would see a share of the traffic. Samples with the same name and labels
are combined: counters and histograms (their buckets, sums and counts) add up; gauges say a
state every process sees alike (disabled endpoints, the ledger's lag), so the largest is
kept rather than a multiple of it. A label with an empty value is the label absent, as
Prometheus reads it (an exposition fills in ``""`` for a label that only other series of
the family have), so series are matched without them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["merge_expositions"]

_KEPT_LARGEST = frozenset({"gauge", "info", "stateset", "unknown"})

_Key = tuple[str, tuple[tuple[str, str], ...]]


def merge_expositions(texts: Sequence[bytes]) -> bytes:
    """The expositions ``texts`` as one, in the text format ``generate_latest`` writes."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[_Key, float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text.decode()):
            if family.name not in families:
                families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
                values[family.name] = {}
            largest = family.type in _KEPT_LARGEST
            seen = values[family.name]
            for sample in family.samples:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if v != ""))
                key = (sample.name, labels)
                before = seen.get(key)
                if before is None:
                    seen[key] = sample.value
                else:
                    seen[key] = max(before, sample.value) if largest else before + sample.value
    for name, family in families.items():
        for (sample_name, pairs), value in values[name].items():
            family.add_sample(sample_name, dict(pairs), value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)
