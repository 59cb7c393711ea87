"""Traces and metrics, derived from ledger events (contract §8).

``semconv`` names everything, ``ids`` derives trace and span ids, ``spans`` folds a request's
events into spans (pure), ``export`` sends them over OTLP (live, checkpointed, and for past
windows), ``metrics`` records the metrics, and ``telemetry`` is the gateway's background task.
``otel`` reads the ledger and never imports the router.
"""
