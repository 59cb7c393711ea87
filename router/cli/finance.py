"""The money commands of contract §6: ``waybill spend`` (the spend report), ``reprice``
(recorded costs against a provider's cost report), ``settle`` (an unknown-usage settlement
by hand) and ``period close`` (a month's books). Reconciliation is ``router.cli.reconcile``."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import date
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated, Any, Final

import typer
from rich import box
from rich.table import Table

from ledger.store import EventStore
from ledger.views import all_projections
from ledger.views.projection import ProjectionRunner
from router.cli._shared import CliError, DatabaseUrl, err, friendly_errors, out, with_store

__all__ = ["period_app", "reprice_command", "settle_command", "spend_command", "spend_table"]

period_app = typer.Typer(help="Close a month's books (contract §6).", no_args_is_help=True)


def spend_command(
    database_url: DatabaseUrl = None,
    group_by: Annotated[
        str,
        typer.Option(
            "--group-by",
            help="Comma-separated: workspace,key,model,endpoint,upstream_model,api,day",
        ),
    ] = "workspace",
    since: Annotated[str | None, typer.Option("--from", help="First day (YYYY-MM-DD).")] = None,
    until: Annotated[str | None, typer.Option("--to", help="Last day (YYYY-MM-DD).")] = None,
    output: Annotated[str, typer.Option("--format", help="table | csv | json")] = "table",
) -> None:
    """Spend report: settled and unknown-held amounts, requests and attempts per group."""
    from ledger.views.spend_queries import ADJUSTMENT_COLUMNS, GROUP_KEYS, spend_csv, spend_report

    keys = [k.strip() for k in group_by.split(",") if k.strip()]
    if (
        not keys
        or any(k not in GROUP_KEYS for k in keys)
        or output
        not in (
            "table",
            "csv",
            "json",
        )
    ):
        err.print(
            f"[red]error:[/red] --group-by takes {', '.join(GROUP_KEYS)}; "
            "--format takes table, csv or json"
        )
        raise typer.Exit(2)

    def day(value: str | None, flag: str) -> date | None:
        if value is None:
            return None
        try:
            return date.fromisoformat(value)
        except ValueError:
            raise CliError(f"{flag} must be a date like 2026-11-30, not {value!r}") from None

    async def work(store: EventStore) -> list[dict[str, Any]]:
        # The spend view is a projection: bring it up to date before reading it.
        runner = ProjectionRunner(store, all_projections())
        await runner.catch_up(runner.get("spend"))
        return await spend_report(
            store.engine, group_by=keys, since=day(since, "--from"), until=day(until, "--to")
        )

    rows = with_store(database_url, work)
    if output == "json":
        print(json.dumps({"data": rows}))
    elif output == "csv":
        print(spend_csv(rows, keys), end="")
    else:
        out.print(spend_table(rows, keys, [*_AMOUNT_COLUMNS, *ADJUSTMENT_COLUMNS]))


_AMOUNT_COLUMNS: Final = ("settled_usd", "held_unknown_usd", "overrun_usd")


def spend_table(
    rows: Sequence[Mapping[str, Any]], keys: Sequence[str], amounts: Sequence[str]
) -> Table:
    """The spend rows as a table that keeps every amount whole in an 80-column terminal.

    An amount column that is zero in every row is left out (settled_usd always stays),
    headers drop the `_usd` every amount has (the caption says it), amounts their trailing
    zeros; the group keys wrap before an amount is ever cut.
    """
    shown = [
        column
        for column in amounts
        if column == "settled_usd" or any(Decimal(row[column]) != 0 for row in rows)
    ]
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, caption="amounts in USD")
    for key in keys:
        table.add_column(key, overflow="fold")
    for column in shown:
        header = column.removesuffix("_usd").replace("adjustment_", "adj_")
        width = max((len(_plain(row[column])) for row in rows), default=1)
        table.add_column(header, justify="right", no_wrap=True, min_width=width, overflow="fold")
    for column in ("requests", "attempts"):
        table.add_column(column, justify="right", no_wrap=True)
    for row in rows:
        table.add_row(
            *(str(row[k]) for k in keys),
            *(_plain(row[c]) for c in shown),
            str(row["requests"]),
            str(row["attempts"]),
        )
    return table


def _plain(amount: str) -> str:
    """An exact decimal string without trailing zeros: `0.0000078`, `0`, `12.5`."""
    return format(Decimal(amount).normalize(), "f")


def reprice_command(
    files: Annotated[
        list[str],
        typer.Argument(
            help="A cost report's pages (OpenAI, Anthropic), or a day,model,cost_usd CSV."
        ),
    ],
    since: Annotated[str, typer.Option("--since", help="First day (YYYY-MM-DD).")],
    until: Annotated[str, typer.Option("--until", help="Last day, inclusive (YYYY-MM-DD).")],
    database_url: DatabaseUrl = None,
    endpoint: Annotated[
        str | None,
        typer.Option(
            "--endpoint",
            help="Hold only this endpoint's recorded costs against the report (its own bill).",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Compare the costs the ledger recorded with a provider's cost report, by model and
    day, and name the days where they part (a price change the config missed)."""
    from ledger.finance.provider_reports import ExportError
    from ledger.finance.reprice import compare, provider_costs, recorded_costs

    with friendly_errors():
        try:
            first, last = date.fromisoformat(since), date.fromisoformat(until)
        except ValueError:
            raise CliError("--since and --until must be dates like 2026-11-30") from None
        pages: list[tuple[str | None, bytes]] = []
        for name in files:
            try:
                pages.append((Path(name).name, Path(name).read_bytes()))
            except OSError as error:
                raise CliError(f"cannot read {name}: {error.strerror or error}") from None
        try:
            provider = provider_costs(pages, first, last)
        except ExportError as error:
            raise CliError(str(error)) from None

    async def work(store: EventStore) -> Any:
        runner = ProjectionRunner(store, all_projections())
        await runner.catch_up(runner.get("spend"))
        return compare(await recorded_costs(store.engine, first, last, endpoint), provider)

    rows = with_store(database_url, work)
    parted = sorted({row.day for row in rows if row.parted})
    if as_json:
        print(json.dumps({"rows": [row.as_json() for row in rows], "parted_days": parted}))
        return
    table = Table("day", "model", "ledger_usd", "provider_usd", "difference_usd", "status")
    for row in rows:
        table.add_row(*(str(v) for v in row.as_json().values()))
    out.print(table)
    if parted:
        out.print(f"costs part on {len(parted)} day(s): {', '.join(parted)}", highlight=False)
    else:
        out.print("recorded costs match the provider's on every day", highlight=False)


@period_app.command("close")
def period_close_command(
    period: Annotated[str, typer.Argument(help="The month, UTC: YYYY-MM.")],
    allow_open: Annotated[
        bool,
        typer.Option("--allow-open", help="Close with unknown-usage settlements still open."),
    ] = False,
    database_url: DatabaseUrl = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the PeriodClosed event.")] = False,
) -> None:
    """Close a month: record each workspace's settled, held-unknown and overrun totals of the
    attempts reserved in it, with the ledger position. Later changes become adjustments."""
    from ledger.finance.periods import PeriodError, close_period

    async def work(store: EventStore) -> Any:
        try:
            return await close_period(store, period, actor="cli", allow_open=allow_open)
        except PeriodError as error:
            raise CliError(str(error)) from None

    event = with_store(database_url, work)
    if as_json:
        print(json.dumps(event.model_dump(mode="json")))
        return
    out.print(
        f"closed {event.period} at ledger position {event.position}"
        + (
            f" with {event.open_unknown} unknown-usage settlement(s) open"
            if event.open_unknown
            else ""
        ),
        highlight=False,
    )
    table = Table(
        "workspace", "settled_usd", "held_unknown_usd", "overrun_usd", "requests", "attempts"
    )
    for total in event.totals:
        table.add_row(
            total.workspace,
            format(total.settled_usd, "f"),
            format(total.held_unknown_usd, "f"),
            format(total.overrun_usd, "f"),
            str(total.requests),
            str(total.attempts),
        )
    out.print(table)


def settle_command(
    settlement_id: Annotated[str, typer.Argument(help="An unknown-usage settlement (unk_...).")],
    settled_usd: Annotated[str, typer.Option("--usd", help="What the attempt really cost.")],
    reason: Annotated[str, typer.Option("--reason", help="Why: recorded with the event.")],
    force: Annotated[
        bool,
        typer.Option("--force", help="Settle an amount over 1,000x the hold all the same."),
    ] = False,
    database_url: DatabaseUrl = None,
) -> None:
    """Settle an unknown-usage settlement by hand (an operator's decision, on the ledger).
    The amount given is settled; above the hold, the excess is recorded as an overrun."""
    from ledger.books.settlements import SettlementError, SettlementRefused, settle_unknown

    try:
        amount = Decimal(settled_usd)
    except InvalidOperation:
        err.print(f"[red]error:[/red] --usd must be a decimal amount, not {settled_usd!r}")
        raise typer.Exit(2) from None
    if not reason.strip():
        err.print("[red]error:[/red] --reason must say why")
        raise typer.Exit(2)

    async def work(store: EventStore) -> Any:
        try:
            return await settle_unknown(
                store, settlement_id, amount, actor="cli", reason=reason.strip(), force=force
            )
        except (SettlementError, SettlementRefused) as error:
            raise CliError(str(error)) from None

    event, overrun = with_store(database_url, work)
    outcome = (
        f"{event.released_usd} released"
        if overrun is None
        else f"overrun {overrun.excess_usd} USD recorded"
    )
    out.print(
        f"settled {settlement_id}: {event.settled_usd} USD of {event.held_usd} held, {outcome}",
        highlight=False,
    )
