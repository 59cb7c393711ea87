"""The ``waybill`` command line (contract §1 "CLI"): the app, assembled from its command groups.

Each group is a module of this package (``serve``, ``demo``, ``keys``, ``database``,
``verify``, ``explain``, ``checkpoints``, ``finance``, ``reconcile``, ``endpoints``,
``traces``, ``fake_provider``), over what they share (``router.cli._shared``). Each command
is a thin edge: parse options, call the ledger or the gateway, print. Errors a user can
cause (a bad URL, an unreachable database, an unknown key) end with a one-line message and a
non-zero exit code, never a traceback.
"""

from __future__ import annotations

import sys

import typer

from ledger.store.db import head_revision
from ledger.support.process import tune_gc
from router.cli import (
    checkpoints,
    database,
    demo,
    endpoints,
    explain,
    fake_provider,
    finance,
    keys,
    reconcile,
    serve,
    traces,
    verify,
)
from router.support.version import package_version

__all__ = ["app", "main"]

app = typer.Typer(
    name="waybill",
    help="Waybill: an LLM gateway whose every decision is an immutable, billable fact.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help, as click writes it: typer's rich panels label a flag with a type it takes no
    # value of (`--json <bool>`), and their boxes cost an 80-column terminal its width.
    rich_markup_mode=None,
)


def _print_version(asked: bool) -> None:
    if asked:
        typer.echo(f"waybill {package_version()} (schema {head_revision()})")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(
        False,
        "--version",
        help="Print the version and the schema revision this code migrates to, and exit.",
        callback=_print_version,
        is_eager=True,
    ),
) -> None:
    """Waybill: an LLM gateway whose every decision is an immutable, billable fact."""


# Every command, in the order `waybill --help` lists them.
app.command("migrate")(database.migrate_command)
app.command("verify")(verify.verify_command)
app.command("replay")(database.replay_command)
app.command("projections")(database.projections_command)
app.command("archive")(database.archive_command)
app.command("explain")(explain.explain_command)
app.command("check-config")(serve.check_config_command)
app.command("serve")(serve.serve_command)
app.command("demo")(demo.demo_command)
app.command("spend")(finance.spend_command)
app.command("reprice")(finance.reprice_command)
app.command("settle")(finance.settle_command)
app.command("prove")(checkpoints.prove_command)
app.command("verify-proof")(checkpoints.verify_proof_command)
app.add_typer(keys.keys_app, name="keys")
app.add_typer(traces.otel_app, name="otel")
app.add_typer(finance.period_app, name="period")
app.add_typer(endpoints.endpoints_app, name="endpoints")
app.add_typer(reconcile.reconcile_app, name="reconcile")
app.add_typer(checkpoints.checkpoint_app, name="checkpoint")
app.add_typer(fake_provider.fake_provider_app, name="fake-provider")


def main() -> None:
    tune_gc()
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
