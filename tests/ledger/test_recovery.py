"""Crash recovery: what it records for an abandoned hold (pure), and whose holds each rule
takes (on SQLite and PostgreSQL): a gateway's own earlier incarnations at once, anyone
else's only after six missed heartbeats."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import sqlalchemy as sa

from ledger import events as ev
from ledger.audit.verify import verify_chain
from ledger.books.accounting import AccountSpec, Hold, Reserve
from ledger.books.balances import holds
from ledger.books.recovery import (
    check_instance_id,
    heartbeat,
    incarnation_owner,
    recover_abandoned_holds,
    recover_earlier_incarnations,
    recovery_events,
    register_instance,
    stop_instance,
)
from ledger.store import NO_STREAM, EventStore
from ledger.store.schema import budget_open_holds, gateway_instances
from tests.ledger.factories import received

D = Decimal
SPEC = AccountSpec("workspace:acme:total", "workspace", "acme", None, None, D("10"))


def _hold(request_id: str, attempt: int = 1, owner: str = "gw-a/inc_1") -> Hold:
    return Hold(
        reservation_id=f"res_{request_id}_{attempt}",
        request_id=request_id,
        attempt_id=f"att_{request_id}_{attempt}",
        workspace="acme",
        key_id="k_1",
        endpoint="west" if attempt > 1 else "east",
        model="m",
        amount_usd=D("0.0040"),
        accounts=(SPEC.account_id,),
        owner=owner,
    )


def _reserved(hold: Hold) -> ev.BudgetReserved:
    return ev.BudgetReserved(
        request_id=hold.request_id,
        attempt_id=hold.attempt_id,
        reservation_id=hold.reservation_id,
        amount_usd=hold.amount_usd,
        accounts=(ev.AccountRef(account_id=SPEC.account_id, kind="workspace", limit_usd=D(10)),),
        endpoint=hold.endpoint,
        model=hold.model,
    )


def _started(hold: Hold, number: int) -> ev.AttemptStarted:
    return ev.AttemptStarted(
        request_id=hold.request_id,
        attempt_id=hold.attempt_id,
        attempt_number=number,
        cause="first" if number == 1 else "failover",
        endpoint=hold.endpoint,
        driver="openai",
        model=hold.model,
        tier=number - 1,
        weight=1,
        reservation_id=hold.reservation_id,
        stream=True,
    )


def _failed_over(hold: Hold) -> list[ev.Event]:
    """A first attempt that failed before starting, its hold released."""
    return [
        _reserved(hold),
        _started(hold, 1),
        ev.AttemptFinished(
            request_id=hold.request_id,
            attempt_id=hold.attempt_id,
            status="failed",
            failure_class=ev.FailureClass.RATE_LIMITED,
            evidence=ev.Evidence.NOT_STARTED,
            http_status=429,
            duration_ms=3,
        ),
        ev.BudgetReleased(
            request_id=hold.request_id,
            attempt_id=hold.attempt_id,
            reservation_id=hold.reservation_id,
            released_usd=hold.amount_usd,
            reason="not_started",
        ),
    ]


def _committed(hold: Hold) -> ev.StreamCommitted:
    return ev.StreamCommitted(
        request_id=hold.request_id,
        attempt_id=hold.attempt_id,
        endpoint=hold.endpoint,
        time_to_first_chunk_ms=42,
    )


# --- what is recorded (pure) ---


def test_a_stream_the_ledger_shows_committed_is_recovered_as_a_partial_failure() -> None:
    first, second = _hold("r1", 1), _hold("r1", 2)
    trail = [
        received("r1"),
        *_failed_over(first),
        _reserved(second),
        _started(second, 2),
        _committed(second),
    ]
    finished, opened, failed = recovery_events(second, trail)
    assert isinstance(finished, ev.AttemptFinished)
    assert (finished.attempt_id, finished.status, finished.error_code) == (
        second.attempt_id,
        "failed",
        "gateway_lost",
    )
    assert finished.stream_committed is True
    assert finished.evidence is ev.Evidence.STARTED
    assert finished.time_to_first_chunk_ms == 42
    assert isinstance(opened, ev.UnknownUsageOpened)
    assert (opened.cause, opened.held_usd, opened.reservation_id) == (
        "crash_recovery",
        D("0.0040"),
        second.reservation_id,
    )
    assert isinstance(failed, ev.RequestFailed)
    assert failed == ev.RequestFailed(
        request_id="r1",
        http_status=200,  # the client had its headers and content
        error_code="gateway_lost",
        error_type="api_error",
        message=failed.message,
        attempts=2,
        endpoint="west",
        stream_started=True,
        duration_ms=0,
    )


def test_a_request_that_got_nothing_is_recovered_as_failed_with_its_attempts() -> None:
    first, second = _hold("r2", 1), _hold("r2", 2)
    trail = [received("r2"), *_failed_over(first), _reserved(second), _started(second, 2)]
    finished, opened, failed = recovery_events(second, trail)
    assert isinstance(finished, ev.AttemptFinished) and isinstance(failed, ev.RequestFailed)
    assert finished.stream_committed is False and finished.evidence is ev.Evidence.UNKNOWN
    assert isinstance(opened, ev.UnknownUsageOpened) and opened.cause == "crash_recovery"
    assert (failed.http_status, failed.error_code, failed.attempts) == (500, "gateway_lost", 2)
    assert failed.stream_started is False and failed.endpoint is None


def test_an_earlier_attempts_commit_does_not_make_this_one_committed() -> None:
    first, second = _hold("r3", 1), _hold("r3", 2)
    trail = [received("r3"), _committed(first), _reserved(second), _started(second, 2)]
    finished, _, failed = recovery_events(second, trail)
    assert isinstance(finished, ev.AttemptFinished) and isinstance(failed, ev.RequestFailed)
    assert finished.stream_committed is False and failed.stream_started is False


def test_a_resume_in_flight_is_recovered_as_a_partial_failure_of_the_stream() -> None:
    first, second = _hold("r5", 1), _hold("r5", 2)
    broken = ev.AttemptFinished(
        request_id="r5",
        attempt_id=first.attempt_id,
        status="failed",
        failure_class=ev.FailureClass.NETWORK_ERROR,
        evidence=ev.Evidence.UNKNOWN,
        duration_ms=40,
        stream_committed=True,
    )
    resume = _started(second, 2).model_copy(
        update={"kind": "resume", "resumed_from": first.attempt_id, "delivered_chars": 12}
    )
    trail = [received("r5"), _reserved(first), _started(first, 1), _committed(first), broken]
    finished, _, failed = recovery_events(second, [*trail, _reserved(second), resume])
    assert isinstance(finished, ev.AttemptFinished) and isinstance(failed, ev.RequestFailed)
    assert finished.stream_committed is True and finished.time_to_first_chunk_ms is None
    assert (failed.http_status, failed.stream_started, failed.endpoint) == (200, True, "west")


def test_a_request_that_has_ended_gets_no_second_end() -> None:
    hold = _hold("r4")
    ended = ev.RequestFailed(
        request_id="r4",
        http_status=503,
        error_code="ledger_unavailable",
        error_type="api_error",
        message="the ledger is unavailable",
        attempts=1,
        duration_ms=5,
    )
    finished = ev.AttemptFinished(
        request_id="r4",
        attempt_id=hold.attempt_id,
        status="failed",
        evidence=ev.Evidence.UNKNOWN,
        duration_ms=4,
    )
    trail = [received("r4"), _reserved(hold), _started(hold, 1), finished, ended]
    assert [e.type for e in recovery_events(hold, trail)] == ["UnknownUsageOpened"]


def test_an_instance_id_never_holds_a_slash_and_fits_an_owner() -> None:
    assert check_instance_id("web-1@127.0.0.1:8080") == "web-1@127.0.0.1:8080"
    assert check_instance_id("gw@[::1]:8080") == "gw@[::1]:8080"
    for bad in ("", "a/b", "x" * 65, "-leading", "sp ace", "per%cent"):
        with pytest.raises(ValueError):
            check_instance_id(bad)
    owner = incarnation_owner("x" * 64, "inc_" + "0" * 28)
    assert len(owner) <= budget_open_holds.c.owner.type.length  # type: ignore[attr-defined]
    assert len(owner) <= gateway_instances.c.instance_id.type.length  # type: ignore[attr-defined]


# --- whose holds each rule takes (both backends) ---


async def _in_flight(store: EventStore, request_id: str, owner: str) -> Hold:
    hold = _hold(request_id, owner=owner)
    await store.append(
        f"request-{request_id}",
        NO_STREAM,
        [received(request_id), _reserved(hold), _started(hold, 1)],
        effects=[Reserve(hold, (SPEC,))],
    )
    return hold


async def _states(store: EventStore) -> dict[str, str]:
    async with store.engine.connect() as conn:
        rows = await conn.execute(holds())
        return {row.request_id: row.state for row in rows}


async def test_a_restart_takes_its_own_earlier_runs_holds_at_once_and_no_one_elses(
    store: EventStore,
) -> None:
    # Every owner has just heartbeated: only the instance id says who is dead. "gwxa" would
    # match "gw_a" as a LIKE pattern; it is another instance all the same.
    for owner in ("gw_a/inc_1", "gwxa/inc_1", "gw_a:8080/inc_1", "gw_a/inc_2"):
        await register_instance(store.engine, owner)
        await _in_flight(store, f"req_{owner}", owner)
    recovered = await recover_earlier_incarnations(store, "gw_a", "gw_a/inc_2")
    assert recovered == 1
    assert await _states(store) == {
        "req_gw_a/inc_1": "unknown",
        "req_gwxa/inc_1": "held",
        "req_gw_a:8080/inc_1": "held",
        "req_gw_a/inc_2": "held",  # this run's own
    }
    trail = await store.read_stream("request-req_gw_a/inc_1")
    assert [r.type for r in trail[-3:]] == [
        "AttemptFinished",
        "UnknownUsageOpened",
        "RequestFailed",
    ]
    assert trail[-1].metadata["owner"] == "gw_a/inc_1"
    async with store.engine.connect() as conn:
        stopped = {
            row.instance_id
            for row in await conn.execute(
                sa.select(gateway_instances.c.instance_id).where(
                    gateway_instances.c.stopped_at.is_not(None)
                )
            )
        }
    assert stopped == {"gw_a/inc_1"}  # its successor is running now
    assert await recover_earlier_incarnations(store, "gw_a", "gw_a/inc_2") == 0  # once
    assert (await verify_chain(store)).ok


async def test_another_instances_holds_wait_for_six_missed_heartbeats(store: EventStore) -> None:
    await register_instance(store.engine, "gw-b/inc_1")
    await _in_flight(store, "req_b", "gw-b/inc_1")
    await register_instance(store.engine, "gw-c/inc_1")
    await _in_flight(store, "req_c", "gw-c/inc_1")
    await heartbeat(store.engine, "gw-b/inc_1")
    assert await recover_abandoned_holds(store, stale_after_s=30) == 0
    assert await _states(store) == {"req_b": "held", "req_c": "held"}
    await stop_instance(store.engine, "gw-c/inc_1")  # stopped: its holds are taken at once
    assert await recover_abandoned_holds(store, stale_after_s=30) == 1
    assert await _states(store) == {"req_b": "held", "req_c": "unknown"}
    silent_since = datetime.now(UTC) - timedelta(seconds=31)
    async with store.engine.begin() as conn:
        await conn.execute(
            sa.update(gateway_instances)
            .where(gateway_instances.c.instance_id == "gw-b/inc_1")
            .values(heartbeat_at=silent_since)
        )
    assert await recover_abandoned_holds(store, stale_after_s=30) == 1
    assert await _states(store) == {"req_b": "unknown", "req_c": "unknown"}
