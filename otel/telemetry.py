"""The gateway's live telemetry: metrics from this process's commits, traces from the ledger.

Metrics: every batch this process's event store commits is recorded into the instruments
soon after its commit, off the request path (``EventStore.on_commit``), so each replica
counts its own requests (summed across replicas, as Prometheus does, nothing is counted
twice) and no page of the ledger is read back for them. Traces: one background task lets
the :class:`TraceFollower` export the spans of requests that have finished, and refreshes
the ledger-lag gauge. It runs beside the request path, never on it: a slow or absent
collector only makes the trace checkpoint wait (spans stay in the ledger and go out when
the collector is back, retried with back-off), and every failure is logged, never raised
into the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine, Sequence
from typing import Any, Final

from sqlalchemy import select

from ledger.store import EventStore, RecordedEvent
from ledger.store.db import READ_ONLY, is_unavailable
from ledger.store.schema import ledger_head, projection_checkpoints
from ledger.store.tail import Wakeup
from otel.export import (
    ExportFailed,
    OtelConfigError,
    TraceFollower,
    resource_from_env,
    trace_exporter_from_env,
    traces_endpoint,
)
from otel.metrics import MetricsPipeline

__all__ = ["METRICS_FOLLOWER", "Telemetry"]

METRICS_FOLLOWER: Final = "otel_metrics"
"""The metrics' name on the ``waybill.ledger.lag`` gauge: always 0, they are recorded at
commit (kept so that dashboards built on the gauge keep their series)."""

_log = logging.getLogger("waybill.otel")
_MAX_BACKOFF_S: Final = 30.0


class Telemetry:
    """Metrics always, traces when configured; see the module docstring."""

    def __init__(
        self,
        store: EventStore,
        metrics: MetricsPipeline,
        traces: TraceFollower | None = None,
        *,
        poll_interval_s: float = 1.0,
        settle_s: float = 0.2,
    ) -> None:
        self.store = store
        self.pipeline = metrics
        self.traces = traces
        self.poll_interval_s = poll_interval_s
        self.settle_s = settle_s
        self._lag_at = 0.0
        self._trace_failures = 0
        self._retry_traces_at = 0.0
        self._failing: set[str] = set()
        self._stopping = False
        self._unsubscribe = store.on_commit(self._record)

    @classmethod
    def from_env(
        cls, store: EventStore, *, export_traces: bool = True, tenant_key: bytes | None = None
    ) -> Telemetry:
        """Metrics always (``GET /metrics``); OTLP traces and metrics as ``OTEL_*`` say
        (traces only if ``export_traces``: one process of several exports them). A setting Waybill
        cannot honour is logged and that export stays off: telemetry never keeps the gateway
        from serving. A ``tenant_key`` (config ``otel``) names tenants in spans by pseudonym."""
        resource = resource_from_env()
        try:
            metrics = MetricsPipeline(resource)
        except OtelConfigError as error:
            _log.error("OTLP metric export is off: %s", error)
            metrics = MetricsPipeline(resource, otlp=False)
        traces = None
        try:
            exporter = trace_exporter_from_env() if export_traces else None
        except OtelConfigError as error:
            _log.error("trace export is off: %s", error)
            exporter = None
        if exporter is not None:
            traces = TraceFollower(store, exporter, resource, tenant_key=tenant_key)
            _log.info("exporting traces from the ledger to %s", traces_endpoint())
        return cls(store, metrics, traces)

    def prometheus_text(self) -> bytes:
        return self.pipeline.prometheus_text()

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the ledger until ``stop`` is set."""
        if self.traces is None:
            # Only the lag gauge to refresh: no need to wake on every commit.
            while not stop.is_set():
                await self.round(stop)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.poll_interval_s):
                        await stop.wait()
            return
        async with Wakeup(self.store, poll_interval_s=self.poll_interval_s) as wakeup:
            while not stop.is_set():
                await self.round(stop)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.poll_interval_s):
                        await wakeup.wait(stop)
                    # Telemetry need not be instant: let a burst of commits settle into one
                    # round rather than competing with the requests for every commit.
                    async with asyncio.timeout(self.settle_s):
                        await stop.wait()

    async def round(self, stop: asyncio.Event | None = None) -> None:
        """One pass: traces (unless backing off), then the lag gauge."""
        if self.traces is not None and time.monotonic() >= self._retry_traces_at:
            await self._export_traces(self.traces, stop)
        if time.monotonic() >= self._lag_at:
            self._lag_at = time.monotonic() + self.poll_interval_s
            await self._guard("lag", self._update_lag())

    def abort(self) -> None:
        """At shutdown: stop waiting out export retries (what was not exported stays in the
        ledger, behind the checkpoint, for the next start)."""
        self._stopping = True
        if self.traces is not None:
            self.traces.exporter.shutdown()

    def shutdown(self) -> None:
        self._unsubscribe()
        self.pipeline.shutdown()

    def _record(self, committed: Sequence[RecordedEvent]) -> None:
        for recorded in committed:
            try:
                self.pipeline.metrics.record(recorded)
            except Exception:
                # One event this code cannot read must not stop the metrics: skip it.
                _log.exception("cannot record event %d in the metrics", recorded.position)

    async def _export_traces(self, traces: TraceFollower, stop: asyncio.Event | None) -> None:
        try:
            while not (stop is not None and stop.is_set()) and await traces.step():
                pass
        except Exception as error:
            self._trace_failures += 1
            delay = min(_MAX_BACKOFF_S, self.poll_interval_s * 2 ** (self._trace_failures - 1))
            self._retry_traces_at = time.monotonic() + delay
            if self._stopping:
                return
            _log.debug("trace export failed: %r", error)
            if self._trace_failures == 1:
                detail = str(error) if isinstance(error, ExportFailed) else repr(error)
                _log.warning(
                    "trace export to %s failed (%s); spans wait in the ledger, retrying",
                    traces_endpoint(),
                    detail,
                )
            return
        if self._trace_failures:
            _log.warning("trace export to %s works again", traces_endpoint())
        self._trace_failures = 0

    async def _update_lag(self) -> None:
        async with self.store.engine.connect() as conn:
            conn = await conn.execution_options(**{READ_ONLY: True})
            head = int(await conn.scalar(select(ledger_head.c.position)) or 0)
            rows = (
                await conn.execute(
                    select(projection_checkpoints.c.name, projection_checkpoints.c.position)
                )
            ).all()
        lag = {str(name): head - int(position) for name, position in rows}
        lag[METRICS_FOLLOWER] = 0
        self.pipeline.metrics.set_lag(lag)

    async def _guard(self, what: str, work: Coroutine[Any, Any, None]) -> None:
        try:
            await work
        except Exception as error:
            if is_unavailable(error):  # the ledger's outage: the store says so, once
                self.store.outage.failed(error)
                return
            # Log the first failure of a streak with its traceback, then stay quiet until
            # it works again.
            if what not in self._failing:
                self._failing.add(what)
                _log.exception("telemetry %s failed; retrying", what)
            return
        if what in self._failing:
            self._failing.discard(what)
            _log.warning("telemetry %s works again", what)
