"""``waybill explain REQUEST_ID`` (contract §3 "Ledger queries"): why a request went where it
did, from its events in the ledger or in the archive."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from ledger.store import EventStore
from ledger.store.archived import ArchiveError
from router.cli._shared import CliError, DatabaseUrl, with_store

__all__ = ["explain_command"]


def explain_command(
    request_id: Annotated[str, typer.Argument(help="The request id (its X-Request-Id).")],
    database_url: DatabaseUrl = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    archive: Annotated[
        Path | None,
        typer.Option(
            "--archive",
            help="The directory of the archived months, for a request recorded in one. "
            "Default: WAYBILL_ARCHIVE_DIR.",
            envvar="WAYBILL_ARCHIVE_DIR",
        ),
    ] = None,
) -> None:
    """Why did this request go there? Its route, attempts and decisions, from the ledger
    (and from the archive, for a request recorded in an archived month)."""
    from ledger.views.explain import NotARequestTrail, explain, render_text
    from ledger.views.queries import RequestArchived, request_trail

    async def work(store: EventStore) -> dict[str, Any]:
        try:
            trail = await request_trail(store.engine, request_id, archive)
        except RequestArchived:
            raise CliError(
                f"request {request_id!r} is not in the live ledger and months of it are "
                "archived: give their directory (--archive or WAYBILL_ARCHIVE_DIR)"
            ) from None
        except ArchiveError as error:
            raise CliError(str(error)) from None
        try:
            return explain(trail)
        except NotARequestTrail:
            raise CliError(f"no request {request_id!r} in the ledger") from None

    explanation = with_store(database_url, work)
    if as_json:
        print(json.dumps(explanation))
    else:
        sys.stdout.write(render_text(explanation))
