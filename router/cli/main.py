"""The ``waybill`` command line (contract §1).

Each command is a thin edge: parse options, call the ledger or the gateway, print. Errors a
user can cause (a bad URL, an unreachable database, an unknown key) end with a one-line
message and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import os
import socket
import sys
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import contextmanager
from pathlib import Path
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
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from ledger import apikeys
from ledger.audit.verify import record_verification, verify_chain
from ledger.store import EventStore
from ledger.store.archived import ArchiveError, HistoryArchived
from ledger.store.db import (
    DatabaseUrlError,
    create_engine,
    current_revision,
    head_revision,
    migrate,
    redacted_url,
    resolve_database_url,
    sqlite_path,
)
from ledger.support.process import tune_gc
from ledger.views import all_projections
from ledger.views.projection import ProjectionRunner

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
otel_app = typer.Typer(
    help="Traces from the ledger, over OTLP (OTEL_* variables).", no_args_is_help=True
)
app.add_typer(otel_app, name="otel")
period_app = typer.Typer(help="Close a month's books (contract §6).", no_args_is_help=True)
app.add_typer(period_app, name="period")
endpoints_app = typer.Typer(
    help="Endpoints disabled after their credentials were refused (contract §5).",
    no_args_is_help=True,
)
app.add_typer(endpoints_app, name="endpoints")

# Piped, a console is as wide as its widest line: tables never cut ids or amounts.
err = Console(stderr=True, width=None if sys.stderr.isatty() else 10_000)
out = Console(width=None if sys.stdout.isatty() else 10_000)

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
    except (CliError, DatabaseUrlError, apikeys.UnknownKey, HistoryArchived, ArchiveError) as error:
        err.print(f"[red]error:[/red] {escape(str(error))}", highlight=False)
        raise typer.Exit(1) from None
    except SQLAlchemyError as error:
        detail = str(getattr(error, "orig", None) or error).splitlines()[0]
        err.print(f"[red]error:[/red] database: {detail}")
        raise typer.Exit(1) from None


def _with_store(database_url: str | None, work: Callable[[EventStore], Awaitable[T]]) -> T:
    """Run ``work`` on the ledger at ``database_url``, which must be one: a command that
    reads or appends never creates a database, nor runs on one that was never migrated."""
    url = resolve_database_url(database_url)

    async def run() -> T:
        engine = create_engine(url)
        store = EventStore(engine)
        try:
            await _require_ledger(engine, url)
            return await work(store)
        finally:
            await store.close()
            await engine.dispose()

    with _friendly_errors():
        _require_sqlite_file(url)
        return _run(run())


def _require_sqlite_file(url: str) -> None:
    path = sqlite_path(url)
    if path is not None and not path.exists():
        raise CliError(
            f"no ledger at {path}: run `waybill migrate` to create one here, or give "
            "--database-url (or WAYBILL_DATABASE_URL)"
        )


async def _require_ledger(engine: Any, url: str) -> None:
    revision, head = await current_revision(engine), head_revision()
    if revision is None:
        raise CliError(f"{redacted_url(url)} holds no Waybill ledger: run `waybill migrate`")
    if revision != head:
        raise CliError(
            f"the ledger at {redacted_url(url)} is at schema revision {revision}, this "
            f"waybill needs {head}: run `waybill migrate`"
        )


def _run(coroutine: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coroutine)


def progress_bar(*, console: Console = err, transient: bool = False) -> Progress:
    """The progress bar of every long CLI command (and the benchmarks): on stderr."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=transient,
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
                store, _progress_callback(progress, task), observe=observe, archive=archive
            )
            report = None
            if books:
                task = progress.add_task("checking the books", total=None)
                report = await check_books(
                    store, _progress_callback(progress, task), archive=archive
                )
        audited = None
        if audit is not None:
            audited = await audit.finish(store.engine, complete=result.ok)
        await _record_verification(store, result, report, audited)
        return result, report, audited

    result, report, audited = _with_store(database_url, work)
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


@app.command("replay")
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
                    *chosen, progress=_progress_callback(progress, task), archive=archive
                )
                applied.update((target.name, count) for target in chosen)
            if BOOKS in names:
                # Under the ledger head's lock: appends wait until the books are rewritten.
                task = progress.add_task("rebuilding the books", total=None)
                report = await rebuild_books(
                    store, _progress_callback(progress, task), archive=archive
                )
                applied[BOOKS] = report.events
                for found in report.discrepancies:
                    err.print(
                        f"  was wrong: {found.kind} {found.id}: {found.detail}",
                        highlight=False,
                        markup=False,
                    )
        return applied

    applied = _with_store(database_url, work)
    for name, count in applied.items():
        out.print(f"{name}: rebuilt from {count} events")


BOOKS = "books"
"""``replay --projection books``: the budget tables, kept by the append path, not a
projection, but rebuilt from the events all the same."""


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


@app.command("archive")
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
    from dataclasses import asdict
    from datetime import date

    from ledger.audit.archive import ArchiveRefused, archive_months

    try:
        day = date.fromisoformat(before)
    except ValueError:
        err.print(f"--before: not a date (YYYY-MM-DD): {before!r}")
        raise typer.Exit(2) from None

    async def work(store: EventStore) -> list[Any]:
        with progress_bar() as progress:
            task = progress.add_task("archiving", total=None)
            try:
                return await archive_months(store, day, to, _progress_callback(progress, task))
            except (ArchiveRefused, ArchiveError) as refused:
                raise CliError(str(refused)) from None

    segments = _with_store(database_url, work)
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


@app.command("explain")
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

    explanation = _with_store(database_url, work)
    if as_json:
        print(json.dumps(explanation))
    else:
        sys.stdout.write(render_text(explanation))


@keys_app.command("create")
def keys_create(
    workspace: Annotated[str, typer.Option("--workspace", help="Workspace id.")],
    role: Annotated[
        str, typer.Option("--role", help="client | admin | finance | auditor")
    ] = "client",
    database_url: DatabaseUrl = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    budget_usd: Annotated[
        str | None,
        typer.Option("--budget-usd", help="This key's own budget (overrides key_budget)."),
    ] = None,
    budget_window: Annotated[
        str, typer.Option("--budget-window", help="day | month | total")
    ] = "day",
    config_file: ConfigFile = None,
) -> None:
    """Create an API key; prints its secret once. With a config (--config or
    WAYBILL_CONFIG), a workspace the config does not know is refused."""
    from decimal import Decimal, InvalidOperation

    if config_file:
        with _friendly_errors():
            known = [w.id for w in _load_config(config_file).workspaces]
            if workspace not in known:
                raise CliError(
                    f"workspace {workspace!r} is not in {config_file} (it has: "
                    f"{', '.join(known) or 'none'}); its keys would be refused"
                )
    else:
        err.print(
            f"[yellow]warning:[/yellow] no config given: workspace {escape(workspace)!r} is "
            "not checked (a workspace the gateway's config lacks has its keys refused; "
            "pass --config to check)",
            highlight=False,
        )
    if not apikeys.is_role(role):
        err.print(f"[red]error:[/red] --role must be one of {', '.join(apikeys.ROLES)}")
        raise typer.Exit(2)
    budget: tuple[Decimal, Any] | None = None
    if budget_usd is not None:
        try:
            limit = Decimal(budget_usd)
        except InvalidOperation:
            limit = Decimal(-1)
        if not limit.is_finite() or limit < 0 or budget_window not in ("day", "month", "total"):
            err.print(
                "[red]error:[/red] --budget-usd must be a non-negative decimal and "
                "--budget-window one of day, month, total"
            )
            raise typer.Exit(2)
        budget = (limit, budget_window)

    async def work(store: EventStore) -> apikeys.NewKey:
        return await apikeys.create_key(store, workspace, role, created_by="cli", budget=budget)

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


@endpoints_app.command("enable")
def endpoints_enable(
    endpoint_id: Annotated[str, typer.Argument(help="The endpoint's id in the config.")],
    database_url: DatabaseUrl = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the event as JSON.")] = False,
) -> None:
    """Enable an endpoint a credentials failure disabled. Gateways follow on their next
    heartbeat, or at once when WAYBILL_REDIS_URL names the Redis they share."""
    import redis.asyncio as aioredis

    from ledger.endpoints import read_states, record_enabled
    from router.adapters.disabling import DOORBELL_CHANNEL, ring_doorbell

    async def work(store: EventStore) -> dict[str, Any]:
        before = await read_states(store)
        disabled = before.disabled.get(endpoint_id)
        after, enabled = await record_enabled(
            store, endpoint_id, cause="operator", actor="cli", generation=None, states=before
        )
        if enabled is None or disabled is None:
            raise CliError(f"endpoint {endpoint_id!r} is not disabled: nothing to enable")
        redis_url = os.environ.get("WAYBILL_REDIS_URL")
        if redis_url:
            client = aioredis.Redis.from_url(redis_url, socket_connect_timeout=2.0)
            try:
                await ring_doorbell(client, DOORBELL_CHANNEL, after.version)
            finally:
                await client.aclose()
        return {**enabled.model_dump(mode="json"), "disabled": disabled.as_json()}

    enabled = _with_store(database_url, work)
    if as_json:
        print(json.dumps(enabled))
        return
    refused = enabled["disabled"]
    answered = " ".join(
        str(part) for part in (refused["http_status"], refused["error_code"]) if part
    )
    out.print(
        f"enabled {endpoint_id}: disabled since {refused['disabled_at']} "
        f"(the upstream answered {answered or 'a credentials failure'})",
        highlight=False,
    )


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
    typer.Option("--config", envvar="WAYBILL_CONFIG", help="The YAML config file (contract §2)."),
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
        int,
        typer.Option(
            "--max-in-flight",
            help="In-flight requests per workspace and worker; beyond them new ones get 503 "
            "at once.",
            min=1,
        ),
    ] = 256,  # router.http.app.DEFAULT_MAX_IN_FLIGHT (not imported: serve starts without the app)
    workers: Annotated[
        int,
        typer.Option(
            "--workers",
            envvar="WAYBILL_WORKERS",
            help="Serving processes on the one port (about one per core); PostgreSQL only.",
            min=1,
            max=64,
        ),
    ] = 1,
    instance_id: Annotated[
        str | None,
        typer.Option(
            "--instance-id",
            envvar="WAYBILL_INSTANCE_ID",
            help="Who this gateway is across restarts; never two live processes at once. "
            "Default: <host name>@<host>:<port>.",
        ),
    ] = None,
    archive: Annotated[
        Path | None,
        typer.Option(
            "--archive",
            envvar="WAYBILL_ARCHIVE_DIR",
            help="The directory of the archived months (`waybill archive`): the events and "
            "explanations of requests recorded in them are read there.",
        ),
    ] = None,
) -> None:
    """Run the gateway (migrates the database first unless --no-migrate)."""
    import os

    from router.http.app import AppSettings

    url = resolve_database_url(database_url)
    with _friendly_errors():
        if workers > 1 and not url.startswith("postgresql"):
            raise CliError("--workers needs a PostgreSQL ledger: a SQLite ledger is one process's")
        config = _load_config(config_file)
        if archive is not None and not archive.is_dir():
            raise CliError(f"--archive: {archive} is not a directory")
        heartbeat_s = _heartbeat_s()
        instance = _instance_id(instance_id, host, port)
        console_secret = _console_secret()
        if no_migrate:
            _require_sqlite_file(url)
            _run(_check_ledger(url))
        else:
            migrate(url)
        listening = _listening_socket(host, port)
    settings = AppSettings(
        config=config,
        database_url=url,
        redis_url=os.environ.get("WAYBILL_REDIS_URL") or None,
        max_in_flight=max_in_flight,
        heartbeat_s=heartbeat_s,
        config_path=config_file,
        follower_process=True,
        instance_id=instance,
        console_secret=console_secret,
        archive_dir=archive,
    )
    if workers > 1:
        _serve_workers(settings, host, port, listening, workers)
    else:
        _serve(settings, host, port, listening)


def _console_secret() -> bytes:
    """The console's session secret: WAYBILL_CONSOLE_SECRET, else random for this run."""
    import os

    from router.http.console import secret_from

    try:
        return secret_from(os.environ.get("WAYBILL_CONSOLE_SECRET"))
    except ValueError as error:
        raise CliError(str(error)) from None


def _instance_id(given: str | None, host: str, port: int) -> str:
    import socket

    from ledger.books.recovery import check_instance_id
    from router.http.app import default_instance_id

    if given is None:
        return default_instance_id(socket.gethostname(), host, port)
    try:
        return check_instance_id(given)
    except ValueError as error:
        raise CliError(f"--instance-id: {error}") from None


def _heartbeat_s() -> float:
    # WAYBILL_HEARTBEAT_S: how often a gateway says it is alive (a gateway silent for six
    # beats is presumed dead and its holds recovered). Tests shorten it.
    import os

    raw = os.environ.get("WAYBILL_HEARTBEAT_S", "5")
    try:
        value = float(raw)
    except ValueError:
        raise CliError(f"WAYBILL_HEARTBEAT_S must be a number of seconds, not {raw!r}") from None
    if not 0.05 <= value <= 3600:
        raise CliError("WAYBILL_HEARTBEAT_S must be between 0.05 and 3600 seconds")
    return value


async def _check_ledger(url: str) -> None:
    engine = create_engine(url)
    try:
        await _require_ledger(engine, url)
    finally:
        await engine.dispose()


def _listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before anything says it is serving: a port in use is one
    line and a non-zero exit, not a banner followed by a failure."""
    where = f"{host}:{port}"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as error:
        raise CliError(f"cannot listen on {where}: {error.strerror}") from None
    listening = socket.socket(family, kind, proto)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listening.bind(address)
    except OSError as error:
        listening.close()
        raise CliError(f"cannot listen on {where}: {error.strerror or error}") from None
    listening.set_inheritable(True)
    return listening


def _serve(settings: Any, host: str, port: int, listening: socket.socket) -> None:
    import uvicorn

    from router.http.app import create_app
    from router.serving.server import UVICORN_OPTIONS

    err.print(
        f"waybill serving on http://{host}:{port} (config generation {settings.config.generation})",
        highlight=False,
    )
    served = create_app(settings)
    gc.freeze()  # the server's modules, imported just now, join those frozen at start-up
    server = uvicorn.Server(uvicorn.Config(served, host=host, port=port, **UVICORN_OPTIONS))
    server.run(sockets=[listening])


def _serve_workers(
    settings: Any, host: str, port: int, listening: socket.socket, count: int
) -> None:
    """``count`` workers accepting on ``listening``, supervised (router.serving.workers)."""
    import shutil
    import tempfile

    import router.http.app  # noqa: F401  imported once, before the workers are forked
    from router.serving.workers import supervise, workers_of

    err.print(
        f"waybill serving on http://{host}:{port} with {count} workers "
        f"(config generation {settings.config.generation})",
        highlight=False,
    )
    directory = Path(tempfile.mkdtemp(prefix="waybill-workers-"))  # 0700: this user's
    gc.freeze()  # what the workers share with this process, copied only if written
    try:
        status = supervise(
            workers_of(settings.instance_id, count, directory),
            functools.partial(_serve_worker, settings, host, port, listening),
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if status:
        raise typer.Exit(status)


def _serve_worker(
    settings: Any, host: str, port: int, listening: socket.socket, worker: Any
) -> None:
    """One worker, in its forked process: a gateway on the shared socket and its own."""
    import dataclasses

    import uvicorn

    from router.http.app import create_app
    from router.serving.server import UVICORN_OPTIONS

    # Each worker's OTLP metrics are a series of their own (service.instance.id).
    attributes = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    if "service.instance.id=" not in attributes:
        mine = f"service.instance.id={worker.instance_id}"
        os.environ["OTEL_RESOURCE_ATTRIBUTES"] = f"{attributes},{mine}" if attributes else mine
    own = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(worker.socket_path)  # its earlier run's
    own.bind(worker.socket_path)
    served = create_app(
        dataclasses.replace(
            settings,
            instance_id=worker.instance_id,
            background=worker.index == 0,
            siblings=worker.siblings,
            appends_socket=worker.appends_socket,
        )
    )
    server = uvicorn.Server(uvicorn.Config(served, host=host, port=port, **UVICORN_OPTIONS))
    server.run(sockets=[listening, own])


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
    from router.cli.demo import run_demo

    url = resolve_database_url(database_url)
    with _friendly_errors():
        migrate(url)
        listening = _listening_socket("127.0.0.1", port)
        run_demo(
            url,
            listening,
            check=check,
            out=out,
            err=err,
            serve=lambda settings, host, port: _serve(settings, host, port, listening),
        )


def _instant(value: str | None, option: str) -> Any:
    """An ISO 8601 date or timestamp; without a zone it is UTC, like the ledger's."""
    from datetime import UTC, datetime

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
) -> None:
    """(Re-)export the traces of a window from the ledger, same ids and timestamps."""
    import logging

    from otel import export

    # The exporter's own retry chatter would drown the one-line error below.
    logging.getLogger("opentelemetry.exporter").setLevel(logging.CRITICAL)
    with _friendly_errors():
        start, end = _instant(since, "--since"), _instant(until, "--until")
        if start is not None and end is not None and end <= start:
            raise CliError("--until must be after --since")
        try:
            exporter = export.trace_exporter_from_env(explicit=True)
        except export.OtelConfigError as error:
            raise CliError(str(error)) from None
        if exporter is None:
            raise CliError("trace export is off (OTEL_TRACES_EXPORTER=none or OTEL_SDK_DISABLED)")
    endpoint = export.traces_endpoint()

    async def work(store: EventStore) -> Any:
        try:
            with progress_bar() as progress:
                task = progress.add_task("exporting traces", total=None)
                return await export.export_window(
                    store, start, end, exporter, progress=_progress_callback(progress, task)
                )
        except export.ExportFailed as error:
            raise CliError(f"{error} ({endpoint}); nothing after that was sent") from None
        finally:
            exporter.shutdown()

    result = _with_store(database_url, work)
    line = f"exported {result.spans} spans of {result.requests} requests to {endpoint}"
    if result.unfinished:
        line += f" ({result.unfinished} requests still in progress were left out)"
    out.print(line, highlight=False)


@app.command("spend")
def spend_command(
    database_url: DatabaseUrl = None,
    group_by: Annotated[
        str,
        typer.Option(
            "--group-by", help="Comma-separated: workspace,key,model,endpoint,upstream_model,day"
        ),
    ] = "workspace",
    since: Annotated[str | None, typer.Option("--from", help="First day (YYYY-MM-DD).")] = None,
    until: Annotated[str | None, typer.Option("--to", help="Last day (YYYY-MM-DD).")] = None,
    output: Annotated[str, typer.Option("--format", help="table | csv | json")] = "table",
) -> None:
    """Spend report: settled and unknown-held amounts, requests and attempts per group."""
    from datetime import date

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

    rows = _with_store(database_url, work)
    if output == "json":
        print(json.dumps({"data": rows}))
    elif output == "csv":
        print(spend_csv(rows, keys), end="")
    else:
        columns = [*keys, "settled_usd", "held_unknown_usd", "overrun_usd", "requests", "attempts"]
        # A closed period's adjustments stand beside its totals, when there are any.
        if any(row[c] != "0" for row in rows for c in ADJUSTMENT_COLUMNS):
            columns += ADJUSTMENT_COLUMNS
        table = Table(*columns)
        for row in rows:
            table.add_row(*(str(row[c]) for c in columns))
        out.print(table)


@app.command("reprice")
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
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Compare the costs the ledger recorded with a provider's cost report, by model and
    day, and name the days where they part (a price change the config missed)."""
    from datetime import date
    from pathlib import Path

    from ledger.finance.provider_reports import ExportError
    from ledger.finance.reprice import compare, provider_costs, recorded_costs

    with _friendly_errors():
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
        return compare(await recorded_costs(store.engine, first, last), provider)

    rows = _with_store(database_url, work)
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

    event = _with_store(database_url, work)
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


@app.command("settle")
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
    from decimal import Decimal, InvalidOperation

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

    event, overrun = _with_store(database_url, work)
    outcome = (
        f"{event.released_usd} released"
        if overrun is None
        else f"overrun {overrun.excess_usd} USD recorded"
    )
    out.print(
        f"settled {settlement_id}: {event.settled_usd} USD of {event.held_usd} held, {outcome}",
        highlight=False,
    )


# `waybill reconcile ...` (router/cli/reconcile.py) uses the helpers above.
from router.cli.reconcile import reconcile_app  # noqa: E402

app.add_typer(reconcile_app, name="reconcile")


# --- checkpoints (contract §7): signed Merkle checkpoints outside the database ---------------

checkpoint_app = typer.Typer(
    help="Sign the ledger's Merkle tree into a directory outside the database: "
    "`waybill checkpoint --signing-key FILE --out DIR`; `waybill checkpoint keygen --out DIR`.",
    invoke_without_command=True,
)
app.add_typer(checkpoint_app, name="checkpoint")


@checkpoint_app.callback()
def checkpoint_command(
    ctx: typer.Context,
    signing_key: Annotated[
        str | None, typer.Option("--signing-key", help="The private key file (PEM).")
    ] = None,
    out_dir: Annotated[
        str | None,
        typer.Option("--out", help="The sink directory the checkpoint is appended to."),
    ] = None,
    database_url: DatabaseUrl = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the checkpoint.")] = False,
) -> None:
    """Take a checkpoint now: sign the tree at the ledger's head, append it to the sink."""
    from pathlib import Path

    from ledger.audit.checkpointer import Checkpointer
    from ledger.audit.sink import SinkError, checkpoint_file

    if ctx.invoked_subcommand is not None:
        return
    if not signing_key or not out_dir:
        err.print("[red]error:[/red] give --signing-key FILE and --out DIR (or: keygen --out DIR)")
        raise typer.Exit(2)
    with _friendly_errors():
        key = _signing_key(signing_key)

    async def work(store: EventStore) -> tuple[Any, int]:
        checkpointer = Checkpointer(store, key, Path(out_dir))
        try:
            try:
                await checkpointer.open()
            except SinkError as error:
                raise CliError(str(error)) from None
            head, _ = await store.head()
            with progress_bar(transient=True) as progress:
                task = progress.add_task("hashing the ledger", total=head)
                progress.update(task, completed=checkpointer.size)
                await checkpointer.catch_up(lambda n: progress.advance(task, n))
            try:
                return await checkpointer.take(), checkpointer.size
            except SinkError as error:
                raise CliError(str(error)) from None
        finally:
            await checkpointer.close()

    checkpoint, _ = _with_store(database_url, work)
    if as_json:
        sys.stdout.buffer.write(checkpoint.line())  # the sink's line, byte for byte
        return
    out.print(
        f"checkpoint taken: size {checkpoint.size}, root {checkpoint.root}, key "
        f"{checkpoint.key_id}, in {checkpoint_file(Path(out_dir), checkpoint)}",
        highlight=False,
    )


@checkpoint_app.command("keygen")
def checkpoint_keygen_command(
    out_dir: Annotated[str, typer.Option("--out", help="The directory to write the keypair to.")],
) -> None:
    """Write a new Ed25519 keypair: checkpoint-<key id>.key (private) and .pub (public)."""
    import os
    from pathlib import Path

    from ledger.audit.checkpoints import generate_key

    key = generate_key()
    directory = Path(out_dir)
    private, public = (directory / f"checkpoint-{key.key_id}.{s}" for s in ("key", "pub"))
    with _friendly_errors():
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as file:
                file.write(key.private_pem())
            public.write_bytes(key.public_pem())
        except OSError as error:
            problem = error.strerror or error
            raise CliError(f"cannot write the keypair in {out_dir}: {problem}") from None
    out.print(f"key id:      {key.key_id}", highlight=False)
    out.print(f"private key: {private}", highlight=False)
    out.print(f"public key:  {public}", highlight=False)
    err.print(
        "Keep the private key out of the database host's reach if you can; it signs (config "
        "checkpoints.signing_key). Give the public key to whoever verifies.",
        highlight=False,
    )


@app.command("prove")
def prove_command(
    request_id: Annotated[str, typer.Argument(help="The request id (its X-Request-Id).")],
    checkpoints: Annotated[
        str, typer.Option("--checkpoints", help="The sink directory (or a copy of it).")
    ],
    size: Annotated[
        int | None,
        typer.Option("--size", min=1, help="Prove against the checkpoint of this size."),
    ] = None,
    database_url: DatabaseUrl = None,
) -> None:
    """Write a proof of the request's events against a signed checkpoint (JSON, stdout)."""
    from pathlib import Path

    from ledger.audit.proofs import ProofUnavailable, build_proof, choose_checkpoint
    from ledger.audit.sink import SinkError, TreeFiles, read_sink
    from ledger.views.queries import read_request_events

    directory = Path(checkpoints)
    with _friendly_errors():
        try:
            entries = read_sink(directory, strict=False)
            checkpoint = choose_checkpoint(entries, size)
        except (SinkError, ProofUnavailable) as error:
            raise CliError(f"{checkpoints}: {error}") from None
    for entry in entries:
        if entry.problem is not None:
            err.print(f"skipped {entry.where}: {entry.problem}", markup=False, highlight=False)

    async def work(store: EventStore) -> bytes:
        trail = await read_request_events(store.engine, request_id)
        if not trail:
            raise CliError(f"no request {request_id!r} in the ledger")
        tree = TreeFiles(directory)
        try:
            with progress_bar(transient=True) as progress:
                task = progress.add_task("hashing the ledger", total=None)
                return await build_proof(
                    store.engine,
                    request_id,
                    trail,
                    checkpoint,
                    tree,
                    progress=_progress_callback(progress, task),
                )
        except ProofUnavailable as error:
            raise CliError(str(error)) from None
        finally:
            tree.close()

    document = _with_store(database_url, work)
    sys.stdout.buffer.write(document)
    sys.stdout.flush()


@app.command("verify-proof")
def verify_proof_command(
    proof_file: Annotated[str, typer.Argument(help="A proof written by `waybill prove`.")],
    public_key: Annotated[
        list[str],
        typer.Option("--public-key", help="A public key the checkpoint may be signed with."),
    ],
) -> None:
    """Check a proof alone, with no database and no network: exit 0, or 1 naming what failed."""
    from pathlib import Path

    from ledger.audit.proofs import ProofInvalid, check_proof

    with _friendly_errors():
        keys = _public_keys(public_key)
        try:
            document = Path(proof_file).read_bytes()
        except OSError as error:
            raise CliError(f"cannot read {proof_file}: {error.strerror or error}") from None
    try:
        summary = check_proof(document, keys)
    except ProofInvalid as error:
        out.print(f"proof FAILED: {error}", highlight=False, markup=False)
        raise typer.Exit(1) from None
    signed = summary.checkpoint
    out.print(
        f"proof OK: request {summary.request_id}: {len(summary.types)} events "
        f"({', '.join(summary.types)}) are in the ledger's tree of size {signed.size}, "
        f"signed by key {signed.key_id} at {signed.time}",
        highlight=False,
        markup=False,
    )


def _signing_key(path: str) -> Any:
    from pathlib import Path

    from ledger.audit.checkpoints import KeyFileError, load_signing_key

    try:
        return load_signing_key(Path(path).read_bytes())
    except OSError as error:
        raise CliError(f"cannot read {path}: {error.strerror or error}") from None
    except KeyFileError as error:
        raise CliError(f"{path}: {error}") from None


def _public_keys(paths: list[str]) -> Any:
    from pathlib import Path

    from ledger.audit.checkpoints import KeyFileError, PublicKeys, load_public_key

    keys = []
    for path in paths:
        try:
            keys.append(load_public_key(Path(path).read_bytes()))
        except OSError as error:
            raise CliError(f"cannot read {path}: {error.strerror or error}") from None
        except KeyFileError as error:
            raise CliError(f"{path}: {error}") from None
    return PublicKeys(keys)


def _checkpoint_audit(directory: str | None, public_keys: list[str] | None) -> Any:
    """The audit ``verify --checkpoints`` feeds, or None without the option."""
    from pathlib import Path

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
    with _friendly_errors():
        keys = _public_keys(public_keys)
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


def main() -> None:
    tune_gc()
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
