"""Crash recovery (SPEC §7): holds whose gateway died mid-attempt become unknown-usage
settlements, never silently released, and their requests get the end the client saw.

Every gateway process registers itself in ``gateway_instances`` and heartbeats. A hold
still ``held`` whose owner stopped, or stopped heartbeating, belongs to an attempt that was
started and never finished: the upstream may have done (and billed) the work, so the hold
stays counted as unknown usage until a reconciliation or an operator settles it. Any live
gateway may do this for any dead one; the books accept the change only once.

What recovery records for a request is :func:`recovery_events`, from the request's own
stream: a stream the ledger shows committed to the client (``StreamCommitted``) ends as a
partial failure with the 200 the client saw; a request that got nothing as a 500
``gateway_lost``; both with the number of attempts the ledger shows started.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from sqlalchemy import and_, insert, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from ledger import events as ev
from ledger.accounting import Hold, HoldStateError, HoldUnknown, settlement_id
from ledger.books import hold_of
from ledger.schema import budget_holds, gateway_instances
from ledger.store import EventStore, WrongExpectedVersion

__all__ = [
    "GATEWAY_LOST",
    "heartbeat",
    "recover_abandoned_holds",
    "recovery_events",
    "register_instance",
    "stop_instance",
]

_log = logging.getLogger("waybill.recovery")

GATEWAY_LOST: Final = "gateway_lost"
"""The error code of a request whose gateway died before it ended."""

# --- the registry of gateways ---


async def register_instance(engine: AsyncEngine, instance_id: str) -> None:
    now = datetime.now(UTC)
    async with engine.begin() as conn:
        await conn.execute(
            insert(gateway_instances).values(
                instance_id=instance_id, started_at=now, heartbeat_at=now, stopped_at=None
            )
        )


async def heartbeat(engine: AsyncEngine, instance_id: str) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            update(gateway_instances)
            .where(gateway_instances.c.instance_id == instance_id)
            .values(heartbeat_at=datetime.now(UTC))
        )


async def stop_instance(engine: AsyncEngine, instance_id: str) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            update(gateway_instances)
            .where(gateway_instances.c.instance_id == instance_id)
            .values(stopped_at=datetime.now(UTC))
        )


# --- recovering ---


async def recover_abandoned_holds(store: EventStore, *, stale_after_s: float) -> int:
    """The held holds of owners that stopped, or that have not heartbeated for
    ``stale_after_s``, become unknown-usage settlements; how many."""
    cutoff = datetime.now(UTC) - timedelta(seconds=stale_after_s)
    alive = select(gateway_instances.c.instance_id).where(
        and_(gateway_instances.c.stopped_at.is_(None), gateway_instances.c.heartbeat_at > cutoff)
    )
    return await _recover(
        store, and_(budget_holds.c.state == "held", budget_holds.c.owner.not_in(alive))
    )


async def _recover(store: EventStore, which: Any) -> int:
    async with store.engine.connect() as conn:
        holds = [hold_of(row) for row in (await conn.execute(select(budget_holds).where(which)))]
    recovered = 0
    for hold in holds:
        stream_id = f"request-{hold.request_id}"
        trail = await store.read_stream(stream_id)
        read = [recorded.event() for recorded in trail if recorded.type in _READ]
        try:
            # At the version read: if the request's own gateway was still writing after
            # all, what it wrote wins and this hold is looked at again on the next round.
            await store.append(
                stream_id,
                trail[-1].version if trail else 0,
                recovery_events(hold, read),
                metadata={
                    "recovered_by": "crash_recovery",
                    "owner": hold.owner,
                    "accounts": list(hold.accounts),
                },
                effects=[HoldUnknown(hold.reservation_id)],
            )
        except (HoldStateError, WrongExpectedVersion):
            continue  # another gateway recovered it first, or it finished meanwhile
        recovered += 1
        _log.warning(
            "recovered the hold %s of request %s, left by %s",
            hold.reservation_id,
            hold.request_id,
            hold.owner,
        )
    return recovered


# --- what is recorded ---

_READ: Final = frozenset(
    cls.type
    for cls in (
        ev.AttemptStarted,
        ev.StreamCommitted,
        ev.AttemptFinished,
        ev.RequestCompleted,
        ev.RequestFailed,
    )
)
"""The events of a request that :func:`recovery_events` looks at (only they are decoded)."""


def recovery_events(hold: Hold, trail: Sequence[ev.Event]) -> list[ev.Event]:
    """What recovery records for an abandoned ``hold``, given its request's events so far.

    The attempt finishes failed with its usage unknown and its hold becomes an unknown-usage
    settlement (``crash_recovery``). Unless the request has already ended, it fails with
    what the client saw: a stream the ledger shows committed (``StreamCommitted``) had its
    200 and some content, and ends as a partial failure on its endpoint; any other request
    got no answer, recorded as a 500. ``attempts`` is the number of attempts the ledger
    shows started. Durations are unknown (0): nobody saw the gateway stop."""
    committed = next(
        (
            event
            for event in trail
            if isinstance(event, ev.StreamCommitted) and event.attempt_id == hold.attempt_id
        ),
        None,
    )
    finished = any(
        isinstance(event, ev.AttemptFinished) and event.attempt_id == hold.attempt_id
        for event in trail
    )
    ended = any(isinstance(event, ev.RequestCompleted | ev.RequestFailed) for event in trail)
    started = {event.attempt_id for event in trail if isinstance(event, ev.AttemptStarted)}
    recorded: list[ev.Event] = []
    if not finished:
        recorded.append(
            ev.AttemptFinished(
                request_id=hold.request_id,
                attempt_id=hold.attempt_id,
                status="failed",
                evidence=ev.Evidence.STARTED if committed else ev.Evidence.UNKNOWN,
                error_code=GATEWAY_LOST,
                duration_ms=0,
                time_to_first_chunk_ms=committed.time_to_first_chunk_ms if committed else None,
                stream_committed=committed is not None,
            )
        )
    recorded.append(
        ev.UnknownUsageOpened(
            settlement_id=settlement_id(hold.attempt_id),
            request_id=hold.request_id,
            attempt_id=hold.attempt_id,
            reservation_id=hold.reservation_id,
            workspace=hold.workspace,
            key_id=hold.key_id,
            endpoint=hold.endpoint,
            model=hold.model,
            held_usd=hold.amount_usd,
            cause="crash_recovery",
        )
    )
    if ended:
        return recorded
    if committed is not None:
        recorded.append(
            ev.RequestFailed(
                request_id=hold.request_id,
                http_status=200,
                error_code=GATEWAY_LOST,
                error_type="api_error",
                message="the gateway stopped while streaming this request: the stream was cut",
                attempts=len(started),
                endpoint=committed.endpoint,
                stream_started=True,
                duration_ms=0,
            )
        )
    else:
        recorded.append(
            ev.RequestFailed(
                request_id=hold.request_id,
                http_status=500,
                error_code=GATEWAY_LOST,
                error_type="api_error",
                message="the gateway stopped while this request was in flight: no answer",
                attempts=len(started),
                duration_ms=0,
            )
        )
    return recorded
