"""Processors for the rotel collector: every span it receives becomes one JSON line in the
file named by ``WAYBILL_TEST_SPANS_FILE``, and every metric's name one line in that file
plus ``.metrics``.

Rotel runs this file inside its own embedded Python (``ROTEL_OTLP_WITH_TRACE_PROCESSOR`` and
``..._METRICS_PROCESSOR``) and calls ``process_spans`` / ``process_metrics`` with each batch
it received over OTLP; it imports nothing from Waybill.
"""

from __future__ import annotations

import json
import os
from typing import Any

_OUT = os.environ.get("WAYBILL_TEST_SPANS_FILE", "spans.jsonl")


def _value(any_value: Any) -> Any:
    if any_value is None:
        return None
    value = any_value.value
    if type(value).__name__ == "ArrayValue":  # no len(): index until IndexError
        items = []
        index = 0
        while True:
            try:
                items.append(_value(value[index]))
            except IndexError:
                return items
            index += 1
    return value


def _attributes(key_values: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in key_values}


def process_spans(resource_spans: Any) -> None:
    resource = _attributes(resource_spans.resource.attributes) if resource_spans.resource else {}
    lines = []
    for scope_spans in resource_spans.scope_spans:
        scope = scope_spans.scope.name if scope_spans.scope else ""
        for span in scope_spans.spans:
            status = span.status
            record = {
                "name": span.name,
                "kind": span.kind,
                "trace_id": bytes(span.trace_id).hex(),
                "span_id": bytes(span.span_id).hex(),
                "parent_span_id": bytes(span.parent_span_id).hex(),
                "flags": span.flags,
                "start": span.start_time_unix_nano,
                "end": span.end_time_unix_nano,
                "attributes": _attributes(span.attributes),
                "events": [
                    {
                        "name": event.name,
                        "time": event.time_unix_nano,
                        "attributes": _attributes(event.attributes),
                    }
                    for event in span.events
                ],
                "status": {"code": status.code, "message": status.message} if status else None,
                "scope": scope,
                "resource": resource,
            }
            lines.append(json.dumps(record, sort_keys=True) + "\n")
    with open(_OUT, "a", encoding="utf-8") as out:
        out.write("".join(lines))


def process_metrics(resource_metrics: Any) -> None:
    names = [
        metric.name
        for scope_metrics in resource_metrics.scope_metrics
        for metric in scope_metrics.metrics
    ]
    with open(_OUT + ".metrics", "a", encoding="utf-8") as out:
        out.write("".join(json.dumps({"name": name}) + "\n" for name in names))
