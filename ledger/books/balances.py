"""The books' edge: load the balances and holds an append batch touches, save them back.

Called by the event store inside its append transaction, after the ledger head-row lock:
every transaction that changes a balance is serialized with every other (in every
process), and the balance changes commit or roll back together with their events. The
rules themselves are in :mod:`ledger.books.accounting`.

Two backends, one shape: :func:`book_needs` says what to load, :func:`hold_of` and
:func:`balance_of` read rows back, :func:`book_writes` says what to write. The SQLAlchemy
functions here serve SQLite, on the connection its writer thread owns (synchronous:
``ledger.store.sqlite``); the event store's PostgreSQL path sends the same reads and writes
as raw statements in its two pipelined round trips (``ledger.store``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
from sqlalchemy import Select, bindparam, delete, func, insert, literal, select, update
from sqlalchemy.engine import Connection

from ledger.books.accounting import Balance, Books, Effect, Hold, Reserve, Resolution
from ledger.store.schema import budget_accounts, budget_holds, budget_open_holds, budget_resolutions
from ledger.types import money_of

__all__ = [
    "BookWrites",
    "account_row",
    "balance_of",
    "book_needs",
    "book_writes",
    "hold_of",
    "hold_row",
    "holds",
    "load_books",
    "open_hold_row",
    "resolution_row",
    "save_books",
]


def book_needs(effects: Iterable[Effect]) -> tuple[set[str], set[str]]:
    """The account ids and reservation ids to load before ``effects`` can be applied."""
    effects = list(effects)
    account_ids, hold_ids = Books.needs(effects)
    # Reservations are loaded too, so that a repeated one is refused by the rules rather
    # than by a primary-key violation that would fail the whole batch.
    hold_ids |= {e.hold.reservation_id for e in effects if isinstance(e, Reserve)}
    return account_ids, hold_ids


def holds() -> Select[Any]:
    """The holds with their state, as :func:`hold_of` reads them: a ``budget_holds`` row
    with its ``budget_open_holds`` row's owner and state, or no owner and ``resolved``."""
    return select(
        budget_holds,
        budget_open_holds.c.owner,
        func.coalesce(budget_open_holds.c.state, literal("resolved")).label("state"),
    ).select_from(budget_holds.outerjoin(budget_open_holds))


def hold_of(row: Any) -> Hold:
    """A row of :func:`holds` (attribute access) as a :class:`Hold`."""
    return Hold(
        reservation_id=row.reservation_id,
        request_id=row.request_id,
        attempt_id=row.attempt_id,
        workspace=row.workspace,
        key_id=row.key_id,
        endpoint=row.endpoint,
        model=row.model,
        amount_usd=money_of(row.amount_usd),
        accounts=tuple(orjson.loads(row.accounts)),
        owner=row.owner,
        state=row.state,
    )


def balance_of(row: Any) -> Balance:
    """A ``budget_accounts`` row (attribute access) as a :class:`Balance`."""
    return Balance(
        account_id=row.account_id,
        kind=row.kind,
        workspace=row.workspace,
        key_id=row.key_id,
        window_start=row.window_start,
        limit_usd=money_of(row.limit_usd),
        held_usd=money_of(row.held_usd),
        settled_usd=money_of(row.settled_usd),
        overrun_usd=money_of(row.overrun_usd),
    )


@dataclass(frozen=True, slots=True)
class BookWrites:
    """The rows one batch's books write, statement by statement (all lists may be empty)."""

    new_accounts: list[dict[str, Any]]
    # account_id, limit_usd, held_usd, settled_usd, overrun_usd
    changed_accounts: list[dict[str, Any]]
    new_holds: list[dict[str, Any]]
    open_holds: list[dict[str, Any]]  # the new holds' open state, if not already resolved
    unknown_holds: list[str]  # reservation ids of open holds whose usage became unknown
    closed_holds: list[str]  # reservation ids of open holds resolved
    resolutions: list[dict[str, Any]]


def account_row(a: Balance, at: datetime) -> dict[str, Any]:
    """A ``budget_accounts`` row, whole."""
    return {
        "account_id": a.account_id,
        "kind": a.kind,
        "workspace": a.workspace,
        "key_id": a.key_id,
        "window_start": a.window_start,
        "limit_usd": a.limit_usd,
        "held_usd": a.held_usd,
        "settled_usd": a.settled_usd,
        "overrun_usd": a.overrun_usd,
        "updated_at": at,
    }


def hold_row(h: Hold, at: datetime) -> dict[str, Any]:
    """A ``budget_holds`` row, whole."""
    return {
        "reservation_id": h.reservation_id,
        "request_id": h.request_id,
        "attempt_id": h.attempt_id,
        "workspace": h.workspace,
        "key_id": h.key_id,
        "endpoint": h.endpoint,
        "model": h.model,
        "amount_usd": h.amount_usd,
        "accounts": orjson.dumps(list(h.accounts)).decode(),
        "created_at": at,
    }


def open_hold_row(h: Hold) -> dict[str, Any] | None:
    """A ``budget_open_holds`` row, whole; None for a resolved hold (it has none)."""
    if h.state == "resolved":
        return None
    return {"reservation_id": h.reservation_id, "state": h.state, "owner": h.owner}


def resolution_row(r: Resolution, at: datetime) -> dict[str, Any]:
    """A ``budget_resolutions`` row, whole."""
    return {
        "reservation_id": r.reservation_id,
        "kind": r.kind,
        "settled_usd": r.settled_usd,
        "released_usd": r.released_usd,
        "overrun_usd": r.overrun_usd,
        "resolved_at": at,
    }


def book_writes(books: Books, now: datetime) -> BookWrites:
    accounts = books.accounts
    held = books.holds
    return BookWrites(
        new_accounts=[account_row(accounts[i], now) for i in sorted(books.new_accounts)],
        changed_accounts=[
            {
                "account_id": a.account_id,
                "limit_usd": a.limit_usd,
                "held_usd": a.held_usd,
                "settled_usd": a.settled_usd,
                "overrun_usd": a.overrun_usd,
                "updated_at": now,
            }
            for a in (accounts[i] for i in sorted(books.changed_accounts - books.new_accounts))
        ],
        new_holds=[hold_row(held[i], now) for i in sorted(books.new_holds)],
        open_holds=[
            row for i in sorted(books.new_holds) if (row := open_hold_row(held[i])) is not None
        ],
        unknown_holds=sorted(i for i in books.changed_holds if held[i].state == "unknown"),
        closed_holds=sorted(i for i in books.changed_holds if held[i].state == "resolved"),
        resolutions=[resolution_row(r, now) for r in books.resolutions],
    )


def load_books(conn: Connection, effects: Iterable[Effect]) -> Books:
    account_ids, hold_ids = book_needs(effects)
    books = Books()
    if hold_ids:
        rows = conn.execute(holds().where(budget_holds.c.reservation_id.in_(sorted(hold_ids))))
        for row in rows:
            hold = hold_of(row)
            books.holds[hold.reservation_id] = hold
            account_ids.update(hold.accounts)
    if account_ids:
        rows = conn.execute(
            select(budget_accounts).where(budget_accounts.c.account_id.in_(sorted(account_ids)))
        )
        for row in rows:
            books.accounts[row.account_id] = balance_of(row)
    return books


def save_books(conn: Connection, books: Books, recorded_at: datetime) -> None:
    """Write what ``books`` changed, stamped with the recorded time of the events that
    changed it (as the PostgreSQL path does, and as a rebuild from the events does)."""
    writes = book_writes(books, recorded_at)
    if writes.new_accounts:
        conn.execute(insert(budget_accounts), writes.new_accounts)
    if writes.changed_accounts:
        conn.execute(
            update(budget_accounts)
            .where(budget_accounts.c.account_id == bindparam("b_account_id"))
            .values(
                limit_usd=bindparam("b_limit_usd"),
                held_usd=bindparam("b_held_usd"),
                settled_usd=bindparam("b_settled_usd"),
                overrun_usd=bindparam("b_overrun_usd"),
                updated_at=bindparam("b_updated_at"),
            ),
            [{f"b_{k}": v for k, v in row.items()} for row in writes.changed_accounts],
        )
    if writes.new_holds:
        conn.execute(insert(budget_holds), writes.new_holds)
    if writes.open_holds:
        conn.execute(insert(budget_open_holds), writes.open_holds)
    if writes.unknown_holds:
        conn.execute(
            update(budget_open_holds)
            .where(budget_open_holds.c.reservation_id.in_(writes.unknown_holds))
            .values(state="unknown")
        )
    if writes.closed_holds:
        conn.execute(
            delete(budget_open_holds).where(
                budget_open_holds.c.reservation_id.in_(writes.closed_holds)
            )
        )
    if writes.resolutions:
        conn.execute(insert(budget_resolutions), writes.resolutions)
