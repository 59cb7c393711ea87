"""``waybill serve`` and ``waybill check-config`` (contract §1, §2): the gateway, in one
process or in supervised workers on one port, and the config it would refuse.

The gateway's modules are imported once the options are checked, not with the CLI: every
other command starts without them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

from ledger.store.db import create_engine, migrate, resolve_database_url
from router.cli._shared import (
    CliError,
    ConfigFile,
    DatabaseUrl,
    counted,
    err,
    friendly_errors,
    listening_socket,
    out,
    read_config,
    require_ledger,
    require_sqlite_file,
    serve_app,
)

__all__ = ["check_config_command", "serve_command"]


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
        f"config OK: generation {config.generation}, {counted(len(config.endpoints), 'endpoint')}, "
        f"{counted(len(config.models), 'model group')}, "
        f"{counted(len(config.workspaces), 'workspace')}",
        highlight=False,
    )


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
    from router.http.app import AppSettings

    url = resolve_database_url(database_url)
    with friendly_errors():
        if workers > 1 and not url.startswith("postgresql"):
            raise CliError("--workers needs a PostgreSQL ledger: a SQLite ledger is one process's")
        config = read_config(config_file)
        if archive is not None and not archive.is_dir():
            raise CliError(f"--archive: {archive} is not a directory")
        heartbeat_s = _heartbeat_s()
        instance = _instance_id(instance_id, host, port)
        console_secret = _console_secret()
        if no_migrate:
            require_sqlite_file(url)
            asyncio.run(_check_ledger(url))
        else:
            migrate(url)
        listening = listening_socket(host, port)
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
        serve_app(settings, host, port, listening)


def _console_secret() -> bytes:
    """The console's session secret: WAYBILL_CONSOLE_SECRET, else random for this run."""
    from router.http.console import secret_from

    try:
        return secret_from(os.environ.get("WAYBILL_CONSOLE_SECRET"))
    except ValueError as error:
        raise CliError(str(error)) from None


def _instance_id(given: str | None, host: str, port: int) -> str:
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
        await require_ledger(engine, url)
    finally:
        await engine.dispose()


def _serve_workers(
    settings: Any, host: str, port: int, listening: socket.socket, count: int
) -> None:
    """``count`` workers accepting on ``listening``, supervised (router.serving.workers)."""
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
    import uvicorn

    from router.config import parse_config_file
    from router.http.app import create_app
    from router.serving.reload import read_accepted
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
    config = settings.config
    accepted = read_accepted(worker.accepted_config)
    if accepted is not None:  # a reload since the command started: the workers serve that
        config = parse_config_file(accepted, settings.config_path)
    served = create_app(
        dataclasses.replace(
            settings,
            config=config,
            instance_id=worker.instance_id,
            background=worker.index == 0,
            siblings=worker.siblings,
            appends_socket=worker.appends_socket,
            accepted_config=worker.accepted_config,
        )
    )
    server = uvicorn.Server(uvicorn.Config(served, host=host, port=port, **UVICORN_OPTIONS))
    server.run(sockets=[listening, own])
