"""What a hostile operator with the database's superuser rights can do to the ledger: edit
around the immutability triggers and recompute everything the database can check."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from sqlalchemy import create_engine, text

from ledger.db import sync_url
from ledger.store import GENESIS_HASH, chain_hash


def _engine(database_url: str) -> Any:
    return create_engine(sync_url(database_url))


def _disable_triggers(conn: Any, postgres: bool) -> None:
    if postgres:
        conn.execute(text("ALTER TABLE events DISABLE TRIGGER USER"))
    else:
        conn.execute(text("DROP TRIGGER IF EXISTS events_no_update"))
        conn.execute(text("DROP TRIGGER IF EXISTS events_no_delete"))


def rewrite_event(
    database_url: str, position: int, edit: Callable[[dict[str, Any]], dict[str, Any]]
) -> None:
    """Rewrite one event's data and stored bytes consistently, then recompute every later
    hash and the ledger head: the hash chain verifies again."""
    engine = _engine(database_url)
    postgres = engine.dialect.name == "postgresql"
    with engine.begin() as conn:
        _disable_triggers(conn, postgres)
        rows = conn.execute(
            text("SELECT position, payload FROM events WHERE position >= :p ORDER BY position"),
            {"p": position - 1},
        ).all()
        previous = GENESIS_HASH
        if position > 1:
            previous = conn.execute(
                text("SELECT hash FROM events WHERE position = :p"), {"p": position - 1}
            ).scalar_one()
        for row in rows:
            if row.position < position:
                continue
            payload = bytes(row.payload)
            if row.position == position:
                body = orjson.loads(payload)
                body["data"] = edit(body["data"])
                payload = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
                data = orjson.dumps(body["data"]).decode()
                cast = "CAST(:data AS jsonb)" if postgres else ":data"
                statement = f"UPDATE events SET payload = :payload, data = {cast} WHERE position=:p"
                conn.execute(text(statement), {"payload": payload, "data": data, "p": row.position})
            previous = chain_hash(previous, row.position, payload)
            conn.execute(
                text("UPDATE events SET hash = :h WHERE position = :p"),
                {"h": previous, "p": row.position},
            )
        conn.execute(text("UPDATE ledger_head SET hash = :h"), {"h": previous})
    engine.dispose()


def cut_tail(database_url: str, keep: int) -> None:
    """Delete every event after ``keep`` and move the head back to it."""
    engine = _engine(database_url)
    with engine.begin() as conn:
        _disable_triggers(conn, engine.dialect.name == "postgresql")
        conn.execute(text("DELETE FROM events WHERE position > :k"), {"k": keep})
        head = conn.execute(
            text("SELECT hash FROM events WHERE position = :k"), {"k": keep}
        ).scalar_one()
        move = text("UPDATE ledger_head SET position = :k, hash = :h")
        conn.execute(move, {"k": keep, "h": head})
    engine.dispose()
