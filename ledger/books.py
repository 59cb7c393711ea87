"""The books' edge: load the balances and holds an append batch touches, save them back.

Called by the event store inside its append transaction, after the ledger head-row lock:
every transaction that changes a balance is serialized with every other (in every
process), and the balance changes commit or roll back together with their events. The
rules themselves are in :mod:`ledger.accounting`.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime

import orjson
from sqlalchemy import bindparam, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger.accounting import Balance, Books, Effect, Hold, Reserve
from ledger.schema import budget_accounts, budget_holds, budget_resolutions

__all__ = ["load_books", "save_books"]


async def load_books(conn: AsyncConnection, effects: Iterable[Effect]) -> Books:
    effects = list(effects)
    account_ids, hold_ids = Books.needs(effects)
    # Reservations are loaded too, so that a repeated one is refused by the rules rather
    # than by a primary-key violation that would fail the whole batch.
    hold_ids |= {e.hold.reservation_id for e in effects if isinstance(e, Reserve)}
    books = Books()
    if hold_ids:
        rows = await conn.execute(
            select(budget_holds).where(budget_holds.c.reservation_id.in_(sorted(hold_ids)))
        )
        for row in rows:
            hold = Hold(
                reservation_id=row.reservation_id,
                request_id=row.request_id,
                attempt_id=row.attempt_id,
                workspace=row.workspace,
                key_id=row.key_id,
                endpoint=row.endpoint,
                model=row.model,
                amount_usd=row.amount_usd,
                accounts=tuple(orjson.loads(row.accounts)),
                owner=row.owner,
                state=row.state,
            )
            books.holds[hold.reservation_id] = hold
            account_ids.update(hold.accounts)
    if account_ids:
        rows = await conn.execute(
            select(budget_accounts).where(budget_accounts.c.account_id.in_(sorted(account_ids)))
        )
        for row in rows:
            books.accounts[row.account_id] = Balance(
                account_id=row.account_id,
                kind=row.kind,
                workspace=row.workspace,
                key_id=row.key_id,
                window_start=row.window_start,
                limit_usd=row.limit_usd,
                held_usd=row.held_usd,
                settled_usd=row.settled_usd,
            )
    return books


async def save_books(conn: AsyncConnection, books: Books) -> None:
    now = datetime.now(UTC)
    if books.new_accounts:
        await conn.execute(
            insert(budget_accounts),
            [
                {
                    "account_id": a.account_id,
                    "kind": a.kind,
                    "workspace": a.workspace,
                    "key_id": a.key_id,
                    "window_start": a.window_start,
                    "limit_usd": a.limit_usd,
                    "held_usd": a.held_usd,
                    "settled_usd": a.settled_usd,
                    "updated_at": now,
                }
                for a in (books.accounts[i] for i in sorted(books.new_accounts))
            ],
        )
    changed = sorted(books.changed_accounts - books.new_accounts)
    if changed:
        await conn.execute(
            update(budget_accounts)
            .where(budget_accounts.c.account_id == bindparam("b_account_id"))
            .values(
                limit_usd=bindparam("b_limit"),
                held_usd=bindparam("b_held"),
                settled_usd=bindparam("b_settled"),
                updated_at=bindparam("b_now"),
            ),
            [
                {
                    "b_account_id": a.account_id,
                    "b_limit": a.limit_usd,
                    "b_held": a.held_usd,
                    "b_settled": a.settled_usd,
                    "b_now": now,
                }
                for a in (books.accounts[i] for i in changed)
            ],
        )
    if books.new_holds:
        await conn.execute(
            insert(budget_holds),
            [
                {
                    "reservation_id": h.reservation_id,
                    "request_id": h.request_id,
                    "attempt_id": h.attempt_id,
                    "workspace": h.workspace,
                    "key_id": h.key_id,
                    "endpoint": h.endpoint,
                    "model": h.model,
                    "amount_usd": h.amount_usd,
                    "accounts": orjson.dumps(list(h.accounts)).decode(),
                    "state": h.state,
                    "owner": h.owner,
                    "created_at": now,
                }
                for h in (books.holds[i] for i in sorted(books.new_holds))
            ],
        )
    if books.changed_holds:
        await conn.execute(
            update(budget_holds)
            .where(budget_holds.c.reservation_id == bindparam("b_reservation_id"))
            .values(state=bindparam("b_state")),
            [
                {"b_reservation_id": h.reservation_id, "b_state": h.state}
                for h in (books.holds[i] for i in sorted(books.changed_holds))
            ],
        )
    if books.resolutions:
        await conn.execute(
            insert(budget_resolutions),
            [
                {
                    "reservation_id": r.reservation_id,
                    "kind": r.kind,
                    "settled_usd": r.settled_usd,
                    "released_usd": r.released_usd,
                    "resolved_at": now,
                }
                for r in books.resolutions
            ],
        )
