"""The books re-derived from the ledger: ``waybill verify --books`` and the books' replay.

The live balances (``budget_accounts``), holds (``budget_holds``, and ``budget_open_holds``
while they are open) and resolutions (``budget_resolutions``) are written by the append
path, in the transaction of the budget events they follow. They are nothing but those
events folded in position order (``ledger.books.accounting.fold_books``), so they can be checked
against the ledger and rebuilt from it:

- :func:`check_books` folds the budget events up to the head and compares the result with
  the tables, naming every account, hold and resolution that differs. It reads in one
  snapshot (PostgreSQL REPEATABLE READ; SQLite's read transaction in WAL mode), so appends
  may go on meanwhile.
- :func:`rebuild_books` folds them under the ledger head's lock (nothing is appended
  meanwhile: every append takes that lock) and rewrites the four tables in the same
  transaction, to exactly what the append path would have written.

Timestamps (``updated_at``, ``created_at``, ``resolved_at``) are the recorded times of the
events that last changed a row; they are not compared.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

from sqlalchemy import delete, insert, select
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger.books.accounting import BOOK_EVENTS, UNKNOWN_OWNER, Books, FoldProblem, fold_books
from ledger.books.balances import (
    account_row,
    balance_of,
    hold_of,
    hold_row,
    holds,
    open_hold_row,
    resolution_row,
)
from ledger.store import EventStore, RecordedEvent, decode_payload, decode_row
from ledger.store.archived import Segment, archived_history, archived_pages
from ledger.store.db import READ_ONLY
from ledger.store.schema import (
    appends,
    budget_accounts,
    budget_holds,
    budget_open_holds,
    budget_resolutions,
    ledger_head,
)
from ledger.store.stored import previous_hash, type_char
from ledger.types import money_of

__all__ = ["BOOK_EVENT_TYPES", "BooksReport", "Discrepancy", "check_books", "rebuild_books"]

BOOK_EVENT_TYPES: Final = tuple(sorted(BOOK_EVENTS))
_PAGE: Final = 5000
_T = TypeVar("_T")

Progress = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class Discrepancy:
    """One row of the books that is not what the ledger's events add up to."""

    kind: Literal["account", "hold", "resolution", "event"]
    id: str  # account id, reservation id, or "position N"
    detail: str

    def as_json(self) -> dict[str, str]:
        return {"kind": self.kind, "id": self.id, "detail": self.detail}


@dataclass(frozen=True, slots=True)
class BooksReport:
    head_position: int
    events: int  # budget events folded
    accounts: int
    holds: int
    discrepancies: list[Discrepancy] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.discrepancies

    def as_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "head_position": self.head_position,
            "events": self.events,
            "accounts": self.accounts,
            "holds": self.holds,
            "discrepancies": [d.as_json() for d in self.discrepancies],
        }


# --- comparing: pure ---

_ACCOUNT_FIELDS: Final = (
    "kind",
    "workspace",
    "key_id",
    "window_start",
    "limit_usd",
    "held_usd",
    "settled_usd",
    "overrun_usd",
)
_HOLD_FIELDS: Final = (
    "request_id",
    "attempt_id",
    "workspace",
    "key_id",
    "endpoint",
    "model",
    "amount_usd",
    "accounts",
    "state",
)
_RESOLUTION_FIELDS: Final = ("kind", "settled_usd", "released_usd", "overrun_usd")


def compare_books(
    derived: Books,
    problems: list[FoldProblem],
    accounts: Sequence[Any],
    stored_hold_rows: Sequence[Any],
    resolutions: Sequence[Any],
) -> list[Discrepancy]:
    """Every difference between the books the events add up to and the rows stored."""
    found = [
        Discrepancy("event", f"position {p.position}", f"{p.event_type}: {p.detail}")
        for p in problems
    ]
    stored_accounts = {row.account_id: balance_of(row) for row in accounts}
    found += _differences("account", derived.accounts, stored_accounts, _ACCOUNT_FIELDS)
    stored_holds = {row.reservation_id: hold_of(row) for row in stored_hold_rows}
    found += _differences("hold", derived.holds, stored_holds, _HOLD_FIELDS)
    for reservation, hold in derived.holds.items():
        stored = stored_holds.get(reservation)
        if (
            stored is not None
            and stored.owner is not None  # only an open hold keeps its owner
            and hold.owner != UNKNOWN_OWNER
            and stored.owner != hold.owner
        ):
            found.append(
                Discrepancy(
                    "hold", reservation, f"owner is {stored.owner}, the ledger says {hold.owner}"
                )
            )
    derived_resolutions = {r.reservation_id: r for r in derived.resolutions}
    stored_resolutions = {
        row.reservation_id: _Stored(
            kind=row.kind,
            settled_usd=money_of(row.settled_usd),
            released_usd=money_of(row.released_usd),
            overrun_usd=money_of(row.overrun_usd),
        )
        for row in resolutions
    }
    found += _differences("resolution", derived_resolutions, stored_resolutions, _RESOLUTION_FIELDS)
    return found


@dataclass(frozen=True, slots=True)
class _Stored:
    kind: str
    settled_usd: Decimal
    released_usd: Decimal
    overrun_usd: Decimal


def _differences(
    kind: Literal["account", "hold", "resolution"],
    derived: dict[str, Any],
    stored: dict[str, Any],
    names: tuple[str, ...],
) -> list[Discrepancy]:
    found = []
    for key in sorted(derived.keys() - stored.keys()):
        found.append(Discrepancy(kind, key, "missing: the ledger records it"))
    for key in sorted(stored.keys() - derived.keys()):
        found.append(Discrepancy(kind, key, "stored, but no event of the ledger makes it"))
    for key in sorted(derived.keys() & stored.keys()):
        mine, theirs = derived[key], stored[key]
        diffs = [
            f"{name} is {_shown(getattr(theirs, name))}, the ledger says "
            f"{_shown(getattr(mine, name))}"
            for name in names
            if getattr(mine, name) != getattr(theirs, name)
        ]
        if diffs:
            found.append(Discrepancy(kind, key, "; ".join(diffs)))
    return found


def _shown(value: object) -> str:
    if isinstance(value, Decimal):
        return format(value, "f")
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "(none)"
    return str(value)


# --- reading and writing ---


async def _budget_events(
    conn: AsyncConnection, head: int, progress: Progress | None, archived: _Archived
) -> AsyncIterator[RecordedEvent]:
    """The budget events up to ``head``, in position order: the archived months' from their
    files, then the live ledger's, read a page at a time (rows that hold none are told by
    their types and never decompressed)."""
    a = appends.c
    wanted = {type_char(t) for t in BOOK_EVENT_TYPES}
    total = 0
    for (types,) in await conn.execute(select(a.types).where(a.position <= head)):
        total += sum(1 for char in types if char in wanted)
    after, done = 0, 0
    if archived is not None:
        async for page in archived_pages(*archived, _PAGE):
            for stored in page:
                recorded = decode_payload(*stored)
                if recorded.type in BOOK_EVENT_TYPES:
                    done += 1
                    yield recorded
            if progress is not None:
                progress(done, total + done)
        total += done
    while True:
        rows = (
            await conn.execute(
                select(a.position, a.types, previous_hash(), a.payloads)
                .where(a.position > after, a.position <= head)
                .order_by(a.position)
                .limit(_PAGE)
            )
        ).all()
        for row in rows:
            if wanted.isdisjoint(row.types):
                continue
            # The hashed bytes: what `waybill verify` vouches for.
            for recorded in decode_row(row.position, row.previous, bytes(row.payloads)):
                if recorded.position <= head and recorded.type in BOOK_EVENT_TYPES:
                    done += 1
                    yield recorded
        if progress is not None:
            progress(done, total)
        if len(rows) < _PAGE:
            return
        after = rows[-1].position


@dataclass
class _Folded:
    books: Books
    problems: list[FoldProblem]
    events: int
    reserved_at: dict[str, datetime]  # reservation id -> when it was made
    touched_at: dict[str, datetime]  # reservation id -> its last budget event


_Archived = tuple[Path, list[Segment]] | None
"""The archive directory and the months in it a fold reads first; None: nothing archived."""


async def _fold(
    conn: AsyncConnection, head: int, progress: Progress | None, archived: _Archived
) -> _Folded:
    recorded = [r async for r in _budget_events(conn, head, progress, archived)]
    reserved_at: dict[str, datetime] = {}
    touched_at: dict[str, datetime] = {}
    for r in recorded:
        reservation = str(r.data["reservation_id"])
        reserved_at.setdefault(reservation, r.recorded_at)
        touched_at[reservation] = r.recorded_at
    books, problems = fold_books((r.position, r.event()) for r in recorded)
    return _Folded(books, problems, len(recorded), reserved_at, touched_at)


async def _head(conn: AsyncConnection, *, lock: bool = False) -> int:
    query = select(ledger_head.c.position).where(ledger_head.c.id == 1)
    if lock:
        query = query.with_for_update()
    return int((await conn.execute(query)).scalar_one())


async def check_books(
    store: EventStore, progress: Progress | None = None, *, archive: Path | None = None
) -> BooksReport:
    """Fold the budget events and compare them with the live tables, in one snapshot; the
    archived months' events are read from ``archive``
    (``ledger.store.archived.archived_history``)."""
    archived = await _archived(store, "checking the books", archive)
    async with store.engine.connect() as conn:
        options: dict[str, Any] = {READ_ONLY: True}
        if conn.dialect.name == "postgresql":
            options["isolation_level"] = "REPEATABLE READ"
        conn = await conn.execution_options(**options)
        async with conn.begin():
            head = await _head(conn)
            folded = await _fold(conn, head, progress, archived)
            found = await _compare_stored(conn, folded)
    return _report(head, folded, found)


async def _archived(store: EventStore, what: str, archive: Path | None) -> _Archived:
    segments = await archived_history(store.engine, what, archive)
    return (archive, segments) if archive is not None and segments else None


def _report(head: int, folded: _Folded, found: list[Discrepancy]) -> BooksReport:
    return BooksReport(
        head_position=head,
        events=folded.events,
        accounts=len(folded.books.accounts),
        holds=len(folded.books.holds),
        discrepancies=found,
    )


async def _compare_stored(conn: AsyncConnection, folded: _Folded) -> list[Discrepancy]:
    accounts = (await conn.execute(select(budget_accounts))).all()
    stored_holds = (await conn.execute(holds())).all()
    resolutions = (await conn.execute(select(budget_resolutions))).all()
    return compare_books(folded.books, folded.problems, accounts, stored_holds, resolutions)


async def rebuild_books(
    store: EventStore, progress: Progress | None = None, *, archive: Path | None = None
) -> BooksReport:
    """Rewrite the books from the budget events, under the ledger head's lock. Returns what
    was found wrong before (an empty list: they were right, and are unchanged in value)."""
    archived = await _archived(store, "rebuilding the books", archive)
    async with store.engine.begin() as conn:
        # SQLite: BEGIN IMMEDIATE (ledger.store.db) already holds the database's write lock.
        head = await _head(conn, lock=conn.dialect.name == "postgresql")
        folded = await _fold(conn, head, progress, archived)
        found = await _compare_stored(conn, folded)
        # A hold whose event did not record its gateway keeps the owner it was stored with.
        owners = dict(
            (
                await conn.execute(
                    select(budget_open_holds.c.reservation_id, budget_open_holds.c.owner)
                )
            ).all()
        )
        await conn.execute(delete(budget_resolutions))
        await conn.execute(delete(budget_open_holds))
        await conn.execute(delete(budget_holds))
        await conn.execute(delete(budget_accounts))
        await _write(conn, folded, owners)
    return _report(head, folded, found)


async def _write(conn: AsyncConnection, folded: _Folded, owners: dict[str, str]) -> None:
    books = folded.books
    kept = [
        replace(h, owner=owners.get(h.reservation_id, h.owner)) if h.owner == UNKNOWN_OWNER else h
        for h in books.holds.values()
    ]
    updated_at: dict[str, datetime] = {}
    for hold in books.holds.values():
        touched = folded.touched_at[hold.reservation_id]
        for account in hold.accounts:
            updated_at[account] = max(touched, updated_at.get(account, touched))
    rows = [
        (
            budget_accounts,
            [account_row(a, updated_at[a.account_id]) for a in books.accounts.values()],
        ),
        (budget_holds, [hold_row(h, folded.reserved_at[h.reservation_id]) for h in kept]),
        (budget_open_holds, [row for h in kept if (row := open_hold_row(h)) is not None]),
        (
            budget_resolutions,
            [resolution_row(r, folded.touched_at[r.reservation_id]) for r in books.resolutions],
        ),
    ]
    for table, table_rows in rows:
        for chunk in _chunks(table_rows):
            await conn.execute(insert(table), chunk)


def _chunks(rows: list[_T]) -> Iterator[list[_T]]:
    for start in range(0, len(rows), _PAGE):
        yield rows[start : start + _PAGE]
