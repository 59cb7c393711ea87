"""Wake-ups for readers that follow the ledger: "something may have been appended".

On PostgreSQL the appender sends ``NOTIFY waybill_events`` inside each append transaction
(delivered at commit, to every process); a listener connection turns that into a local
signal. Appends made by this process signal directly. Polling at ``poll_interval_s`` stays
as the fallback for a lost notification or a listener that cannot connect, and is the only
mechanism on SQLite across processes. A wake-up is only a hint: readers always read
``position > checkpoint`` and so never depend on it for correctness.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from types import TracebackType

from ledger.store import EventStore

__all__ = ["CHANNEL", "Wakeup"]

CHANNEL = "waybill_events"
_log = logging.getLogger(__name__)


class Wakeup:
    def __init__(
        self, store: EventStore, *, poll_interval_s: float = 1.0, listen: bool = True
    ) -> None:
        """``listen=False``: no LISTEN connection, only this process's own appends and the
        poll interval (``ledger.views.follow``: a notification per commit cost more than
        polling does)."""
        self._store = store
        self._listen_on_postgres = listen
        self._signal = store.commit_signal()
        self._poll_interval_s = poll_interval_s
        self._listener: asyncio.Task[None] | None = None
        self.notifications = 0

    async def __aenter__(self) -> Wakeup:
        if self._listen_on_postgres and self._store.engine.dialect.name == "postgresql":
            self._listener = asyncio.create_task(self._listen(), name="waybill-ledger-listen")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener

    async def wait(self, stop: asyncio.Event | None = None) -> None:
        """Return at the next wake-up, at ``stop``, or after the poll interval."""
        if not self._signal.is_set():
            waiters = [asyncio.ensure_future(self._signal.wait())]
            if stop is not None:
                waiters.append(asyncio.ensure_future(stop.wait()))
            try:
                await asyncio.wait(
                    waiters, timeout=self._poll_interval_s, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                for waiter in waiters:
                    waiter.cancel()
        self._signal.clear()

    async def _listen(self) -> None:
        import psycopg

        url = self._store.engine.url.set(drivername="postgresql")
        conninfo = url.render_as_string(hide_password=False)
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    async for _ in conn.notifies():
                        self.notifications += 1
                        self._signal.set()
            except psycopg.Error as error:
                # Polling keeps readers correct meanwhile; try to listen again shortly.
                _log.warning(
                    "ledger LISTEN connection lost (%s); polling until it returns",
                    type(error).__name__,
                )
                await asyncio.sleep(self._poll_interval_s)
