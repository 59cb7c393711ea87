"""How every fake of the kit is served on 127.0.0.1: in a test's own event loop
(``async with``), or in a loop of its own on a daemon thread (``with``), for synchronous
callers and for processes the fake must outlive a request of."""

from __future__ import annotations

import asyncio
import threading
from abc import ABC, abstractmethod
from types import TracebackType
from typing import Self

__all__ = ["Served"]


class Served(ABC):
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None

    @abstractmethod
    async def astart(self) -> Self:
        """Listen (on the running loop)."""

    @abstractmethod
    async def aclose(self) -> None:
        """Stop listening and end what is being served."""

    def thread_name(self) -> str:
        return type(self).__name__

    async def __aenter__(self) -> Self:
        return await self.astart()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # Synchronously: on a private loop in a daemon thread.

    def start(self) -> Self:
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name=self.thread_name(), daemon=True)
        thread.start()
        self._loop, self._thread = loop, thread
        try:
            asyncio.run_coroutine_threadsafe(self.astart(), loop).result(timeout=10)
        except BaseException:
            self._stop_loop()
            raise
        return self

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self.aclose(), loop).result(timeout=10)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
        self._loop = self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
