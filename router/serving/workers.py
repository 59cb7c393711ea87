"""``waybill serve --workers N``: N serving processes behind one listening socket.

One Python process serves from one core. With ``--workers N`` the command binds the port
once, then forks N workers that accept on that same socket (the kernel hands each new
connection to one of them) and supervises them:

- Each worker is a gateway of its own, as a replica on another host would be: its instance
  id is the command's with ``-w<k>`` added (so a worker that is started again recovers the
  holds its earlier run left, ``ledger.books.recovery``), its capacity (``--max-in-flight``),
  breakers, latencies and endpoint slots are its own unless Redis shares them.
- Worker 0 alone keeps the read models (their follower), takes the signed checkpoints and
  exports traces; the others only serve. It also commits the others' ledger appends with
  its own, over a Unix socket in the workers' private directory (``ledger.store.shared_appends``):
  one appender, so the workers do not take the ledger head's lock in turn.
- ``GET /metrics`` on any worker answers for all of them: each worker also listens on a Unix
  socket of its own in a private directory, and the one asked reads its siblings' own
  expositions there and merges them (``otel.merge``). A worker that is being started again
  is missing from that answer until it is up.
- A reload (``POST /v1/admin/config/reload`` to any worker, or SIGHUP to the command, which
  passes it to one worker) reloads every worker, as one gateway: ``router.serving.reload``.
  A worker that is started again serves the config the last reload accepted.
- SIGTERM or SIGINT to the command stops every worker gracefully (a second one, at once).
  A worker that exits while the command is not stopping is started again (its holds in
  flight are recovered as it starts), unless it has exited within :data:`MIN_UPTIME_S` of its
  start :data:`EARLY_EXITS` times in a row: then it cannot serve and the command stops them
  all with exit status 1.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from ledger.books.recovery import MAX_INSTANCE_ID, check_instance_id

__all__ = ["EARLY_EXITS", "MIN_UPTIME_S", "Worker", "supervise", "worker_instance_id", "workers_of"]

MIN_UPTIME_S: Final = 10.0
EARLY_EXITS: Final = 3
"""A worker that exits this many times in a row, each within :data:`MIN_UPTIME_S` of its
start, is not started again: the command stops."""

_log = logging.getLogger("waybill.workers")
_PR_SET_PDEATHSIG: Final = 1


@dataclass(frozen=True, slots=True)
class Worker:
    index: int
    instance_id: str
    socket_path: str  # its own Unix socket, where its siblings read its metrics
    siblings: tuple[str, ...]  # the others' sockets
    appends_socket: str  # where the first worker commits the others' appends
    accepted_config: str  # the config file's bytes as the last reload accepted them


def worker_instance_id(instance_id: str, index: int) -> str:
    """Worker ``index``'s instance id: the command's, with ``-w<index>`` (shortened to fit
    as ``ledger.books.recovery`` requires, keeping the suffix)."""
    suffix = f"-w{index}"
    try:
        return check_instance_id(instance_id + suffix)
    except ValueError:
        return check_instance_id(instance_id[: MAX_INSTANCE_ID - len(suffix)] + suffix)


def workers_of(instance_id: str, count: int, directory: Path) -> list[Worker]:
    paths = [str(directory / f"w{k}.sock") for k in range(count)]
    return [
        Worker(
            index=k,
            instance_id=worker_instance_id(instance_id, k),
            socket_path=paths[k],
            siblings=tuple(p for j, p in enumerate(paths) if j != k),
            appends_socket=str(directory / "appends.sock"),
            accepted_config=str(directory / "accepted-config"),
        )
        for k in range(count)
    ]


def supervise(workers: list[Worker], serve: Callable[[Worker], None]) -> int:
    """Fork a process per worker that runs ``serve(worker)``; start again any that exits
    while not stopping; return the exit status once all have exited (see the module)."""
    running: dict[int, tuple[Worker, float]] = {}
    early = dict.fromkeys(range(len(workers)), 0)  # exits in a row soon after a start
    stopping = False
    failed = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for pid in list(running):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    def reload(signum: int, _frame: object) -> None:
        # One worker reloads them all (router.serving.reload): the first one running.
        for pid, _ in sorted(running.items(), key=lambda item: item[1][0].index)[:1]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGHUP)

    def start(worker: Worker) -> None:
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            os._exit(_run_worker(worker, serve, parent))
        running[pid] = (worker, time.monotonic())

    previous = {
        signum: signal.signal(signum, handler)
        for signum, handler in (
            (signal.SIGTERM, stop),
            (signal.SIGINT, stop),
            (signal.SIGHUP, reload),
        )
    }
    try:
        for worker in workers:
            start(worker)
        while running:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            entry = running.pop(pid, None)
            if entry is None:
                continue
            worker, started = entry
            code = os.waitstatus_to_exitcode(status)
            if stopping:
                failed = failed or code not in (0, -signal.SIGTERM)
                continue
            early[worker.index] = (
                early[worker.index] + 1 if time.monotonic() - started < MIN_UPTIME_S else 0
            )
            if early[worker.index] >= EARLY_EXITS:
                print(
                    f"waybill: worker {worker.index} exited ({_said(code)}) within "
                    f"{MIN_UPTIME_S:.0f} s of its start {EARLY_EXITS} times in a row; "
                    "stopping every worker",
                    file=sys.stderr,
                    flush=True,
                )
                failed = True
                stop(signal.SIGTERM, None)
                continue
            print(
                f"waybill: worker {worker.index} exited ({_said(code)}); starting it again",
                file=sys.stderr,
                flush=True,
            )
            start(worker)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 1 if failed else 0


def _said(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"status {code}"


def _run_worker(worker: Worker, serve: Callable[[Worker], None], parent: int) -> int:
    """In the forked child: its own signal handling, gone when the command is."""
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    # Its own process group, so that a terminal's Ctrl-C reaches the command alone, which
    # passes on one SIGTERM (two would make uvicorn stop at once, cutting streams).
    os.setpgid(0, 0)
    _die_with(parent)
    try:
        serve(worker)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _die_with(parent: int) -> None:
    """On Linux, SIGTERM when the supervising command dies (even by SIGKILL)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the request above took effect
        os._exit(1)
