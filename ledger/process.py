"""Settings every long-running Waybill process applies at start-up."""

from __future__ import annotations

import gc

__all__ = ["tune_gc"]


def tune_gc() -> None:
    """Waybill's work is a stream of short-lived objects (decoded events, rows, requests)
    that reference counting frees; the cyclic collector's default pace (a young collection
    every 700 allocations, each full one walking every object ever imported) cost about a
    third of a replay's CPU. Freeze what exists at start-up out of its reach, and let it
    run less often (``bench/README.md``)."""
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
