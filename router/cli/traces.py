"""``waybill otel export``: (re-)export a window's traces from the ledger over OTLP
(contract §8), with the ids and timestamps the live exporter gave them."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Annotated, Any

import typer

from ledger.store import EventStore
from router.cli._shared import (
    CliError,
    ConfigFile,
    DatabaseUrl,
    friendly_errors,
    out,
    progress_bar,
    progress_callback,
    read_config,
    with_store,
)

__all__ = ["otel_app"]

otel_app = typer.Typer(
    help="Traces from the ledger, over OTLP (OTEL_* variables).", no_args_is_help=True
)


def _instant(value: str | None, option: str) -> Any:
    """An ISO 8601 date or timestamp; without a zone it is UTC, like the ledger's."""
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise CliError(f"{option}: not an ISO 8601 date or timestamp: {value!r}") from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


@otel_app.command("export")
def otel_export_command(
    since: Annotated[
        str | None,
        typer.Option("--since", help="Requests received at or after this ISO time (UTC)."),
    ] = None,
    until: Annotated[
        str | None, typer.Option("--until", help="Requests received before this ISO time (UTC).")
    ] = None,
    database_url: DatabaseUrl = None,
    config_file: ConfigFile = None,
) -> None:
    """(Re-)export the traces of a window from the ledger, same ids and timestamps. With a
    config whose otel.pseudonymous_tenants is true, tenants are named by pseudonym."""
    from otel import export

    # The exporter's own retry chatter would drown the one-line error below.
    logging.getLogger("opentelemetry.exporter").setLevel(logging.CRITICAL)
    with friendly_errors():
        start, end = _instant(since, "--since"), _instant(until, "--until")
        if start is not None and end is not None and end <= start:
            raise CliError("--until must be after --since")
        try:
            exporter = export.trace_exporter_from_env(explicit=True)
        except export.OtelConfigError as error:
            raise CliError(str(error)) from None
        if exporter is None:
            raise CliError("trace export is off (OTEL_TRACES_EXPORTER=none or OTEL_SDK_DISABLED)")
        tenant_key = read_config(config_file).otel.tenant_key if config_file else None
    endpoint = export.traces_endpoint()

    async def work(store: EventStore) -> Any:
        try:
            with progress_bar() as progress:
                task = progress.add_task("exporting traces", total=None)
                return await export.export_window(
                    store,
                    start,
                    end,
                    exporter,
                    progress=progress_callback(progress, task),
                    tenant_key=tenant_key,
                )
        except export.ExportFailed as error:
            raise CliError(f"{error} ({endpoint}); nothing after that was sent") from None
        finally:
            exporter.shutdown()

    result = with_store(database_url, work)
    line = f"exported {result.spans} spans of {result.requests} requests to {endpoint}"
    if result.unfinished:
        line += f" ({result.unfinished} requests still in progress were left out)"
    out.print(line, highlight=False)
