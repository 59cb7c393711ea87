"""Crash recovery (contract §7): holds whose gateway died mid-attempt become unknown-usage
settlements, never silently released, and their requests get the end the client saw.

A gateway has an instance id that survives its restarts (``waybill serve --instance-id``;
by default its host name, the address it binds and its port). Each run of it is a new
incarnation, registered in ``gateway_instances`` as ``<instance id>/<incarnation>``, which
is also the ``owner`` of every hold it takes; it heartbeats while it runs.

A hold still ``held`` belongs to an attempt that was started and never finished: the
upstream may have done (and billed) the work, so the hold stays counted as unknown usage
until a reconciliation or an operator settles it. Two rules find the dead owners:

- at start-up, before it serves, a gateway takes the holds of its own instance id's earlier
  incarnations, whatever their heartbeat: it is their successor, so they are dead (two live
  processes must never share an instance id);
- any live gateway takes the holds of an owner that stopped, or that has not heartbeated
  for six beats.

The books accept a hold's change only once, so gateways racing for the same hold are safe.
What recovery records for a request is :func:`recovery_events`, from the request's own
stream: a stream the ledger shows committed to the client (``StreamCommitted``) ends as a
partial failure with the 200 the client saw; a request that got nothing as a 500
``gateway_lost``; both with the number of attempts the ledger shows started.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from sqlalchemy import and_, insert, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from ledger import events as ev
from ledger.books.accounting import Hold, HoldStateError, HoldUnknown, settlement_id
from ledger.books.balances import hold_of, holds
from ledger.store import EventStore, WrongExpectedVersion
from ledger.store.schema import budget_open_holds, gateway_instances

__all__ = [
    "GATEWAY_LOST",
    "MAX_INSTANCE_ID",
    "check_instance_id",
    "heartbeat",
    "incarnation_owner",
    "recover_abandoned_holds",
    "recover_earlier_incarnations",
    "recovery_events",
    "register_instance",
    "stop_instance",
]

_log = logging.getLogger("waybill.recovery")

GATEWAY_LOST: Final = "gateway_lost"
"""The error code of a request whose gateway died before it ended."""

MAX_INSTANCE_ID: Final = 64
"""Room for ``/<incarnation>`` in the 100 characters of an owner."""

_INSTANCE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@\[\]-]*")


def check_instance_id(instance_id: str) -> str:
    """``instance_id`` if it can name a gateway instance, else ValueError saying why.

    No ``/``: it separates the instance id from the incarnation in an owner, and a prefix
    of owners must name exactly one instance."""
    if not 1 <= len(instance_id) <= MAX_INSTANCE_ID:
        raise ValueError(f"an instance id is 1 to {MAX_INSTANCE_ID} characters long")
    if not _INSTANCE_ID.fullmatch(instance_id):
        raise ValueError(
            f"instance id {instance_id!r}: letters, digits and . _ : @ [ ] - only, "
            "starting with a letter or a digit"
        )
    return instance_id


def incarnation_owner(instance_id: str, incarnation: str) -> str:
    """The owner of the holds an incarnation takes, and its row in ``gateway_instances``."""
    return f"{check_instance_id(instance_id)}/{incarnation}"


# --- the registry of incarnations ---


async def register_instance(engine: AsyncEngine, owner: str) -> None:
    now = datetime.now(UTC)
    async with engine.begin() as conn:
        await conn.execute(
            insert(gateway_instances).values(
                instance_id=owner, started_at=now, heartbeat_at=now, stopped_at=None
            )
        )


async def heartbeat(engine: AsyncEngine, owner: str) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            update(gateway_instances)
            .where(gateway_instances.c.instance_id == owner)
            .values(heartbeat_at=datetime.now(UTC))
        )


async def stop_instance(engine: AsyncEngine, owner: str) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            update(gateway_instances)
            .where(gateway_instances.c.instance_id == owner)
            .values(stopped_at=datetime.now(UTC))
        )


# --- the two rules ---


async def recover_earlier_incarnations(store: EventStore, instance_id: str, owner: str) -> int:
    """At start-up: the held holds of ``instance_id``'s incarnations other than ``owner``
    (this one) become unknown-usage settlements, whatever their heartbeat; how many.
    Those incarnations are marked stopped: this one is their successor."""
    earlier = and_(
        gateway_instances.c.instance_id.startswith(f"{instance_id}/", autoescape=True),
        gateway_instances.c.instance_id != owner,
        gateway_instances.c.stopped_at.is_(None),
    )
    async with store.engine.begin() as conn:
        await conn.execute(
            update(gateway_instances).where(earlier).values(stopped_at=datetime.now(UTC))
        )
    held = and_(
        budget_open_holds.c.state == "held",
        budget_open_holds.c.owner.startswith(f"{instance_id}/", autoescape=True),
        budget_open_holds.c.owner != owner,
    )
    return await _recover(store, held)


async def recover_abandoned_holds(store: EventStore, *, stale_after_s: float) -> int:
    """The held holds of owners that stopped, or that have not heartbeated for
    ``stale_after_s``, become unknown-usage settlements; how many."""
    cutoff = datetime.now(UTC) - timedelta(seconds=stale_after_s)
    alive = select(gateway_instances.c.instance_id).where(
        and_(gateway_instances.c.stopped_at.is_(None), gateway_instances.c.heartbeat_at > cutoff)
    )
    return await _recover(
        store,
        and_(budget_open_holds.c.state == "held", budget_open_holds.c.owner.not_in(alive)),
    )


async def _recover(store: EventStore, which: Any) -> int:
    async with store.engine.connect() as conn:
        found = [hold_of(row) for row in (await conn.execute(holds().where(which)))]
    recovered = 0
    for hold in found:
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

_READ: Final = ev.type_names(
    ev.AttemptStarted,
    ev.StreamCommitted,
    ev.AttemptFinished,
    ev.RequestCompleted,
    ev.RequestFailed,
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
    # The client has the stream once any attempt committed it; the attempt that did, or a
    # resume continuing it, was writing to the client when the gateway stopped.
    stream = next((event for event in trail if isinstance(event, ev.StreamCommitted)), None)
    resumed = any(
        isinstance(event, ev.AttemptStarted)
        and event.attempt_id == hold.attempt_id
        and event.kind == "resume"
        for event in trail
    )
    committed = (
        stream if stream is not None and (stream.attempt_id == hold.attempt_id or resumed) else None
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
                time_to_first_chunk_ms=committed.time_to_first_chunk_ms
                if committed and committed.attempt_id == hold.attempt_id
                else None,
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
                endpoint=hold.endpoint,
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
