"""The PostgreSQL committer: each batch decided and written in one to four statements, on
the appender's own asyncpg connection (``ledger.store.reads.connect`` says how it is planned).

THE LOCK, below, is how every commit in every process is serialized on the ledger head's
row, and why a batch is first tried without taking it; ``_Known`` is what lets most batches
skip the read as well. Each month of the ledger is a table of its own
(``ledger.store.partitions``): the committer makes sure of the month before its first batch.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any, Final, Literal, TypeVar

import asyncpg
import orjson
from sqlalchemy.ext.asyncio import AsyncEngine

from ledger.books.accounting import Balance, Books, Effect, Hold, Reserve
from ledger.books.balances import balance_of, book_needs, book_writes, hold_of
from ledger.store.append import Batch, Bookkeeping, Written, decide, streams_of
from ledger.store.db import LedgerUnavailable, asyncpg_dsn, is_unavailable
from ledger.store.partitions import ensure_months, month_bounds, month_of
from ledger.store.reads import close_quietly, connect, positional
from ledger.store.recorded import NO_STREAM

__all__ = ["PostgresCommitter"]

_V = TypeVar("_V")

# THE LOCK. Every append that commits, in every process, holds the single ledger_head row's
# lock at its commit and moves the head to the positions it wrote. So transactions that write
# events are strictly serialized: positions are head+1, head+2, ... with no gaps, and the
# transaction that got position N has committed (and is visible) before the one that gets N+1
# can even read the head. A reader tailing `position > p` therefore can never see N+1 without
# N — the bigserial pitfall (sequence values taken in one order, committed in another) cannot
# happen. It also gives the hash chain its single predecessor, and serializes every change to
# the books (balances read after the lock include every reservation committed before, by any
# process). The cost, one writer at a time, is paid once per batch rather than per event
# thanks to group commit.
#
# A batch is first tried OPTIMISTICALLY, in two autocommit statements and no explicit
# transaction: the read (_PG_READ, one snapshot: head, versions and books agree), then the
# write (_pg_write), whose every part is gated on moving the head from the position read
# (`UPDATE ledger_head ... WHERE position = :expected AND hash = :expected_hash`; the hash
# too, so that a database restored under a running gateway to another history with the same
# length is not taken for the one it knew). That UPDATE takes the head lock, or
# waits for whoever holds it and then sees the moved head; if the head moved since the read,
# the statement writes nothing at all and the batch is decided again under the lock. The
# guard covers the books too because nothing changes a book row except an append, which
# always moves the head. Two round trips instead of four (BEGIN+lock, read, write, COMMIT),
# for each of a request's appends (see bench/README.md, Decisions: the optimistic append).
# A process that loses the race goes
# LOCKED for the next few batches, so two busy gateways on one database do not keep paying
# for reads they throw away. And when the head is still where this appender's own last
# commit left it, the read is skipped altogether: what the batch needs is KNOWN (_Known).
#
# A stream's first append must find it without rows. On PostgreSQL the table is partitioned
# by month (ledger.store.partitions) and can hold no unique key on (stream_id, version), so the
# write's guard also asks that the streams it starts have no row; a stream taken to be new
# that was not (the KNOWN guess) then writes nothing, like a moved head, and the batch is
# read and decided again.
_PG_BEGIN_AND_LOCK = "BEGIN; SELECT 1 FROM ledger_head WHERE id = 1 FOR UPDATE"

# Everything the batch is decided on, read in one statement, so in one snapshot; on the
# locked path AFTER the lock's statement: in READ COMMITTED a statement reads from a
# snapshot taken when it starts, so reads folded into the locking statement could miss the
# transaction that held the lock before us. The head, the streams' last versions (one
# index probe each, never a scan), the holds the batch resolves, and the accounts it touches
# (named by its reservations, or by the holds' own account lists). Money travels as text so
# that it stays exact. Rows are found by `= ANY(array)`, never joined to a
# set-returning function: the planner guesses such a function returns 100 rows and would
# hash-join it against a scan of the whole table, making every append's cost grow with the
# number of holds ever made (see bench/README.md, Decisions: `= ANY(array)`). The write's
# UPDATEs name their rows the same way.
_PG_READ = """
    SELECT
      (SELECT position FROM ledger_head WHERE id = 1) AS position,
      (SELECT hash FROM ledger_head WHERE id = 1) AS hash,
      (SELECT coalesce(json_agg(json_build_array(s.id, coalesce((
                  SELECT e.version + length(e.types) - 1 FROM appends e
                  WHERE e.stream_id = s.id ORDER BY e.version DESC LIMIT 1), (
                  SELECT a.version FROM archived_streams a WHERE a.stream_id = s.id)))), '[]')
       FROM unnest(:streams::text[]) AS s(id)) AS versions,
      (SELECT coalesce(json_agg(json_build_object(
                  'reservation_id', h.reservation_id, 'request_id', h.request_id,
                  'attempt_id', h.attempt_id, 'workspace', h.workspace, 'key_id', h.key_id,
                  'endpoint', h.endpoint, 'model', h.model, 'amount_usd', h.amount_usd::text,
                  'accounts', h.accounts, 'owner', o.owner,
                  'state', coalesce(o.state, 'resolved'))), '[]')
       FROM budget_holds h LEFT JOIN budget_open_holds o USING (reservation_id)
       WHERE h.reservation_id = ANY(:holds::text[])) AS holds,
      (SELECT coalesce(json_agg(json_build_object(
                  'account_id', a.account_id, 'kind', a.kind, 'workspace', a.workspace,
                  'key_id', a.key_id, 'window_start', a.window_start,
                  'limit_usd', a.limit_usd::text, 'held_usd', a.held_usd::text,
                  'settled_usd', a.settled_usd::text,
                  'overrun_usd', a.overrun_usd::text)), '[]')
       FROM budget_accounts a WHERE a.account_id = ANY(:accounts::text[] || ARRAY(
           SELECT jsonb_array_elements_text(h.accounts::jsonb) FROM budget_holds h
           WHERE h.reservation_id = ANY(:holds::text[])))) AS accounts
"""

# Everything the batch writes, in one statement: the events as parallel arrays (asyncpg
# encodes them in its binary format, in C; their positions follow the head read, so they
# are numbered by the statement), each part of the books that has rows as a JSON document
# of its own (money as exact decimal strings) or an array of reservation ids, the head row,
# and the NOTIFY that wakes tailing readers at commit. (The events as one JSON document
# cost the same on the client and halved throughput at large batches: PostgreSQL then
# parses every payload twice.) The statement holds only the parts the batch writes
# (_pg_write: a few shapes, each prepared once; a reservation writes a hold, its open state
# and its accounts, a settlement closes a hold and writes its resolution and accounts):
# every data-modifying CTE costs the server its setup even when it has no rows. New and
# changed rows of a table are disjoint sets (ledger.books.accounting.Books), so the CTEs never
# touch the same row twice. Every part waits on `head`, the guarded move of the head (see
# THE LOCK): when it moves nothing, nothing is written and the statement returns no row.
# Nothing else is asked of the server: no RETURNING the committer does not read, and the
# new-stream guard only in the shapes of batches that start streams (a settlement's does
# not); data-modifying CTEs run to completion whether read or not. (The books as json in
# place of jsonb, measured: no difference; see bench/README.md, Issue 44's levers.)
_PG_WRITE_HEAD = """
    WITH head AS (
        UPDATE ledger_head SET position = :head, hash = :head_hash
        WHERE id = 1 AND position = :expected AND hash = :expected_hash{new_streams}
        RETURNING 1
    )"""
_PG_NEW_STREAMS = """
          AND NOT EXISTS (SELECT 1 FROM appends WHERE stream_id = ANY(:new_streams::text[]))
          AND NOT EXISTS (SELECT 1 FROM archived_streams
                          WHERE stream_id = ANY(:new_streams::text[]))"""
_PG_WRITE_BOOKS = {
    "new_accounts": """
    , new_accounts AS (
        INSERT INTO budget_accounts (account_id, kind, workspace, key_id, window_start,
                                     limit_usd, held_usd, settled_usd, overrun_usd,
                                     updated_at)
        SELECT u.*, :recorded_at
        FROM jsonb_to_recordset(:new_accounts::jsonb) AS u(
            account_id text, kind text, workspace text, key_id text, window_start text,
            limit_usd numeric, held_usd numeric, settled_usd numeric, overrun_usd numeric)
        WHERE EXISTS (SELECT 1 FROM head)
    )""",
    "changed_accounts": """
    , changed_accounts AS (
        UPDATE budget_accounts a
        SET limit_usd = u.limit_usd, held_usd = u.held_usd, settled_usd = u.settled_usd,
            overrun_usd = u.overrun_usd, updated_at = :recorded_at
        FROM jsonb_to_recordset(:changed_accounts::jsonb) AS u(
            account_id text, limit_usd numeric, held_usd numeric, settled_usd numeric,
            overrun_usd numeric)
        WHERE a.account_id = u.account_id
          AND a.account_id = ANY(:changed_account_ids::text[])
          AND EXISTS (SELECT 1 FROM head)
    )""",
    "new_holds": """
    , new_holds AS (
        INSERT INTO budget_holds (reservation_id, request_id, attempt_id, workspace, key_id,
                                  endpoint, model, amount_usd, accounts, created_at)
        SELECT u.*, :recorded_at
        FROM jsonb_to_recordset(:new_holds::jsonb) AS u(
            reservation_id text, request_id text, attempt_id text, workspace text,
            key_id text, endpoint text, model text, amount_usd numeric, accounts text)
        WHERE EXISTS (SELECT 1 FROM head)
    )""",
    "open_holds": """
    , open_holds AS (
        INSERT INTO budget_open_holds (reservation_id, state, owner)
        SELECT u.*
        FROM jsonb_to_recordset(:open_holds::jsonb) AS u(
            reservation_id text, state text, owner text)
        WHERE EXISTS (SELECT 1 FROM head)
    )""",
    "unknown_holds": """
    , unknown_holds AS (
        UPDATE budget_open_holds SET state = 'unknown'
        WHERE reservation_id = ANY(:unknown_holds::text[]) AND EXISTS (SELECT 1 FROM head)
    )""",
    "closed_holds": """
    , closed_holds AS (
        DELETE FROM budget_open_holds
        WHERE reservation_id = ANY(:closed_holds::text[]) AND EXISTS (SELECT 1 FROM head)
    )""",
    "resolutions": """
    , resolutions AS (
        INSERT INTO budget_resolutions (reservation_id, kind, settled_usd, released_usd,
                                        overrun_usd, resolved_at)
        SELECT u.*, :recorded_at
        FROM jsonb_to_recordset(:resolutions::jsonb) AS u(
            reservation_id text, kind text, settled_usd numeric, released_usd numeric,
            overrun_usd numeric)
        WHERE EXISTS (SELECT 1 FROM head)
    )""",
}
_PG_WRITE_EVENTS = """
    , inserted AS (
        INSERT INTO appends (position, recorded_at, version, stream_id, types, hash, payloads)
        SELECT p, :recorded_at, v, s, t, h, b
        FROM unnest(:positions::bigint[], :versions::int[], :stream_ids::text[],
                    :types::text[], :hashes::bytea[], :payloads::bytea[]) AS u(p, v, s, t, h, b)
        WHERE EXISTS (SELECT 1 FROM head)
    )
    SELECT pg_notify('waybill_events', :head::text) FROM head
"""
# Whether any of the streams a write took to be new has rows: asked only when the write
# wrote nothing, for the count of wrong guesses.
_PG_TAKEN = """
    SELECT EXISTS (SELECT 1 FROM appends WHERE stream_id = ANY(:new_streams::text[]))
           OR EXISTS (SELECT 1 FROM archived_streams WHERE stream_id = ANY(:new_streams::text[]))
"""


_ID_PARTS: Final = frozenset({"unknown_holds", "closed_holds"})
"""The parts of ``_PG_WRITE_BOOKS`` whose rows are reservation ids."""


@functools.lru_cache(maxsize=64)
def _pg_write(parts: tuple[str, ...], new_streams: bool) -> tuple[str, tuple[str, ...]]:
    """The write statement for a batch whose books have rows in ``parts`` (names of
    ``_PG_WRITE_BOOKS``, in its order) and that starts streams or not, with asyncpg's ``$n``
    and the parameters' names."""
    head = _PG_WRITE_HEAD.format(new_streams=_PG_NEW_STREAMS if new_streams else "")
    books = "".join(_PG_WRITE_BOOKS[part] for part in parts)
    return positional(head + books + _PG_WRITE_EVENTS)


class _Known:
    """What this appender's own commits left in the ledger, as long as nobody else wrote.

    After each batch the appender keeps the head it left, the versions of the streams it
    wrote or read and the balances and holds it saved or read. While the head is still
    there (the write's guard checks exactly that), these are the database's current values,
    so a batch that needs nothing else is decided without reading: one round trip. A
    request's first append is to a new stream (``NO_STREAM``) and makes a new hold, which
    are taken to be absent; if one was not, the write finds the stream's rows (its guard) or
    breaks the holds' key, writes nothing, and the batch is read and decided again. Only
    acceptances are decided this way: a batch with any append refused is read and decided
    again. Bounded: the oldest entries are forgotten (forgetting is always safe, it only
    costs a read)."""

    LIMIT = 4096

    def __init__(self) -> None:
        self.head: tuple[int, str] | None = None
        self.versions: dict[str, int] = {}
        self.accounts: dict[str, Balance] = {}
        self.holds: dict[str, Hold] = {}

    def forget(self) -> None:
        self.head = None
        self.versions.clear()
        self.accounts.clear()
        self.holds.clear()

    def state_for(
        self, batch: Batch, effects: list[Effect]
    ) -> tuple[int, str, dict[str, int], Books | None] | None:
        """The head, versions and books ``batch`` is decided on, or None: something it
        needs is not known (then it is read)."""
        if self.head is None:
            return None
        versions = {}
        for pending in batch:
            version = self.versions.get(pending.stream_id)
            if version is not None:
                versions[pending.stream_id] = version
            elif pending.expected_version != NO_STREAM:
                return None  # a stream that exists, at a version not known here
            for required, _ in pending.requires:
                version = self.versions.get(required)
                if version is None:
                    return None
                versions[required] = version
        if not effects:
            return (*self.head, versions, None)
        account_ids, hold_ids = book_needs(effects)
        new_holds = {e.hold.reservation_id for e in effects if isinstance(e, Reserve)}
        books = Books()
        for hold_id in hold_ids:
            hold = self.holds.get(hold_id)
            if hold is None:
                if hold_id not in new_holds:
                    return None
                continue  # a new reservation: its id is taken to be free
            books.holds[hold_id] = copy.copy(hold)  # Books.apply changes them in place
            account_ids.update(hold.accounts)
        for account_id in account_ids:
            balance = self.accounts.get(account_id)
            if balance is None:
                return None
            books.accounts[account_id] = copy.copy(balance)
        return (*self.head, versions, books)

    def learn(
        self,
        decided_on: tuple[int, str],
        head: tuple[int, str],
        versions: dict[str, int],
        books: Books | None,
    ) -> None:
        """A batch decided on the ledger at ``decided_on`` (known here, or just read) left
        it at ``head``, with these versions and books among others. A batch decided on
        another head than the one known here means others wrote: all else is forgotten."""
        if decided_on != self.head:
            self.forget()
        self.head = head
        _remember(self.versions, versions.items())
        if books is not None:
            _remember(self.accounts, books.accounts.items())
            _remember(self.holds, books.holds.items())


def _remember(known: dict[str, _V], entries: Iterable[tuple[str, _V]]) -> None:
    for key, value in entries:
        known.pop(key, None)  # to the end: the most recently used
        known[key] = value
    while len(known) > _Known.LIMIT:
        del known[next(iter(known))]


_NEVER: Final = datetime.min.replace(tzinfo=UTC)


class PostgresCommitter:
    """The appender's own connection on PostgreSQL, and a batch in one to four statements.

    Known (see ``_Known``): the one guarded write, decided on what this appender's last
    commit left. Optimistic (see THE LOCK): the one read of what the batch is decided on,
    then the write, each its own transaction, however many appends the batch holds. When
    the head moved in between, the batch is decided again LOCKED: BEGIN with the head lock
    (one simple-protocol round trip), the read, the write, COMMIT. The connection is
    asyncpg's, not the SQLAlchemy pool's nor psycopg's: the appender's statements are few
    and run thousands of times a second, so what each costs the client's CPU decides (see
    bench/README.md, Decisions: asyncpg). A connection that failed mid-batch is dropped,
    which rolls back what it had not committed; the next batch connects afresh."""

    LOCKED_AFTER_A_LOST_RACE = 16
    """Batches committed under the lock after an optimistic write found the head moved."""

    def __init__(self, engine: AsyncEngine, clock: Callable[[], datetime]) -> None:
        self._clock = clock
        self._dsn = asyncpg_dsn(engine)
        self._conn: asyncpg.Connection | None = None
        self._locked_batches_left = 0
        self._known = _Known()
        self._unlearned: _Learned | None = None  # what the last batch left, for learn()
        # The month whose partitions this appender has made sure of: its first instant and
        # the next month's (a comparison per batch costs less than formatting its month:
        # see bench/README.md, Decisions: the event store).
        self._month: tuple[datetime, datetime] = (_NEVER, _NEVER)
        self.lost_races = 0
        self.unread_batches = 0
        self.wrong_guesses = 0

    def learn(self) -> None:
        """Take in what the last batch left (``_Known.learn``): after its callers are
        woken (the bookkeeping ``commit`` returns), and in any case before the next batch
        is decided."""
        if self._unlearned is not None:
            self._known.learn(*self._unlearned)
            self._unlearned = None

    async def commit(self, batch: Batch) -> Bookkeeping:
        self.learn()
        conn = self._conn
        try:
            if conn is None or conn.is_closed():
                conn = self._conn = await connect(self._dsn, appender=True)
            try:
                now = self._clock()
                if not self._month[0] <= now < self._month[1]:
                    await ensure_months(conn, now)  # this month's table and the next one's exist
                    self._month = month_bounds(month_of(now))
                if self._locked_batches_left == 0:
                    if await self._commit(conn, batch, how="known"):
                        return self.learn
                    if await self._commit(conn, batch, how="read"):
                        return self.learn
                    self.lost_races += 1
                    self._locked_batches_left = self.LOCKED_AFTER_A_LOST_RACE
                self._locked_batches_left -= 1
                await self._commit(conn, batch, how="locked")
                return self.learn
            except BaseException:
                self._unlearned = None
                self._known.forget()  # the batch may have committed, its answer lost
                self._conn = None
                await close_quietly(conn)
                raise
        except Exception as error:
            # asyncpg's errors end here: a database that could not commit now is
            # LedgerUnavailable (retryable); anything else (a constraint the batch broke: a
            # bug, which a retry would meet again) is raised as itself.
            if not is_unavailable(error):
                raise
            raise LedgerUnavailable(f"the ledger could not commit: {error}") from error

    async def _commit(self, conn: asyncpg.Connection, batch: Batch, *, how: _How) -> bool:
        """Decide and write ``batch``; False if nothing was written and the next way must
        decide it again (every append's result is then set again): unlocked, the head moved;
        known, also when nothing could be decided without a read, an append was refused, or
        a guess was wrong."""
        effects = [e for p in batch for e in p.effects]
        if how == "known":
            state = self._known.state_for(batch, effects)
            if state is None:
                return False
            position, previous, versions, books = state
        else:
            if how == "locked":
                # THE LOCK, taken before the read: what the batch is decided on is then the
                # ledger as the previous holder left it, and nobody moves it until COMMIT.
                await conn.execute(_PG_BEGIN_AND_LOCK)  # no arguments: one simple query
            position, previous, versions, books = await _read(conn, batch, effects)
        written = decide(batch, position, previous, versions, books, self._clock())
        if how == "known" and any(isinstance(p.result, BaseException) for p in batch):
            # A refusal is only ever decided on a read. Decided on what is known, it could
            # rest on a guess (a stream taken to be new may exist: the version check comes
            # first), and with nothing else to write no guard would check the rest.
            return False
        if written is None:
            if how == "locked":
                await conn.execute("ROLLBACK")
            self._unlearned = ((position, previous), (position, previous), versions, books)
            return True
        parameters, parts = _write_parameters(written, books, expected=(position, previous))
        write, names = _pg_write(parts, bool(parameters["new_streams"]))
        try:
            moved = await conn.fetchrow(write, *(parameters[name] for name in names))
        except asyncpg.UniqueViolationError:
            if how != "known":
                raise
            # A stream or reservation taken to be new was not. What is known is still true
            # (the head has not moved); the read adds what was missing.
            self.wrong_guesses += 1
            return False
        if moved is None:  # the head's guarded move wrote nothing, so nothing was written
            if how == "locked":  # the head is ours under the lock: it cannot have moved
                raise RuntimeError("the ledger head moved under its lock")
            if how == "known" and parameters["new_streams"]:
                taken, names = positional(_PG_TAKEN)
                if await conn.fetchval(taken, *(parameters[name] for name in names)):
                    self.wrong_guesses += 1  # a stream taken to be new was not
            return False  # the read that follows shows the new head: learn() forgets
        if how == "locked":
            await conn.execute("COMMIT")
        elif how == "known":
            self.unread_batches += 1
        self._unlearned = ((position, previous), (written.head, written.head_hash), versions, books)
        return True

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await close_quietly(conn)


_How = Literal["known", "read", "locked"]

_Learned = tuple[tuple[int, str], tuple[int, str], dict[str, int], Books | None]


async def _read(
    conn: asyncpg.Connection, batch: Batch, effects: list[Effect]
) -> tuple[int, str, dict[str, int], Books | None]:
    """The head, the batch's streams' versions and the books its effects touch, in one
    statement (so one snapshot)."""
    account_ids, hold_ids = book_needs(effects)
    read, names = positional(_PG_READ)
    parameters = {
        "streams": sorted(streams_of(batch)),
        "holds": sorted(hold_ids),
        "accounts": sorted(account_ids),
    }
    row = await conn.fetchrow(read, *(parameters[name] for name in names))
    assert row is not None
    versions = {str(s): int(v) for s, v in orjson.loads(row["versions"]) if v is not None}
    books = None
    if effects:
        books = Books()
        for fields in orjson.loads(row["holds"]):
            hold = hold_of(SimpleNamespace(**fields))
            books.holds[hold.reservation_id] = hold
        for fields in orjson.loads(row["accounts"]):
            balance = balance_of(SimpleNamespace(**fields))
            books.accounts[balance.account_id] = balance
    return int(row["position"]), str(row["hash"]), versions, books


def _write_parameters(
    written: Written, books: Books | None, *, expected: tuple[int, str]
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The write's parameters, and the parts of the books that have rows (``_pg_write``)."""
    new = written.events
    assert new[0].position == expected[0] + 1 and written.head == expected[0] + len(new)
    rows = written.rows
    parameters: dict[str, Any] = {
        "expected": expected[0],
        "expected_hash": expected[1],
        "recorded_at": written.recorded_at,
        "positions": [r["position"] for r in rows],
        "versions": [r["version"] for r in rows],
        "stream_ids": [r["stream_id"] for r in rows],
        "types": [r["types"] for r in rows],
        "hashes": [r["hash"] for r in rows],
        "payloads": [r["payloads"] for r in rows],
        "head": written.head,
        "head_hash": written.head_hash,
        # Streams the batch starts: none may have a row (see THE LOCK).
        "new_streams": [r["stream_id"] for r in rows if r["version"] == 1],
    }
    if books is None:
        return parameters, ()
    writes = book_writes(books, written.recorded_at)
    parts = tuple(part for part in _PG_WRITE_BOOKS if getattr(writes, part))
    for part in parts:
        rows = getattr(writes, part)
        # Rows as JSON, Decimals as their exact strings (the timestamps are the statement's
        # own); reservation ids as an array.
        parameters[part] = rows if part in _ID_PARTS else orjson.dumps(rows, default=str).decode()
    parameters["changed_account_ids"] = [a["account_id"] for a in writes.changed_accounts]
    return parameters, parts
