"""The executor (router/request/executor.py) against in-memory fakes of its ports
(tests/request/fakes.py): every action the walk can emit carried out, asserted on the events
the journal received and on what the drivers, breakers and clock were asked."""

from __future__ import annotations

import asyncio
from decimal import Decimal
from typing import Any

import orjson
import pytest

from ledger import events as ev
from ledger.books.accounting import BudgetDenied
from ledger.store import LedgerUnavailable
from router.adapters.breakers import BreakerKey
from router.errors import GatewayError
from tests.request.fakes import USAGE, World, answer, config, fail, failure, stream

EAST, WEST = BreakerKey.endpoint("east"), BreakerKey.endpoint("west")
EAST_M, WEST_M = BreakerKey.mapping("east", "m"), BreakerKey.mapping("west", "m")
HEDGED = "  hedge: {enabled: true, after_ms: 200}"
DENIED = BudgetDenied("workspace:acme", "workspace", Decimal(1), Decimal(0), Decimal("0.01"))


def _chunks(body: bytes) -> list[dict[str, Any]]:
    frames = [frame for frame in body.split(b"\n\n") if frame]
    assert frames[-1] == b"data: [DONE]"
    chunks = []
    for frame in frames[:-1]:
        assert frame.startswith(b"data: ")
        chunks.extend(_as_list(orjson.loads(frame[len(b"data: ") :])))
    return chunks


def _as_list(value: Any) -> list[dict[str, Any]]:
    return value if isinstance(value, list) else [value]


def _text(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


async def test_a_first_try_answer_is_recorded_in_two_appends_and_settled() -> None:
    world = World(config())
    world.drivers["east"].then(answer("hi"))
    completion = await world.executor().complete()

    assert (completion.endpoint, completion.attempts) == ("east", 1)
    assert completion.response["choices"][0]["message"]["content"] == "hi"
    assert [[e.type for e in append] for append in world.journal.appends] == [
        ["RequestReceived", "RouteEvaluated", "BudgetReserved", "AttemptStarted"],
        ["AttemptFinished", "BudgetSettled", "RequestCompleted"],
    ]
    (started,) = world.journal.of(ev.AttemptStarted)
    assert (started.endpoint, started.cause, started.attempt_number) == ("east", "first", 1)
    assert (started.server_address, started.server_port, started.admitted_as) == (
        "east.invalid",
        443,
        "closed",
    )
    (finished,) = world.journal.of(ev.AttemptFinished)
    assert (finished.status, finished.usage, finished.response_model) == (
        "succeeded",
        USAGE,
        "m-2026",
    )
    (completed,) = world.journal.of(ev.RequestCompleted)
    assert completed.cost_usd == completion.cost_usd == Decimal("0.000022")
    assert [request.upstream_model for request in world.drivers["east"].sent] == ["m"]
    assert world.drivers["west"].sent == []
    assert world.breakers.admitted == [EAST, EAST_M]
    assert [key for key, _ in world.breakers.successes] == [EAST, EAST_M]
    assert world.clock.sleeps == []


async def test_a_rate_limited_attempt_is_retried_on_its_endpoint_after_its_retry_after() -> None:
    world = World(config())
    world.drivers["east"].then(fail(failure(429, retry_after_ms=250)), answer())
    completion = await world.executor().complete()

    assert (completion.endpoint, completion.attempts) == ("east", 2)
    assert world.clock.sleeps == [0.25], "the back-off is waited for on the clock, once"
    (decided,) = world.journal.of(ev.FailoverDecided)
    assert (decided.action, decided.reason, decided.backoff_ms) == (
        "retry",
        "retry_after_honoured",
        250,
    )
    first, retry = world.journal.of(ev.AttemptStarted)
    assert (retry.endpoint, retry.cause, retry.attempt_number) == ("east", "retry", 2)
    assert len(world.journal.of(ev.RouteEvaluated)) == 1, "a retry evaluates nothing again"
    (released,) = world.journal.of(ev.BudgetReleased)
    assert (released.attempt_id, released.reason) == (first.attempt_id, "not_started")
    assert world.breakers.failures == [(EAST, ev.FailureClass.RATE_LIMITED)]
    assert len(world.drivers["east"].sent) == 2


async def test_a_connect_error_fails_over_to_the_next_mapping() -> None:
    world = World(config())
    world.drivers["east"].then(fail(failure(transport="connect_error")))
    world.drivers["west"].then(answer("from west"))
    completion = await world.executor().complete()

    assert (completion.endpoint, completion.attempts) == ("west", 2)
    assert world.journal.types() == [
        "RequestReceived",
        "RouteEvaluated",
        "BudgetReserved",
        "AttemptStarted",
        "AttemptFinished",
        "BudgetReleased",
        "FailoverDecided",
        "RouteEvaluated",
        "BudgetReserved",
        "AttemptStarted",
        "AttemptFinished",
        "BudgetSettled",
        "RequestCompleted",
    ]
    (decided,) = world.journal.of(ev.FailoverDecided)
    assert (decided.action, decided.failure_class, decided.attempts_left) == (
        "failover",
        ev.FailureClass.NETWORK_ERROR,
        3,
    )
    _, second = world.journal.of(ev.RouteEvaluated)
    assert second.tried_endpoints == ("east",) and second.sequence == 2
    failed, answered = world.journal.of(ev.AttemptFinished)
    assert (failed.status, failed.evidence) == ("failed", ev.Evidence.NOT_STARTED)
    assert (answered.status, answered.attempt_id) == (
        "succeeded",
        world.journal.of(ev.AttemptStarted)[1].attempt_id,
    )
    assert world.breakers.failures == [(EAST, ev.FailureClass.NETWORK_ERROR)]
    assert [key for key, _ in world.breakers.successes] == [WEST, WEST_M]


async def test_a_reservation_lost_to_another_request_is_routed_again() -> None:
    world = World(config())
    world.journal.refuse(ev.BudgetReserved, DENIED)
    world.drivers["east"].then(answer())
    completion = await world.executor().complete()

    assert (completion.endpoint, completion.attempts) == ("east", 1)
    assert world.journal.types() == [
        "RequestReceived",
        "RouteEvaluated",
        "BudgetReservationDenied",
        "RouteEvaluated",
        "BudgetReserved",
        "AttemptStarted",
        "AttemptFinished",
        "BudgetSettled",
        "RequestCompleted",
    ]
    (denied,) = world.journal.of(ev.BudgetReservationDenied)
    assert (denied.account_id, denied.endpoint) == ("workspace:acme", "east")
    (started,) = world.journal.of(ev.AttemptStarted)
    assert (started.cause, started.attempt_number) == ("first", 1)
    assert len(world.drivers["east"].sent) == 1, "no upstream call for the refused start"


async def test_reservations_lost_again_and_again_end_the_request_with_budget_exceeded() -> None:
    world = World(config())
    world.journal.refuse(ev.BudgetReserved, DENIED, times=6)
    with pytest.raises(GatewayError) as raised:
        await world.executor().complete()

    assert (raised.value.status, raised.value.code) == (402, "budget_exceeded")
    assert world.journal.types().count("BudgetReservationDenied") == 6
    assert world.journal.of(ev.AttemptStarted) == []
    (failed,) = world.journal.of(ev.RequestFailed)
    assert (failed.error_code, failed.attempts) == ("budget_exceeded", 0)
    assert world.drivers["east"].sent == []


async def test_no_route_while_every_breaker_is_open_is_a_503_recorded() -> None:
    world = World(config())
    world.breakers.open = {EAST, WEST}
    with pytest.raises(GatewayError) as raised:
        await world.executor().complete()

    assert (raised.value.status, raised.value.code) == (503, "upstream_unavailable")
    assert world.journal.types() == ["RequestReceived", "RouteEvaluated", "RequestFailed"]
    (evaluated,) = world.journal.of(ev.RouteEvaluated)
    assert evaluated.chosen is None
    assert {c.reason_code for c in evaluated.candidates} == {ev.ReasonCode.BREAKER_OPEN}
    assert world.breakers.admitted == []
    assert world.drivers["east"].sent == world.drivers["west"].sent == []


async def test_a_hedge_armed_after_its_delay_wins_and_the_first_way_is_cancelled() -> None:
    world = World(config(HEDGED))
    world.drivers["east"].then(answer(gate=asyncio.Event()))  # never answers
    world.drivers["west"].then(answer("from west"))
    task = asyncio.create_task(world.executor().complete())
    await world.clock.armed.wait()
    assert [seconds for seconds, _ in world.clock.timers] == [0.2]
    world.clock.fire()
    completion = await task
    await world.kept.drain()

    assert (completion.endpoint, completion.attempts) == ("west", 2)
    first, hedge = world.journal.of(ev.AttemptStarted)
    assert (hedge.endpoint, hedge.kind, hedge.cause, hedge.hedge_of) == (
        "west",
        "hedge",
        "hedge",
        first.attempt_id,
    )
    finished = {f.attempt_id: f for f in world.journal.of(ev.AttemptFinished)}
    assert finished[first.attempt_id].error_code == ev.HEDGE_LOST
    assert finished[first.attempt_id].evidence == ev.Evidence.UNKNOWN
    assert finished[hedge.attempt_id].status == "succeeded"
    (held,) = world.journal.of(ev.UnknownUsageOpened)
    assert (held.attempt_id, held.cause) == (first.attempt_id, ev.HEDGE_LOST)
    assert world.journal.of(ev.FailoverDecided) == []


async def test_a_hedge_that_loses_the_race_is_cancelled_and_its_usage_held() -> None:
    world = World(config(HEDGED))
    east_answers, west_answers = asyncio.Event(), asyncio.Event()
    world.drivers["east"].then(answer("from east", gate=east_answers))
    world.drivers["west"].then(answer("from west", gate=west_answers))
    task = asyncio.create_task(world.executor().complete())
    await world.clock.armed.wait()
    world.clock.fire()
    await world.drivers["west"].called.wait()  # the hedge is on its way
    east_answers.set()
    completion = await task

    assert (completion.endpoint, completion.attempts) == ("east", 2)
    first, hedge = world.journal.of(ev.AttemptStarted)
    finished = {f.attempt_id: f for f in world.journal.of(ev.AttemptFinished)}
    assert finished[first.attempt_id].status == "succeeded"
    assert finished[hedge.attempt_id].error_code == ev.HEDGE_LOST
    (held,) = world.journal.of(ev.UnknownUsageOpened)
    assert held.attempt_id == hedge.attempt_id
    assert world.journal.types()[-1] == "RequestCompleted"


async def test_a_committed_stream_that_breaks_is_resumed_on_a_sibling_mapping() -> None:
    world = World(config(west_resume="assistant_prefill"))
    world.drivers["east"].then(stream("Hello", " from", " east", cut_after=2))
    world.drivers["west"].then(stream(" there", "!"))
    started = await world.executor(stream=True).stream()
    assert (started.endpoint, started.attempts) == ("east", 1)
    assert world.journal.types()[-1] == "StreamCommitted", "durable before the first byte"
    chunks = _chunks(b"".join([piece async for piece in started.body]))

    assert _text(chunks) == "Hello from there!"
    assert {chunk["id"] for chunk in chunks} == {"chatcmpl-east"}, "one stream, one id"
    assert [c["choices"][0]["delta"].get("role") for c in chunks].count("assistant") == 1
    continued = world.drivers["west"].sent[0]
    assert continued.body["messages"][-1] == {"role": "assistant", "content": "Hello from"}
    first, resume = world.journal.of(ev.AttemptStarted)
    assert (resume.endpoint, resume.kind, resume.cause) == ("west", "resume", "failover")
    assert (resume.resumed_from, resume.delivered_chars) == (first.attempt_id, 10)
    (decided,) = world.journal.of(ev.FailoverDecided)
    assert (decided.action, decided.reason) == ("resume", "resume_same_model")
    broken, answered = world.journal.of(ev.AttemptFinished)
    assert (broken.status, broken.stream_committed, broken.failure_class) == (
        "failed",
        True,
        ev.FailureClass.NETWORK_ERROR,
    )
    assert (answered.status, answered.stream_committed) == ("succeeded", True)
    (held,) = world.journal.of(ev.UnknownUsageOpened)
    assert (held.attempt_id, held.cause) == (first.attempt_id, "broken_stream")
    (completed,) = world.journal.of(ev.RequestCompleted)
    assert (completed.endpoint, completed.attempts) == ("west", 2)
    assert world.journal.types().count("StreamCommitted") == 1
    assert all(upstream.closed for d in world.drivers.values() for upstream in d.streams)


async def test_a_continuation_that_repeats_then_departs_is_recorded_as_unverified() -> None:
    # contract §5 "Resume": the seam cannot be verified, and the stream ends with its error.
    world = World(config(east_resume="assistant_prefill"))
    world.drivers["east"].then(
        stream("Hello", " from", " east", cut_after=2), stream("Hello fr", "ench")
    )
    started = await world.executor(stream=True).stream()
    body = b"".join([piece async for piece in started.body])

    last = orjson.loads(body.split(b"\n\n")[-2][len(b"data: ") :])
    assert last["error"]["code"] == "upstream_error"
    _, resume = world.journal.of(ev.AttemptFinished)
    assert (resume.error_code, resume.failure_class) == (
        "resume_seam_unverified",
        ev.FailureClass.UPSTREAM_UNAVAILABLE,
    )
    assert world.breakers.failures == [(EAST, ev.FailureClass.NETWORK_ERROR)], "not the seam"


async def test_a_broken_stream_no_mapping_can_continue_ends_with_its_error_event() -> None:
    world = World(config())  # no mapping can resume
    world.drivers["east"].then(stream("Hello", " from", " east", cut_after=2))
    started = await world.executor(stream=True).stream()
    body = b"".join([piece async for piece in started.body])

    last = orjson.loads(body.split(b"\n\n")[-2][len(b"data: ") :])
    assert (last["error"]["code"], last["error"]["request_id"]) == ("upstream_error", "req-1")
    assert _text([orjson.loads(f[6:]) for f in body.split(b"\n\n")[:-2]]) == "Hello from"
    assert world.drivers["west"].sent == []
    (failed,) = world.journal.of(ev.RequestFailed)
    assert (failed.endpoint, failed.stream_started, failed.error_code) == (
        "east",
        True,
        "upstream_error",
    )


async def test_a_client_that_goes_away_mid_attempt_is_recorded_as_canceled() -> None:
    world = World(config())
    world.drivers["east"].then(answer(gate=asyncio.Event()))  # never answers
    task = asyncio.create_task(world.executor().complete())
    await world.drivers["east"].called.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await world.kept.drain()

    assert world.journal.types()[4:] == [
        "AttemptFinished",
        "UnknownUsageOpened",
        "FailoverDecided",
        "RequestFailed",
    ]
    (finished,) = world.journal.of(ev.AttemptFinished)
    assert (finished.failure_class, finished.evidence) == (
        ev.FailureClass.CLIENT_CANCELED,
        ev.Evidence.UNKNOWN,
    )
    (decided,) = world.journal.of(ev.FailoverDecided)
    assert (decided.action, decided.reason) == ("stop", "client_canceled")
    (failed,) = world.journal.of(ev.RequestFailed)
    assert (failed.error_code, failed.attempts) == ("client_canceled", 1)
    assert world.breakers.failures == [] and world.breakers.successes == []


async def test_a_client_that_closes_a_committed_stream_leaves_a_partial_failure() -> None:
    world = World(config())
    world.drivers["east"].then(stream("Hello", " from", " east"))
    started = await world.executor(stream=True).stream()
    body = started.body
    first = await anext(body)
    assert _text(_chunks(first + b"data: [DONE]\n\n")) == "Hello"
    await body.aclose()
    await world.kept.drain()

    assert world.journal.types()[-2:] == ["FailoverDecided", "RequestFailed"]
    (failed,) = world.journal.of(ev.RequestFailed)
    assert (failed.error_code, failed.stream_started, failed.endpoint) == (
        "client_canceled",
        True,
        "east",
    )
    assert world.journal.of(ev.RequestCompleted) == []


async def test_the_ledger_unavailable_at_a_start_means_no_upstream_call() -> None:
    world = World(config())
    world.journal.refuse(ev.AttemptStarted, LedgerUnavailable("the database is down"))
    with pytest.raises(LedgerUnavailable):
        await world.executor().complete()
    await world.kept.drain()

    assert world.drivers["east"].sent == [], "never called for a start the ledger lacks"
    assert world.journal.types() == ["RequestReceived", "RouteEvaluated", "RequestFailed"]
    (failed,) = world.journal.of(ev.RequestFailed)
    assert (failed.error_code, failed.http_status, failed.attempts) == (
        "ledger_unavailable",
        503,
        0,
    )


async def test_a_failure_that_opens_its_own_breaker_fails_over_at_once_naming_it() -> None:
    # A 503 would be retried after a back-off, but it opened the endpoint's breaker: the
    # record must not say "retry" for an endpoint the next step cannot enter.
    world = World(config())
    world.breakers.opens.add(EAST)
    world.drivers["east"].then(fail(failure(503)))
    world.drivers["west"].then(answer("from west"))
    completion = await world.executor().complete()

    assert completion.endpoint == "west"
    (decided,) = world.journal.of(ev.FailoverDecided)
    assert (decided.action, decided.reason) == ("failover", "endpoint_breaker_opened")
    assert world.clock.sleeps == [], "no back-off before a failover"
    assert [s.endpoint for s in world.journal.of(ev.AttemptStarted)] == ["east", "west"]


async def test_a_retry_its_breaker_refuses_records_the_changed_plan_before_failing_over() -> None:
    world = World(config())
    world.drivers["east"].then(fail(failure(503)))
    world.drivers["west"].then(answer("from west"))
    executor = world.executor()
    # The first admission is allowed; the retry's is refused (another request took the
    # endpoint's probe meanwhile).
    admits = 0
    admit = world.breakers.admit

    async def refuse_the_retry(key: BreakerKey, request_id: str) -> Any:
        nonlocal admits
        admits += key == EAST
        if key == EAST and admits == 2:
            world.breakers.deny.add(EAST)
        return await admit(key, request_id)

    world.breakers.admit = refuse_the_retry  # type: ignore[method-assign]
    completion = await executor.complete()

    assert completion.endpoint == "west"
    retry, refused = world.journal.of(ev.FailoverDecided)
    assert (retry.action, retry.reason) == ("retry", "retry_with_backoff")
    assert (refused.action, refused.reason) == ("failover", "retry_refused_breaker_open")
    assert refused.after_attempt_id == retry.after_attempt_id
    assert [s.endpoint for s in world.journal.of(ev.AttemptStarted)] == ["east", "west"]


async def test_a_probe_that_ends_in_a_class_no_breaker_counts_gives_its_lease_back() -> None:
    # The client's own 400 says nothing of the endpoint's health: the half-open breakers'
    # probes go back at once instead of blocking every tenant until their lease runs out.
    world = World(config())
    world.breakers.probe |= {EAST, EAST_M}
    world.drivers["east"].then(fail(failure(400, error_message="Invalid schema for function f")))
    with pytest.raises(GatewayError):
        await world.executor().complete()

    (started,) = world.journal.of(ev.AttemptStarted)
    assert started.admitted_as == "probe:endpoint+mapping"
    assert world.breakers.failures == []
    assert world.breakers.released == [EAST, EAST_M]


async def test_a_probe_judged_on_one_scope_gives_back_the_other() -> None:
    world = World(config())
    world.breakers.probe |= {EAST, EAST_M}
    world.drivers["east"].then(fail(failure(transport="connect_error")))
    world.drivers["west"].then(answer())
    await world.executor().complete()

    assert world.breakers.failures == [(EAST, ev.FailureClass.NETWORK_ERROR)]
    assert world.breakers.released == [EAST_M]


async def test_a_stream_whose_completion_the_ledger_cannot_take_ends_with_its_error() -> None:
    # contract §7 "Durability of answers": [DONE] only after the completion is recorded.
    world = World(config())
    world.drivers["east"].then(stream("Hello", " from", " east"))
    world.journal.refuse(ev.RequestCompleted, LedgerUnavailable("the database is down"))
    started = await world.executor(stream=True).stream()
    body = b"".join([piece async for piece in started.body])  # raises nothing
    await world.kept.drain()

    frames = [frame for frame in body.split(b"\n\n") if frame]
    assert b"data: [DONE]" not in frames
    last = orjson.loads(frames[-1][len(b"data: ") :])
    assert (last["error"]["code"], last["error"]["request_id"]) == ("ledger_unavailable", "req-1")
    assert world.journal.of(ev.RequestCompleted) == []
    (failed,) = world.journal.of(ev.RequestFailed)
    assert (failed.error_code, failed.stream_started, failed.endpoint) == (
        "ledger_unavailable",
        True,
        "east",
    )
