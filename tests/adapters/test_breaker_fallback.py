"""Breakers that outlive their shared store: in-process while Redis cannot be reached
(``router.adapters.breakers.FallbackBreakers``)."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import pytest

from router.adapters.breaker_policy import Admission, Call
from router.adapters.breakers import (
    BreakerKey,
    BreakerStoreUnavailable,
    FallbackBreakers,
    InProcessBreakers,
    RedisBreakers,
    breaker_board,
)
from router.config import Breaker
from tests.helpers import REDIS_URL, redis_prefix

SETTINGS = Breaker(failure_threshold=2, base_cooldown_ms=60_000, max_cooldown_ms=60_000)
EP = BreakerKey.endpoint("ep-a")
FAILED = Call(failed=True, failure_class="upstream_unavailable")


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _Switch(InProcessBreakers):
    """A shared store that can be taken away and brought back, counting what it is asked."""

    def __init__(self) -> None:
        super().__init__(SETTINGS, "gen-1")
        self.down = False
        self.asked = 0

    async def admit(self, key: BreakerKey) -> tuple[Admission, list]:  # type: ignore[type-arg]
        self.asked += 1
        if self.down:
            raise BreakerStoreUnavailable("breaker store redis://127.0.0.1:1 is unreachable")
        return await super().admit(key)

    async def hear(self, key: BreakerKey, call: Call) -> list:  # type: ignore[type-arg]
        self.asked += 1
        if self.down:
            raise BreakerStoreUnavailable("breaker store redis://127.0.0.1:1 is unreachable")
        return await super().hear(key, call)


async def test_while_the_shared_store_is_down_the_process_keeps_its_own_breakers(caplog):
    shared, clock = _Switch(), _Clock()
    board = FallbackBreakers(shared, InProcessBreakers(SETTINGS, "gen-1"), clock=clock)

    def sharing() -> bool:  # read anew each time (not narrowed as a constant)
        return board.sharing

    await board.hear(EP, FAILED)  # shared: one failure counted there
    assert sharing()
    shared.down = True
    assert (await board.admit(EP))[0] is Admission.ALLOWED  # answered in-process
    assert not sharing()
    assert "breakers are this process's own" in caplog.text
    # Not asked again until its retry is due: the in-process board opens on its own count.
    asked = shared.asked
    await board.hear(EP, FAILED)
    transitions = await board.hear(EP, FAILED)
    assert [t.to_state for t in transitions] == ["open"]
    assert (await board.admit(EP))[0] is Admission.DENIED
    assert shared.asked == asked
    # Retries back off: 1 s, then 2 s.
    clock.now += 1.0
    await board.admit(EP)
    assert shared.asked == asked + 1
    clock.now += 1.0
    await board.admit(EP)
    assert shared.asked == asked + 1
    # Back: the shared breakers resume as they were left (one failure, still closed).
    shared.down = False
    clock.now += 1.0
    assert (await board.admit(EP))[0] is Admission.ALLOWED
    assert sharing()
    assert await shared.state(EP) == "closed"
    assert "breakers are shared again" in caplog.text
    await board.aclose()


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_an_unreachable_redis_leaves_every_call_answered_in_process():
    url = f"redis://waybill:s3cret@127.0.0.1:{_unused_port()}/0"
    board = FallbackBreakers(
        RedisBreakers(url, SETTINGS, "gen-1"), InProcessBreakers(SETTINGS, "gen-1")
    )
    assert await board.blocked([EP]) == {EP: False}
    assert (await board.admit(EP))[0] is Admission.ALLOWED
    await board.record_failure(EP, "upstream_unavailable", opens_at_once=True, retry_after_ms=None)
    assert await board.state(EP) == "open"
    assert (await board.inspect([EP]))[EP].state == "open"
    await board.aclose()


@pytest.fixture(name="prefix")
async def _prefix() -> AsyncIterator[str]:
    async with redis_prefix() as prefix:
        yield prefix


async def test_a_reachable_redis_is_the_board_every_process_shares(prefix: str):
    def board() -> FallbackBreakers:
        shared = RedisBreakers(REDIS_URL, SETTINGS, "gen-1", prefix=prefix)
        return FallbackBreakers(shared, InProcessBreakers(SETTINGS, "gen-1"))

    one, two = board(), board()
    await one.hear(EP, FAILED)
    await two.hear(EP, FAILED)  # the second failure, heard by another process: it opens
    assert await one.state(EP) == "open"
    assert one.sharing and two.sharing
    await one.aclose()
    await two.aclose()


async def test_the_board_of_a_gateway_with_redis_falls_back_to_its_own():
    board = breaker_board(SETTINGS, "gen-1", REDIS_URL, prefix="waybill-test:unused")
    try:
        assert isinstance(board, FallbackBreakers)
        assert type(board.shared) is RedisBreakers and type(board.local) is InProcessBreakers
        assert board.settings_for(EP) == board.local.settings_for(EP) == SETTINGS.settings()
    finally:
        await board.aclose()
