"""``waybill reconcile`` (contract §1, §3): import a usage export or a provider's report pages,
fetch a provider's report from its admin API, and show a recorded report down to one bucket.

``waybill reconcile FILE...`` imports (the ``import`` subcommand, named or not);
``waybill reconcile fetch`` and ``waybill reconcile show`` are subcommands. Every report
prints as a table, JSON or CSV (``--output``; ``--json`` is ``--output json``).
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal

import typer
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from ledger.store import EventStore
from router.cli._shared import (
    CliError,
    ConfigFile,
    DatabaseUrl,
    err,
    friendly_errors,
    out,
    progress_bar,
    progress_callback,
    read_config,
    with_store,
)

if TYPE_CHECKING:
    from ledger.finance.reconcile import ReconcileScope

__all__ = ["reconcile_app"]

Output = Literal["table", "json", "csv"]
InputFormat = Literal[
    "openai-usage",
    "openai-costs",
    "anthropic-usage",
    "anthropic-costs",
    "anthropic-analytics",
    "lines",
]


class _FilesOrCommand(TyperGroup):
    """``waybill reconcile FILE...`` is ``waybill reconcile import FILE...``: anything that
    is not a subcommand's name is a file (or an option of the import)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["import", *args]
        return super().parse_args(ctx, args)


reconcile_app = typer.Typer(
    cls=_FilesOrCommand,
    help="Reconcile the ledger with what a provider billed: usage exports and report pages.",
    no_args_is_help=True,
)

OutputOption = Annotated[
    Output | None,
    typer.Option("--output", "-o", help="table (default), json or csv."),
]
JsonOption = Annotated[bool, typer.Option("--json", help="The same as --output json.")]
ForceOption = Annotated[
    bool, typer.Option("--force", help="Settle amounts over 1,000x their hold all the same.")
]

_REPORT_LISTS: Final = (
    "matched",
    "settled_unknown",
    "amount_mismatches",
    "unmatched_provider_lines",
    "unmatched_attempts",
    "overruns",
)
_ENTRY_COLUMNS: Final = (
    "line",
    "attempt_id",
    "provider_request_id",
    "expected_usd",
    "provider_usd",
    "detail",
)
_BUCKET_COLUMNS: Final = (
    "bucket",
    "bucket_end",
    "model",
    "endpoints",
    "project_id",
    "api_key_id",
    "workspace_id",
    "provider_input_tokens",
    "provider_cached_input_tokens",
    "provider_output_tokens",
    "provider_requests",
    "provider_usd",
    "ledger_attempts",
    "ledger_input_tokens",
    "ledger_cached_input_tokens",
    "ledger_output_tokens",
    "ledger_usd",
    "held_unknown_usd",
    "settled_unknown_usd",
    "unknown_settlements",
    "difference_input_tokens",
    "difference_cached_input_tokens",
    "difference_output_tokens",
    "difference_usd",
    "within_tolerance",
    "status",
)
_ATTEMPT_COLUMNS: Final = (
    "attempt_id",
    "request_id",
    "endpoint",
    "model",
    "workspace",
    "state",
    "started_at",
    "input_tokens",
    "cached_input_tokens",
    "output_tokens",
    "settled_usd",
    "held_unknown_usd",
    "settlement_id",
)


def _output(output: Output | None, as_json: bool) -> Output:
    if as_json and output not in (None, "json"):
        raise CliError("--json and --output other than json: choose one")
    return "json" if as_json else output or "table"


@reconcile_app.command("import")
def import_command(
    files: Annotated[
        list[str],
        typer.Argument(help="A usage export (CSV/JSONL), or the pages of one provider report."),
    ],
    report_format: Annotated[
        InputFormat | None,
        typer.Option("--format", help="What the files are (default: told from their content)."),
    ] = None,
    provider: Annotated[
        str | None, typer.Option("--provider", help="Reconcile only this endpoint's attempts.")
    ] = None,
    workspace: Annotated[
        str | None,
        typer.Option(
            "--workspace",
            help="A usage export of one workspace: match only its attempts, as its finance "
            "key would, and let that key read the report (console and API).",
        ),
    ] = None,
    config_file: ConfigFile = None,
    database_url: DatabaseUrl = None,
    output: OutputOption = None,
    as_json: JsonOption = False,
    force: ForceOption = False,
) -> None:
    """Import a usage export or a provider report's pages: match, settle unknown usage, report."""
    from ledger.finance.provider_reports import detect_format
    from ledger.finance.reconcile import ReconcileScope

    with friendly_errors():
        chosen_output = _output(output, as_json)
        contents = [(name, _read(name)) for name in files]
        chosen: str | None = report_format
        if chosen is None:
            found = {detect_format(data) for _, data in contents}
            if "lines" in found and len(found) > 1:
                raise CliError("these files mix a usage export and report pages: one at a time")
            chosen = "lines" if found == {"lines"} else None
        if chosen == "lines" and len(contents) > 1:
            raise CliError(
                "one usage export at a time (several files are a provider report's pages)"
            )
    if chosen == "lines":
        scope = ReconcileScope(workspace=workspace, provider=provider)
        report = _import_lines(files[0], contents[0][1], scope, database_url, force)
    elif workspace is not None:
        # As for a finance key (contract §3): a provider's bucket counts every workspace's
        # traffic on its identity, so it cannot be reconciled for one workspace.
        with friendly_errors():
            raise CliError("--workspace is for a usage export: a provider report spans every one")
    else:
        report = _import_report(
            contents, chosen, provider, config_file, database_url, force, label=", ".join(files)
        )
    print_report(report, chosen_output)


def _read(name: str) -> bytes:
    try:
        return Path(name).read_bytes()
    except OSError as error:
        raise CliError(f"cannot read {name}: {error.strerror or error}") from None


def _import_lines(
    name: str, data: bytes, scope: ReconcileScope, database_url: str | None, force: bool
) -> dict[str, Any]:
    from ledger.finance.reconcile import ExportError, import_reconciliation, report_json
    from ledger.finance.usage_export import ExportFormat

    suffix = Path(name).suffix.lower()
    # The file's extension names its format; anything else is sniffed from its first line.
    export_format: ExportFormat | None = (
        "csv" if suffix == ".csv" else "jsonl" if suffix in (".jsonl", ".ndjson") else None
    )

    async def work(store: EventStore) -> dict[str, Any]:
        try:
            with progress_bar() as progress:
                task = progress.add_task("reconciling", total=None)
                report = await import_reconciliation(
                    store,
                    data,
                    actor="cli",
                    scope=scope,
                    export_format=export_format,
                    progress=progress_callback(progress, task),
                    force=force,
                )
        except ExportError as error:
            raise CliError(f"{name}: {error}") from None
        return report_json(report)

    return with_store(database_url, work)


def _import_report(
    contents: list[tuple[str, bytes]],
    report_format: str | None,
    provider: str | None,
    config_file: str | None,
    database_url: str | None,
    force: bool,
    *,
    label: str,
) -> dict[str, Any]:
    from ledger.finance.bucket_reconcile import import_provider_report
    from ledger.finance.provider_reports import REPORT_FORMATS
    from ledger.finance.reconcile import ExportError, ReconcileScope, report_json
    from router.adapters.provider_reports import identities_of, rates_of

    with friendly_errors():
        config = read_config(config_file)
    chosen = next((f for f in REPORT_FORMATS if f == report_format), None)

    async def work(store: EventStore) -> dict[str, Any]:
        try:
            with progress_bar() as progress:
                progress.add_task("reconciling", total=None)
                report = await import_provider_report(
                    store,
                    [(name, data) for name, data in contents],
                    actor="cli",
                    identities=identities_of(config),
                    rates=rates_of(config),
                    scope=ReconcileScope(provider=provider),
                    report_format=chosen,
                    force=force,
                )
        except ExportError as error:
            where = "" if error.source else f"{label}: "
            raise CliError(f"{where}{error}") from None
        return report_json(report)

    return with_store(database_url, work)


@reconcile_app.command("fetch")
def fetch_command(
    endpoint: Annotated[str, typer.Option("--endpoint", help="The endpoint (config id).")],
    since: Annotated[str, typer.Option("--since", help="First day (YYYY-MM-DD) or instant.")],
    until: Annotated[str, typer.Option("--until", help="Last day, inclusive, or instant.")],
    report: Annotated[
        Literal["usage", "costs"],
        typer.Option("--report", help="usage (hourly tokens, the default) or costs (daily)."),
    ] = "usage",
    save: Annotated[
        str | None, typer.Option("--save", help="Also write the fetched pages to this directory.")
    ] = None,
    config_file: ConfigFile = None,
    database_url: DatabaseUrl = None,
    output: OutputOption = None,
    as_json: JsonOption = False,
    force: ForceOption = False,
) -> None:
    """Fetch an endpoint's usage or cost report from its provider's admin API, then reconcile."""
    from router.adapters.provider_reports import FetchError, day_window, fetch_report

    with friendly_errors():
        chosen_output = _output(output, as_json)
        config = read_config(config_file)
        target = config.endpoint(endpoint)
        if target is None:
            raise CliError(f"no endpoint {endpoint!r} in the config")
        if not any(
            (target.provider_project_id, target.provider_api_key_id, target.provider_workspace_id)
        ):
            raise CliError(
                f"endpoint {endpoint} has no provider_project_id, provider_api_key_id or "
                "provider_workspace_id: its usage cannot be told from the rest of the "
                "organization's"
            )
        try:
            start, end = day_window(since, until)
            with progress_bar() as progress:
                task = progress.add_task(f"fetching {endpoint} {report}", total=None)
                fetched = asyncio.run(
                    fetch_report(
                        target,
                        report,
                        start,
                        end,
                        on_page=lambda n: progress.update(task, completed=n),
                    )
                )
        except FetchError as error:
            raise CliError(str(error)) from None
        names = [f"{endpoint}-{report}-{n:04d}.json" for n in range(1, len(fetched.pages) + 1)]
        if save is not None:
            folder = Path(save)
            folder.mkdir(parents=True, exist_ok=True)
            for name, page in zip(names, fetched.pages, strict=True):
                (folder / name).write_bytes(page)
    result = _import_report(
        list(zip(names, fetched.pages, strict=True)),
        fetched.format,
        endpoint,
        config_file,
        database_url,
        force,
        label=f"{endpoint} {report}",
    )
    print_report(result, chosen_output)


@reconcile_app.command("show")
def show_command(
    reconciliation_id: Annotated[str, typer.Argument(help="The reconciliation (rec_...).")],
    bucket: Annotated[
        str | None,
        typer.Option("--bucket", help="Drill down to the attempts of this bucket (its start)."),
    ] = None,
    model: Annotated[str | None, typer.Option("--model", help="With --bucket: one model.")] = None,
    endpoint: Annotated[
        str | None, typer.Option("--endpoint", help="With --bucket: one endpoint.")
    ] = None,
    database_url: DatabaseUrl = None,
    output: OutputOption = None,
    as_json: JsonOption = False,
) -> None:
    """Print a recorded reconciliation, or the attempts of one of its buckets."""
    from ledger.finance.bucket_reconcile import bucket_json, find_bucket
    from ledger.finance.reconcile import find_reconciliation, report_json

    with friendly_errors():
        chosen_output = _output(output, as_json)

    async def work(store: EventStore) -> dict[str, Any]:
        recorded = await find_reconciliation(store, reconciliation_id)
        if recorded is None:
            raise CliError(f"no reconciliation {reconciliation_id!r}")
        if bucket is None:
            return report_json(recorded)
        found = find_bucket(recorded, bucket, model=model, endpoint=endpoint)
        if not found:
            raise CliError(
                f"{reconciliation_id} has no bucket {bucket!r} (with that model/endpoint)"
            )
        return await bucket_json(store, recorded.reconciliation_id, found)

    result = with_store(database_url, work)
    if bucket is None:
        print_report(result, chosen_output)
    else:
        print_bucket(result, chosen_output)


# --- printing ---


def print_report(report: dict[str, Any], output: Output) -> None:
    if output == "json":
        print(json.dumps(report))
    elif output == "csv":
        sys.stdout.write(report_csv(report))
        # The rows carry no id, and stdout is often a file: say which report it was, for
        # `reconcile show`, where the terminal still shows it.
        err.print(f"reconciliation {report['id']} (`waybill reconcile show {report['id']}`)")
    elif report.get("format", "lines") == "lines":
        _lines_table(report)
    else:
        _buckets_table(report)


def report_csv(report: dict[str, Any]) -> str:
    """Bucket reports: one row per comparison. Usage exports: one row per entry, its list
    named in the first column."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    if report.get("format", "lines") == "lines":
        writer.writerow(("list", *_ENTRY_COLUMNS))
        for name in _REPORT_LISTS:
            for entry in report[name]:
                writer.writerow((name, *(_cell(entry[k]) for k in _ENTRY_COLUMNS)))
        return buffer.getvalue()
    writer.writerow(_BUCKET_COLUMNS)
    for comparison in report["buckets"]:
        flat = _flat(comparison)
        writer.writerow(_cell(flat.get(k)) for k in _BUCKET_COLUMNS)
    return buffer.getvalue()


def _flat(comparison: dict[str, Any]) -> dict[str, Any]:
    flat = dict(comparison)
    flat["endpoints"] = "+".join(comparison["endpoints"])
    for side in ("provider", "ledger"):
        usage = comparison.get(f"{side}_usage") or {}
        for kind in ("input_tokens", "cached_input_tokens", "output_tokens"):
            flat[f"{side}_{kind}"] = usage.get(kind)
    return flat


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _lines_table(report: dict[str, Any]) -> None:
    out.print(f"reconciliation {report['id']}: {report['lines']} lines", highlight=False)
    counts = Table("result", "entries")
    for name in _REPORT_LISTS:
        counts.add_row(name, str(len(report[name])))
    out.print(counts)
    for name in _REPORT_LISTS:
        if not report[name]:
            continue
        table = Table(*_ENTRY_COLUMNS, title=name)
        for entry in report[name]:
            table.add_row(*(escape(_cell(entry[k])) for k in _ENTRY_COLUMNS))
        out.print(table)


def _buckets_table(report: dict[str, Any]) -> None:
    buckets = report["buckets"]
    out.print(
        f"reconciliation {report['id']}: {report['format']}, {report['lines']} results, "
        f"{len(buckets)} bucket comparisons",
        highlight=False,
    )
    statuses: dict[str, int] = {}
    for comparison in buckets:
        statuses[comparison["status"]] = statuses.get(comparison["status"], 0) + 1
    counts = Table("status", "buckets")
    for status, n in sorted(statuses.items()):
        counts.add_row(status, str(n))
    out.print(counts)
    shown = [c for c in buckets if c["status"] != "matched"]
    if shown:
        table = Table(
            "bucket", "model", "endpoints", "provider tokens in/out", "provider $", "ledger $",
            "settled $", "difference $", "status", title="buckets that do not simply match",
        )  # fmt: skip
        for c in shown:
            flat = _flat(c)
            tokens = (
                f"{flat['provider_input_tokens']}/{flat['provider_output_tokens']}"
                if c.get("provider_usage")
                else ""
            )
            table.add_row(
                c["bucket"], _cell(c["model"]) or "(all)", flat["endpoints"], tokens,
                _cell(c["provider_usd"]), c["ledger_usd"], c["settled_unknown_usd"],
                _cell(c["difference_usd"]), c["status"],
            )  # fmt: skip
        out.print(table)
    matched = len(buckets) - len(shown)
    if matched:
        out.print(f"{matched} matched bucket(s) not shown: --output csv lists every one")
    if report["unattributed_provider_usage"]:
        table = Table(
            "bucket", "model", "endpoints", "input tokens", "output tokens", "requests", "usd",
            title="unattributed_provider_usage",
        )  # fmt: skip
        for u in report["unattributed_provider_usage"]:
            table.add_row(
                u["bucket"], _cell(u["model"]) or "(all)", "+".join(u["endpoints"]),
                str(u["input_tokens"]), str(u["output_tokens"]), _cell(u["requests"]),
                _cell(u["usd"]),
            )  # fmt: skip
        out.print(table)
    for name in ("settled_unknown", "overruns"):
        if report[name]:
            table = Table("attempt_id", "settled_usd", "detail", title=name)
            for entry in report[name]:
                table.add_row(entry["attempt_id"], entry["expected_usd"], escape(entry["detail"]))
            out.print(table)
    for note in report["notes"]:
        err.print(f"note: {escape(note)}", highlight=False)


def print_bucket(detail: dict[str, Any], output: Output) -> None:
    if output == "json":
        print(json.dumps(detail))
        return
    if output == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(("bucket", "comparison_model", "comparison_endpoints", *_ATTEMPT_COLUMNS))
        for c in detail["comparisons"]:
            for a in c["attempts"]:
                where = (c["bucket"], _cell(c["model"]), "+".join(c["endpoints"]))
                writer.writerow((*where, *(_cell(a[k]) for k in _ATTEMPT_COLUMNS)))
        sys.stdout.write(buffer.getvalue())
        return
    for c in detail["comparisons"]:
        out.print(
            f"bucket {c['bucket']}..{c['bucket_end']} {_cell(c['model']) or '(all models)'} on "
            f"{'+'.join(c['endpoints'])}: {c['status']}; provider ${_cell(c['provider_usd'])}, "
            f"ledger ${c['ledger_usd']}, settled now ${c['settled_unknown_usd']}",
            highlight=False,
        )
        table = Table(*_ATTEMPT_COLUMNS)
        for a in c["attempts"]:
            table.add_row(*(escape(_cell(a[k])) for k in _ATTEMPT_COLUMNS))
        out.print(table)
