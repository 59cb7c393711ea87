"""Small test utilities."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


async def eventually(
    check: Callable[[], Awaitable[bool]], *, within_s: float = 5.0, interval: float = 0.01
) -> None:
    """Wait until ``check()`` is true; fail the test after ``within_s`` seconds."""
    async with asyncio.timeout(within_s):
        while not await check():  # noqa: ASYNC110 - polling a database, not an in-process event
            await asyncio.sleep(interval)
