"""Identifiers for requests and attempts: time-ordered, unguessable, URL-safe."""

from __future__ import annotations

import secrets
import time

__all__ = ["new_id"]


def new_id(prefix: str) -> str:
    """``<prefix>_<12 hex of milliseconds><16 hex of randomness>``: sorts by creation time."""
    return f"{prefix}_{time.time_ns() // 1_000_000:012x}{secrets.token_hex(8)}"
