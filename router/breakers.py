"""Circuit breakers (contract §5): per endpoint and per mapping, in-process or shared through Redis.

Each breaker key moves through one state machine:

- **closed**: attempts are allowed. A failure counts; ``failure_threshold`` consecutive
  failures (or one, when the classification opens at once) trip it. A success resets the count.
- **open**: attempts are denied for a cool-down of ``base_cooldown_ms * 2**(trips-1)``, capped
  at ``max_cooldown_ms``; a 429's Retry-After sets the cool-down instead (capped at 5 min).
- **half_open**: once the cool-down has passed, exactly one caller is admitted as the probe,
  under a lease of ``probe_lease_ms``; everyone else is still denied. The probe's success
  closes the breaker (failures and trips reset); its failure re-opens it with the next
  cool-down. A lease whose holder never reports expires, and the next caller probes instead.

State lives under the config generation, so a new generation starts with every breaker closed.
Every operation returns the :class:`Transition` objects it caused; the routing core records
each one as a ``BreakerTransitioned`` ledger event.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, Final, Literal, TypeVar, cast
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from router.classify import MAX_RETRY_AFTER_MS
from router.config import Breaker

__all__ = [
    "Admission",
    "BreakerBoard",
    "BreakerKey",
    "BreakerState",
    "BreakerStoreUnavailable",
    "InProcessBreakers",
    "RedisBreakers",
    "Scope",
    "Transition",
    "breaker_board",
]

BreakerState = Literal["closed", "open", "half_open"]
Scope = Literal["endpoint", "mapping"]

_DEFAULT_PROBE_LEASE_MS: Final = 60_000
_KEY_TTL_MS: Final = 24 * 60 * 60 * 1000
"""A Redis breaker expires a day after its last change, so old generations clean themselves up."""
_MAX_BACKOFF_DOUBLINGS: Final = 32
"""Keeps ``2**(trips-1)`` finite after many trips; the result is capped long before anyway."""
_REDIS_TIMEOUT_S: Final = 2.0
"""Default socket timeouts; a URL's own ``socket_timeout`` query option wins."""


@dataclass(frozen=True)
class BreakerKey:
    """Which breaker: an endpoint (``target`` = endpoint id) or a mapping
    (``target`` = ``"endpoint_id/upstream_model"``), as in ``BreakerTransitioned``."""

    scope: Scope
    target: str

    @staticmethod
    def endpoint(endpoint_id: str) -> BreakerKey:
        return BreakerKey("endpoint", endpoint_id)

    @staticmethod
    def mapping(endpoint_id: str, upstream_model: str) -> BreakerKey:
        return BreakerKey("mapping", f"{endpoint_id}/{upstream_model}")


@dataclass(frozen=True)
class Transition:
    """One change of a breaker's state; the core records it as a ``BreakerTransitioned``."""

    key: BreakerKey
    from_state: BreakerState
    to_state: BreakerState
    failure_class: str | None
    consecutive_failures: int
    cooldown_ms: int | None


class Admission(StrEnum):
    ALLOWED = "allowed"
    """The breaker is closed."""
    PROBE = "probe"
    """The caller holds the one half-open probe and must report its outcome."""
    DENIED = "denied"


class BreakerStoreUnavailable(Exception):
    """The shared breaker store (Redis) cannot be reached; the caller decides what follows."""


def _clamp_retry_after(retry_after_ms: int | None) -> int | None:
    if retry_after_ms is None:
        return None
    return max(0, min(retry_after_ms, MAX_RETRY_AFTER_MS))


def _transitions(
    key: BreakerKey,
    from_state: BreakerState,
    to_state: BreakerState,
    *,
    consecutive_failures: int,
    failure_class: str | None = None,
    cooldown_ms: int | None = None,
) -> list[Transition]:
    if from_state == to_state:
        return []
    return [Transition(key, from_state, to_state, failure_class, consecutive_failures, cooldown_ms)]


class BreakerBoard(ABC):
    """Every breaker of one config generation."""

    generation: str

    @abstractmethod
    async def blocked(self, keys: Sequence[BreakerKey]) -> dict[BreakerKey, bool]:
        """For route evaluation, read-only: whether each key would refuse an attempt now.

        True while open and cooling down, or half-open with a live probe lease; False when
        closed, or when the cool-down has passed and a probe is free to take.
        """

    @abstractmethod
    async def admit(self, key: BreakerKey) -> tuple[Admission, list[Transition]]:
        """Atomically admit one attempt: closed → ALLOWED; cooled down and no live probe →
        PROBE (the caller now holds the probe lease); otherwise DENIED."""

    @abstractmethod
    async def record_success(self, key: BreakerKey) -> list[Transition]:
        """A success resets a closed breaker's count and closes a half-open one. A success
        reported while open (an attempt admitted before the trip) changes nothing."""

    @abstractmethod
    async def record_failure(
        self,
        key: BreakerKey,
        failure_class: str,
        *,
        opens_at_once: bool,
        retry_after_ms: int | None,
    ) -> list[Transition]:
        """Count a failure; trip a closed breaker at the threshold (or at once), re-open a
        half-open one. A failure reported while open only counts."""

    @abstractmethod
    async def state(self, key: BreakerKey) -> BreakerState:
        """The stored state, for tests and diagnostics (an open breaker stays "open" here
        after its cool-down, until someone takes the probe)."""

    @abstractmethod
    async def aclose(self) -> None: ...


# --- in process -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Record:
    """One breaker's state; the Redis hash holds the same fields. Instants are in ms."""

    state: BreakerState = "closed"
    failures: int = 0
    trips: int = 0
    cooldown_ms: int = 0  # the last cool-down, for diagnostics
    cooldown_until: int = 0  # meaningful while open
    lease_until: int = 0  # meaningful while half-open

    def blocked(self, now: int) -> bool:
        if self.state == "open":
            return now < self.cooldown_until
        if self.state == "half_open":
            return now < self.lease_until
        return False


_CLOSED: Final = _Record()


def _cooldown_ms(settings: Breaker, trips: int, retry_after_ms: int | None) -> int:
    if retry_after_ms is not None:
        return retry_after_ms
    doublings = min(trips - 1, _MAX_BACKOFF_DOUBLINGS)
    return min(settings.max_cooldown_ms, settings.base_cooldown_ms << doublings)


class InProcessBreakers(BreakerBoard):
    """Breakers held in this process's memory, for a gateway running alone.

    Every method reads and writes its record without an ``await`` in between, so on the event
    loop each one is atomic: two tasks can never both take the probe or lose a count.
    """

    def __init__(
        self,
        settings: Breaker,
        generation: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        probe_lease_ms: int = _DEFAULT_PROBE_LEASE_MS,
    ) -> None:
        self.generation = generation
        self._settings = settings
        self._clock = clock
        self._probe_lease_ms = probe_lease_ms
        self._records: dict[BreakerKey, _Record] = {}

    def _now(self) -> int:
        return round(self._clock() * 1000)

    def _put(self, key: BreakerKey, record: _Record) -> None:
        if record == _CLOSED:
            self._records.pop(key, None)
        else:
            self._records[key] = record

    async def blocked(self, keys: Sequence[BreakerKey]) -> dict[BreakerKey, bool]:
        now = self._now()
        return {key: self._records.get(key, _CLOSED).blocked(now) for key in keys}

    async def admit(self, key: BreakerKey) -> tuple[Admission, list[Transition]]:
        record = self._records.get(key, _CLOSED)
        if record.state == "closed":
            return Admission.ALLOWED, []
        now = self._now()
        if record.blocked(now):
            return Admission.DENIED, []
        self._put(key, replace(record, state="half_open", lease_until=now + self._probe_lease_ms))
        return Admission.PROBE, _transitions(
            key, record.state, "half_open", consecutive_failures=record.failures
        )

    async def record_success(self, key: BreakerKey) -> list[Transition]:
        record = self._records.get(key, _CLOSED)
        if record.state == "open":
            return []
        self._put(key, _CLOSED)
        return _transitions(key, record.state, "closed", consecutive_failures=0)

    async def record_failure(
        self,
        key: BreakerKey,
        failure_class: str,
        *,
        opens_at_once: bool,
        retry_after_ms: int | None,
    ) -> list[Transition]:
        record = self._records.get(key, _CLOSED)
        failures = record.failures + 1
        opens = record.state == "half_open" or (
            record.state == "closed"
            and (opens_at_once or failures >= self._settings.failure_threshold)
        )
        if not opens:
            self._put(key, replace(record, failures=failures))
            return []
        cooldown = _cooldown_ms(
            self._settings, record.trips + 1, _clamp_retry_after(retry_after_ms)
        )
        opened = _Record(
            state="open",
            failures=failures,
            trips=record.trips + 1,
            cooldown_ms=cooldown,
            cooldown_until=self._now() + cooldown,
        )
        self._put(key, opened)
        return _transitions(
            key,
            record.state,
            "open",
            consecutive_failures=failures,
            failure_class=failure_class,
            cooldown_ms=cooldown,
        )

    async def state(self, key: BreakerKey) -> BreakerState:
        return self._records.get(key, _CLOSED).state

    async def aclose(self) -> None:
        self._records.clear()


# --- shared through Redis -------------------------------------------------------------------
#
# Each state change is one Lua script, so it is atomic across every gateway process sharing
# the Redis: two processes can never both take the probe, and concurrent failures never
# overwrite each other's count. Time is the Redis server's `TIME`, so replicas need not agree
# on their clocks. A breaker is a hash with the fields of `_Record`; an absent hash is a
# closed breaker with no failures, which is also what a success (re)writes by deleting it.
# The scripts mirror `InProcessBreakers` line for line; the contract tests run both.

_LUA_PRELUDE: Final = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function int(n) return string.format('%d', n) end
"""

# KEYS: the breaker. ARGV: probe_lease_ms, ttl_ms.
# Returns {admission, state before, consecutive failures}.
_ADMIT: Final = (
    _LUA_PRELUDE
    + """
local key, lease_ms, ttl_ms = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2])
local h = redis.call('HMGET', key, 'state', 'failures', 'cooldown_until', 'lease_until')
local state = h[1] or 'closed'
if state == 'closed' then return {'allowed', state, 0} end
local now = now_ms()
if (state == 'open' and now < (tonumber(h[3]) or 0))
    or (state == 'half_open' and now < (tonumber(h[4]) or 0)) then
  return {'denied', state, 0}
end
redis.call('HSET', key, 'state', 'half_open', 'lease_until', int(now + lease_ms))
redis.call('PEXPIRE', key, ttl_ms)
return {'probe', state, tonumber(h[2]) or 0}
"""
)

# KEYS: the breaker. Returns {state before, state after}.
_SUCCESS: Final = """
local state = redis.call('HGET', KEYS[1], 'state') or 'closed'
if state == 'open' then return {state, state} end
redis.call('DEL', KEYS[1])
return {state, 'closed'}
"""

# KEYS: the breaker. ARGV: opens_at_once ('1'/'0'), retry_after_ms (-1: none, else already
# capped), failure_threshold, base_cooldown_ms, max_cooldown_ms, ttl_ms, max doublings.
# Returns {state before, state after, consecutive failures, cooldown_ms (-1: none)}.
_FAILURE: Final = (
    _LUA_PRELUDE
    + """
local key = KEYS[1]
local at_once, retry_after = ARGV[1] == '1', tonumber(ARGV[2])
local threshold, base, max_cd = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local ttl_ms, max_doublings = tonumber(ARGV[6]), tonumber(ARGV[7])
local h = redis.call('HMGET', key, 'state', 'failures', 'trips')
local state = h[1] or 'closed'
local failures = (tonumber(h[2]) or 0) + 1
local trips = (tonumber(h[3]) or 0)
if not (state == 'half_open' or (state == 'closed' and (at_once or failures >= threshold))) then
  redis.call('HSET', key, 'state', state, 'failures', failures)
  redis.call('PEXPIRE', key, ttl_ms)
  return {state, state, failures, -1}
end
trips = trips + 1
local cooldown = retry_after
if cooldown < 0 then
  cooldown = math.min(max_cd, base * 2 ^ math.min(trips - 1, max_doublings))
end
redis.call('HSET', key, 'state', 'open', 'failures', failures, 'trips', trips,
  'cooldown_ms', int(cooldown), 'cooldown_until', int(now_ms() + cooldown))
redis.call('HDEL', key, 'lease_until')
redis.call('PEXPIRE', key, ttl_ms)
return {state, 'open', failures, cooldown}
"""
)

# KEYS: the breakers, all read in one round trip. Returns 1 (blocked) or 0 per key, in order.
_BLOCKED: Final = (
    _LUA_PRELUDE
    + """
local now = now_ms()
local out = {}
for i, key in ipairs(KEYS) do
  local h = redis.call('HMGET', key, 'state', 'cooldown_until', 'lease_until')
  local blocked = (h[1] == 'open' and now < (tonumber(h[2]) or 0))
    or (h[1] == 'half_open' and now < (tonumber(h[3]) or 0))
  out[i] = blocked and 1 or 0
end
return out
"""
)

_T = TypeVar("_T")


def _redacted(url: str) -> str:
    """The URL without its credentials, fit for an error message."""
    parts = urlsplit(url)
    netloc = parts.hostname or ""
    if parts.port is not None:
        netloc = f"{netloc}:{parts.port}"
    return parts._replace(netloc=netloc, query="").geturl()


class RedisBreakers(BreakerBoard):
    """Breakers shared by every gateway process using the same Redis (``WAYBILL_REDIS_URL``).

    Keys are ``{prefix}:{generation}:{scope}:{target}``. Connection failures and timeouts are
    raised as :class:`BreakerStoreUnavailable`.
    """

    def __init__(
        self,
        url: str,
        settings: Breaker,
        generation: str,
        *,
        probe_lease_ms: int = _DEFAULT_PROBE_LEASE_MS,
        prefix: str = "waybill:breaker",
    ) -> None:
        self.generation = generation
        self._settings = settings
        self._probe_lease_ms = probe_lease_ms
        self._namespace = f"{prefix}:{generation}"
        self._where = _redacted(url)
        self._redis = aioredis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=_REDIS_TIMEOUT_S,
            socket_connect_timeout=_REDIS_TIMEOUT_S,
        )
        self._admit = self._redis.register_script(_ADMIT)
        self._success = self._redis.register_script(_SUCCESS)
        self._failure = self._redis.register_script(_FAILURE)
        self._blocked = self._redis.register_script(_BLOCKED)

    def _key(self, key: BreakerKey) -> str:
        return f"{self._namespace}:{key.scope}:{key.target}"

    async def _call(self, command: Awaitable[_T]) -> _T:
        try:
            return await command
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise BreakerStoreUnavailable(
                f"breaker store {self._where} is unreachable: {exc}"
            ) from exc

    async def _script(
        self, script: AsyncScript, keys: list[str], args: list[int | str]
    ) -> list[Any]:
        return cast(list[Any], await self._call(script(keys=keys, args=args)))

    async def blocked(self, keys: Sequence[BreakerKey]) -> dict[BreakerKey, bool]:
        if not keys:
            return {}
        flags = await self._script(self._blocked, [self._key(k) for k in keys], [])
        return {key: bool(flag) for key, flag in zip(keys, flags, strict=True)}

    async def admit(self, key: BreakerKey) -> tuple[Admission, list[Transition]]:
        admission, before, failures = await self._script(
            self._admit, [self._key(key)], [self._probe_lease_ms, _KEY_TTL_MS]
        )
        if admission != Admission.PROBE:
            return Admission(admission), []
        return Admission.PROBE, _transitions(
            key, before, "half_open", consecutive_failures=int(failures)
        )

    async def record_success(self, key: BreakerKey) -> list[Transition]:
        before, after = await self._script(self._success, [self._key(key)], [])
        return _transitions(key, before, after, consecutive_failures=0)

    async def record_failure(
        self,
        key: BreakerKey,
        failure_class: str,
        *,
        opens_at_once: bool,
        retry_after_ms: int | None,
    ) -> list[Transition]:
        retry_after = _clamp_retry_after(retry_after_ms)
        s = self._settings
        before, after, failures, cooldown = await self._script(
            self._failure,
            [self._key(key)],
            [
                int(opens_at_once),
                -1 if retry_after is None else retry_after,
                s.failure_threshold,
                s.base_cooldown_ms,
                s.max_cooldown_ms,
                _KEY_TTL_MS,
                _MAX_BACKOFF_DOUBLINGS,
            ],
        )
        return _transitions(
            key,
            before,
            after,
            consecutive_failures=int(failures),
            failure_class=failure_class,
            cooldown_ms=int(cooldown),
        )

    async def state(self, key: BreakerKey) -> BreakerState:
        stored = await self._call(self._redis.hget(self._key(key), "state"))
        return cast(BreakerState, stored or "closed")

    async def aclose(self) -> None:
        await self._redis.aclose()


def breaker_board(
    settings: Breaker, generation: str, redis_url: str | None, **kw: Any
) -> BreakerBoard:
    """The board contract §5 asks for: shared through Redis when a URL is set, else in-process.

    ``kw`` goes to the chosen class (``probe_lease_ms``; ``prefix`` for Redis, ``clock`` for
    in-process).
    """
    if redis_url:
        return RedisBreakers(redis_url, settings, generation, **kw)
    return InProcessBreakers(settings, generation, **kw)
