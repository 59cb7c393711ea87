"""The rolling breaker policy (contract §5 "Circuit breakers"), threshold by threshold, on the
in-process board and on Redis, both driven by one fake clock; and the two backends held to the
same steps over random histories of either policy.

Redis is reached at ``WAYBILL_TEST_REDIS_URL`` (default ``redis://127.0.0.1:6379/15``); its
runs are skipped only if it does not answer. Every board here is given the test's clock, so
no test waits for time to pass.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.adapters.breaker_policy import Figures
from router.adapters.breakers import (
    Admission,
    BreakerBoard,
    BreakerKey,
    BreakerView,
    InProcessBreakers,
    RedisBreakers,
    Transition,
)
from router.config import Breaker
from tests.helpers import REDIS_URL, redis_prefix

EP = BreakerKey.endpoint("ep-a")
FAILED = "upstream_unavailable"
START_MS = 1_000_000


class FakeClock:
    def __init__(self) -> None:
        self.ms = START_MS

    def __call__(self) -> float:
        return self.ms / 1000


class Boards:
    """Makes boards on one backend, all on one fake clock."""

    def __init__(self, backend: str, prefix: str | None) -> None:
        self.backend = backend
        self.prefix = prefix
        self.clock = FakeClock()
        self._made: list[BreakerBoard] = []

    def board(self, settings: Breaker, *, probe_lease_ms: int = 60_000) -> BreakerBoard:
        made: BreakerBoard
        if self.prefix is None:
            made = InProcessBreakers(
                settings, "gen-1", clock=self.clock, probe_lease_ms=probe_lease_ms
            )
        else:
            made = RedisBreakers(
                REDIS_URL,
                settings,
                "gen-1",
                clock=self.clock,
                probe_lease_ms=probe_lease_ms,
                prefix=self.prefix,
            )
        self._made.append(made)
        return made

    async def close(self) -> None:
        for board in self._made:
            await board.aclose()


@pytest.fixture(params=["in_process", "redis"])
async def boards(request: pytest.FixtureRequest) -> AsyncIterator[Boards]:
    if request.param == "in_process":
        made = Boards("in_process", None)
        yield made
        await made.close()
        return
    async with redis_prefix() as prefix:
        made = Boards("redis", prefix)
        yield made
        await made.close()


def rolling(**keys: Any) -> Breaker:
    return Breaker.model_validate(
        {"policy": "rolling", "base_cooldown_ms": 60_000, "max_cooldown_ms": 120_000, **keys}
    )


async def fail(
    board: BreakerBoard, *, duration_ms: int | None = None, at_once: bool = False
) -> list[Transition]:
    return await board.record_failure(
        EP, FAILED, opens_at_once=at_once, retry_after_ms=None, duration_ms=duration_ms
    )


async def succeed(board: BreakerBoard, duration_ms: int | None = None) -> list[Transition]:
    return await board.record_success(EP, duration_ms=duration_ms)


async def invalid_output(
    board: BreakerBoard, workspace: str, *, duration_ms: int | None = None
) -> list[Transition]:
    return await board.record_failure(
        EP,
        "invalid_output",
        opens_at_once=False,
        retry_after_ms=None,
        duration_ms=duration_ms,
        workspace=workspace,
    )


def opened(
    reason: str,
    figures: Figures | None,
    *,
    failures: int,
    failure_class: str | None = FAILED,
    from_state: str = "closed",
    cooldown_ms: int = 60_000,
    duration_ms: int | None = None,
) -> list[Transition]:
    return [
        Transition(
            EP,
            from_state,  # type: ignore[arg-type]
            "open",
            failure_class,
            failures,
            cooldown_ms,
            reason,
            figures,
            duration_ms,
        )
    ]


# --- minimum_calls and failure_rate -------------------------------------------------------


async def test_below_minimum_calls_the_breaker_stays_closed_whatever_the_rate(boards: Boards):
    board = boards.board(rolling(window_calls=10, minimum_calls=4, failure_rate=0.5))
    for _ in range(3):
        assert await fail(board) == []  # 100% failed, but 3 calls < minimum_calls 4
    assert await board.state(EP) == "closed"
    assert await board.admit(EP) == (Admission.ALLOWED, [])
    # The fourth call reaches minimum_calls, and 4 of 4 failed.
    assert await fail(board) == opened("failure_rate", Figures(4, 4, 0), failures=4)


async def test_failure_rate_reached_exactly_opens_and_just_below_it_does_not(boards: Boards):
    board = boards.board(rolling(window_calls=10, minimum_calls=4, failure_rate=0.5))
    assert await succeed(board) == []
    assert await succeed(board) == []
    assert await fail(board) == []  # 1 of 3: below minimum_calls
    assert await succeed(board) == []  # 1 of 4 = 0.25 < 0.5
    assert await fail(board) == []  # 2 of 5 = 0.4 < 0.5
    # 3 of 6 = 0.5: reached exactly.
    transitions = await fail(board)
    assert transitions == opened("failure_rate", Figures(6, 3, 0), failures=2)
    assert transitions[0].figures is not None
    assert transitions[0].figures.failure_rate() == Decimal("0.5000")
    assert await board.state(EP) == "open"
    assert await board.blocked([EP]) == {EP: True}


async def test_a_success_that_brings_the_window_to_minimum_calls_may_open_it(boards: Boards):
    # The rate is judged on every call the window hears of, a success included.
    board = boards.board(rolling(window_calls=10, minimum_calls=3, failure_rate=0.6))
    assert await fail(board) == []
    assert await fail(board) == []
    assert await succeed(board) == opened(
        "failure_rate", Figures(3, 2, 0), failures=0, failure_class=None
    )


async def test_a_count_window_holds_only_the_last_window_calls_calls(boards: Boards):
    board = boards.board(rolling(window_calls=4, minimum_calls=4, failure_rate=0.75))
    assert await fail(board) == []
    assert await fail(board) == []
    for _ in range(3):  # the failures slide out of the window: 1 of 4, then 0 of 4
        assert await succeed(board) == []
    assert await fail(board) == []  # o o o f: 1 of 4
    assert await fail(board) == []  # o o f f: 2 of 4
    assert await fail(board) == opened("failure_rate", Figures(4, 3, 0), failures=3)


async def test_a_failure_that_opens_at_once_opens_a_rolling_breaker_below_minimum_calls(
    boards: Boards,
):
    board = boards.board(rolling(window_calls=10, minimum_calls=5))
    assert await succeed(board) == []
    assert await board.record_failure(
        EP, "rate_limited", opens_at_once=True, retry_after_ms=2000
    ) == opened(
        "opens_at_once",
        Figures(2, 1, 0),
        failures=1,
        failure_class="rate_limited",
        cooldown_ms=2000,
    )


# --- slow calls ---------------------------------------------------------------------------


async def test_slow_call_rate_reached_exactly_opens_on_slow_successes(boards: Boards):
    board = boards.board(
        rolling(
            window_calls=10,
            minimum_calls=4,
            failure_rate=1,
            slow_call_ms=1000,
            slow_call_rate=0.5,
        )
    )
    assert await succeed(board, 999) == []  # just under slow_call_ms: not slow
    assert await succeed(board, 1000) == []  # slow_call_ms itself is slow
    assert await succeed(board, 20) == []  # 1 slow of 3: below minimum_calls
    # 2 slow of 4 = 0.5: reached exactly; nothing failed.
    transitions = await succeed(board, 40_000)
    assert transitions == opened(
        "slow_call_rate", Figures(4, 0, 2), failures=0, failure_class=None, duration_ms=40_000
    )
    assert transitions[0].figures is not None
    assert transitions[0].figures.slow_call_rate() == Decimal("0.5000")


async def test_a_slow_failure_counts_as_failed_and_as_slow(boards: Boards):
    board = boards.board(
        rolling(window_calls=10, minimum_calls=2, failure_rate=1, slow_call_ms=100)
    )
    assert await succeed(board, 10) == []
    # 1 failed of 2 (< 1.0), 1 slow of 2 (< 1.0, the default slow_call_rate)
    assert await fail(board, duration_ms=5000) == []
    assert (await board.inspect([EP]))[EP].figures == Figures(2, 1, 1)


async def test_without_slow_call_ms_no_call_is_slow(boards: Boards):
    board = boards.board(rolling(window_calls=4, minimum_calls=4))
    for _ in range(4):
        assert await succeed(board, 10_000_000) == []
    assert (await board.inspect([EP]))[EP].figures == Figures(4, 0, 0)


# --- time-based windows -------------------------------------------------------------------


async def test_a_time_window_forgets_calls_once_their_bucket_leaves_it(boards: Boards):
    # window_ms 10000: ten buckets of 1000 ms. START_MS is the start of bucket 1000.
    settings = rolling(window_ms=10_000, minimum_calls=3, failure_rate=1)
    kept, forgotten = boards.board(settings), boards.board(settings)
    kept_key, forgotten_key = BreakerKey.endpoint("kept"), BreakerKey.endpoint("forgotten")
    for board, key in ((kept, kept_key), (forgotten, forgotten_key)):
        for _ in range(2):
            assert (
                await board.record_failure(key, FAILED, opens_at_once=False, retry_after_ms=None)
                == []
            )

    # The last instant of bucket 1009: bucket 1000 is still one of the ten.
    boards.clock.ms = START_MS + 9_999
    assert (await kept.inspect([kept_key]))[kept_key].figures == Figures(2, 2, 0)
    third = await kept.record_failure(kept_key, FAILED, opens_at_once=False, retry_after_ms=None)
    assert [(t.to_state, t.reason, t.figures) for t in third] == [
        ("open", "failure_rate", Figures(3, 3, 0))
    ]

    # The first instant of bucket 1010: bucket 1000 has left the window.
    boards.clock.ms = START_MS + 10_000
    assert (await forgotten.inspect([forgotten_key]))[forgotten_key].figures == Figures(0, 0, 0)
    assert (
        await forgotten.record_failure(
            forgotten_key, FAILED, opens_at_once=False, retry_after_ms=None
        )
        == []
    )
    assert (await forgotten.inspect([forgotten_key]))[forgotten_key].figures == Figures(1, 1, 0)
    assert await forgotten.state(forgotten_key) == "closed"


async def test_a_time_window_slides_bucket_by_bucket(boards: Boards):
    board = boards.board(rolling(window_ms=10_000, minimum_calls=1, failure_rate=1))
    for second in range(12):
        boards.clock.ms = START_MS + second * 1000
        assert await succeed(board) == []
    # Twelve calls, one per bucket; the window holds the last ten.
    assert (await board.inspect([EP]))[EP].figures == Figures(10, 0, 0)
    boards.clock.ms += 60_000  # long idle: everything left
    assert (await board.inspect([EP]))[EP].figures == Figures(0, 0, 0)


# --- half-open under rolling --------------------------------------------------------------


async def _open_then_probe(boards: Boards, board: BreakerBoard) -> None:
    assert await fail(board, at_once=True) != []
    boards.clock.ms += 60_000
    admission, transitions = await board.admit(EP)
    assert admission is Admission.PROBE
    assert [(t.from_state, t.to_state, t.reason) for t in transitions] == [
        ("open", "half_open", "probe")
    ]


async def test_a_slow_probe_reopens_the_breaker_with_the_next_cooldown(boards: Boards):
    board = boards.board(rolling(window_calls=10, slow_call_ms=1000, slow_call_rate=0.5))
    await _open_then_probe(boards, board)
    assert await succeed(board, 1500) == opened(
        "probe_slow",
        None,
        failures=1,
        failure_class=None,
        from_state="half_open",
        cooldown_ms=120_000,
        duration_ms=1500,
    )


async def test_a_quick_probe_closes_the_breaker_with_an_empty_window(boards: Boards):
    board = boards.board(rolling(window_calls=10, minimum_calls=2, slow_call_ms=1000))
    await _open_then_probe(boards, board)
    closed = await succeed(board, 10)
    assert [(t.from_state, t.to_state, t.reason, t.duration_ms) for t in closed] == [
        ("half_open", "closed", "probe_succeeded", 10)
    ]
    view = (await board.inspect([EP]))[EP]
    assert (view.state, view.figures, view.trips) == ("closed", Figures(0, 0, 0), 0)
    assert await fail(board) == []  # 1 call: below minimum_calls again


async def test_inspect_tells_state_cooldown_and_window(boards: Boards):
    board = boards.board(rolling(window_calls=10, minimum_calls=3))
    await succeed(board)
    await fail(board)
    assert (await board.inspect([EP]))[EP] == BreakerView(
        state="closed",
        blocked=False,
        consecutive_failures=1,
        trips=0,
        cooldown_ms=None,
        probe_in_ms=None,
        figures=Figures(2, 1, 0),
    )
    await fail(board, at_once=True)
    boards.clock.ms += 15_000
    view = (await board.inspect([EP]))[EP]
    assert (view.state, view.blocked, view.trips, view.cooldown_ms, view.probe_in_ms) == (
        "open",
        True,
        1,
        60_000,
        45_000,
    )


# --- invalid outputs count only when more than one workspace's are in the window ----------


async def test_one_workspaces_invalid_outputs_never_open_a_consecutive_breaker(boards: Boards):
    board = boards.board(Breaker(failure_threshold=2))
    for _ in range(5):
        assert await invalid_output(board, "acme") == []
    view = (await board.inspect([EP]))[EP]
    assert (view.state, view.consecutive_failures) == ("closed", 0), "remembered, not counted"
    # Another workspace's is counted: the run now holds both workspaces' (1 in a row) ...
    assert await invalid_output(board, "other") == []
    assert (await board.inspect([EP]))[EP].consecutive_failures == 1
    # ... and so is the first workspace's next one: 2 in a row open it.
    assert [
        (t.to_state, t.reason, t.failure_class) for t in await invalid_output(board, "acme")
    ] == [("open", "failure_threshold", "invalid_output")]


async def test_a_success_ends_the_run_and_forgets_whose_invalid_outputs_it_held(boards: Boards):
    board = boards.board(Breaker(failure_threshold=2))
    assert await invalid_output(board, "acme") == []
    assert await succeed(board) == []
    assert await invalid_output(board, "other") == []  # acme's left with the run: alone
    assert await invalid_output(board, "other") == []
    assert (await board.inspect([EP]))[EP].consecutive_failures == 0


async def test_other_failures_count_as_ever_beside_one_workspaces_invalid_outputs(boards: Boards):
    board = boards.board(Breaker(failure_threshold=2))
    assert await fail(board) == []
    assert await invalid_output(board, "acme") == []  # neither counted nor a success
    assert await fail(board) == opened("failure_threshold", None, failures=2, cooldown_ms=5000)


async def test_in_a_count_window_another_workspaces_invalid_output_counts_until_it_leaves(
    boards: Boards,
):
    board = boards.board(rolling(window_calls=3, minimum_calls=2, failure_rate=1))
    assert await invalid_output(board, "acme") == []  # alone: not a call of the window
    assert (await board.inspect([EP]))[EP].figures == Figures(0, 0, 0)
    assert await invalid_output(board, "other") == []  # acme's is held: counted, 1 of 1
    for _ in range(3):
        assert await succeed(board) == []  # three calls later, both have left the window
    assert (await board.inspect([EP]))[EP].figures == Figures(3, 0, 0)
    assert await invalid_output(board, "acme") == []
    assert (await board.inspect([EP]))[EP].figures == Figures(3, 0, 0)


async def test_in_a_time_window_two_workspaces_invalid_outputs_open_it(boards: Boards):
    board = boards.board(rolling(window_ms=10_000, minimum_calls=2, failure_rate=1))
    assert await invalid_output(board, "acme") == []
    boards.clock.ms += 9_000  # acme's bucket is still in the window
    assert await invalid_output(board, "other") == []  # counted: 1 of 1, below minimum_calls
    assert await invalid_output(board, "acme") == opened(
        "failure_rate", Figures(2, 2, 0), failures=2, failure_class="invalid_output"
    )


async def test_a_probe_answered_with_one_workspaces_invalid_output_gives_its_lease_back(
    boards: Boards,
):
    board = boards.board(Breaker(failure_threshold=2, base_cooldown_ms=1000))
    await fail(board, at_once=True)
    boards.clock.ms += 1000
    assert (await board.admit(EP))[0] is Admission.PROBE
    assert await invalid_output(board, "acme") == []  # no verdict
    assert await board.state(EP) == "half_open"
    assert await board.blocked([EP]) == {EP: False}, "the next request probes at once"
    assert (await board.admit(EP))[0] is Admission.PROBE
    # Another workspace's probe fails the same way: both are in the window, it re-opens.
    assert [(t.from_state, t.to_state) for t in await invalid_output(board, "other")] == [
        ("half_open", "open")
    ]


# --- the two backends take the same steps -------------------------------------------------

POLICIES = [
    Breaker(failure_threshold=3, base_cooldown_ms=100, max_cooldown_ms=400),
    rolling(window_calls=5, minimum_calls=3, failure_rate=0.6, base_cooldown_ms=100,
            max_cooldown_ms=400),
    rolling(window_calls=8, minimum_calls=2, failure_rate=0.75, slow_call_ms=50,
            slow_call_rate=0.5, base_cooldown_ms=100, max_cooldown_ms=400),
    rolling(window_ms=1000, minimum_calls=3, failure_rate=0.5, slow_call_ms=50,
            base_cooldown_ms=100, max_cooldown_ms=400),
    # A ramp-up after each close (ramp_up_ms): both keep when a probe closed the breaker.
    Breaker(failure_threshold=2, base_cooldown_ms=100, max_cooldown_ms=400, ramp_up_ms=500),
    rolling(window_calls=5, minimum_calls=3, failure_rate=0.6, base_cooldown_ms=100,
            max_cooldown_ms=400, ramp_up_ms=300, ramp_up_floor=0.25),
]  # fmt: skip

_OPERATIONS = st.one_of(
    st.tuples(st.just("admit")),
    st.tuples(st.just("release")),
    st.tuples(st.just("wait"), st.integers(0, 700)),
    st.tuples(
        st.just("invalid_output"),
        st.sampled_from(["acme", "other", "third"]),  # the workspace
        st.integers(0, 120),  # duration_ms
    ),
    st.tuples(
        st.just("hear"),
        st.booleans(),  # failed
        st.integers(0, 120),  # duration_ms
        st.booleans(),  # opens at once
        st.one_of(st.none(), st.integers(0, 300)),  # retry_after_ms
    ),
)


async def _play(board: BreakerBoard, clock: FakeClock, history: list[tuple[Any, ...]]) -> list[Any]:
    seen: list[Any] = []
    for operation in history:
        if operation[0] == "admit":
            seen.append(await board.admit(EP))
        elif operation[0] == "release":
            await board.release_probe(EP)
        elif operation[0] == "wait":
            clock.ms += operation[1]
        elif operation[0] == "invalid_output":
            _, workspace, duration = operation
            seen.append(await invalid_output(board, workspace, duration_ms=duration))
        else:
            _, failed, duration, at_once, retry_after = operation
            if failed:
                seen.append(
                    await board.record_failure(
                        EP,
                        FAILED,
                        opens_at_once=at_once,
                        retry_after_ms=retry_after,
                        duration_ms=duration,
                    )
                )
            else:
                seen.append(await board.record_success(EP, duration_ms=duration))
        seen.append((await board.inspect([EP]))[EP])
        seen.append(await board.standing([EP]))
    return seen


async def _both(policy: int, history: list[tuple[Any, ...]]) -> tuple[list[Any], list[Any]]:
    async with redis_prefix() as prefix:
        in_process, redis = FakeClock(), FakeClock()
        local = InProcessBreakers(POLICIES[policy], "gen-1", clock=in_process, probe_lease_ms=200)
        shared = RedisBreakers(
            REDIS_URL, POLICIES[policy], "gen-1", clock=redis, probe_lease_ms=200, prefix=prefix
        )
        try:
            return await _play(local, in_process, history), await _play(shared, redis, history)
        finally:
            await shared.aclose()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, len(POLICIES) - 1), st.lists(_OPERATIONS, max_size=40))
def test_redis_takes_the_same_steps_as_the_pure_functions(
    policy: int, history: list[tuple[Any, ...]]
) -> None:
    local, shared = asyncio.run(_both(policy, history))
    assert shared == local


_ONE_WORKSPACE_OPERATIONS = st.one_of(
    st.tuples(st.just("admit")),
    st.tuples(st.just("release")),
    st.tuples(st.just("wait"), st.integers(0, 700)),
    st.tuples(st.just("invalid_output"), st.just("acme"), st.integers(0, 120)),
    st.tuples(
        st.just("hear"),
        st.booleans(),
        st.integers(0, 120),
        st.booleans(),
        st.one_of(st.none(), st.integers(0, 300)),
    ),
)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, len(POLICIES) - 1), st.lists(_ONE_WORKSPACE_OPERATIONS, max_size=40))
def test_one_workspace_alone_never_opens_a_breaker_through_invalid_output(
    policy: int, history: list[tuple[Any, ...]]
) -> None:
    clock = FakeClock()
    board = InProcessBreakers(POLICIES[policy], "gen-1", clock=clock, probe_lease_ms=200)
    seen = asyncio.run(_play(board, clock, history))
    transitions = [t for step in seen if isinstance(step, list) for t in step]
    assert all(t.failure_class != "invalid_output" for t in transitions)
