"""The read models' follower as a process of its own, beside the gateway's.

``waybill serve`` keeps its read models (request views, spend, keys) current from a child
process running ``python -m ledger.views.follow``: decoding and folding every event is CPU the
request path would otherwise share its one event loop with (bench/README.md, "Decisions").
The child polls for new events, takes turns with other runners through the checkpoints,
and stops when told (SIGTERM, SIGINT) or when the gateway that started it is gone. The
gateway restarts it if it dies; while it is down the read models only trail (their lag
shows it), and nothing on the request path waits for them.

On SQLite, one writer at a time being the file's rule, the child folds each page in a read
transaction, which takes no lock, and holds the write lock only to write what it folded
(``ProjectionRunner._step_sqlite``), so the gateway's appends seldom wait for it, and
briefly (bench/README.md, "The embedded default").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

from ledger.store import EventStore
from ledger.store.db import create_engine
from ledger.store.tail import Wakeup
from ledger.support.process import run, tune_gc
from ledger.views import all_projections
from ledger.views.projection import ProjectionRunner

__all__ = [
    "exit_with_parent",
    "follow_in_child",
    "serve_as_child",
    "supervise_child",
    "vacuum_open_tables",
]

_log = logging.getLogger(__name__)

_URL_VARIABLE = "WAYBILL_FOLLOW_DATABASE_URL"  # not argv: a password in a URL shows in ps
_PARENT_VARIABLE = "WAYBILL_FOLLOW_PARENT"  # the gateway's pid (it may die before we start)
_PARENT_CHECK_S = 1.0
SETTLE_S = 0.1
"""After a wake-up, let this long pass before catching up, so one catch-up folds the commits
of many requests (the read models then trail by about that much)."""
POLL_S = SETTLE_S
"""How often the follower looks for new events. It polls instead of LISTENing: a NOTIFY per
commit woke a PostgreSQL backend and this process, CPU on both sides for every request
(`bench/ab.py`; bench/README.md, "Decisions"), while the read models would wait out the same
settle time anyway; idle, a poll is one indexed read ten times a second."""
VACUUM_OPEN_S = 5.0
"""How often the follower vacuums the open tables: the read models' (``open_request_views``,
``open_spend_attempts``) and the books' (``budget_open_holds``). A row there lives while its
request or hold is open and is deleted at its end, so the tables hold a few pages of live
rows and a stream of deleted ones. Without a vacuum, PostgreSQL reuses little of that space
(its free-space map learns of it from a vacuum only) and the rows' bytes stay on disk as if
they were never deleted; a vacuum of a few pages every few seconds gives it back
(bench/README.md, "Ledger size")."""
_OPEN_TABLES = ("open_request_views", "open_spend_attempts", "budget_open_holds")


async def follow_in_child(
    database_url: str, stop: asyncio.Event, *, restart_after_s: float = 1.0
) -> None:
    """Run the follower as a child process until ``stop`` is set, restarting it when it
    exits on its own (after ``restart_after_s``, doubled up to a minute while it keeps dying
    young); then stop it and wait for it."""
    env = {_URL_VARIABLE: database_url, _PARENT_VARIABLE: str(os.getpid())}
    await supervise_child(
        "ledger.views.follow",
        env,
        stop,
        name="the read-model follower",
        restart_after_s=restart_after_s,
    )


async def supervise_child(
    module: str,
    env: dict[str, str],
    stop: asyncio.Event,
    *,
    name: str,
    stdin: bytes = b"",
    restart_after_s: float = 1.0,
) -> None:
    """Run ``python -m module`` with ``env`` added (and ``stdin`` written to it, then
    closed) until ``stop`` is set, restarting it as :func:`follow_in_child` says; then stop
    it (SIGTERM, SIGKILL after 10 s) and wait for it."""
    env = {**os.environ, **env}
    delay = restart_after_s / 2
    while not stop.is_set():
        started = time.monotonic()
        # A session of its own: a Ctrl-C at the terminal stops the gateway, which stops
        # its child, rather than reaching both at once.
        try:
            child = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                module,
                env=env,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                start_new_session=True,
            )
            if stdin and child.stdin is not None:
                child.stdin.write(stdin)
                with contextlib.suppress(ConnectionError):
                    await child.stdin.drain()
                child.stdin.close()
        except OSError as error:  # out of processes or memory: its work only waits
            delay = min(delay * 2, 60)
            _log.error("could not start %s (%s); retrying in %.0f s", name, error, delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            continue
        stopping = asyncio.create_task(stop.wait())
        exiting = asyncio.create_task(child.wait())
        try:
            await asyncio.wait({stopping, exiting}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            if child.returncode is None:
                await _stop(child)
            exiting.cancel()
        if stop.is_set():
            return
        lived_s = time.monotonic() - started
        delay = restart_after_s if lived_s > 60 else min(delay * 2, 60)
        _log.warning(
            "%s exited (status %s); restarting it in %.0f s", name, child.returncode, delay
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)


async def _stop(child: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        child.terminate()
    try:
        await asyncio.wait_for(child.wait(), 10)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        await child.wait()


async def _follow(database_url: str, parent: int) -> None:
    async def follow(store: EventStore, stop: asyncio.Event) -> None:
        runner = ProjectionRunner(store, all_projections(), poll_interval_s=POLL_S)
        vacuuming = asyncio.create_task(vacuum_open_tables(store, stop))
        try:
            await runner.run(stop, Wakeup(store, poll_interval_s=POLL_S, listen=False))
        finally:
            stop.set()
            await vacuuming

    await serve_as_child(database_url, parent, follow)


async def vacuum_open_tables(
    store: EventStore, stop: asyncio.Event, every_s: float = VACUUM_OPEN_S
) -> None:
    """Until ``stop``: every ``every_s``, VACUUM the open tables (PostgreSQL;
    SQLite reuses a file's freed pages itself). A plain VACUUM blocks none of the follower's
    or the readers' statements; a failure is logged and tried again next time."""
    if store.engine.dialect.name != "postgresql":
        return
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(every_s):
                await stop.wait()
        if stop.is_set():
            return
        try:
            async with store.engine.connect() as conn:
                conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
                await conn.exec_driver_sql(f"VACUUM {', '.join(_OPEN_TABLES)}")
        except Exception as error:
            _log.warning("vacuum of the open tables failed: %s", error)


async def serve_as_child(
    database_url: str,
    parent: int,
    work: Callable[[EventStore, asyncio.Event], Awaitable[None]],
) -> None:
    """A child process of ``waybill serve``: run ``work`` on the ledger until SIGTERM or
    SIGINT, or until its parent is gone, then close the store and the engine."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    engine = create_engine(database_url)
    store = EventStore(engine)
    watching = asyncio.create_task(exit_with_parent(parent, stop))
    try:
        await work(store, stop)
    finally:
        stop.set()
        await watching
        await store.close()
        await engine.dispose()


async def exit_with_parent(parent: int, stop: asyncio.Event) -> None:
    """Set ``stop`` when ``parent`` is gone: a gateway killed with SIGKILL cannot stop its
    child, so the child notices instead."""
    while not stop.is_set():
        if os.getppid() != parent:
            stop.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), _PARENT_CHECK_S)


def main() -> None:
    tune_gc()
    logging.basicConfig(level=logging.WARNING, format="waybill follower: %(message)s")
    database_url = os.environ.get(_URL_VARIABLE)
    parent = os.environ.get(_PARENT_VARIABLE, "")
    if not database_url or not parent.isdigit():
        sys.exit("ledger.views.follow is started by `waybill serve`, not by hand")
    run(_follow(database_url, int(parent)))


if __name__ == "__main__":
    main()
