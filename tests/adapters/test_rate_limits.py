"""The window arithmetic of rate limits (router/adapters/rate_limits.py), pure."""

from __future__ import annotations

import pytest

from router.adapters.rate_limits import (
    Counted,
    RateLimit,
    Window,
    decide,
    unreachable,
    window_at,
)

T = 1_764_504_000  # 2025-11-30T12:00:00Z, a minute's start


@pytest.mark.parametrize(
    ("now", "start", "retry_after"),
    [
        (T, T, 60),
        (T + 0.001, T, 60),  # rounded up: never a retry into the same window
        (T + 59.2, T, 1),
        (T + 59.999, T, 1),
        (T + 60, T + 60, 60),
        (T - 0.5, T - 60, 1),
    ],
)
def test_windows_are_aligned_minutes_and_retry_after_is_their_rest(
    now: float, start: int, retry_after: int
) -> None:
    window = window_at(now)
    assert (window.start, window.end) == (start, start + 60)
    assert window.retry_after_s(now) == retry_after


WORKSPACE = RateLimit("workspace:acme", requests_per_minute=3, tokens_per_minute=1000)
KEY = RateLimit("key:k_1", tokens_per_minute=500)


def test_a_request_is_admitted_while_every_subject_stays_within_its_limits() -> None:
    window = window_at(T + 10)
    assert decide((WORKSPACE, KEY), (Counted(2, 400), Counted(1, 100)), 400, window, T + 10) is None
    # exactly at the limit is within it
    assert decide((WORKSPACE,), (Counted(2, 600),), 400, window, T + 10) is None


@pytest.mark.parametrize(
    ("counted", "tokens", "subject", "name", "limit"),
    [
        ((Counted(3, 0), Counted(0, 0)), 1, "workspace:acme", "requests_per_minute", 3),
        ((Counted(0, 601), Counted(0, 0)), 400, "workspace:acme", "tokens_per_minute", 1000),
        ((Counted(0, 0), Counted(5, 101)), 400, "key:k_1", "tokens_per_minute", 500),
        # one request's worst case above the whole limit is refused even in an empty window
        ((Counted(0, 0), Counted(0, 0)), 501, "key:k_1", "tokens_per_minute", 500),
    ],
)
def test_the_first_limit_exceeded_is_named_with_its_window_and_retry_after(
    counted: tuple[Counted, Counted], tokens: int, subject: str, name: str, limit: int
) -> None:
    window = window_at(T + 45.5)
    refusal = decide((WORKSPACE, KEY), counted, tokens, window, T + 45.5)
    assert refusal is not None
    assert (refusal.subject, refusal.limit_name, refusal.limit) == (subject, name, limit)
    assert (refusal.window, refusal.retry_after_s) == (Window(T), 15)


def test_unreachable_counters_refuse_by_the_first_limit_set() -> None:
    assert unreachable(KEY, Window(T), T + 1).limit_name == "tokens_per_minute"
    assert unreachable(WORKSPACE, Window(T), T + 1).limit_name == "requests_per_minute"
