"""Small test utilities."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
import redis
import redis.asyncio as aioredis
import sqlalchemy as sa
from redis.exceptions import ConnectionError as RedisConnectionError

from ledger.store import RecordedEvent, decode_row

REDIS_URL = os.environ.get("WAYBILL_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
"""The test Redis (its own database, 15, unless the environment says otherwise)."""


def redis_up() -> bool:
    """Whether the test Redis answers (the tests that need it skip, saying why, if not)."""
    try:
        redis.Redis.from_url(REDIS_URL).ping()
    except redis.RedisError:
        return False
    return True


def ledger_events(conn: sa.Connection) -> list[RecordedEvent]:
    """Every event of the ledger, in order, read on a synchronous connection."""
    rows = conn.execute(sa.text("SELECT position, hash, payloads FROM appends ORDER BY position"))
    found: list[RecordedEvent] = []
    for row in rows:
        found += decode_row(
            row.position, bytes.fromhex(found[-1].hash) if found else None, row.payloads
        )
    return found


async def eventually(
    check: Callable[[], Awaitable[bool]], *, within_s: float = 5.0, interval: float = 0.01
) -> None:
    """Wait until ``check()`` is true; fail the test after ``within_s`` seconds."""
    async with asyncio.timeout(within_s):
        while not await check():  # noqa: ASYNC110 - polling a database, not an in-process event
            await asyncio.sleep(interval)


@contextlib.contextmanager
def breaker_keys_removed(redis_url: str, generation: str) -> Iterator[None]:
    """Delete, after the block, the breaker keys its gateways wrote to the test Redis under
    config ``generation`` (a test leaves no state behind for the next run)."""
    try:
        yield
    finally:
        client = redis.Redis.from_url(redis_url)
        try:
            keys = list(client.scan_iter(f"waybill:breaker:{generation}:*"))
            if keys:
                client.delete(*keys)
        finally:
            client.close()


@contextlib.asynccontextmanager
async def redis_prefix() -> AsyncIterator[str]:
    """A fresh key prefix on the test Redis, every key under it deleted afterwards; skips the
    test if Redis does not answer."""
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        try:
            await client.ping()
        except RedisConnectionError as exc:
            pytest.skip(f"the test Redis (WAYBILL_TEST_REDIS_URL) is unreachable: {exc}")
        prefix = f"waybill-test:{uuid.uuid4().hex}"
        yield prefix
        keys = [key async for key in client.scan_iter(match=f"{prefix}:*")]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()
