"""One attempt as the executor keeps it while it runs: the route it was bound to, what its task
found (an answer, a stream up to its first content, or a failure), and the slot it holds;
and the mailbox through which attempts and the hedge timer report to the request's task.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Literal

from ledger import events as ev
from ledger.support.frozen import direct_init
from router.adapters.breakers import BreakerKey
from router.config import Driver as DriverName
from router.config import Mapping as ModelMapping
from router.drivers import DriverResult, DriverStream, PreparedCall, UpstreamFailure
from router.request.classify import Classification
from router.request.composer import Dispatch
from router.request.moves import (
    Kind,
)
from router.request.ports import UpstreamDriver
from router.request.resume import Seam

__all__ = ["Attempt", "AttemptRoute", "Mailbox"]


@direct_init
@dataclass(frozen=True, slots=True)
class AttemptRoute:
    """One attempt's binding: chosen at selection, never redirected by a config reload."""

    choice: ev.RouteChoice
    mapping: ModelMapping
    driver: UpstreamDriver
    driver_name: DriverName  # the endpoint's `driver`: what it sends on, so may be billed
    cause: Literal["first", "retry", "failover", "hedge"]
    worst_case_usd: Decimal
    # A composed group's attempt: the directive its pool was given (contract §4 "Pools").
    dispatch: Dispatch | None = None


@dataclass(slots=True)
class Attempt:
    route: AttemptRoute
    attempt_id: str
    started_at: float
    call: PreparedCall | None  # built while its start committed (None: build it to send)
    kind: Kind = "call"
    seam: Seam | None = None  # a resume's join to the text the client has
    invalid_output: str | None = None  # how its answer broke the shape demanded
    slot: str | None = None  # the endpoint slot it holds (max_in_flight), until it ends
    probes: tuple[BreakerKey, ...] = ()  # the half-open breakers whose probe it holds
    stream_committed: bool = False
    task: asyncio.Task[None] | None = None
    # What its task found: an answer, a stream up to its first content, or a failure.
    result: DriverResult | None = None
    upstream: DriverStream | None = None
    batches: AsyncIterator[list[dict[str, Any]]] | None = None
    held: list[dict[str, Any]] = field(default_factory=list)
    held_raw: bytes | None = None  # the held chunks as the upstream's bytes, if it has them
    classification: Classification | None = None
    failure: UpstreamFailure | None = None
    error_code: str | None = None  # the gateway's own, where the upstream gave none
    error: Exception | None = None  # not a failure of the upstream: raised by the request

    def response_bytes(self) -> int:
        """The upstream's body as far as this attempt read it, answered or failed."""
        if self.result is not None:
            return self.result.response_bytes
        if self.upstream is not None:
            return self.upstream.response_bytes
        return self.failure.response_bytes if self.failure is not None else 0


class Mailbox:
    """What a request's attempts and its hedge timer report, in order, to the one task that
    drives it: an ``asyncio.Queue`` without its unbounded-capacity machinery (a request holds
    one for its whole life, and a long stream's memory is mostly what it holds). ``None`` is
    the hedge timer's: the hedge delay ran out."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[Attempt | None] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: Attempt | None) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def hedge_due(self) -> None:
        self.put(None)

    async def get(self) -> Attempt | None:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()
