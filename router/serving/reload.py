"""How the workers of ``waybill serve --workers N`` reload the config as one gateway
(contract §2 "Reloading").

A reload reaches one worker (the admin API's call, or SIGHUP, which the command passes to one
worker: ``router.serving.workers``). That worker, holding the workers' reload lock
(:func:`one_reload_at_a_time`), reads the config file once and validates it: a file that
does not validate is refused there and no worker changes. Otherwise it writes the bytes it
read where every worker finds them (:func:`write_accepted`: a worker that is started again
serves them too), swaps them in itself, and asks each other worker, on that worker's own
Unix socket, to swap in those same bytes (:func:`reload_siblings`, a
``POST /v1/admin/config/reload`` carrying :data:`WORKER_RELOAD_HEADER`: the generation they
must be). It answers once every worker has; a worker that did not (not reachable, being
started again, or found other bytes) is named in the answer, ``503 reload_incomplete``.

The lock makes reloads taken by two workers at once follow one another, so the accepted
bytes cannot change while a reload asks the others to take them. The swap the others are
asked for is trusted by the socket it comes on: only this user's processes reach the
workers' directory (0700), as for ``ledger.store.shared_appends``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Final

import httpx

__all__ = [
    "WORKER_RELOAD_HEADER",
    "one_reload_at_a_time",
    "read_accepted",
    "reload_siblings",
    "write_accepted",
]

WORKER_RELOAD_HEADER: Final = "x-waybill-worker-reload"
"""On a reload sent to a worker's own socket: swap in the accepted config, which must be of
this generation."""

_LOCK_POLL_S: Final = 0.02  # a reload holds the lock for a few milliseconds
_SIBLING_TIMEOUT_S: Final = 30.0  # a swap parses the config and builds a gateway


@contextlib.asynccontextmanager
async def one_reload_at_a_time(accepted: str) -> AsyncIterator[None]:
    """Hold the workers' reload lock (an exclusive ``flock`` beside the accepted config,
    released if the holder dies). Polled rather than waited for in a thread, so that a
    cancelled caller leaves nothing waiting behind it."""
    fd = os.open(accepted + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(_LOCK_POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock


def write_accepted(accepted: str, raw: bytes) -> None:
    """Keep ``raw`` as the config every worker serves (replaced whole: a reader never sees
    half of it)."""
    new = accepted + ".new"
    Path(new).write_bytes(raw)
    os.replace(new, accepted)


def read_accepted(accepted: str) -> bytes | None:
    """The config bytes the last reload accepted; None before any reload did."""
    try:
        return Path(accepted).read_bytes()
    except FileNotFoundError:
        return None


async def reload_siblings(sockets: tuple[str, ...], generation: str) -> list[str]:
    """Ask each other worker to swap in the accepted config of ``generation``; returns what
    went wrong, one line per worker that did not (empty: every one did)."""
    said = await asyncio.gather(*(_reload_one(path, generation) for path in sockets))
    return [line for line in said if line is not None]


async def _reload_one(path: str, generation: str) -> str | None:
    worker = f"worker {Path(path).stem.removeprefix('w')}"
    transport = httpx.AsyncHTTPTransport(uds=path)
    try:
        async with httpx.AsyncClient(transport=transport, timeout=_SIBLING_TIMEOUT_S) as client:
            response = await client.post(
                "http://worker/v1/admin/config/reload",
                headers={WORKER_RELOAD_HEADER: generation},
            )
    except httpx.HTTPError as error:
        return f"{worker} could not be reached ({type(error).__name__})"
    if response.status_code == 200:
        return None
    try:
        message = str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = f"HTTP {response.status_code}"
    return f"{worker}: {message}"
