"""Settings every long-running Waybill process applies at start-up."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["run", "tune_gc"]

_T = TypeVar("_T")


def tune_gc() -> None:
    """Waybill's work is a stream of short-lived objects (decoded events, rows, requests)
    that reference counting frees; the cyclic collector's default pace (a young collection
    every 700 allocations, each full one walking every object ever imported) cost a large
    part of a replay's CPU. Freeze what exists at start-up out of its reach, and let it
    run less often (``bench/README.md``, "Decisions")."""
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def run(main: Coroutine[Any, Any, _T]) -> _T:
    """``asyncio.run`` on uvloop where it is installed: the loop the gateway serves on
    (through uvicorn), whose I/O and callbacks cost a fraction of the default loop's."""
    try:
        import uvloop
    except ImportError:  # not on every platform (see pyproject.toml)
        return asyncio.run(main)
    return uvloop.run(main)
