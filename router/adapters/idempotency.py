"""Idempotency-Key (contract §3): a retry with the same key and body gets the recorded answer
without a second upstream call; 409 while the first is in flight or for another body.

A record belongs to one API key (contract §9: keyed by workspace, API key and Idempotency-Key):
another API key sending the same Idempotency-Key makes an independent request, never a
replay of an answer it may not read (``GET /v1/requests/{id}`` is 404 to it) nor a 409 that
tells it someone else used that Idempotency-Key.

Records live in the database so that replicas sharing it agree. A key is claimed with one
insert (the primary key is the arbiter between racing replicas); a claim carries a lease so
that a process dying mid-request does not wedge its key forever; expired records are taken
over with a compare-and-set on the lease. Keys are stored only as SHA-256.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final

import orjson
from sqlalchemy import and_, delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from ledger.store.schema import idempotency_records
from router.errors import idempotency_conflict

__all__ = ["Claim", "IdempotencyStore", "RecordedAnswer"]

_TABLE: Final = idempotency_records


@dataclass(frozen=True, slots=True)
class RecordedAnswer:
    """The answer given the first time, to be given again."""

    request_id: str
    status_code: int
    content_type: str
    headers: dict[str, str]
    body: bytes


@dataclass(frozen=True, slots=True)
class Claim:
    """This request owns the key: record its answer with :meth:`IdempotencyStore.finish`."""

    workspace: str
    key_id: str
    key_sha256: str
    request_id: str


class IdempotencyStore:
    def __init__(self, engine: AsyncEngine, *, retention_s: float = 24 * 3600) -> None:
        self._engine = engine
        self._retention = timedelta(seconds=retention_s)

    async def claim(
        self,
        workspace: str,
        key_id: str,
        key: str,
        body_sha256: str,
        request_id: str,
        lease_s: float,
    ) -> Claim | RecordedAnswer:
        """Claim Idempotency-Key ``key`` of API key ``key_id`` for this request, or the answer
        recorded for that API key; 409 GatewayError otherwise."""
        digest = hashlib.sha256(key.encode()).hexdigest()
        now = datetime.now(UTC)
        lease_until = now + timedelta(seconds=lease_s)
        fresh = {
            "body_sha256": body_sha256,
            "request_id": request_id,
            "state": "in_flight",
            "status_code": None,
            "content_type": None,
            "headers": None,
            "body": None,
            "lease_until": lease_until,
            "expires_at": lease_until + self._retention,
        }
        try:
            async with self._engine.begin() as conn:
                await conn.execute(
                    _TABLE.insert().values(
                        workspace=workspace, key_id=key_id, key_sha256=digest, **fresh
                    )
                )
            return Claim(workspace, key_id, digest, request_id)
        except IntegrityError:
            pass  # someone holds or held this key: look at what they left
        where = and_(
            _TABLE.c.workspace == workspace,
            _TABLE.c.key_id == key_id,
            _TABLE.c.key_sha256 == digest,
        )
        async with self._engine.begin() as conn:
            row = (await conn.execute(select(_TABLE).where(where))).first()
            if row is None:  # deleted meanwhile (an abandoned claim): the caller may retry
                raise idempotency_conflict(
                    "the first request with this key is in flight", in_flight=True
                )
            expired = row.expires_at.replace(tzinfo=row.expires_at.tzinfo or UTC) <= now
            if not expired and row.body_sha256 != body_sha256:
                raise idempotency_conflict(
                    "this Idempotency-Key was used with a different request body", in_flight=False
                )
            if not expired and row.state == "done":
                return RecordedAnswer(
                    request_id=row.request_id,
                    status_code=row.status_code,
                    content_type=row.content_type,
                    headers=orjson.loads(row.headers or b"{}"),
                    body=row.body or b"",
                )
            lease = row.lease_until.replace(tzinfo=row.lease_until.tzinfo or UTC)
            if not expired and lease > now:
                raise idempotency_conflict(
                    "the first request with this key is still in flight", in_flight=True
                )
            # Expired, or its owner died mid-request: take it over, if nobody beat us to it.
            taken = await conn.execute(
                update(_TABLE).where(where, _TABLE.c.request_id == row.request_id).values(**fresh)
            )
            if taken.rowcount != 1:
                raise idempotency_conflict(
                    "the first request with this key is still in flight", in_flight=True
                )
        return Claim(workspace, key_id, digest, request_id)

    async def finish(self, claim: Claim, answer: RecordedAnswer) -> None:
        async with self._engine.begin() as conn:
            await conn.execute(
                update(_TABLE)
                .where(self._owned(claim))
                .values(
                    state="done",
                    status_code=answer.status_code,
                    content_type=answer.content_type,
                    headers=orjson.dumps(answer.headers).decode(),
                    body=answer.body,
                )
            )

    async def abandon(self, claim: Claim) -> None:
        """Forget a claim whose request never ran (e.g. refused for capacity)."""
        async with self._engine.begin() as conn:
            await conn.execute(delete(_TABLE).where(self._owned(claim)))

    @staticmethod
    def _owned(claim: Claim):  # type: ignore[no-untyped-def]
        return and_(
            _TABLE.c.workspace == claim.workspace,
            _TABLE.c.key_id == claim.key_id,
            _TABLE.c.key_sha256 == claim.key_sha256,
            _TABLE.c.request_id == claim.request_id,
        )
