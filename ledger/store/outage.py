"""A ledger outage as the log tells it: one line when this process finds the ledger's
database unavailable, one when it works again, with what the outage cost in between.

While the database is away every request is refused (503 ``ledger_unavailable``) and every
end of a request that cannot be recorded waits to be (``router.request.journal``): a line,
let alone a traceback, for each of them said the same thing dozens of times a second. So the
store (its commits and reads) and the gateway tell one :class:`Outage` what happened, and it
speaks twice: when the first failure comes, and when the first success after it does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sqlalchemy.exc import DBAPIError

from ledger.store.db import LedgerUnavailable

__all__ = ["Outage", "cause_of"]

_log = logging.getLogger("waybill.ledger")


def cause_of(error: BaseException) -> str:
    """What failed, by the name of its type alone: the driver's for a database error (a
    driver's message can quote a statement and its values), the one a ``LedgerUnavailable``
    was raised for."""
    while isinstance(error, LedgerUnavailable) and error.__context__ is not None:
        error = error.__context__
    original = error.orig if isinstance(error, DBAPIError) and error.orig is not None else error
    return type(original).__name__


class Outage:
    """Whether this process finds the ledger unavailable now, and what it cost so far."""

    __slots__ = ("_clock", "_late", "_lost", "_refused", "_since")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._since: float | None = None  # when the outage began; None: there is none
        self._refused = 0
        self._late = 0
        self._lost = 0

    @property
    def down(self) -> bool:
        return self._since is not None

    def failed(self, error: BaseException) -> None:
        """The database could not do some work now (``ledger.store.db.is_unavailable``)."""
        if self._since is None:
            self._since = self._clock()
            _log.error(
                "the ledger is unavailable (%s): requests are refused with 503 "
                "ledger_unavailable until it is back",
                cause_of(error),
            )

    def refused(self, error: BaseException) -> None:
        """A request was answered 503 ``ledger_unavailable``."""
        self.failed(error)
        self._refused += 1

    def recorded_late(self) -> None:
        """The end of a request could not be recorded when it happened: it is retried."""
        self._late += 1

    def not_recorded(self) -> None:
        """The end of a request could not be recorded at all: crash recovery will end it
        (``ledger.books.recovery``)."""
        self._lost += 1

    def succeeded(self) -> None:
        """The database did some work: an outage, if there was one, is over."""
        if self._since is None:
            return
        _log.warning(
            "the ledger is available again after %.1f s: %d requests were refused, %d "
            "request ends were not recorded at once (retried; %d left to crash recovery)",
            self._clock() - self._since,
            self._refused,
            self._late,
            self._lost,
        )
        self._since = None
        self._refused = self._late = self._lost = 0
