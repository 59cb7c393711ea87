"""``waybill verify`` (contract §7): the hash chain, and with ``--books`` the budget tables
against the events, with ``--checkpoints`` the ledger against its signed checkpoints; each
run recorded for the console's Health page."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from sqlalchemy.exc import DBAPIError

from ledger.audit.verify import record_verification, verify_chain
from ledger.store import EventStore
from router.cli._shared import (
    CliError,
    DatabaseUrl,
    err,
    friendly_errors,
    load_public_keys,
    out,
    progress_bar,
    progress_callback,
    with_store,
)

__all__ = ["verify_command"]


def verify_command(
    database_url: DatabaseUrl = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    books: Annotated[
        bool,
        typer.Option(
            "--books",
            help="Also fold the budget events and compare them with the live balances, "
            "holds and resolutions, naming each that differs.",
        ),
    ] = False,
    checkpoints: Annotated[
        str | None,
        typer.Option(
            "--checkpoints",
            help="Also check the ledger against the signed checkpoints in this directory "
            "(a sink, or a copy of its checkpoint files).",
        ),
    ] = None,
    public_key: Annotated[
        list[str] | None,
        typer.Option(
            "--public-key",
            help="A public key the checkpoints may be signed with (repeat it for each key).",
        ),
    ] = None,
    archive: Annotated[
        Path | None,
        typer.Option(
            "--archive",
            help="The directory of the archived months (`waybill archive`): checked as the "
            "chain's start, and their budget events folded by --books. Default: "
            "WAYBILL_ARCHIVE_DIR.",
            envvar="WAYBILL_ARCHIVE_DIR",
        ),
    ] = None,
) -> None:
    """Verify the ledger's hash chain; exits non-zero naming the first bad event. With
    --checkpoints, also that its Merkle tree has each signed checkpoint's root."""
    from ledger.audit.book_audit import BooksReport, check_books

    audit = _checkpoint_audit(checkpoints, public_key)

    async def work(store: EventStore) -> tuple[Any, BooksReport | None, Any]:
        with progress_bar() as progress:
            task = progress.add_task("verifying", total=None)
            observe = audit.feed if audit is not None and audit.planned else None
            result = await verify_chain(
                store, progress_callback(progress, task), observe=observe, archive=archive
            )
            report = None
            if books:
                task = progress.add_task("checking the books", total=None)
                report = await check_books(
                    store, progress_callback(progress, task), archive=archive
                )
        audited = None
        if audit is not None:
            audited = await audit.finish(store.engine, complete=result.ok)
        await _record_verification(store, result, report, audited)
        return result, report, audited

    result, report, audited = with_store(database_url, work)
    ok = result.ok and (report is None or report.ok) and (audited is None or audited.ok)
    if as_json:
        answer = result.as_json()
        if report is not None:
            answer["books"] = report.as_json()
        if audited is not None:
            answer["checkpoints"] = audited.as_json()
        answer["ok"] = ok
        print(json.dumps(answer))
        raise typer.Exit(0 if ok else 1)
    if result.ok:
        line = f"ledger OK: {result.checked} events, head at position {result.head_position}"
        if result.archived and not result.archive_checked:
            line += f" (positions 1-{result.archived} archived, not checked: give --archive)"
        elif result.archived:
            line += f" (positions 1-{result.archived} from the archive)"
        out.print(line)
    else:
        out.print(
            f"ledger BROKEN at position {result.first_bad_position}: {result.problem} "
            f"({result.checked} events verified before it)"
        )
    if report is not None:
        _print_books(report)
    if audited is not None:
        _print_checkpoints(audited)
    raise typer.Exit(0 if ok else 1)


async def _record_verification(store: EventStore, result: Any, report: Any, audited: Any) -> None:
    """Keep the run's outcome for the console's Health page. A ledger this command may only
    read (a replica, a restored backup) is still verified: the record is then skipped,
    saying so on stderr."""
    try:
        await record_verification(
            store.engine,
            result,
            verified_by="cli",
            books_ok=None if report is None else report.ok,
            checkpoints_ok=None if audited is None else audited.ok,
        )
    except DBAPIError as error:
        err.print(
            f"this verification was not recorded: {type(error.orig).__name__}",
            highlight=False,
            markup=False,
        )


def _print_books(report: Any) -> None:
    if report.ok:
        out.print(
            f"books OK: {report.accounts} accounts and {report.holds} holds are what "
            f"{report.events} budget events add up to",
            highlight=False,
        )
        return
    out.print(
        f"books DIFFER from the ledger in {len(report.discrepancies)} place(s) "
        "(`waybill replay --projection books` rebuilds them from the events):",
        highlight=False,
    )
    for found in report.discrepancies:
        out.print(f"  {found.kind} {found.id}: {found.detail}", highlight=False, markup=False)


def _checkpoint_audit(directory: str | None, public_keys: list[str] | None) -> Any:
    """The audit ``verify --checkpoints`` feeds, or None without the option."""
    from ledger.audit.checkpoint_audit import CheckpointAudit
    from ledger.audit.sink import SinkError, TreeFiles, read_sink

    if directory is None:
        if public_keys:
            err.print("[red]error:[/red] --public-key goes with --checkpoints DIR")
            raise typer.Exit(2)
        return None
    if not public_keys:
        err.print("[red]error:[/red] --checkpoints needs --public-key FILE (one per key)")
        raise typer.Exit(2)
    with friendly_errors():
        keys = load_public_keys(public_keys)
        try:
            entries = read_sink(Path(directory), strict=True)
        except SinkError as error:
            raise CliError(str(error)) from None
    tree = TreeFiles(Path(directory))
    return CheckpointAudit(entries, keys, tree if tree.leaves else None)


def _print_checkpoints(report: Any) -> None:
    if report.ok:
        out.print(
            f"checkpoints OK: {report.verified} signed tree sizes up to {report.largest_size} "
            f"(from {report.checkpoints} checkpoints, keys {', '.join(report.key_ids)}) are the "
            "ledger's, each consistent with the one before",
            highlight=False,
        )
        return
    if report.failure is None:
        out.print(
            f"checkpoints NOT CHECKED: {report.unchecked} checkpoints lie beyond the break in "
            "the hash chain",
            highlight=False,
        )
        return
    out.print(f"checkpoint FAILED: {report.failure.describe()}", highlight=False, markup=False)
