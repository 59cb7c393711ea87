"""The ledger's database: ``waybill migrate`` (its schema), ``replay`` and ``projections``
(its read models and books, rebuilt and their lag) and ``archive`` (its oldest months moved
to files), contract §1, §7 "Retention"."""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import date
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from ledger.store import EventStore
from ledger.store.db import migrate, resolve_database_url
from ledger.views import all_projections
from ledger.views.projection import ProjectionRunner
from router.cli._shared import (
    CliError,
    DatabaseUrl,
    err,
    friendly_errors,
    out,
    progress_bar,
    progress_callback,
    with_store,
)

__all__ = ["archive_command", "migrate_command", "projections_command", "replay_command"]


def migrate_command(database_url: DatabaseUrl = None) -> None:
    """Upgrade the database schema to the latest revision (alembic upgrade head)."""
    url = resolve_database_url(database_url)
    with friendly_errors():
        migrate(url)
    err.print("[green]database is at the latest revision[/green]")


def replay_command(
    database_url: DatabaseUrl = None,
    projection: Annotated[
        str | None,
        typer.Option(
            "--projection",
            help="Only this projection, or `books` for the budget balances, holds and "
            "resolutions (default: all of them).",
        ),
    ] = None,
    archive: Annotated[
        Path | None,
        typer.Option(
            "--archive",
            help="The directory of the archived months (`waybill archive`), needed once "
            "months are archived: their events are read from the files, checked as the "
            "chain's start. Default: WAYBILL_ARCHIVE_DIR.",
            envvar="WAYBILL_ARCHIVE_DIR",
        ),
    ] = None,
) -> None:
    """Rebuild projections and the books from event 0."""
    from ledger.audit.book_audit import rebuild_books

    async def work(store: EventStore) -> dict[str, int]:
        runner = ProjectionRunner(store, all_projections())
        names = [projection] if projection else [*runner.projections, BOOKS]
        try:
            chosen = [runner.get(name) for name in names if name != BOOKS]
        except KeyError as error:
            raise CliError(f"{error.args[0]} (or {BOOKS})") from None
        applied: dict[str, int] = {}
        with progress_bar() as progress:
            if chosen:
                # One pass over the ledger rebuilds them all: each page is read and decoded
                # once.
                label = ", ".join(t.name for t in chosen)
                task = progress.add_task(f"replaying {label}", total=None)
                count = await runner.replay(
                    *chosen, progress=progress_callback(progress, task), archive=archive
                )
                applied.update((target.name, count) for target in chosen)
            if BOOKS in names:
                # Under the ledger head's lock: appends wait until the books are rewritten.
                task = progress.add_task("rebuilding the books", total=None)
                report = await rebuild_books(
                    store, progress_callback(progress, task), archive=archive
                )
                applied[BOOKS] = report.events
                for found in report.discrepancies:
                    err.print(
                        f"  was wrong: {found.kind} {found.id}: {found.detail}",
                        highlight=False,
                        markup=False,
                    )
        return applied

    applied = with_store(database_url, work)
    for name, count in applied.items():
        out.print(f"{name}: rebuilt from {count} events")


BOOKS = "books"
"""``replay --projection books``: the budget tables, kept by the append path, not a
projection, but rebuilt from the events all the same."""


def projections_command(
    database_url: DatabaseUrl = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Show each projection's lag (head position minus checkpoint)."""

    async def work(store: EventStore) -> dict[str, int]:
        return await ProjectionRunner(store, all_projections()).lag()

    lag = with_store(database_url, work)
    if as_json:
        print(json.dumps({"lag": lag}))
        return
    table = Table("projection", "lag (events)")
    for name, value in lag.items():
        table.add_row(name, str(value))
    out.print(table)


def archive_command(
    before: Annotated[
        str, typer.Option("--before", help="Archive the whole months ended by this date.")
    ],
    to: Annotated[Path, typer.Option("--to", help="The directory of the archive files.")],
    database_url: DatabaseUrl = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Write each closed month before --before to a compressed file in --to (its chain
    segment and end hash), then drop it from the database (PostgreSQL)."""
    from ledger.audit.archive import ArchiveRefused, archive_months
    from ledger.store.archived import ArchiveError

    try:
        day = date.fromisoformat(before)
    except ValueError:
        err.print(f"--before: not a date (YYYY-MM-DD): {before!r}")
        raise typer.Exit(2) from None

    async def work(store: EventStore) -> list[Any]:
        with progress_bar() as progress:
            task = progress.add_task("archiving", total=None)
            try:
                return await archive_months(store, day, to, progress_callback(progress, task))
            except (ArchiveRefused, ArchiveError) as refused:
                raise CliError(str(refused)) from None

    segments = with_store(database_url, work)
    if as_json:
        print(json.dumps({"archived": [asdict(s) for s in segments], "directory": str(to)}))
        return
    if not segments:
        out.print(f"nothing to archive before {day}")
    for segment in segments:
        out.print(
            f"archived {segment.month}: positions {segment.first_position}-"
            f"{segment.last_position} ({segment.events} events) to {to / segment.file}, "
            f"end hash {segment.end_hash}",
            highlight=False,
        )
