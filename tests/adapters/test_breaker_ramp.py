"""Ramp-up after a breaker closes (contract §5 "Circuit breakers", ``ramp_up_ms``): the pure
rule (:func:`breaker_policy.ramp`) as properties, then both boards (in process and Redis) on
one fake clock: a probe's success starts the ramp, opening again forgets it, and a closed
breaker that never opened gives its full weight.

Redis is reached at ``WAYBILL_TEST_REDIS_URL`` (default ``redis://127.0.0.1:6379/15``); its
runs are skipped only if it does not answer.
"""

from __future__ import annotations

from decimal import Decimal

import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st

from router.adapters.breaker_policy import CLOSED, RAMP_PLACES, Call, Record, hear, ramp
from router.adapters.breakers import Admission, BreakerKey, Standing
from router.config import Breaker
from tests.adapters.test_breaker_policy import EP, Boards, boards, fail, succeed
from tests.helpers import REDIS_URL, redis_prefix

__all__ = ["boards"]  # the fixture, shared with test_breaker_policy

_FLOORS = st.integers(1, 1000).map(lambda n: Decimal(n) * RAMP_PLACES)
_RAMPS = st.integers(1, 24 * 60 * 60 * 1000)


@given(_RAMPS, _FLOORS, st.integers(0, 10**8), st.integers(0, 10**8))
def test_a_ramp_never_falls_as_time_passes(ramp_up_ms: int, floor: Decimal, a: int, b: int):
    early, late = sorted((a, b))
    assert ramp(early, ramp_up_ms, floor) <= ramp(late, ramp_up_ms, floor)


@given(_RAMPS, _FLOORS)
def test_a_ramp_starts_at_its_floor_when_the_breaker_closes(ramp_up_ms: int, floor: Decimal):
    assert ramp(0, ramp_up_ms, floor) == floor


@given(_RAMPS, _FLOORS, st.integers(0, 10**8))
def test_a_ramp_gives_the_full_weight_from_ramp_up_ms_on(
    ramp_up_ms: int, floor: Decimal, after: int
):
    assert ramp(ramp_up_ms + after, ramp_up_ms, floor) == 1


@given(_RAMPS, _FLOORS, st.integers(0, 10**8))
def test_a_ramp_stays_between_its_floor_and_the_full_weight(
    ramp_up_ms: int, floor: Decimal, elapsed: int
):
    assert floor <= ramp(elapsed, ramp_up_ms, floor) <= 1


@given(_FLOORS, st.integers(-(10**8), 10**8))
def test_ramp_up_ms_0_is_no_ramp(floor: Decimal, elapsed: int):
    assert ramp(elapsed, 0, floor) == 1


def test_a_ramp_rises_linearly_rounded_down_to_a_thousandth():
    assert ramp(500, 1000, Decimal("0.1")) == Decimal("0.55")
    assert ramp(1, 3000, Decimal("0.1")) == Decimal("0.1")  # 0.1003 → 0.100
    assert ramp(999, 1000, Decimal("0.5")) == Decimal("0.499") + Decimal("0.5")


# --- on both boards ------------------------------------------------------------------------

RAMPING = Breaker(failure_threshold=1, base_cooldown_ms=100, max_cooldown_ms=100, ramp_up_ms=1000)


async def _open_and_close(boards: Boards, settings: Breaker = RAMPING):
    board = boards.board(settings)
    await fail(board)
    boards.clock.ms += 100
    assert (await board.admit(EP))[0] is Admission.PROBE
    transitions = await succeed(board)
    assert [t.reason for t in transitions] == ["probe_succeeded"]
    return board


async def test_a_breaker_that_never_opened_gives_its_full_weight(boards: Boards):
    board = boards.board(RAMPING)
    assert await board.standing([EP]) == {EP: Standing(False, Decimal(1))}
    await succeed(board)
    assert await board.standing([EP]) == {EP: Standing(False, Decimal(1))}


async def test_a_probe_that_closes_the_breaker_starts_its_ramp_at_the_floor(boards: Boards):
    board = await _open_and_close(boards)
    assert await board.standing([EP]) == {EP: Standing(False, Decimal("0.1"))}
    boards.clock.ms += 500
    assert await board.standing([EP]) == {EP: Standing(False, Decimal("0.55"))}
    # Successes in the meantime leave the ramp where the clock has it.
    await succeed(board)
    boards.clock.ms += 500
    assert await board.standing([EP]) == {EP: Standing(False, Decimal(1))}


async def test_a_failure_run_that_ends_keeps_the_ramp_going(boards: Boards):
    settings = Breaker(failure_threshold=3, base_cooldown_ms=100, ramp_up_ms=1000)
    board = boards.board(settings)
    for _ in range(3):
        await fail(board)
    boards.clock.ms += 100
    await board.admit(EP)
    await succeed(board)
    await fail(board)  # one in a row, below the threshold
    await succeed(board)  # the run ends
    boards.clock.ms += 250
    assert (await board.standing([EP]))[EP].share == Decimal("0.325")


async def test_opening_again_forgets_the_ramp(boards: Boards):
    board = await _open_and_close(boards)
    await fail(board)
    assert await board.standing([EP]) == {EP: Standing(True, Decimal(1))}
    boards.clock.ms += 100
    await board.admit(EP)
    await succeed(board)
    assert (await board.standing([EP]))[EP].share == Decimal("0.1"), "a new ramp, from now"


async def test_without_ramp_up_ms_a_closing_breaker_gives_its_full_weight_at_once(
    boards: Boards,
):
    board = await _open_and_close(boards, Breaker(failure_threshold=1, base_cooldown_ms=100))
    assert await board.standing([EP]) == {EP: Standing(False, Decimal(1))}


async def test_a_mapping_breaker_ramps_on_its_own(boards: Boards):
    board = boards.board(Breaker(failure_threshold=1, base_cooldown_ms=100, ramp_up_ms=2000,
                                 ramp_up_floor=Decimal("0.5")))  # fmt: skip
    mapping = BreakerKey.mapping(EP.endpoint_id, "m-1")
    await board.record_failure(mapping, "upstream_unavailable", opens_at_once=False,
                               retry_after_ms=None)  # fmt: skip
    boards.clock.ms += 100
    await board.admit(mapping)
    await board.record_success(mapping)
    assert await board.standing([EP, mapping]) == {
        EP: Standing(False, Decimal(1)),
        mapping: Standing(False, Decimal("0.5")),
    }
    boards.clock.ms += 1000
    assert (await board.standing([mapping]))[mapping].share == Decimal("0.75")


def test_a_success_after_the_ramp_forgets_when_the_breaker_closed():
    settings = RAMPING.settings()
    ramping = Record(closed_at=5_000)
    assert hear(ramping, Call(failed=False), settings, 5_999) == (ramping, None)
    assert hear(ramping, Call(failed=False), settings, 6_000) == (CLOSED, None)


async def test_on_redis_a_success_after_the_ramp_deletes_the_breakers_hash():
    async with redis_prefix() as prefix:
        boards = Boards("redis", prefix)
        try:
            board = await _open_and_close(boards)
            client = aioredis.Redis.from_url(REDIS_URL)
            try:
                key = f"{prefix}:gen-1:endpoint:{EP.endpoint_id}"
                assert await client.exists(key)
                await succeed(board)  # still ramping: kept
                assert await client.exists(key)
                boards.clock.ms += 1000
                await succeed(board)  # the ramp is over: the usual success writes nothing
                assert not await client.exists(key)
            finally:
                await client.aclose()
        finally:
            await boards.close()
