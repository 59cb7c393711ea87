"""Hash-chain verification: re-derive every event's hash and compare it with what is stored.

The chain catches what the immutability triggers cannot: an edit made with the triggers
disabled, by a superuser, or on SQLite by hand. A row's queryable columns (its stream, first
version, types and recorded time) are also checked against the hashed bytes of its events,
so editing a column alone is caught as well as editing the bytes. In the same pass, every
request's story is held to its decisions (:mod:`ledger.audit.stories`): a record that
contradicts itself fails the check as a changed one does.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy import func, insert, select
from sqlalchemy.ext.asyncio import AsyncEngine

from ledger.audit.stories import Stories, StoryBroken
from ledger.store import GENESIS_HASH, EventStore, chain_hash
from ledger.store.archived import ArchiveError, archived_segments, check_directory, read_segment
from ledger.store.schema import appends, ledger_head, ledger_verifications
from ledger.store.stored import payloads_of, types_of

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
    archived: int = 0  # positions 1 .. archived are in archive files (ledger.store.archived)
    archive_checked: bool = False  # and their files were checked as part of the chain
    stories_checked: int = 0  # requests whose story was held to its decisions
    broken_stories: tuple[StoryBroken, ...] = ()  # the first of those that contradict it

    def as_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "checked": self.checked,
            "head_position": self.head_position,
            "first_bad_position": self.first_bad_position,
            "problem": self.problem,
            "archived": self.archived,
            "archive_checked": self.archive_checked,
            "stories_checked": self.stories_checked,
            "broken_stories": [
                {
                    "request_id": b.request_id,
                    "position": b.position,
                    "rule": b.rule,
                    "detail": b.detail,
                }
                for b in self.broken_stories
            ],
        }


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _row_events(row: Any) -> tuple[list[bytes], list[str]] | str:
    """A row's events' stored bytes and types, or what is wrong with its form."""
    try:
        payloads = payloads_of(bytes(row.payloads))
        types = types_of(row.types)
    except (ValueError, zlib.error) as error:
        return f"stored bytes cannot be read: {error}"
    if len(payloads) != len(types):
        return "the row's events and types differ in number"
    return payloads, types


def _event_problem(row: Any, offset: int, payload: bytes, type_: str) -> str | dict[str, Any]:
    """What is wrong with a stored event, or its JSON body if nothing is."""
    try:
        body = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return "stored bytes are not JSON"
    columns = {"stream_id": row.stream_id, "version": row.version + offset, "type": type_}
    for name, value in columns.items():
        if body.get(name) != value:
            return f"column {name!r} differs from the hashed bytes"
    if _utc(datetime.fromisoformat(body["recorded_at"])) != _utc(row.recorded_at):
        return "column 'recorded_at' differs from the hashed bytes"
    return dict(body)


_STORIES_KEPT = 20  # broken stories a result names (the first ones, in ledger order)


async def verify_chain(
    store: EventStore,
    progress: Callable[[int, int], None] | None = None,
    *,
    observe: Callable[[int, bytes, str], None] | None = None,
    archive: Path | None = None,
) -> VerifyResult:
    """Walk the whole chain; stop at the first bad event and name its position.
    ``observe`` is told each good event's position, stored bytes and hash, in order (the
    checkpoint audit recomputes the Merkle tree in this same pass). Months archived
    (``ledger.store.archived``) are checked from their files in ``archive``, as the chain's start;
    without it the live ledger is checked from the last one's end hash."""
    async with store.engine.connect() as conn:
        head = (await conn.execute(select(ledger_head.c.position, ledger_head.c.hash))).one()
        total = int(
            (await conn.execute(select(func.sum(func.length(appends.c.types))))).scalar() or 0
        )
    head_position = int(head.position)
    segments = await archived_segments(store.engine)
    archived = segments[-1].last_position if segments else 0
    previous, expected, checked = GENESIS_HASH, 1, 0
    stories, broken_stories = Stories(), []
    if segments and archive is None:
        if observe is not None:
            needed = f"positions 1-{archived} are archived: give their directory (--archive)"
            return VerifyResult(False, 0, head_position, 1, needed, archived)
        previous, expected = segments[-1].end_hash, archived + 1
    elif segments and archive is not None:
        try:
            await asyncio.to_thread(check_directory, archive, segments)
        except ArchiveError as error:
            return VerifyResult(False, 0, head_position, 1, str(error), archived)
        for segment in segments:
            _, events = read_segment(archive / segment.file)
            for position, hash_, payload in events:
                if observe is not None:
                    observe(position, payload, hash_)
                body = orjson.loads(payload)
                broken_stories += stories.feed(position, body["stream_id"], body)
                checked += 1
        previous, expected = segments[-1].end_hash, archived + 1
    total += checked
    while True:
        async with store.engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(appends)
                    .where(appends.c.position >= expected)
                    .order_by(appends.c.position)
                    .limit(_PAGE)
                )
            ).all()
        for row in rows:
            if row.position != expected:
                missing = f"position {expected} is missing (next stored is {row.position})"
                return VerifyResult(False, checked, head_position, expected, missing, archived)
            stored = _row_events(row)
            if isinstance(stored, str):
                return VerifyResult(False, checked, head_position, expected, stored, archived)
            # A row keeps its last event's hash: the chain through its events must reach it.
            hashes, chained = [], previous
            for offset, payload in enumerate(stored[0]):
                chained = chain_hash(chained, expected + offset, payload)
                hashes.append(chained)
            if chained != bytes(row.hash).hex():
                last = expected + len(hashes) - 1
                broken = (
                    f"hash does not match the previous hash, positions and stored bytes of the "
                    f"append at positions {expected}-{last}"
                )
                return VerifyResult(False, checked, head_position, expected, broken, archived)
            for offset, (payload, type_) in enumerate(zip(*stored, strict=True)):
                problem = _event_problem(row, offset, payload, type_)
                if isinstance(problem, str):
                    return VerifyResult(False, checked, head_position, expected, problem, archived)
                broken_stories += stories.feed(expected, row.stream_id, problem)
                if observe is not None:
                    observe(expected, payload, hashes[offset])
                previous, expected, checked = hashes[offset], expected + 1, checked + 1
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
    archive_checked = bool(archive and segments)
    if broken_stories:
        first = broken_stories[0]
        more = f" (and {len(broken_stories) - 1} more)" if len(broken_stories) > 1 else ""
        return VerifyResult(
            False,
            checked,
            head_position,
            first.position,
            f"request {first.request_id}: {first.rule}: {first.detail}{more}",
            archived,
            archive_checked,
            stories.checked,
            tuple(broken_stories[:_STORIES_KEPT]),
        )
    return VerifyResult(
        True,
        checked,
        head_position,
        archived=archived,
        archive_checked=archive_checked,
        stories_checked=stories.checked,
    )


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
