"""The live trace exporter's checkpoint, on SQLite and PostgreSQL: a restart neither loses
nor repeats spans, a collector that refuses leaves them waiting in the ledger, and a
re-export of a window gives the same spans."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ledger.store import NO_STREAM, EventStore
from otel.export import TraceFollower, export_window
from otel.ids import request_span_id
from tests.ledger import factories

RESOURCE = Resource({"service.name": "waybill-test"})


class FlakyExporter(InMemorySpanExporter):
    """Refuses every batch while ``down`` is set, like a collector that is away."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.refused = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self.down:
            self.refused += 1
            return SpanExportResult.FAILURE
        return super().export(spans)


async def _append(store: EventStore, request_id: str, trail) -> None:
    await store.append(f"request-{request_id}", NO_STREAM, trail)


def _request_ids(exporter: InMemorySpanExporter) -> list[str]:
    return sorted(
        str((s.attributes or {})["waybill.request_id"])
        for s in exporter.get_finished_spans()
        if s.kind.name == "SERVER"
    )


async def test_restart_neither_loses_nor_repeats_spans(store: EventStore) -> None:
    exporter = FlakyExporter()
    await _append(store, "r1", factories.succeeded_trail("r1"))
    await _append(store, "r2", [factories.received("r2")])  # still in flight

    follower = TraceFollower(store, exporter, RESOURCE, page_size=3)
    assert await follower.catch_up() > 0
    assert _request_ids(exporter) == ["r1"]
    assert len(exporter.get_finished_spans()) == 2  # request span + one attempt span

    # A new process (same checkpoint) exports only what finished since.
    await _append(store, "r3", factories.unknown_then_failed_trail("r3"))
    restarted = TraceFollower(store, exporter, RESOURCE, page_size=3)
    await restarted.catch_up()
    assert _request_ids(exporter) == ["r1", "r3"]
    assert await restarted.catch_up() == 0
    assert await TraceFollower(store, exporter, RESOURCE).catch_up() == 0
    assert _request_ids(exporter) == ["r1", "r3"]


async def test_a_refusing_collector_leaves_spans_waiting_in_the_ledger(store: EventStore) -> None:
    exporter = FlakyExporter()
    follower = TraceFollower(store, exporter, RESOURCE)
    await _append(store, "r1", factories.succeeded_trail("r1"))
    exporter.down = True
    before = await follower.checkpoint()
    for _ in range(2):
        try:
            await follower.step()
        except Exception as error:
            assert type(error).__name__ == "ExportFailed"
        else:
            raise AssertionError("a refused export must fail the step")
    assert exporter.refused == 2
    assert await follower.checkpoint() == before  # nothing marked as exported
    assert exporter.get_finished_spans() == ()

    exporter.down = False
    await follower.catch_up()
    assert _request_ids(exporter) == ["r1"]
    assert await follower.checkpoint() == (await store.head())[0]


async def test_a_window_reexport_gives_the_live_spans_again(store: EventStore) -> None:
    live = InMemorySpanExporter()
    await _append(store, "r1", factories.succeeded_trail("r1"))
    middle = datetime.now(UTC)
    await _append(store, "r2", factories.unknown_then_failed_trail("r2"))
    await TraceFollower(store, live, RESOURCE).catch_up()

    replayed = InMemorySpanExporter()
    result = await export_window(store, None, middle, replayed, resource=RESOURCE)
    assert (result.requests, result.unfinished, result.spans) == (1, 0, 2)
    assert _request_ids(replayed) == ["r1"]

    everything = InMemorySpanExporter()
    progress: list[tuple[int, int]] = []
    result = await export_window(
        store,
        middle,
        None,
        everything,
        resource=RESOURCE,
        progress=lambda d, t: progress.append((d, t)),
    )
    assert _request_ids(everything) == ["r2"] and progress[-1] == (1, 1)

    def key(span: ReadableSpan) -> tuple[object, ...]:
        assert span.context is not None
        return (
            span.context.trace_id,
            span.context.span_id,
            span.parent.span_id if span.parent else None,
            span.name,
            span.start_time,
            span.end_time,
            tuple(sorted((span.attributes or {}).items())),
        )

    again = sorted(map(key, [*replayed.get_finished_spans(), *everything.get_finished_spans()]))
    assert again == sorted(map(key, live.get_finished_spans()))
    request_span = next(s for s in live.get_finished_spans() if s.kind.name == "SERVER")
    assert request_span.context is not None
    assert format(request_span.context.span_id, "016x") in {
        request_span_id("r1"),
        request_span_id("r2"),
    }
