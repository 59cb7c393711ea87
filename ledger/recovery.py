"""Crash recovery (SPEC §7): holds whose gateway died mid-attempt become unknown-usage
settlements, never silently released.

Every gateway process registers itself in ``gateway_instances`` and heartbeats. A hold
still ``held`` whose owner stopped, or stopped heartbeating, belongs to an attempt that was
started and never finished: the upstream may have done (and billed) the work, so the hold
stays counted as unknown usage until a reconciliation or an operator settles it. Any live
gateway may do this for any dead one; the books accept the change only once.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

import orjson
from sqlalchemy import and_, insert, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from ledger import events as ev
from ledger.accounting import HoldStateError, HoldUnknown, settlement_id
from ledger.schema import budget_holds, gateway_instances
from ledger.store import ANY_VERSION, EventStore

__all__ = ["heartbeat", "recover_abandoned_holds", "register_instance", "stop_instance"]

_log = logging.getLogger("waybill.recovery")


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


async def recover_abandoned_holds(store: EventStore, *, stale_after_s: float) -> int:
    """Turn the held holds of dead gateways into unknown-usage settlements; how many."""
    cutoff = datetime.now(UTC) - timedelta(seconds=stale_after_s)
    alive = select(gateway_instances.c.instance_id).where(
        and_(gateway_instances.c.stopped_at.is_(None), gateway_instances.c.heartbeat_at > cutoff)
    )
    async with store.engine.connect() as conn:
        rows = (
            await conn.execute(
                select(budget_holds).where(
                    budget_holds.c.state == "held",
                    budget_holds.c.owner.not_in(alive),
                )
            )
        ).all()
    recovered = 0
    for row in rows:
        attempt_id, reservation_id = row.attempt_id, row.reservation_id
        recovery: list[ev.Event] = [
            ev.AttemptFinished(
                request_id=row.request_id,
                attempt_id=attempt_id,
                status="failed",
                evidence=ev.Evidence.UNKNOWN,
                error_code="gateway_lost",
                duration_ms=0,
            ),
            ev.UnknownUsageOpened(
                settlement_id=settlement_id(attempt_id),
                request_id=row.request_id,
                attempt_id=attempt_id,
                reservation_id=reservation_id,
                workspace=row.workspace,
                key_id=row.key_id,
                endpoint=row.endpoint,
                model=row.model,
                held_usd=row.amount_usd,
                cause="crash_recovery",
            ),
            ev.RequestFailed(
                request_id=row.request_id,
                http_status=500,
                error_code="gateway_lost",
                error_type="api_error",
                message="the gateway stopped while this request was in flight",
                attempts=0,
                endpoint=row.endpoint,
                duration_ms=0,
            ),
        ]
        try:
            await store.append(
                f"request-{row.request_id}",
                ANY_VERSION,
                recovery,
                metadata={"recovered_by": "crash_recovery", "accounts": orjson.loads(row.accounts)},
                effects=[HoldUnknown(reservation_id)],
            )
        except HoldStateError:
            continue  # another gateway recovered it first, or it finished meanwhile
        recovered += 1
        _log.warning("recovered abandoned hold %s of request %s", reservation_id, row.request_id)
    return recovered
