"""The ledger by month, on PostgreSQL: ``appends`` is partitioned by month of
``recorded_at``, one table per month (``appends_YYYY_MM``), so that a closed month can be
archived whole and dropped (``ledger.audit.archive``). Each month's table exists before its first
event: the appender ensures the current month's and the next one's on its first batch of
each month (``ensure_months``), so an append at a month's first instant finds its table.
SQLite keeps one table."""

from __future__ import annotations

from datetime import UTC, date, datetime
from typing import Final

import asyncpg

__all__ = [
    "ensure_months",
    "month_bounds",
    "month_of",
    "next_month",
    "partition_name",
    "partition_sql",
]

# Two processes creating the same month take turns (the transaction-scoped advisory lock).
_LOCK: Final = 0x7761_7962_696C_6C31  # "waybill1"


def month_of(moment: datetime) -> str:
    """``YYYY-MM`` of ``moment`` in UTC."""
    return moment.astimezone(UTC).strftime("%Y-%m")


def next_month(month: str) -> str:
    year, number = int(month[:4]), int(month[5:7])
    return f"{year + number // 12:04d}-{number % 12 + 1:02d}"


def month_bounds(month: str) -> tuple[datetime, datetime]:
    """The first instant of ``month`` and of the next one, UTC."""
    start = date.fromisoformat(f"{month}-01")
    end = date.fromisoformat(f"{next_month(month)}-01")
    return (
        datetime(start.year, start.month, 1, tzinfo=UTC),
        datetime(end.year, end.month, 1, tzinfo=UTC),
    )


def partition_name(month: str) -> str:
    return f"appends_{month[:4]}_{month[5:7]}"


def partition_sql(month: str) -> list[str]:
    """The statements that give ``month`` its table (none if it has one): made apart with
    its primary key, then attached (attaching an empty table is quick)."""
    name = partition_name(month)
    start, end = (moment.isoformat() for moment in month_bounds(month))
    return [
        f"CREATE TABLE IF NOT EXISTS {name} (LIKE appends INCLUDING DEFAULTS "
        "INCLUDING CONSTRAINTS, PRIMARY KEY (position))",
        f"""DO $$ BEGIN
            IF NOT EXISTS (SELECT 1 FROM pg_inherits WHERE inhrelid = '{name}'::regclass) THEN
                ALTER TABLE appends ATTACH PARTITION {name}
                    FOR VALUES FROM ('{start}') TO ('{end}');
            END IF;
        END $$""",
    ]


async def ensure_months(conn: asyncpg.Connection, moment: datetime) -> None:
    """The tables of ``moment``'s month and the next one exist."""
    month = month_of(moment)
    async with conn.transaction():
        await conn.execute(f"SELECT pg_advisory_xact_lock({_LOCK})")
        for each in (month, next_month(month)):
            for statement in partition_sql(each):
                await conn.execute(statement)
