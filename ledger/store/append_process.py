"""The appender as a process of its own: ``waybill serve --append-process``.

A serving process's appender decides, hashes, compresses and writes every batch on the one
event loop that also serves the requests (``ledger.store.append``, ``ledger.store.postgres``):
about a fifth of the process's CPU at concurrency 16. With ``--append-process`` that work
runs in a child process, ``python -m ledger.store.append_process``, on another core: the
serving process (every worker, with ``--workers``) forwards each batch to it over a Unix
socket in a private directory, as the workers forward theirs to the first worker without the
option (``ledger.store.shared_appends``: the same ``AppendServer`` here, the same
``AppendClient`` there). An append is answered once the child has committed it, so nothing is
answered before it is durable.

The serving process (the first worker, with ``--workers``) starts the child and starts it
again when it dies (``ledger.views.follow.supervise_child``). While it cannot be reached, each
serving process commits its batches itself, through its own backend, and tries the socket
again after a back-off; a batch whose reply never came (the child was killed with it) fails
with ``LedgerUnavailable`` and may have committed, which the request path resolves by
reading its stream (``router.request.journal``), and ``ledger.books.recovery`` settles the
holds of a serving process that died. The child stops when told (SIGTERM), or when the process
that started it is gone, after committing what it had queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time

from ledger.store.event_store import EventStore
from ledger.store.shared_appends import AppendServer
from ledger.support.process import run, tune_gc
from ledger.views.follow import serve_as_child, supervise_child

__all__ = ["commit_in_child", "wait_listening"]

_log = logging.getLogger("waybill.ledger")

_URL_VARIABLE = "WAYBILL_APPENDS_DATABASE_URL"  # not argv: a password in a URL shows in ps
_PARENT_VARIABLE = "WAYBILL_APPENDS_PARENT"
_SOCKET_VARIABLE = "WAYBILL_APPENDS_SOCKET"


async def commit_in_child(database_url: str, socket_path: str, stop: asyncio.Event) -> None:
    """Run the append process, listening on ``socket_path``, until ``stop`` is set; start it
    again when it exits on its own; then stop it (it commits what it holds) and wait for it."""
    env = {
        _URL_VARIABLE: database_url,
        _PARENT_VARIABLE: str(os.getpid()),
        _SOCKET_VARIABLE: socket_path,
    }
    await supervise_child("ledger.store.append_process", env, stop, name="the append process")


async def wait_listening(socket_path: str, within_s: float) -> bool:
    """Whether something accepts on ``socket_path`` within ``within_s``: a serving process
    waits for the append process before it serves (until then it would commit itself)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            _, writer = await asyncio.open_unix_connection(socket_path)
        except OSError:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
            continue
        writer.close()  # the server reads no frame from it and drops it
        return True


async def _serve(database_url: str, parent: int, socket_path: str) -> None:
    server: AppendServer | None = None

    async def commit(store: EventStore, stop: asyncio.Event) -> None:
        nonlocal server
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)  # the run before this one's
        server = AppendServer(store, socket_path)
        await server.start()
        await stop.wait()

    try:
        await serve_as_child(database_url, parent, commit)
    finally:
        # After the store's close (serve_as_child's end): what was queued is committed and
        # answered; a batch sent since is answered "not taken", and its sender commits it.
        if server is not None:
            await server.close()


def main() -> None:
    tune_gc()
    logging.basicConfig(level=logging.WARNING, format="waybill append process: %(message)s")
    database_url = os.environ.get(_URL_VARIABLE)
    parent = os.environ.get(_PARENT_VARIABLE, "")
    socket_path = os.environ.get(_SOCKET_VARIABLE)
    if not database_url or not parent.isdigit() or not socket_path:
        sys.exit("ledger.store.append_process is started by `waybill serve`, not by hand")
    run(_serve(database_url, int(parent), socket_path))


if __name__ == "__main__":
    main()
