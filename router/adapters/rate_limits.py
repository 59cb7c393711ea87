"""Rate limits per key and per workspace (issue 43 item 2): the window arithmetic, free of I/O.

A limit counts requests and tokens in fixed one-minute windows aligned on the minute (UTC
epoch seconds divisible by 60), so every replica and worker names the same window for the
same instant without sharing a clock's state. A request is admitted only if, in every
subject it counts against (its key, its workspace), one more request and its worst-case
tokens stay within the limits; its tokens are corrected to what it used at settlement, in
the window it was admitted in. A refusal says which limit, its window, and how long until
that window ends (``Retry-After``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Literal

__all__ = [
    "WINDOW_S",
    "Counted",
    "RateLimit",
    "Refusal",
    "Window",
    "decide",
    "unreachable",
    "window_at",
]

WINDOW_S: Final = 60

LimitName = Literal["requests_per_minute", "tokens_per_minute"]


@dataclass(frozen=True, slots=True)
class Window:
    """``[start, start + 60)`` in epoch seconds."""

    start: int

    @property
    def end(self) -> int:
        return self.start + WINDOW_S

    def retry_after_s(self, now: float) -> int:
        """Whole seconds until the window ends: at least 1 (a ``Retry-After`` of 0 invites a
        retry into the same window)."""
        return max(1, math.ceil(self.end - now))


def window_at(now: float) -> Window:
    """The window ``now`` (epoch seconds) falls in."""
    return Window(int(now // WINDOW_S) * WINDOW_S)


@dataclass(frozen=True, slots=True)
class RateLimit:
    """One subject's limits (None: that dimension is unlimited)."""

    subject: str  # "workspace:acme", "key:k_123"
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


@dataclass(frozen=True, slots=True)
class Counted:
    """What a subject has used in a window so far."""

    requests: int = 0
    tokens: int = 0


@dataclass(frozen=True, slots=True)
class Refusal:
    subject: str
    limit_name: LimitName
    limit: int
    window: Window
    retry_after_s: int


def decide(
    limits: tuple[RateLimit, ...],
    counted: tuple[Counted, ...],
    tokens: int,
    window: Window,
    now: float,
) -> Refusal | None:
    """The first limit one more request of ``tokens`` worst-case tokens would exceed, or None
    (admit, and count it in every subject). ``counted`` is in the order of ``limits``."""
    for limit, used in zip(limits, counted, strict=True):
        if limit.requests_per_minute is not None and used.requests + 1 > limit.requests_per_minute:
            return _refused(limit, "requests_per_minute", limit.requests_per_minute, window, now)
        if limit.tokens_per_minute is not None and used.tokens + tokens > limit.tokens_per_minute:
            return _refused(limit, "tokens_per_minute", limit.tokens_per_minute, window, now)
    return None


def unreachable(limit: RateLimit, window: Window, now: float) -> Refusal:
    """The refusal when the shared counters cannot be read: a limit fails closed, named by
    the first dimension ``limit`` sets."""
    if limit.requests_per_minute is not None:
        return _refused(limit, "requests_per_minute", limit.requests_per_minute, window, now)
    return _refused(limit, "tokens_per_minute", limit.tokens_per_minute or 0, window, now)


def _refused(limit: RateLimit, name: LimitName, value: int, window: Window, now: float) -> Refusal:
    return Refusal(limit.subject, name, value, window, window.retry_after_s(now))
