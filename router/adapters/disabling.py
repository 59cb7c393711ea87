"""Disabled endpoints on the request path (contract §5 "Disabled endpoints").

A ``credentials`` failure (401/403) disables its endpoint: no attempt goes there, no probe, no
cool-down ends it; an operator enables it again (``waybill endpoints enable``,
``POST /v1/admin/endpoints/{id}/enable``), or a config that gives it another key does.

The truth is the ledger's ``endpoints`` stream (``ledger.endpoints``), not the breakers,
which a reload starts afresh: a disabled endpoint stays disabled across reloads and restarts.
Each gateway process holds the stream's fold in memory (:class:`Disabling`, one per process,
shared by its config generations), so routing reads it without I/O. It is kept current:

- at once, by this process's own writes;
- when Redis is configured, by a doorbell: each write publishes the stream's new version on
  a Redis channel, and every gateway that hears it reads the stream's new events. The
  message carries no state, so a stray ring (another deployment on the same Redis) can only
  cause a read, and a lost one only a delay;
- on every heartbeat (``WAYBILL_HEARTBEAT_S``), whatever became of the doorbell, and for
  writers without Redis (``waybill endpoints enable`` with no ``WAYBILL_REDIS_URL``).

Which key was refused is told by :func:`key_check`, never by the key: a salted, slow hash
of it. A config whose key for the endpoint has another check does not see the endpoint
disabled, and activating it records ``EndpointEnabled`` (cause ``key_changed``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Final, Literal

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from ledger import events as ev
from ledger.endpoints import (
    DisabledEndpoint,
    EndpointStates,
    read_states,
    record_disabled,
    record_enabled,
)
from ledger.store import EventStore, LedgerUnavailable, WrongExpectedVersion
from router.config import Config, Endpoint

__all__ = ["DOORBELL_CHANNEL", "ConfigView", "Disabling", "detail", "key_check", "ring_doorbell"]

log = logging.getLogger("waybill.disabling")

DOORBELL_CHANNEL: Final = "waybill:endpoints"
_KEY_CHECK_ROUNDS: Final = 100_000
_KEY_CHECK_SALT: Final = b"waybill endpoint key check\x00"
_REDIS_TIMEOUT_S: Final = 2.0
_RECONNECT_S: Final = 1.0


def key_check(endpoint: Endpoint) -> str | None:
    """What tells one key of an endpoint from another without revealing it: PBKDF2-SHA256
    of the key, salted with the endpoint's id, at a cost that makes guessing a weak key as
    slow as guessing a password. None for an endpoint without a key. CPU-bound, on purpose
    (``bench/README.md``, "Decisions"): call it in a thread."""
    if endpoint.api_key is None:
        return None
    digest = hashlib.pbkdf2_hmac(
        "sha256",
        endpoint.api_key.get_secret_value().encode(),
        _KEY_CHECK_SALT + endpoint.id.encode(),
        _KEY_CHECK_ROUNDS,
        dklen=16,
    )
    return f"pbkdf2-sha256${_KEY_CHECK_ROUNDS}${digest.hex()}"


class Disabling:
    """This process's view of the disabled endpoints, and the way it changes them."""

    def __init__(
        self,
        store: EventStore,
        *,
        redis_url: str | None = None,
        channel: str = DOORBELL_CHANNEL,
        on_change: Callable[[EndpointStates], None] | None = None,
    ) -> None:
        self.states = EndpointStates()
        self._store = store
        self._on_change = on_change
        self._channel = channel
        self._redis = None if redis_url is None else _client(redis_url)
        # One read of the stream at a time; a read that finds a later fold than this
        # process's own writes left is all that changes the view (_take).
        self._reading = asyncio.Lock()

    def _take(self, states: EndpointStates) -> None:
        if states.version > self.states.version:
            self.states = states
            if self._on_change is not None:
                self._on_change(states)

    async def sync(self) -> EndpointStates:
        """Read the stream's events this process has not folded yet."""
        async with self._reading:
            self._take(await read_states(self._store, self.states))
        return self.states

    async def disable(self, disabled: ev.EndpointDisabled) -> bool:
        """Record the disabling (unless the ledger has the endpoint disabled for the same
        key already); whether this call recorded it. Raises ``LedgerUnavailable``."""
        states, recorded = await record_disabled(self._store, disabled, self.states)
        self._take(states)
        if recorded:
            await self._ring()
        return recorded

    async def enable(
        self,
        endpoint: str,
        *,
        actor: str | None,
        generation: str,
        lifts: Callable[[DisabledEndpoint], bool] = lambda _: True,
        cause: Literal["operator", "key_changed"] = "operator",
    ) -> ev.EndpointEnabled | None:
        """Enable a disabled endpoint; the event recorded, or None if it was not disabled
        (or ``lifts`` says this does not lift its disabling)."""
        states, enabled = await record_enabled(
            self._store,
            endpoint,
            cause=cause,
            actor=actor,
            generation=generation,
            states=self.states,
            lifts=lifts,
        )
        self._take(states)
        if enabled is not None:
            await self._ring()
        return enabled

    async def activate(self, config: Config) -> list[str]:
        """At start-up and on each reload: catch up with the ledger, and enable every
        endpoint disabled for a key that ``config`` no longer gives it. Returns those."""
        await self.sync()
        lifted = []
        for endpoint_id, disabled in sorted(self.states.disabled.items()):
            endpoint = config.endpoint(endpoint_id)
            if endpoint is None:
                continue  # not served by this config: its disabling waits for one that does
            mine = await asyncio.to_thread(key_check, endpoint)
            if mine == disabled.key_check:
                continue
            enabled = await self.enable(
                endpoint_id,
                actor=None,
                generation=config.generation,
                lifts=_another_key(mine),
                cause="key_changed",
            )
            if enabled is not None:
                lifted.append(endpoint_id)
        return lifted

    def view(self, config: Config) -> ConfigView:
        """The disabled endpoints as a config generation sees them."""
        return ConfigView(self, config)

    async def _ring(self) -> None:
        if self._redis is not None:
            await ring_doorbell(self._redis, self._channel, self.states.version)

    async def listen(self, stop: asyncio.Event) -> None:
        """Until ``stop``: read the stream whenever another process rings (Redis only)."""
        if self._redis is None:
            return
        await _listen(self._redis, self._channel, self._heard, stop)

    async def _heard(self) -> None:
        try:
            await self.sync()
        except LedgerUnavailable as error:  # the next ring or heartbeat reads it again
            log.warning("cannot read the endpoints stream now: %s", error)

    async def aclose(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()


class ConfigView:
    """The disabled endpoints as one config generation sees them: its endpoints disabled
    for the keys it gives them (a replica on another key during a rotation sees its own)."""

    def __init__(self, disabling: Disabling, config: Config) -> None:
        self.disabling = disabling
        self._config = config
        self._key_checks: dict[str, asyncio.Task[str | None]] = {}

    async def key_check(self, endpoint_id: str) -> str | None:
        """The config's key check of an endpoint, computed once, in a thread (slow on
        purpose)."""
        task = self._key_checks.get(endpoint_id)
        if task is None:
            endpoint = self._config.endpoint(endpoint_id)
            assert endpoint is not None, "an endpoint of this config"
            task = asyncio.create_task(asyncio.to_thread(key_check, endpoint))
            self._key_checks[endpoint_id] = task
        return await asyncio.shield(task)

    async def current(self) -> dict[str, DisabledEndpoint]:
        """This config's endpoints disabled now (nothing to wait for when none is)."""
        found: dict[str, DisabledEndpoint] = {}
        for endpoint_id, disabled in self.disabling.states.disabled.items():
            if self._config.endpoint(endpoint_id) is None:
                continue
            if await self.key_check(endpoint_id) == disabled.key_check:
                found[endpoint_id] = disabled
        return found

    async def disable(
        self,
        endpoint_id: str,
        *,
        http_status: int | None,
        error_code: str | None,
        request_id: str,
        attempt_id: str,
    ) -> bool:
        """Disable an endpoint whose key was refused; False if the ledger cannot record it
        now (the caller opens its breaker instead, so the key is not tried on and on)."""
        disabled = ev.EndpointDisabled(
            endpoint=endpoint_id,
            http_status=http_status,
            error_code=error_code,
            key_check=await self.key_check(endpoint_id),
            request_id=request_id,
            attempt_id=attempt_id,
            config_generation=self._config.generation,
        )
        try:
            await self.disabling.disable(disabled)
        except (LedgerUnavailable, WrongExpectedVersion) as error:
            log.warning("cannot record endpoint %s disabled: %s", endpoint_id, error)
            return False
        return True


def detail(disabled: Mapping[str, DisabledEndpoint], endpoint_id: str) -> str | None:
    """A disabled endpoint's reason detail (routing's ``credentials_disabled``): what the
    upstream answered, and the way out."""
    found = disabled.get(endpoint_id)
    if found is None:
        return None
    answered = " ".join(str(part) for part in (found.http_status, found.error_code) if part)
    return (
        f"the upstream answered {answered or 'a credentials failure'}; "
        f"enable it with: waybill endpoints enable {endpoint_id}"
    )


def _another_key(mine: str | None) -> Callable[[DisabledEndpoint], bool]:
    """Whether a disabling was of another key than ``mine`` (a new key lifts only that)."""

    def lifts(disabled: DisabledEndpoint) -> bool:
        return disabled.key_check != mine

    return lifts


def _client(url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(
        url, socket_timeout=_REDIS_TIMEOUT_S, socket_connect_timeout=_REDIS_TIMEOUT_S
    )


async def ring_doorbell(client: aioredis.Redis, channel: str, version: int) -> None:
    """Tell every gateway listening that the ``endpoints`` stream moved (to ``version``).
    A ring that cannot be sent is logged, not raised: the write it announces is in the
    ledger, and every gateway reads that on its next heartbeat anyway."""
    try:
        await client.publish(channel, str(version))
    except RedisError as error:
        log.warning("cannot ring the endpoints doorbell on Redis: %s", type(error).__name__)


async def _listen(
    client: aioredis.Redis,
    channel: str,
    heard: Callable[[], Awaitable[None]],
    stop: asyncio.Event,
) -> None:
    while not stop.is_set():
        try:
            async with client.pubsub() as pubsub:
                await pubsub.subscribe(channel)
                await heard()  # whatever rang while this process was not listening
                while not stop.is_set():
                    message = await pubsub.get_message(
                        ignore_subscribe_messages=True, timeout=_RECONNECT_S
                    )
                    if message is not None:
                        await heard()
        except (RedisError, OSError) as error:
            log.warning("endpoints doorbell: %s; listening again", type(error).__name__)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_RECONNECT_S):
                    await stop.wait()
