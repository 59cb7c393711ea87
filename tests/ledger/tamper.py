"""What a hostile operator with the database's superuser rights can do to the ledger: edit
around the immutability triggers and recompute everything the database can check."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from itertools import groupby
from typing import Any

import orjson
from sqlalchemy import create_engine, text

from ledger.store import GENESIS_HASH, chain_hash
from ledger.store.db import sync_url
from ledger.store.stored import TYPE_CHARS, compress, stored_events, types_of


@dataclass
class Stored:
    """One event as the ledger's rows hold it; ``row`` is its row's first position."""

    position: int
    row: int
    stream_id: str
    version: int
    type: str
    recorded_at: datetime
    hash: str
    payload: bytes


def _engine(database_url: str) -> Any:
    return create_engine(sync_url(database_url))


def _disable_triggers(conn: Any, postgres: bool) -> None:
    if postgres:
        conn.execute(text("ALTER TABLE appends DISABLE TRIGGER USER"))
    else:
        conn.execute(text("DROP TRIGGER IF EXISTS appends_no_update"))
        conn.execute(text("DROP TRIGGER IF EXISTS appends_no_delete"))


def _read(conn: Any) -> list[Stored]:
    rows = conn.execute(text("SELECT * FROM appends ORDER BY position")).all()
    found = []
    previous = None
    for row in rows:
        types = types_of(row.types)
        events = stored_events(row.position, previous, bytes(row.payloads))
        previous = bytes(row.hash)
        for offset, (position, hash_, payload) in enumerate(events):
            found.append(
                Stored(
                    position,
                    row.position,
                    row.stream_id,
                    row.version + offset,
                    types[offset] if offset < len(types) else "",
                    row.recorded_at,
                    hash_,
                    payload,
                )
            )
    return found


def edit_ledger(
    database_url: str, change: Callable[[list[Stored]], None], *, rehash: bool = False
) -> None:
    """Rewrite the ledger's rows as ``change`` edits its events (a row's columns are taken
    from its first event's fields, its types from each event's, its hash from its last
    event's): with ``rehash``, every hash and the head are recomputed, so that the hash chain
    verifies again."""
    engine = _engine(database_url)
    postgres = engine.dialect.name == "postgresql"
    with engine.begin() as conn:
        _disable_triggers(conn, postgres)
        events = _read(conn)
        change(events)
        if rehash:
            previous = GENESIS_HASH
            for event in events:
                event.hash = previous = chain_hash(previous, event.position, event.payload)
            conn.execute(text("UPDATE ledger_head SET hash = :h"), {"h": previous})
        conn.execute(text("DELETE FROM appends"))
        for _, run in groupby(events, key=lambda e: e.row):
            members = list(run)
            first = members[0]
            conn.execute(
                text(
                    "INSERT INTO appends (position, recorded_at, version, stream_id, types, "
                    "hash, payloads) VALUES (:p, :at, :v, :s, :t, :h, :b)"
                ),
                {
                    "p": first.position,
                    "at": first.recorded_at,
                    "v": first.version,
                    "s": first.stream_id,
                    "t": "".join(TYPE_CHARS[e.type] for e in members),
                    "h": bytes.fromhex(members[-1].hash),
                    "b": compress([e.payload for e in members]),
                },
            )
    engine.dispose()


def rewrite_event(
    database_url: str, position: int, edit: Callable[[dict[str, Any]], dict[str, Any]]
) -> None:
    """Rewrite one event's data in its stored bytes, then recompute every later hash and
    the ledger head: the hash chain verifies again."""

    def change(events: list[Stored]) -> None:
        event = next(e for e in events if e.position == position)
        body = orjson.loads(event.payload)
        body["data"] = edit(body["data"])
        event.payload = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)

    edit_ledger(database_url, change, rehash=True)


def cut_tail(database_url: str, keep: int) -> None:
    """Delete every event after ``keep`` and move the head back to it."""
    head: list[str] = []

    def change(events: list[Stored]) -> None:
        head.append(next(e.hash for e in events if e.position == keep))
        events[:] = [e for e in events if e.position <= keep]

    edit_ledger(database_url, change)
    engine = _engine(database_url)
    with engine.begin() as conn:
        move = text("UPDATE ledger_head SET position = :k, hash = :h")
        conn.execute(move, {"k": keep, "h": head[0]})
    engine.dispose()
