"""What one gateway process is started with (:class:`AppSettings`), and its default instance id."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from ledger.books.recovery import (
    MAX_INSTANCE_ID,
    check_instance_id,
)
from router.config import (
    Config,
)

DEFAULT_MAX_IN_FLIGHT: Final = 256
"""Requests in flight per workspace in one process before new ones get 503 capacity_error
(``waybill serve --max-in-flight``). What an LLM gateway carries is long streams, and the
number of them open is its load. The default comes from a sweep of ``bench/streams_bench.py``
on a 2-core machine (``bench/README.md``, "Capacity"): past it, the time to first token the
gateway adds grows with every stream more, for all of them, and a fast 503 serves a client
better than a slower stream for everyone. Derive it for other machines the same way."""


@dataclass(frozen=True)
class AppSettings:
    config: Config
    database_url: str
    redis_url: str | None = None
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT  # per workspace and process; then: 503
    heartbeat_s: float = 5.0  # a gateway silent for 6 heartbeats is presumed dead
    config_path: str | None = None  # where a reload (SIGHUP, or the admin API) reads from
    follower_process: bool = False  # read models in a child (ledger.views.follow)
    # Who this gateway is across restarts (ledger.books.recovery): at start-up it recovers the
    # holds its own earlier incarnations left. None: a new id, so it has no earlier ones.
    instance_id: str | None = None
    # Signs the console's session cookies (WAYBILL_CONSOLE_SECRET). None: a random secret
    # of this process, so sessions end when it does.
    console_secret: bytes | None = None
    # Whether this process also keeps the read models, takes the checkpoints and exports
    # traces: one worker of `waybill serve --workers N` does (router.serving.workers), the others
    # only serve.
    background: bool = True
    # The Unix sockets of the other workers of the same `waybill serve --workers N`, whose
    # metrics GET /metrics adds to this process's own.
    siblings: tuple[str, ...] = ()
    # The Unix socket where the first worker of `waybill serve --workers N` commits the
    # others' appends (ledger.store.shared_appends): it listens there (``background``), they send.
    appends_socket: str | None = None
    # Where the workers of `waybill serve --workers N` keep the config bytes the last reload
    # accepted: a reload reloads every worker (router.serving.reload). None: one process.
    accepted_config: str | None = None
    # Where `waybill archive` put the archived months (WAYBILL_ARCHIVE_DIR): the events and
    # explanation of a request recorded in one are read there. None: such a request's
    # events answer 404, saying why.
    archive_dir: Path | None = None


def default_instance_id(host_name: str, bind_host: str, port: int) -> str:
    """``waybill serve``'s instance id when none is given: ``<host name>@<address>:<port>``,
    a socket address only one process on a machine can listen on at a time. One that an
    instance id cannot hold (too long, odd characters) is cut down to what it can, with a
    hash of the whole to keep it unique."""
    address = f"[{bind_host}]" if ":" in bind_host else bind_host  # IPv6, as in a URL
    wanted = f"{host_name}@{address}:{port}"
    try:
        return check_instance_id(wanted)
    except ValueError:
        digest = hashlib.sha256(wanted.encode()).hexdigest()[:8]
        kept = re.sub(r"[^A-Za-z0-9._:@\[\]-]+", "-", wanted).lstrip("._:@[]-")
        return f"{kept[: MAX_INSTANCE_ID - 9]}-{digest}" if kept else digest
