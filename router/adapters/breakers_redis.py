"""The Redis breaker board: every breaker shared by the gateway processes using one Redis,
each operation one Lua script (``breaker_policy``'s functions written in Lua)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, TypeVar, cast
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from router.adapters import breaker_policy as policy
from router.adapters.breaker_interface import (
    DEFAULT_PROBE_LEASE_MS,
    BreakerBoard,
    BreakerKey,
    BreakerStoreUnavailable,
    BreakerView,
    EndpointSettings,
    Standing,
    Transition,
    settings_by_endpoint,
    settings_of,
    transitions,
    view_of,
)
from router.adapters.breaker_policy import (
    MAX_DOUBLINGS,
    RATE_SCALE,
    TIME_BUCKETS,
    Admission,
    BreakerSettings,
    BreakerState,
    Call,
    Figures,
    Record,
    Step,
    clamp_retry_after,
    is_slow,
)
from router.config import Breaker

__all__ = ["RedisBreakers"]

_KEY_TTL_MS: Final = 24 * 60 * 60 * 1000
"""A Redis breaker expires a day after its last change, so old generations clean themselves up."""
_REDIS_TIMEOUT_S: Final = 2.0
"""Default socket timeouts; a URL's own ``socket_timeout`` query option wins."""

# Each operation is one Lua script, so it is atomic across every gateway process sharing the
# Redis: two processes can never both take the probe, and concurrent outcomes never overwrite
# each other's count. Time is the Redis server's `TIME` (replicas need not agree on their
# clocks) unless the board was given a clock (tests). A breaker is a hash with the fields of
# `breaker_policy.Record`; an absent hash is a closed breaker with no failures and an empty
# window, which is also what a success of a consecutive breaker (re)writes by deleting it.
# The scripts are `breaker_policy`'s functions line for line; tests/adapters/test_breaker_policy.py
# runs both on the same histories.

_LUA_PRELUDE: Final = """
local function now_ms(given)
  if given >= 0 then return given end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function int(n) return string.format('%d', n) end
"""

# KEYS: the breaker. ARGV: now (-1: the server's), probe_lease_ms, ttl_ms.
# Returns {admission, state before, consecutive failures}.
_ADMIT: Final = (
    _LUA_PRELUDE
    + """
local key, lease_ms, ttl_ms = KEYS[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local h = redis.call('HMGET', key, 'state', 'failures', 'cooldown_until', 'lease_until')
local state = h[1] or 'closed'
if state == 'closed' then return {'allowed', state, 0} end
local now = now_ms(tonumber(ARGV[1]))
if (state == 'open' and now < (tonumber(h[3]) or 0))
    or (state == 'half_open' and now < (tonumber(h[4]) or 0)) then
  return {'denied', state, 0}
end
redis.call('HSET', key, 'state', 'half_open', 'lease_until', int(now + lease_ms))
redis.call('PEXPIRE', key, ttl_ms)
return {'probe', state, tonumber(h[2]) or 0}
"""
)

# KEYS: the breaker. A half-open breaker's probe lease given back (breaker_policy.release).
_RELEASE: Final = """
if redis.call('HGET', KEYS[1], 'state') == 'half_open' then
  redis.call('HSET', KEYS[1], 'lease_until', 0)
end
return 0
"""

# KEYS: the breaker. ARGV: now (-1: the server's), failed, slow, opens at once ('1'/'0'),
# retry_after_ms (-1: none, else capped), then _HearSettings.args: policy, failure_threshold,
# base_cooldown_ms, max_cooldown_ms, ttl_ms, max doublings, window_calls (0: time-based),
# bucket_ms (0: count-based), buckets, minimum_calls, failure_rate, slow counts ('1'/'0'),
# slow_call_rate, rate scale, ramp_up_ms (0: no ramp); then whether the failure counts only
# when shared ('1'/'0', breaker_policy.COUNTED_WHEN_SHARED) and its workspace.
# Returns {state before, state after, reason ('' : none), consecutive failures,
# cooldown_ms (-1: none), calls, failed, slow (-1: not counted)}.
_HEAR: Final = (
    _LUA_PRELUDE
    + """
local key = KEYS[1]
local now = now_ms(tonumber(ARGV[1]))
local failed, slow, at_once = ARGV[2] == '1', ARGV[3] == '1', ARGV[4] == '1'
local retry_after, rolling = tonumber(ARGV[5]), ARGV[6] == 'rolling'
local threshold, base, max_cd = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local ttl_ms, max_doublings = tonumber(ARGV[10]), tonumber(ARGV[11])
local window_calls, bucket_ms, nbuckets = tonumber(ARGV[12]), tonumber(ARGV[13]), tonumber(ARGV[14])
local minimum, failure_rate = tonumber(ARGV[15]), tonumber(ARGV[16])
local slow_counts, slow_rate, scale = ARGV[17] == '1', tonumber(ARGV[18]), tonumber(ARGV[19])
local ramp_ms = tonumber(ARGV[20])

local when_shared, workspace = ARGV[21] == '1', ARGV[22]

local h = redis.call('HMGET', key, 'state', 'failures', 'trips', 'calls', 'buckets', 'newest',
  'heard', 'ws1', 'st1', 'ws2', 'st2', 'closed_at')
local state = h[1] or 'closed'
local failures, trips = tonumber(h[2]) or 0, tonumber(h[3]) or 0
local heard = tonumber(h[7]) or 0

-- breaker_policy: a failure counted only when the window holds another workspace's too.
local function in_window(stamp)
  if not rolling then return true end
  if window_calls > 0 then return heard - stamp < window_calls end
  return math.floor(now / bucket_ms) - stamp < nbuckets
end
local function stamp_at(count)
  if not rolling then return 0 end
  if window_calls > 0 then return count end
  return math.floor(now / bucket_ms)
end
local function remember(stamp)
  if h[8] and h[8] ~= workspace then
    redis.call('HSET', key, 'ws2', h[8], 'st2', h[9])
  end
  redis.call('HSET', key, 'ws1', workspace, 'st1', int(stamp))
  redis.call('PEXPIRE', key, ttl_ms)
end
if when_shared then
  local another = (h[8] and h[8] ~= workspace and in_window(tonumber(h[9])))
    or (h[10] and h[10] ~= workspace and in_window(tonumber(h[11])))
  if not another then
    remember(stamp_at(heard))
    if state == 'half_open' then redis.call('HSET', key, 'lease_until', 0) end
    return {state, state, '', failures, -1, -1, -1, -1}
  end
  if state == 'closed' and window_calls > 0 then
    remember(stamp_at(heard + 1))
  else
    remember(stamp_at(heard))
  end
end

local function open(new_failures, reason, calls, nfailed, nslow)
  trips = trips + 1
  local cooldown = retry_after
  if cooldown < 0 then
    cooldown = math.min(max_cd, base * 2 ^ math.min(trips - 1, max_doublings))
  end
  redis.call('DEL', key)
  redis.call('HSET', key, 'state', 'open', 'failures', new_failures, 'trips', trips,
    'cooldown_ms', int(cooldown), 'cooldown_until', int(now + cooldown))
  redis.call('PEXPIRE', key, ttl_ms)
  return {state, 'open', reason, new_failures, cooldown, calls, nfailed, nslow}
end

if state == 'open' then
  if failed then
    failures = failures + 1
    redis.call('HSET', key, 'failures', failures)
    redis.call('PEXPIRE', key, ttl_ms)
  end
  return {state, state, '', failures, -1, -1, -1, -1}
end
if state == 'half_open' then
  if failed then return open(failures + 1, 'probe_failed', -1, -1, -1) end
  if slow then return open(failures, 'probe_slow', -1, -1, -1) end
  redis.call('DEL', key)
  if ramp_ms > 0 then
    -- breaker_policy.ramp_share: the ramp-up runs from this close.
    redis.call('HSET', key, 'closed_at', int(now))
    redis.call('PEXPIRE', key, ttl_ms)
  end
  return {state, 'closed', 'probe_succeeded', 0, -1, -1, -1, -1}
end

local new_failures = 0
if failed then new_failures = failures + 1 end
if not rolling then
  if failed and at_once then return open(new_failures, 'opens_at_once', -1, -1, -1) end
  if failed and new_failures >= threshold then
    return open(new_failures, 'failure_threshold', -1, -1, -1)
  end
  if new_failures == 0 then
    -- breaker_policy._still_ramping: a ramp-up that is over is forgotten.
    local stored_close = tonumber(h[12]) or 0
    local closed_at = 0
    if stored_close > 0 and now - stored_close < ramp_ms then closed_at = stored_close end
    if failures > 0 or h[8] or closed_at ~= stored_close then
      redis.call('DEL', key)
      if closed_at > 0 then  -- the run of failures ended; the ramp-up under way goes on
        redis.call('HSET', key, 'closed_at', int(closed_at))
        redis.call('PEXPIRE', key, ttl_ms)
      end
    end
  else
    redis.call('HSET', key, 'state', 'closed', 'failures', new_failures)
    redis.call('PEXPIRE', key, ttl_ms)
  end
  return {state, state, '', new_failures, -1, -1, -1, -1}
end

local calls, nfailed, nslow = 0, 0, 0
if window_calls > 0 then
  local code = 'o'
  if failed and slow then code = 'x' elseif failed then code = 'f' elseif slow then code = 's' end
  local window = string.sub((h[4] or '') .. code, -window_calls)
  calls = #window
  nfailed = select(2, string.gsub(window, '[fx]', ''))
  nslow = select(2, string.gsub(window, '[sx]', ''))
  redis.call('HSET', key, 'calls', window, 'heard', heard + 1)
else
  local now_bucket = math.floor(now / bucket_ms)
  local c, f, s = {}, {}, {}
  local newest = tonumber(h[6]) or 0
  local stored = h[5] or ''
  for i = 1, nbuckets do c[i], f[i], s[i] = 0, 0, 0 end
  if stored == '' then
    newest = now_bucket
  else
    local i = 0
    for bc, bf, bs in string.gmatch(stored, '(%d+),(%d+),(%d+)') do
      i = i + 1
      c[i], f[i], s[i] = tonumber(bc), tonumber(bf), tonumber(bs)
    end
    local gone = math.min(math.max(0, now_bucket - newest), nbuckets)
    if gone > 0 then
      for j = 1, nbuckets do
        if j + gone <= nbuckets then
          c[j], f[j], s[j] = c[j + gone], f[j + gone], s[j + gone]
        else
          c[j], f[j], s[j] = 0, 0, 0
        end
      end
      newest = now_bucket
    end
  end
  c[nbuckets] = c[nbuckets] + 1
  if failed then f[nbuckets] = f[nbuckets] + 1 end
  if slow then s[nbuckets] = s[nbuckets] + 1 end
  local parts = {}
  for j = 1, nbuckets do
    calls, nfailed, nslow = calls + c[j], nfailed + f[j], nslow + s[j]
    parts[j] = c[j] .. ',' .. f[j] .. ',' .. s[j]
  end
  redis.call('HSET', key, 'buckets', table.concat(parts, ';'), 'newest', int(newest))
end

local reason = ''
if failed and at_once then
  reason = 'opens_at_once'
elseif calls >= minimum then
  if nfailed * scale >= failure_rate * calls then
    reason = 'failure_rate'
  elseif slow_counts and nslow * scale >= slow_rate * calls then
    reason = 'slow_call_rate'
  end
end
if reason ~= '' then return open(new_failures, reason, calls, nfailed, nslow) end
redis.call('HSET', key, 'state', 'closed', 'failures', new_failures)
redis.call('PEXPIRE', key, ttl_ms)
return {state, state, '', new_failures, -1, calls, nfailed, nslow}
"""
)

# KEYS: the breakers, all read in one round trip. ARGV: now (-1: the server's).
# Returns {now, then per key, in order: 1 (blocked) or 0, and when a probe closed it (0:
# not since it opened, or not closed)}: breaker_policy.blocked and .ramp_share's inputs.
_STANDING: Final = (
    _LUA_PRELUDE
    + """
local now = now_ms(tonumber(ARGV[1]))
local out = {now}
for _, key in ipairs(KEYS) do
  local h = redis.call('HMGET', key, 'state', 'cooldown_until', 'lease_until', 'closed_at')
  local blocked = (h[1] == 'open' and now < (tonumber(h[2]) or 0))
    or (h[1] == 'half_open' and now < (tonumber(h[3]) or 0))
  out[#out + 1] = blocked and 1 or 0
  if (h[1] or 'closed') == 'closed' then out[#out + 1] = tonumber(h[4]) or 0
  else out[#out + 1] = 0 end
end
return out
"""
)

_FIELDS: Final = (
    "state",
    "failures",
    "trips",
    "cooldown_ms",
    "cooldown_until",
    "lease_until",
    "calls",
    "buckets",
    "newest",
    "closed_at",
)

# KEYS: the breakers. ARGV: now (-1: the server's). Returns {now, fields of each key...}.
_INSPECT: Final = (
    _LUA_PRELUDE
    + """
local out = {now_ms(tonumber(ARGV[1]))}
for _, key in ipairs(KEYS) do
  out[#out + 1] = redis.call('HMGET', key, """
    + ", ".join(f"'{name}'" for name in _FIELDS)
    + """)
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


def _hear_args(settings: BreakerSettings) -> list[int | str]:
    """``_HEAR``'s arguments that the settings fix (all but the call's own)."""
    return [
        settings.policy,
        settings.failure_threshold,
        settings.base_cooldown_ms,
        settings.max_cooldown_ms,
        _KEY_TTL_MS,
        MAX_DOUBLINGS,
        settings.window_calls or 0,
        settings.bucket_ms if settings.window_ms is not None else 0,
        TIME_BUCKETS,
        settings.minimum_calls,
        settings.failure_rate,
        int(settings.slow_call_ms is not None),
        settings.slow_call_rate,
        RATE_SCALE,
        settings.ramp_up_ms,
    ]


def _record(fields: Sequence[str | None]) -> Record:
    """A breaker read from its Redis hash (absent fields: a closed breaker's)."""
    (
        state,
        failures,
        trips,
        cooldown_ms,
        cooldown_until,
        lease_until,
        calls,
        buckets,
        newest,
        closed_at,
    ) = fields
    return Record(
        state=cast(BreakerState, state or "closed"),
        failures=int(failures or 0),
        trips=int(trips or 0),
        cooldown_ms=int(cooldown_ms or 0),
        cooldown_until=int(cooldown_until or 0),
        lease_until=int(lease_until or 0),
        calls=calls or "",
        buckets=tuple(
            cast(tuple[int, int, int], tuple(int(n) for n in bucket.split(",")))
            for bucket in buckets.split(";")
        )
        if buckets
        else (),
        newest=int(newest or 0),
        closed_at=int(closed_at or 0),
    )


class RedisBreakers(BreakerBoard):
    """Breakers shared by every gateway process using the same Redis (``WAYBILL_REDIS_URL``).

    Keys are ``{prefix}:{generation}:{scope}:{target}``. Connection failures and timeouts are
    raised as :class:`BreakerStoreUnavailable`. ``clock`` (seconds) replaces the server's time.
    """

    def __init__(
        self,
        url: str,
        settings: Breaker | BreakerSettings,
        generation: str,
        *,
        endpoints: EndpointSettings | None = None,
        probe_lease_ms: int = DEFAULT_PROBE_LEASE_MS,
        prefix: str = "waybill:breaker",
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.generation = generation
        self.settings = settings_of(settings)
        self._by_endpoint = settings_by_endpoint(endpoints)
        # The script is given the settings on every call, each breaker its endpoint's.
        self._hear_args = _hear_args(self.settings)
        self._endpoint_hear_args = {e: _hear_args(s) for e, s in self._by_endpoint.items()}
        self._probe_lease_ms = probe_lease_ms
        self._clock = clock
        self._namespace = f"{prefix}:{generation}"
        self._where = _redacted(url)
        self._redis = aioredis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=_REDIS_TIMEOUT_S,
            socket_connect_timeout=_REDIS_TIMEOUT_S,
        )
        self._admit = self._redis.register_script(_ADMIT)
        self._hear = self._redis.register_script(_HEAR)
        self._standing = self._redis.register_script(_STANDING)
        self._release = self._redis.register_script(_RELEASE)
        self._inspect = self._redis.register_script(_INSPECT)

    def _key(self, key: BreakerKey) -> str:
        return f"{self._namespace}:{key.scope}:{key.target}"

    def _now(self) -> int:
        return -1 if self._clock is None else round(self._clock() * 1000)

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

    async def standing(self, keys: Sequence[BreakerKey]) -> dict[BreakerKey, Standing]:
        if not keys:
            return {}
        now, *flat = await self._script(self._standing, [self._key(k) for k in keys], [self._now()])
        out = {}
        for i, key in enumerate(keys):
            blocked, closed_at = int(flat[2 * i]), int(flat[2 * i + 1])
            settings = self.settings_for(key)
            share = policy.ramp_share(Record(closed_at=closed_at), settings, int(now))
            out[key] = Standing(bool(blocked), share)
        return out

    async def admit(self, key: BreakerKey) -> tuple[Admission, list[Transition]]:
        admission, before, failures = await self._script(
            self._admit, [self._key(key)], [self._now(), self._probe_lease_ms, _KEY_TTL_MS]
        )
        if admission != Admission.PROBE or before == "half_open":
            return Admission(admission), []
        step = Step(before, "half_open", policy.StepReason.PROBE, int(failures))
        return Admission.PROBE, transitions(key, step)

    async def hear(self, key: BreakerKey, call: Call) -> list[Transition]:
        retry_after = clamp_retry_after(call.retry_after_ms)
        workspace = policy.counted_when_shared(call)
        before, after, reason, failures, cooldown, calls, failed, slow = await self._script(
            self._hear,
            [self._key(key)],
            [
                self._now(),
                int(call.failed),
                int(is_slow(self.settings_for(key), call.duration_ms)),
                int(call.opens_at_once),
                -1 if retry_after is None else retry_after,
                *self._endpoint_hear_args.get(key.endpoint_id, self._hear_args),
                int(workspace is not None),
                workspace or "",
            ],
        )
        if before == after:
            return []
        step = Step(
            from_state=before,
            to_state=after,
            reason=policy.StepReason(reason),
            failures=int(failures),
            cooldown_ms=None if int(cooldown) < 0 else int(cooldown),
            figures=None if int(calls) < 0 else Figures(int(calls), int(failed), int(slow)),
        )
        return transitions(key, step, call)

    async def release_probe(self, key: BreakerKey) -> None:
        await self._script(self._release, [self._key(key)], [])

    async def inspect(self, keys: Sequence[BreakerKey]) -> dict[BreakerKey, BreakerView]:
        if not keys:
            return {}
        now, *rows = await self._script(self._inspect, [self._key(k) for k in keys], [self._now()])
        return {
            key: view_of(_record(row), self.settings_for(key), int(now))
            for key, row in zip(keys, rows, strict=True)
        }

    async def state(self, key: BreakerKey) -> BreakerState:
        stored = await self._call(self._redis.hget(self._key(key), "state"))
        return cast(BreakerState, stored or "closed")

    async def aclose(self) -> None:
        await self._redis.aclose()
