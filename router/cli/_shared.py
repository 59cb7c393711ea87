"""What every ``waybill`` command group shares (contract §1 "CLI").

The consoles (piped, as wide as their widest line), the options every group spells alike
(``--database-url``, ``--config``), the error edge (:class:`CliError` and
:func:`friendly_errors`: one line and exit 1, never a traceback), :func:`with_store` (work
on a ledger that exists and is migrated), the progress bar, the config and public-key
loaders, and the bound socket and server that ``serve`` and ``demo`` share.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import sys
from collections.abc import Awaitable, Callable
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
from sqlalchemy.exc import SQLAlchemyError

from ledger import apikeys
from ledger.store import EventStore
from ledger.store.archived import ArchiveError, HistoryArchived
from ledger.store.db import (
    DatabaseUrlError,
    create_engine,
    current_revision,
    head_revision,
    redacted_url,
    resolve_database_url,
    sqlite_path,
)

__all__ = [
    "CliError",
    "ConfigFile",
    "DatabaseUrl",
    "counted",
    "err",
    "friendly_errors",
    "listening_socket",
    "load_public_keys",
    "out",
    "progress_bar",
    "progress_callback",
    "read_config",
    "require_ledger",
    "require_sqlite_file",
    "serve_app",
    "with_store",
]

T = TypeVar("T")

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


def counted(count: int, noun: str) -> str:
    """`1 model group`, `2 model groups`: a count with its noun agreeing."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


@contextmanager
def friendly_errors() -> Any:
    try:
        yield
    except (CliError, DatabaseUrlError, apikeys.UnknownKey, HistoryArchived, ArchiveError) as error:
        err.print(f"[red]error:[/red] {escape(str(error))}", highlight=False)
        raise typer.Exit(1) from None
    except SQLAlchemyError as error:
        detail = str(getattr(error, "orig", None) or error).splitlines()[0]
        err.print(f"[red]error:[/red] database: {detail}")
        raise typer.Exit(1) from None


def with_store(database_url: str | None, work: Callable[[EventStore], Awaitable[T]]) -> T:
    """Run ``work`` on the ledger at ``database_url``, which must be one: a command that
    reads or appends never creates a database, nor runs on one that was never migrated."""
    url = resolve_database_url(database_url)

    async def run() -> T:
        engine = create_engine(url)
        store = EventStore(engine)
        try:
            await require_ledger(engine, url)
            return await work(store)
        finally:
            await store.close()
            await engine.dispose()

    with friendly_errors():
        require_sqlite_file(url)
        return asyncio.run(run())


def require_sqlite_file(url: str) -> None:
    path = sqlite_path(url)
    if path is not None and not path.exists():
        raise CliError(
            f"no ledger at {path}: run `waybill migrate` to create one here, or give "
            "--database-url (or WAYBILL_DATABASE_URL)"
        )


async def require_ledger(engine: Any, url: str) -> None:
    revision, head = await current_revision(engine), head_revision()
    if revision is None:
        raise CliError(f"{redacted_url(url)} holds no Waybill ledger: run `waybill migrate`")
    if revision != head:
        raise CliError(
            f"the ledger at {redacted_url(url)} is at schema revision {revision}, this "
            f"waybill needs {head}: run `waybill migrate`"
        )


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


def progress_callback(progress: Progress, task: TaskID) -> Callable[[int, int], None]:
    def update(done: int, total: int) -> None:
        progress.update(task, completed=done, total=total)

    return update


ConfigFile = Annotated[
    str | None,
    typer.Option("--config", envvar="WAYBILL_CONFIG", help="The YAML config file (contract §2)."),
]


def read_config(config_file: str | None) -> Any:
    """The config named by ``--config`` (or WAYBILL_CONFIG), parsed: its absence, or every
    offending field's path, is a :class:`CliError`."""
    from router.config import ConfigError, load_config

    if not config_file:
        raise CliError("no config: pass --config FILE or set WAYBILL_CONFIG")
    try:
        return load_config(config_file)
    except ConfigError as error:
        raise CliError(
            f"config is invalid ({config_file}):\n  " + str(error).replace("\n", "\n  ")
        ) from None


def listening_socket(host: str, port: int) -> socket.socket:
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
    # Left non-inheritable (Python's default): `--workers N` forks, which shares it anyway,
    # and a child started with exec (the read-model follower, the checkpointer) must not
    # keep it — uvloop's spawn passes inheritable descriptors on, and a child holding it
    # after the gateway died would accept connections nobody serves.
    return listening


def serve_app(settings: Any, host: str, port: int, listening: socket.socket) -> None:
    """Serve the gateway in this process on ``listening`` until it is stopped."""
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


def load_public_keys(paths: list[str]) -> Any:
    """The checkpoint public keys in the files ``paths`` (``--public-key``), for
    ``verify --checkpoints`` and ``verify-proof``; a file that is not one is a CliError."""
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
