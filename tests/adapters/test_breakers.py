"""Circuit breakers (contract §5): one contract, run against the in-process board and Redis.

The in-process board runs on a fake clock, so cool-down boundaries are checked to the
millisecond. Redis keeps its own time (``TIME``), so its runs use cool-downs of a few tens of
milliseconds and wait for them to pass; the shared-store tests use two ``RedisBreakers`` on one
prefix, as two gateway processes would. Redis is reached at ``WAYBILL_TEST_REDIS_URL``
(default ``redis://127.0.0.1:6379/15``); its runs are skipped only if it does not answer.
"""

from __future__ import annotations

import asyncio
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable
from decimal import Decimal

import pytest
import redis.asyncio as aioredis

from router.adapters.breaker_policy import Figures
from router.adapters.breakers import (
    Admission,
    BreakerBoard,
    BreakerKey,
    BreakerStoreUnavailable,
    FallbackBreakers,
    InProcessBreakers,
    RedisBreakers,
    Transition,
    breaker_board,
)
from router.config import Breaker
from router.request.classify import MAX_RETRY_AFTER_MS
from tests.helpers import REDIS_URL, eventually, redis_prefix

# FAST cool-downs are waited out for real on Redis; SLOW ones never pass during a test.
FAST = Breaker(failure_threshold=3, base_cooldown_ms=80, max_cooldown_ms=320)
SLOW = Breaker(failure_threshold=3, base_cooldown_ms=60_000, max_cooldown_ms=120_000)

EP = BreakerKey.endpoint("ep-a")
UNAVAILABLE = "upstream_unavailable"
RATE_LIMITED = "rate_limited"


# --- the stores under test ------------------------------------------------------------------


class Store(ABC):
    """Makes boards on one breaker store and lets a test wait out a cool-down."""

    shared: bool
    """Whether two boards of one generation share state (two gateway processes on Redis)."""
    real_time: bool

    def __init__(self) -> None:
        self._boards: list[BreakerBoard] = []

    def board(
        self,
        settings: Breaker = FAST,
        *,
        generation: str = "gen-1",
        probe_lease_ms: int = 60_000,
        endpoints: dict[str, Breaker] | None = None,
    ) -> BreakerBoard:
        board = self._make(settings, generation, probe_lease_ms, endpoints)
        self._boards.append(board)
        return board

    def peers(self, n: int, settings: Breaker = FAST) -> list[BreakerBoard]:
        """``n`` boards of one generation on this store: as many processes as the store can
        share state between, one in-process board otherwise."""
        if not self.shared:
            return [self.board(settings)] * n
        return [self.board(settings) for _ in range(n)]

    @abstractmethod
    def _make(
        self,
        settings: Breaker,
        generation: str,
        probe_lease_ms: int,
        endpoints: dict[str, Breaker] | None,
    ) -> BreakerBoard: ...

    @abstractmethod
    def now_ms(self) -> float: ...

    @abstractmethod
    async def wait_out(self, board: BreakerBoard, key: BreakerKey, ms: int, since: float) -> None:
        """Wait until ``ms`` after ``since`` (a ``now_ms()`` taken before the breaker started
        cooling or the probe lease began), checking that ``key`` stays blocked until then."""

    async def close(self) -> None:
        for board in self._boards:
            await board.aclose()


class FakeClock:
    def __init__(self) -> None:
        self.ms = 1_000_000

    def __call__(self) -> float:
        return self.ms / 1000


class InProcessStore(Store):
    shared = False
    real_time = False

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()

    def _make(
        self,
        settings: Breaker,
        generation: str,
        probe_lease_ms: int,
        endpoints: dict[str, Breaker] | None,
    ) -> BreakerBoard:
        return InProcessBreakers(
            settings,
            generation,
            endpoints=endpoints,
            clock=self.clock,
            probe_lease_ms=probe_lease_ms,
        )

    def now_ms(self) -> float:
        return self.clock.ms

    async def wait_out(self, board: BreakerBoard, key: BreakerKey, ms: int, since: float) -> None:
        self.clock.ms = int(since) + ms - 1
        assert (await board.blocked([key]))[key], f"unblocked before {ms} ms"
        self.clock.ms += 1
        assert not (await board.blocked([key]))[key], f"still blocked after {ms} ms"


class RedisStore(Store):
    shared = True
    real_time = True

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def _make(
        self,
        settings: Breaker,
        generation: str,
        probe_lease_ms: int,
        endpoints: dict[str, Breaker] | None,
    ) -> BreakerBoard:
        return RedisBreakers(
            REDIS_URL,
            settings,
            generation,
            endpoints=endpoints,
            probe_lease_ms=probe_lease_ms,
            prefix=self.prefix,
        )

    def now_ms(self) -> float:
        return time.monotonic() * 1000

    async def wait_out(self, board: BreakerBoard, key: BreakerKey, ms: int, since: float) -> None:
        assert (await board.blocked([key]))[key], "unblocked at once"

        async def unblocked() -> bool:
            return not (await board.blocked([key]))[key]

        await eventually(unblocked, within_s=ms / 1000 + 5)
        # Redis counts whole milliseconds; allow for the truncation at both ends.
        assert self.now_ms() - since >= ms - 2, f"unblocked before {ms} ms"


@pytest.fixture(name="redis_prefix")
async def _redis_prefix_fixture() -> AsyncIterator[str]:
    async with redis_prefix() as prefix:
        yield prefix


@pytest.fixture(params=["in_process", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    if request.param == "in_process":
        made: Store = InProcessStore()
        yield made
        await made.close()
        return
    async with redis_prefix() as prefix:
        made = RedisStore(prefix)
        yield made
        await made.close()


async def _fail(
    board: BreakerBoard,
    failure_class: str = UNAVAILABLE,
    *,
    key: BreakerKey = EP,
    at_once: bool = False,
    retry_after_ms: int | None = None,
) -> list[Transition]:
    return await board.record_failure(
        key, failure_class, opens_at_once=at_once, retry_after_ms=retry_after_ms
    )


def _opened(
    from_state: str,
    failures: int,
    cooldown_ms: int,
    failure_class: str = UNAVAILABLE,
    *,
    at_once: bool = False,
) -> list[Transition]:
    reason = "opens_at_once" if at_once else "failure_threshold"
    if from_state == "half_open":
        reason = "probe_failed"
    return [Transition(EP, from_state, "open", failure_class, failures, cooldown_ms, reason)]  # type: ignore[arg-type]


async def _take_probe(board: BreakerBoard, failures: int) -> None:
    assert await board.admit(EP) == (
        Admission.PROBE,
        [Transition(EP, "open", "half_open", None, failures, None, "probe")],
    )


# --- closed and opening ---------------------------------------------------------------------


async def test_a_breaker_never_seen_is_closed_and_allows(store: Store):
    board = store.board()
    assert await board.state(EP) == "closed"
    assert await board.blocked([EP]) == {EP: False}
    assert await board.admit(EP) == (Admission.ALLOWED, [])
    assert await board.record_success(EP) == []


async def test_opens_after_failure_threshold_consecutive_failures(store: Store):
    board = store.board(SLOW)
    assert await _fail(board) == []
    assert await _fail(board) == []
    assert await board.state(EP) == "closed"
    assert await board.admit(EP) == (Admission.ALLOWED, [])

    assert await _fail(board) == _opened("closed", 3, 60_000)
    assert await board.state(EP) == "open"
    assert await board.blocked([EP]) == {EP: True}
    assert await board.admit(EP) == (Admission.DENIED, [])


async def test_success_while_closed_resets_the_consecutive_failure_count(store: Store):
    board = store.board(SLOW)
    await _fail(board)
    await _fail(board)
    assert await board.record_success(EP) == []
    assert await _fail(board) == []
    assert await _fail(board) == []
    assert await board.state(EP) == "closed"
    assert await _fail(board) == _opened("closed", 3, 60_000)


async def test_a_failure_that_opens_at_once_trips_on_the_first_failure(store: Store):
    board = store.board(SLOW)
    assert await _fail(board, "credentials", at_once=True) == _opened(
        "closed", 1, 60_000, "credentials", at_once=True
    )
    assert await board.admit(EP) == (Admission.DENIED, [])


async def test_endpoint_and_mapping_breakers_are_separate(store: Store):
    board = store.board(SLOW)
    mapping = BreakerKey.mapping("ep-a", "gpt-4o")
    assert (mapping.scope, mapping.target) == ("mapping", "ep-a/gpt-4o")
    await _fail(board, "model_unavailable", key=mapping, at_once=True)
    assert await board.blocked([mapping, EP]) == {mapping: True, EP: False}
    assert await board.admit(EP) == (Admission.ALLOWED, [])


async def test_a_late_success_while_open_changes_nothing(store: Store):
    board = store.board(SLOW)
    await _fail(board, at_once=True)
    assert await board.record_success(EP) == []
    assert await board.state(EP) == "open"
    assert await board.admit(EP) == (Admission.DENIED, [])


# --- cool-downs -----------------------------------------------------------------------------


async def test_retry_after_sets_the_cooldown_instead_of_the_backoff(store: Store):
    board = store.board(SLOW)
    since = store.now_ms()
    transitions = await _fail(board, RATE_LIMITED, at_once=True, retry_after_ms=150)
    assert transitions == _opened("closed", 1, 150, RATE_LIMITED, at_once=True)
    await store.wait_out(board, EP, 150, since)
    await _take_probe(board, failures=1)


async def test_retry_after_is_capped_at_five_minutes_even_above_max_cooldown(store: Store):
    board = store.board(SLOW)
    since = store.now_ms()
    an_hour = 3_600_000
    transitions = await _fail(board, RATE_LIMITED, at_once=True, retry_after_ms=an_hour)
    assert transitions == _opened("closed", 1, MAX_RETRY_AFTER_MS, RATE_LIMITED, at_once=True)
    assert SLOW.max_cooldown_ms < MAX_RETRY_AFTER_MS
    if not store.real_time:
        await store.wait_out(board, EP, MAX_RETRY_AFTER_MS, since)
    else:
        assert await board.blocked([EP]) == {EP: True}


async def test_probe_failure_reopens_with_a_doubled_cooldown_capped_at_max(store: Store):
    board = store.board(FAST)
    since = store.now_ms()
    assert await _fail(board, at_once=True) == _opened("closed", 1, 80, at_once=True)
    await store.wait_out(board, EP, 80, since)
    for failures, cooldown in ((2, 160), (3, 320), (4, 320)):
        await _take_probe(board, failures=failures - 1)
        assert await board.state(EP) == "half_open"
        since = store.now_ms()
        assert await _fail(board) == _opened("half_open", failures, cooldown)
        await store.wait_out(board, EP, cooldown, since)


async def test_probe_success_closes_and_resets_the_count_and_the_backoff(store: Store):
    board = store.board(FAST)
    since = store.now_ms()
    await _fail(board, at_once=True)
    await store.wait_out(board, EP, 80, since)
    await _take_probe(board, failures=1)
    since = store.now_ms()
    assert await _fail(board) == _opened("half_open", 2, 160)
    await store.wait_out(board, EP, 160, since)
    await _take_probe(board, failures=2)

    assert await board.record_success(EP) == [
        Transition(EP, "half_open", "closed", None, 0, None, "probe_succeeded")
    ]
    assert await board.state(EP) == "closed"
    assert await board.admit(EP) == (Admission.ALLOWED, [])
    assert await _fail(board) == []
    assert await _fail(board) == []
    assert await _fail(board) == _opened("closed", 3, 80)


# --- the half-open probe --------------------------------------------------------------------


async def test_exactly_one_probe_among_fifty_concurrent_admits(store: Store):
    boards = store.peers(2)
    since = store.now_ms()
    await _fail(boards[0], at_once=True)
    await store.wait_out(boards[1], EP, 80, since)

    results = await asyncio.gather(*(boards[i % 2].admit(EP) for i in range(50)))

    admissions = [admission for admission, _ in results]
    assert admissions.count(Admission.PROBE) == 1
    assert admissions.count(Admission.DENIED) == 49
    assert [t for _, ts in results for t in ts] == [
        Transition(EP, "open", "half_open", None, 1, None, "probe")
    ]
    for board in boards:
        assert await board.blocked([EP]) == {EP: True}
        assert await board.state(EP) == "half_open"


async def test_concurrent_failures_from_many_processes_are_all_counted(store: Store):
    settings = Breaker(failure_threshold=50, base_cooldown_ms=60_000, max_cooldown_ms=60_000)
    boards = store.peers(2, settings)
    results = await asyncio.gather(*(_fail(boards[i % 2]) for i in range(50)))
    assert [t for ts in results for t in ts] == _opened("closed", 50, 60_000)


async def test_a_probe_whose_holder_never_reports_expires_after_its_lease(store: Store):
    board = store.board(FAST, probe_lease_ms=150)
    since = store.now_ms()
    await _fail(board, at_once=True)
    await store.wait_out(board, EP, 80, since)
    since = store.now_ms()
    await _take_probe(board, failures=1)
    assert await board.admit(EP) == (Admission.DENIED, [])

    await store.wait_out(board, EP, 150, since)
    # Still half-open: the new holder takes over the probe; nothing transitions.
    assert await board.admit(EP) == (Admission.PROBE, [])
    assert await board.admit(EP) == (Admission.DENIED, [])
    assert await board.record_success(EP) == [
        Transition(EP, "half_open", "closed", None, 0, None, "probe_succeeded")
    ]


async def test_a_probe_that_ends_without_a_verdict_gives_its_lease_back(store: Store):
    board = store.board(FAST, probe_lease_ms=60_000)
    since = store.now_ms()
    await _fail(board, at_once=True)
    await store.wait_out(board, EP, 80, since)
    await _take_probe(board, failures=1)
    assert await board.admit(EP) == (Admission.DENIED, [])

    # The probe's attempt ended with a class no breaker counts (say, the client's own 400):
    # its lease goes back at once, not in 60 s; the breaker is still half-open.
    await board.release_probe(EP)
    assert await board.blocked([EP]) == {EP: False}
    assert await board.state(EP) == "half_open"
    assert await board.admit(EP) == (Admission.PROBE, [])
    assert await board.admit(EP) == (Admission.DENIED, [])


async def test_giving_back_a_probe_never_taken_changes_nothing(store: Store):
    board = store.board(FAST)
    await board.release_probe(EP)  # closed, never seen
    assert await board.state(EP) == "closed"
    since = store.now_ms()
    await _fail(board, at_once=True)
    await board.release_probe(EP)  # open and cooling down: still blocked
    assert await board.state(EP) == "open"
    assert await board.blocked([EP]) == {EP: True}
    await store.wait_out(board, EP, 80, since)
    await _take_probe(board, failures=1)


# --- an endpoint's own settings -------------------------------------------------------------


async def test_an_endpoint_with_its_own_threshold_opens_at_it_and_another_at_the_defaults(
    store: Store,
):
    flaky = Breaker(failure_threshold=1, base_cooldown_ms=60_000, max_cooldown_ms=120_000)
    board = store.board(SLOW, endpoints={"flaky": flaky})
    own, own_mapping = BreakerKey.endpoint("flaky"), BreakerKey.mapping("flaky", "org/model")
    steady = BreakerKey.endpoint("steady")

    def opened(key: BreakerKey) -> list[Transition]:
        failures = 1 if key.endpoint_id == "flaky" else 3
        return [
            Transition(key, "closed", "open", UNAVAILABLE, failures, 60_000, "failure_threshold")
        ]

    # The endpoint's settings hold for its mappings' breakers too.
    assert await _fail(board, key=own) == opened(own)
    assert await _fail(board, key=own_mapping) == opened(own_mapping)
    assert await _fail(board, key=steady) == []
    assert await _fail(board, key=steady) == []
    assert await board.blocked([own, own_mapping, steady]) == {
        own: True,
        own_mapping: True,
        steady: False,
    }
    assert await _fail(board, key=steady) == opened(steady)
    assert board.settings_for(own_mapping).failure_threshold == 1
    assert board.settings_for(steady).failure_threshold == 3


async def test_an_endpoint_may_run_a_rolling_policy_beside_consecutive_defaults(store: Store):
    rolling = Breaker(
        policy="rolling",
        window_calls=4,
        minimum_calls=2,
        failure_rate=Decimal("0.5"),
        base_cooldown_ms=60_000,
        max_cooldown_ms=120_000,
    )
    board = store.board(SLOW, endpoints={"cheap": rolling})
    cheap = BreakerKey.endpoint("cheap")
    for key in (cheap, EP):
        assert await board.record_success(key) == []
    # One failed of two reaches the cheap endpoint's failure_rate; the defaults count one
    # failure in a row of three.
    assert await _fail(board, key=cheap) == [
        Transition(
            cheap, "closed", "open", UNAVAILABLE, 1, 60_000, "failure_rate", Figures(2, 1, 0)
        )
    ]
    assert await _fail(board) == []
    views = await board.inspect([cheap, EP])
    assert (views[cheap].state, views[EP].state) == ("open", "closed")
    assert (views[EP].consecutive_failures, views[EP].figures) == (1, None)


# --- reading many breakers, generations -----------------------------------------------------


async def test_blocked_answers_for_many_keys_at_once(store: Store):
    board = store.board(SLOW)
    keys = [BreakerKey.endpoint(f"ep-{i}") for i in range(50)]
    keys += [BreakerKey.mapping(f"ep-{i}", "model") for i in range(50)]
    opened = set(keys[::3])
    for key in opened:
        await _fail(board, key=key, at_once=True)
    assert await board.blocked(keys) == {key: key in opened for key in keys}
    assert await board.blocked([]) == {}


async def test_blocked_is_false_once_a_probe_is_free_and_true_while_one_is_out(store: Store):
    board = store.board(FAST)
    cooled, probed, closed = (BreakerKey.endpoint(name) for name in ("cooled", "probed", "closed"))
    since = store.now_ms()
    await _fail(board, key=cooled, at_once=True)
    await _fail(board, key=probed, at_once=True)
    await store.wait_out(board, probed, 80, since)

    assert (await board.admit(probed))[0] is Admission.PROBE
    assert await board.blocked([cooled, probed, closed]) == {
        cooled: False,
        probed: True,
        closed: False,
    }
    # Reading does not take the probe.
    assert await board.state(cooled) == "open"
    assert (await board.admit(cooled))[0] is Admission.PROBE


async def test_a_new_config_generation_starts_with_every_breaker_closed(store: Store):
    old = store.board(SLOW, generation="gen-1")
    await _fail(old, at_once=True)
    new = store.board(SLOW, generation="gen-2")
    assert await new.state(EP) == "closed"
    assert await new.blocked([EP]) == {EP: False}
    assert await new.admit(EP) == (Admission.ALLOWED, [])
    assert await old.state(EP) == "open"
    if store.shared:
        assert await store.board(SLOW, generation="gen-1").state(EP) == "open"


# --- Redis specifics ------------------------------------------------------------------------


async def test_redis_keys_are_namespaced_by_generation_and_expire(redis_prefix: str):
    board = RedisBreakers(REDIS_URL, SLOW, "gen-7", prefix=redis_prefix)
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        await _fail(board)
        await _fail(board, key=BreakerKey.mapping("ep-a", "m"), at_once=True)
        keys = sorted([key async for key in client.scan_iter(match=f"{redis_prefix}:*")])
        assert keys == [
            f"{redis_prefix}:gen-7:endpoint:ep-a",
            f"{redis_prefix}:gen-7:mapping:ep-a/m",
        ]
        for key in keys:
            assert 0 < await client.pttl(key) <= 24 * 60 * 60 * 1000
        await board.record_success(EP)
        assert await client.exists(f"{redis_prefix}:gen-7:endpoint:ep-a") == 0
    finally:
        await board.aclose()
        await client.aclose()


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_unreachable_redis_raises_breaker_store_unavailable_without_the_password():
    url = f"redis://waybill:s3cret@127.0.0.1:{_unused_port()}/0"
    board = RedisBreakers(url, SLOW, "gen-1")
    try:
        calls: list[Callable[[], Awaitable[object]]] = [
            lambda: board.blocked([EP]),
            lambda: board.admit(EP),
            lambda: board.record_success(EP),
            lambda: _fail(board),
            lambda: board.state(EP),
        ]
        for call in calls:
            with pytest.raises(BreakerStoreUnavailable) as caught:
                await call()
            assert "127.0.0.1" in str(caught.value)
            assert "s3cret" not in str(caught.value)
    finally:
        await board.aclose()


async def test_breaker_board_uses_redis_only_when_a_url_is_given():
    own = {"ep-b": FAST}
    in_process = breaker_board(SLOW, "gen-1", None, endpoints=own, probe_lease_ms=10)
    shared = breaker_board(SLOW, "gen-1", REDIS_URL, endpoints=own, prefix="waybill-test:unused")
    try:
        assert type(in_process) is InProcessBreakers
        assert isinstance(shared, FallbackBreakers) and type(shared.shared) is RedisBreakers
        assert in_process.generation == shared.generation == "gen-1"
        for board in (in_process, shared):
            assert board.settings_for(BreakerKey.mapping("ep-b", "m")) == FAST.settings()
            assert board.settings_for(EP) == SLOW.settings()
    finally:
        await in_process.aclose()
        await shared.aclose()
