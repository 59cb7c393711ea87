"""Identifiers for requests and attempts: time-ordered, unguessable, URL-safe."""

from __future__ import annotations

import os
import time

__all__ = ["new_id"]

_POOL_BYTES = 4096
_pool = b""
_used = _POOL_BYTES


def _forget_pool() -> None:
    global _pool, _used
    _pool, _used = b"", _POOL_BYTES


os.register_at_fork(after_in_child=_forget_pool)  # a forked child must not reuse our bytes


def new_id(prefix: str) -> str:
    """``<prefix>_<12 hex of milliseconds><16 hex of randomness>``: sorts by creation time.

    The randomness is the operating system's (as ``secrets``), read 4 KiB at a time: a
    request makes several ids, and a system call for each showed in the gateway's CPU
    (bench/README.md, "Decisions")."""
    global _pool, _used
    if _used + 8 > len(_pool):
        _pool, _used = os.urandom(_POOL_BYTES), 0
    random_part = _pool[_used : _used + 8].hex()
    _used += 8
    return f"{prefix}_{time.time_ns() // 1_000_000:012x}{random_part}"
