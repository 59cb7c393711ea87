"""The ``waybill`` command line (SPEC §1).

Each command is a thin edge: parse options, call the ledger or the gateway, print. Errors a
user can cause (a bad URL, an unreachable database, an unknown key) end with a one-line
message and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import contextmanager
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from sqlalchemy.exc import SQLAlchemyError

from ledger import apikeys
from ledger.db import DatabaseUrlError, create_engine, migrate, resolve_database_url
from ledger.projection import ProjectionRunner
from ledger.store import EventStore
from ledger.verify import verify_chain
from ledger.views import all_projections

__all__ = ["app", "main"]

T = TypeVar("T")

app = typer.Typer(
    name="waybill",
    help="Waybill: an LLM gateway whose every decision is an immutable, billable fact.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
keys_app = typer.Typer(help="Create and revoke API keys.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")

err = Console(stderr=True)
out = Console()

DatabaseUrl = Annotated[
    str | None,
    typer.Option(
        "--database-url",
        envvar="WAYBILL_DATABASE_URL",
        help="SQLAlchemy URL (sqlite:///waybill.db, postgresql://...). Default: ./waybill.db",
    ),
]


class CliError(Exception):
    """A failure the user can act on: printed as one line, exit code 1."""


@contextmanager
def _friendly_errors() -> Any:
    try:
        yield
    except (CliError, DatabaseUrlError, apikeys.UnknownKey) as error:
        err.print(f"[red]error:[/red] {escape(str(error))}", highlight=False)
        raise typer.Exit(1) from None
    except SQLAlchemyError as error:
        detail = str(getattr(error, "orig", None) or error).splitlines()[0]
        err.print(f"[red]error:[/red] database: {detail}")
        raise typer.Exit(1) from None


def _with_store(database_url: str | None, work: Callable[[EventStore], Awaitable[T]]) -> T:
    async def run() -> T:
        engine = create_engine(resolve_database_url(database_url))
        store = EventStore(engine)
        try:
            return await work(store)
        finally:
            await store.close()
            await engine.dispose()

    with _friendly_errors():
        return _run(run())


def _run(coroutine: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coroutine)


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=False,
    )


def _progress_callback(progress: Progress, task: TaskID) -> Callable[[int, int], None]:
    def update(done: int, total: int) -> None:
        progress.update(task, completed=done, total=total)

    return update


@app.command("migrate")
def migrate_command(database_url: DatabaseUrl = None) -> None:
    """Upgrade the database schema to the latest revision (alembic upgrade head)."""
    url = resolve_database_url(database_url)
    with _friendly_errors():
        migrate(url)
    err.print("[green]database is at the latest revision[/green]")


@app.command("verify")
def verify_command(
    database_url: DatabaseUrl = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Verify the ledger's hash chain; exits non-zero naming the first bad event."""

    async def work(store: EventStore) -> Any:
        with _progress() as progress:
            task = progress.add_task("verifying", total=None)
            return await verify_chain(store, _progress_callback(progress, task))

    result = _with_store(database_url, work)
    if as_json:
        print(json.dumps(result.as_json()))
    elif result.ok:
        out.print(f"ledger OK: {result.checked} events, head at position {result.head_position}")
    else:
        out.print(
            f"ledger BROKEN at position {result.first_bad_position}: {result.problem} "
            f"({result.checked} events verified before it)"
        )
    raise typer.Exit(0 if result.ok else 1)


@app.command("replay")
def replay_command(
    database_url: DatabaseUrl = None,
    projection: Annotated[
        str | None, typer.Option("--projection", help="Only this projection (default: all).")
    ] = None,
) -> None:
    """Rebuild projections from event 0."""

    async def work(store: EventStore) -> dict[str, int]:
        runner = ProjectionRunner(store, all_projections())
        names = [projection] if projection else list(runner.projections)
        try:
            chosen = [runner.get(name) for name in names]
        except KeyError as error:
            raise CliError(str(error.args[0])) from None
        applied = {}
        with _progress() as progress:
            for target in chosen:
                task = progress.add_task(f"replaying {target.name}", total=None)
                applied[target.name] = await runner.replay(
                    target, _progress_callback(progress, task)
                )
        return applied

    applied = _with_store(database_url, work)
    for name, count in applied.items():
        out.print(f"{name}: rebuilt from {count} events")


@app.command("projections")
def projections_command(
    database_url: DatabaseUrl = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Show each projection's lag (head position minus checkpoint)."""

    async def work(store: EventStore) -> dict[str, int]:
        return await ProjectionRunner(store, all_projections()).lag()

    lag = _with_store(database_url, work)
    if as_json:
        print(json.dumps({"lag": lag}))
        return
    table = Table("projection", "lag (events)")
    for name, value in lag.items():
        table.add_row(name, str(value))
    out.print(table)


@keys_app.command("create")
def keys_create(
    workspace: Annotated[str, typer.Option("--workspace", help="Workspace id.")],
    role: Annotated[
        str, typer.Option("--role", help="client | admin | finance | auditor")
    ] = "client",
    database_url: DatabaseUrl = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Create an API key; prints its secret once."""
    if not apikeys.is_role(role):
        err.print(f"[red]error:[/red] --role must be one of {', '.join(apikeys.ROLES)}")
        raise typer.Exit(2)

    async def work(store: EventStore) -> apikeys.NewKey:
        return await apikeys.create_key(store, workspace, role, created_by="cli")

    key = _with_store(database_url, work)
    if as_json:
        print(
            json.dumps(
                {
                    "key_id": key.key_id,
                    "secret": key.secret,
                    "workspace": key.workspace,
                    "role": key.role,
                }
            )
        )
        return
    out.print(f"key id:    {key.key_id}\nworkspace: {key.workspace}\nrole:      {key.role}")
    out.print(f"secret:    {key.secret}")
    err.print("Store the secret now: Waybill keeps only its hash and cannot show it again.")


@keys_app.command("revoke")
def keys_revoke(key_id: str, database_url: DatabaseUrl = None) -> None:
    """Revoke a key; it is refused from now on."""

    async def work(store: EventStore) -> None:
        await apikeys.revoke_key(store, key_id, revoked_by="cli")

    _with_store(database_url, work)
    out.print(f"revoked {key_id}")


@app.command("check-config")
def check_config_command(
    config_file: Annotated[str, typer.Argument(help="The YAML config file to validate.")],
) -> None:
    """Validate a config file; exits non-zero with the path of every offending field."""
    from router.config import ConfigError, load_config

    try:
        config = load_config(config_file)
    except ConfigError as error:
        err.print(f"[red]config is invalid[/red] ({config_file}):", highlight=False)
        for line in str(error).splitlines():
            err.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    out.print(
        f"config OK: generation {config.generation}, {len(config.endpoints)} endpoints, "
        f"{len(config.models)} model groups, {len(config.workspaces)} workspaces",
        highlight=False,
    )


ConfigFile = Annotated[
    str | None,
    typer.Option("--config", envvar="WAYBILL_CONFIG", help="The YAML config file (SPEC §2)."),
]


def _load_config(config_file: str | None) -> Any:
    from router.config import ConfigError, load_config

    if not config_file:
        raise CliError("no config: pass --config FILE or set WAYBILL_CONFIG")
    try:
        return load_config(config_file)
    except ConfigError as error:
        raise CliError(
            f"config is invalid ({config_file}):\n  " + str(error).replace("\n", "\n  ")
        ) from None


@app.command("serve")
def serve_command(
    config_file: ConfigFile = None,
    database_url: DatabaseUrl = None,
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port")] = 8080,
    no_migrate: Annotated[
        bool, typer.Option("--no-migrate", help="Do not upgrade the database first.")
    ] = False,
    max_in_flight: Annotated[
        int, typer.Option("--max-in-flight", help="In-flight requests per workspace.", min=1)
    ] = 512,
) -> None:
    """Run the gateway (migrates the database first unless --no-migrate)."""
    import os

    from router.app import AppSettings

    url = resolve_database_url(database_url)
    with _friendly_errors():
        config = _load_config(config_file)
        if not no_migrate:
            migrate(url)
    settings = AppSettings(
        config=config,
        database_url=url,
        redis_url=os.environ.get("WAYBILL_REDIS_URL") or None,
        max_in_flight=max_in_flight,
    )
    _serve(settings, host, port)


def _serve(settings: Any, host: str, port: int) -> None:
    import uvicorn

    from router.app import create_app

    err.print(
        f"waybill serving on http://{host}:{port} (config generation {settings.config.generation})",
        highlight=False,
    )
    uvicorn.run(
        create_app(settings),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="on",
    )


@app.command("demo")
def demo_command(
    database_url: DatabaseUrl = None,
    port: Annotated[int, typer.Option("--port")] = 8080,
    check: Annotated[
        bool,
        typer.Option("--check", help="Send one request through the demo, print it and exit."),
    ] = False,
) -> None:
    """Serve a demo config in front of a bundled local demo provider (works offline)."""
    from router.demo import run_demo

    url = resolve_database_url(database_url)
    with _friendly_errors():
        migrate(url)
        run_demo(url, port, check=check, out=out, err=err, serve=_serve)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
