"""A SQLite ledger comes out of ``migrate`` in WAL mode, so that no gateway connection has
to switch it (taking an exclusive lock) while others open."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from ledger.store.db import migrate


def test_migrate_leaves_a_sqlite_ledger_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    migrate(f"sqlite:///{path}")
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    finally:
        conn.close()
