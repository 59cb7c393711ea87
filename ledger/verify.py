"""Hash-chain verification: re-derive every event's hash and compare it with what is stored.

The chain catches what the immutability triggers cannot: an edit made with the triggers
disabled, by a superuser, or on SQLite by hand. A row's queryable columns are also checked
against the hashed bytes, so editing ``data`` alone is caught as well as editing ``payload``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
from sqlalchemy import func, insert, select
from sqlalchemy.ext.asyncio import AsyncEngine

from ledger.schema import events, ledger_head, ledger_verifications
from ledger.store import GENESIS_HASH, EventStore, chain_hash

__all__ = [
    "RecordedVerification",
    "VerifyResult",
    "last_verification",
    "record_verification",
    "verify_chain",
]

_PAGE = 5000


@dataclass(frozen=True, slots=True)
class VerifyResult:
    ok: bool
    checked: int
    head_position: int
    first_bad_position: int | None = None
    problem: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "checked": self.checked,
            "head_position": self.head_position,
            "first_bad_position": self.first_bad_position,
            "problem": self.problem,
        }


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _row_problem(row: Any, expected_position: int, previous: str) -> str | None:
    if row.position != expected_position:
        return f"position {expected_position} is missing (next stored is {row.position})"
    if chain_hash(previous, row.position, row.payload) != row.hash:
        return "hash does not match the previous hash, position and stored bytes"
    try:
        body = orjson.loads(row.payload)
    except orjson.JSONDecodeError:
        return "stored bytes are not JSON"
    columns = {
        "stream_id": row.stream_id,
        "version": row.version,
        "type": row.type,
        "schema_version": row.schema_version,
        "data": row.data,
        "metadata": row.metadata,
    }
    for name, value in columns.items():
        if body.get(name) != value:
            return f"column {name!r} differs from the hashed bytes"
    if _utc(datetime.fromisoformat(body["recorded_at"])) != _utc(row.recorded_at):
        return "column 'recorded_at' differs from the hashed bytes"
    return None


async def verify_chain(
    store: EventStore,
    progress: Callable[[int, int], None] | None = None,
    *,
    observe: Callable[[int, bytes, str], None] | None = None,
) -> VerifyResult:
    """Walk the whole chain; stop at the first bad event and name its position.
    ``observe`` is told each good event's position, stored bytes and hash, in order (the
    checkpoint audit recomputes the Merkle tree in this same pass)."""
    async with store.engine.connect() as conn:
        head = (await conn.execute(select(ledger_head.c.position, ledger_head.c.hash))).one()
        total = int((await conn.execute(select(func.count()).select_from(events))).scalar_one())
    head_position = int(head.position)
    previous, expected, checked = GENESIS_HASH, 1, 0
    while True:
        async with store.engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(events)
                    .where(events.c.position >= expected)
                    .order_by(events.c.position)
                    .limit(_PAGE)
                )
            ).all()
        for row in rows:
            problem = _row_problem(row, expected, previous)
            if problem is not None:
                return VerifyResult(False, checked, head_position, expected, problem)
            if observe is not None:
                observe(row.position, row.payload, row.hash)
            previous, expected, checked = row.hash, expected + 1, checked + 1
        if progress is not None:
            progress(checked, total)
        if len(rows) < _PAGE:
            break
    last = expected - 1
    if last != head_position or previous != head.hash:
        bad = min(last, head_position) + 1 if last != head_position else last
        return VerifyResult(
            False,
            checked,
            head_position,
            bad,
            f"ledger head says position {head_position}, chain ends at {last}",
        )
    return VerifyResult(True, checked, head_position)


@dataclass(frozen=True, slots=True)
class RecordedVerification:
    """One recorded run of the check: when, by whom (``cli`` or an API key's id), and what
    it found. ``books_ok`` / ``checkpoints_ok``: None where the run did not check them."""

    verified_at: datetime
    verified_by: str
    result: VerifyResult
    books_ok: bool | None = None
    checkpoints_ok: bool | None = None

    @property
    def ok(self) -> bool:
        return self.result.ok and self.books_ok is not False and self.checkpoints_ok is not False


async def record_verification(
    engine: AsyncEngine,
    result: VerifyResult,
    *,
    verified_by: str,
    books_ok: bool | None = None,
    checkpoints_ok: bool | None = None,
) -> None:
    """Keep what a run of the check found (``ledger_verifications``, outside the chain)."""
    async with engine.begin() as conn:
        await conn.execute(
            insert(ledger_verifications).values(
                verified_at=datetime.now(UTC),
                verified_by=verified_by,
                ok=result.ok,
                checked=result.checked,
                head_position=result.head_position,
                first_bad_position=result.first_bad_position,
                problem=result.problem,
                books_ok=books_ok,
                checkpoints_ok=checkpoints_ok,
            )
        )


async def last_verification(engine: AsyncEngine) -> RecordedVerification | None:
    """The latest recorded run of the check, or None if none was ever recorded."""
    t = ledger_verifications
    async with engine.connect() as conn:
        row = (await conn.execute(select(t).order_by(t.c.id.desc()).limit(1))).first()
    if row is None:
        return None
    result = VerifyResult(
        bool(row.ok),
        int(row.checked),
        int(row.head_position),
        row.first_bad_position,
        row.problem,
    )
    return RecordedVerification(
        _utc(row.verified_at), row.verified_by, result, row.books_ok, row.checkpoints_ok
    )
