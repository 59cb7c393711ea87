"""One circuit breaker's state machine (contract §5 "Circuit breakers"), as pure functions.

A breaker is a :class:`Record`; what happens to it is a function of the record, the
:class:`BreakerSettings`, one fact and the time (integer milliseconds): :func:`blocked`
(may an attempt go now?), :func:`admit` (take the half-open probe) and :func:`hear` (an
attempt's outcome). Each returns the next record and the :class:`Step` it took, if the
state changed. ``router.adapters.breakers`` keeps records in this process's memory and calls these
functions directly; its Redis scripts are these functions written again in Lua, line for
line, and ``tests/adapters/test_breaker_policy.py`` feeds both the same random histories and
requires the same steps.

Two policies decide when a closed breaker opens:

- ``consecutive``: ``failure_threshold`` failures in a row (a success resets the count);
- ``rolling``: over a window, once it holds ``minimum_calls`` calls, when the failed ones
  reach ``failure_rate`` of them, or the slow ones (``slow_call_ms`` or longer, failed or
  not) ``slow_call_rate``. The window is the last ``window_calls`` calls, or the last
  ``window_ms`` counted in :data:`TIME_BUCKETS` buckets of ``window_ms / 10`` each: a call
  leaves it between 0.9 and 1 times ``window_ms`` after it was heard of.

Under both, a failure whose class opens at once opens a closed breaker on its own, the
cool-downs double from ``base_cooldown_ms`` per trip up to ``max_cooldown_ms`` (a
Retry-After instead, capped at 5 minutes), and one probe decides a half-open breaker: its
success closes it and empties the window, its failure re-opens it. Under ``rolling``, a slow
success of the probe counts as its failure. Rates are compared as whole numbers
(``failed * 10000 >= failure_rate * calls``, rates held per :data:`RATE_SCALE`), so Lua's
doubles and Python's integers agree exactly.

A failure of a class in :data:`COUNTED_WHEN_SHARED` (``invalid_output``: the answer broke
the shape one request demanded, which may be that request's own doing) counts only when the
breaker's window holds such failures from more than one workspace, this one included: one
workspace alone cannot open a breaker every workspace shares. Otherwise the breaker only
remembers the workspace (a probe's lease goes back: no verdict). The window here is the
rolling window (the last ``window_calls`` calls heard, or the ten buckets of ``window_ms``);
under ``consecutive`` it is the run of failures since the last success; either way it starts
empty when the breaker opens. The record keeps the two workspaces heard from last, with the
stamp of each one's latest such failure: enough to know whether any other workspace's is
still in the window, whoever comes next.

Ramp-up (``ramp_up_ms`` > 0): a breaker that closes after a probe remembers when
(``closed_at``), and for ``ramp_up_ms`` after that :func:`ramp_share` gives the share of its
configured weight that selection gives its endpoint or mapping: ``ramp_up_floor`` at the
close, rising linearly to 1 (:func:`ramp`). Opening forgets the close, as it forgets the
window. With ``ramp_up_ms`` 0 (the default) a closed breaker is the empty record, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import ROUND_DOWN, Decimal
from enum import StrEnum
from typing import Any, Final, Literal

from ledger.support.frozen import evolve
from router.request.classify import MAX_RETRY_AFTER_MS

__all__ = [
    "COUNTED_WHEN_SHARED",
    "MAX_DOUBLINGS",
    "RAMP_PLACES",
    "RATE_SCALE",
    "TIME_BUCKETS",
    "Admission",
    "BreakerSettings",
    "BreakerState",
    "Call",
    "Figures",
    "Policy",
    "Record",
    "Step",
    "StepReason",
    "admit",
    "blocked",
    "clamp_retry_after",
    "counted_when_shared",
    "crossed",
    "figures",
    "hear",
    "is_slow",
    "ramp",
    "ramp_share",
]

BreakerState = Literal["closed", "open", "half_open"]
Policy = Literal["consecutive", "rolling"]

RATE_SCALE: Final = 10_000
"""Rates are held as whole parts per ten thousand."""
RAMP_PLACES: Final = Decimal("0.001")
"""A ramp's share of the configured weight is exact to a thousandth (rounded down)."""
DEFAULT_RAMP_UP_FLOOR: Final = Decimal("0.1")
TIME_BUCKETS: Final = 10
"""A time-based window is this many buckets of ``window_ms / TIME_BUCKETS`` each."""
MAX_DOUBLINGS: Final = 32
"""Keeps ``2**(trips-1)`` finite after many trips; the result is capped long before anyway."""
COUNTED_WHEN_SHARED: Final = frozenset({"invalid_output"})
"""Failure classes a breaker counts only when its window holds them from more than one
workspace (contract §5 "Circuit breakers"): a tenant's own mistakes stay its own."""


class StepReason(StrEnum):
    """Why a breaker changed state (``BreakerTransitioned.reason``)."""

    FAILURE_THRESHOLD = "failure_threshold"  # consecutive: that many failures in a row
    OPENS_AT_ONCE = "opens_at_once"  # the failure's class opens on its own (§5)
    FAILURE_RATE = "failure_rate"  # rolling: the window's failed share reached it
    SLOW_CALL_RATE = "slow_call_rate"  # rolling: the window's slow share reached it
    PROBE = "probe"  # the cool-down was over: one attempt admitted as the probe
    PROBE_FAILED = "probe_failed"
    PROBE_SLOW = "probe_slow"  # rolling: the probe answered, slowly
    PROBE_SUCCEEDED = "probe_succeeded"


class Admission(StrEnum):
    ALLOWED = "allowed"
    """The breaker is closed."""
    PROBE = "probe"
    """The caller holds the one half-open probe and must report its outcome."""
    DENIED = "denied"


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    """The config's ``defaults.breaker`` as plain numbers (``router.config.Breaker``)."""

    policy: Policy = "consecutive"
    failure_threshold: int = 2
    base_cooldown_ms: int = 5000
    max_cooldown_ms: int = 30000
    window_calls: int | None = None  # rolling, count-based
    window_ms: int | None = None  # rolling, time-based
    minimum_calls: int = 10
    failure_rate: int = RATE_SCALE // 2  # per RATE_SCALE
    slow_call_ms: int | None = None  # None: no call is slow
    slow_call_rate: int = RATE_SCALE
    ramp_up_ms: int = 0  # 0: a breaker that closes gives its full weight back at once
    ramp_up_floor: Decimal = DEFAULT_RAMP_UP_FLOOR  # the share of the weight at the close

    @property
    def bucket_ms(self) -> int:
        assert self.window_ms is not None
        return self.window_ms // TIME_BUCKETS


@dataclass(frozen=True, slots=True)
class Call:
    """One attempt's outcome, as a breaker hears of it."""

    failed: bool
    failure_class: str | None = None
    opens_at_once: bool = False
    retry_after_ms: int | None = None  # sets the cool-down, capped at 5 minutes
    duration_ms: int | None = None  # its latency: a stream's time to first chunk
    workspace: str | None = None  # whose request it was (None: counted as any failure)


Bucket = tuple[int, int, int]
"""(calls, failed, slow) of one bucket of a time-based window."""
_EMPTY_BUCKETS: Final[tuple[Bucket, ...]] = ((0, 0, 0),) * TIME_BUCKETS

# A count-based window is a string, one letter per call, oldest first (Redis keeps the same
# string): ok, slow, failed, failed and slow.
_CODES: Final = {(False, False): "o", (False, True): "s", (True, False): "f", (True, True): "x"}


@dataclass(frozen=True, slots=True)
class Record:
    """One breaker's state; the Redis hash holds the same fields (``shared`` as ``ws1``,
    ``st1``, ``ws2``, ``st2``). Instants are in ms."""

    state: BreakerState = "closed"
    failures: int = 0  # in a row, under either policy (recorded as consecutive_failures)
    trips: int = 0
    cooldown_ms: int = 0  # the last cool-down, for diagnostics
    cooldown_until: int = 0  # meaningful while open
    lease_until: int = 0  # meaningful while half-open
    calls: str = ""  # rolling, count-based: the window
    buckets: tuple[Bucket, ...] = ()  # rolling, time-based: the window, oldest first
    newest: int = 0  # rolling, time-based: the newest bucket's number (instant // bucket_ms)
    heard: int = 0  # rolling, count-based: calls the window has heard since it started
    # COUNTED_WHEN_SHARED failures the window holds, by workspace: the two heard from last,
    # newest first, each with the stamp of its latest (see _stamp).
    shared: tuple[tuple[str, int], ...] = ()
    # When a probe's success last closed it, while its settings ramp up (ramp_up_ms > 0);
    # 0: not since it last opened. Kept until it opens again: ramp_share reads it.
    closed_at: int = 0


CLOSED: Final = Record()


@dataclass(frozen=True, slots=True)
class Figures:
    """What a rolling window held: the calls, and how many failed or were slow."""

    calls: int
    failed: int
    slow: int

    def failure_rate(self) -> Decimal:
        return _share(self.failed, self.calls)

    def slow_call_rate(self) -> Decimal:
        return _share(self.slow, self.calls)


def crossed(reason: str | None, settings: BreakerSettings) -> dict[str, Any]:
    """The configured threshold an opening for ``reason`` crossed, as the
    ``BreakerTransitioned`` fields that record it (another transition: none)."""
    if reason == StepReason.FAILURE_THRESHOLD:
        return {"failure_threshold": settings.failure_threshold}
    if reason == StepReason.FAILURE_RATE:
        rate = _share(settings.failure_rate, RATE_SCALE)
        return {"minimum_calls": settings.minimum_calls, "failure_rate_threshold": rate}
    if reason == StepReason.SLOW_CALL_RATE:
        rate = _share(settings.slow_call_rate, RATE_SCALE)
        return {"minimum_calls": settings.minimum_calls, "slow_call_rate_threshold": rate}
    return {}


def _share(part: int, whole: int) -> Decimal:
    if whole == 0:
        return Decimal(0)
    return (Decimal(part) / Decimal(whole)).quantize(Decimal("0.0001"), rounding=ROUND_DOWN)


@dataclass(frozen=True, slots=True)
class Step:
    """A change of state, with what caused it: a ``BreakerTransitioned`` to record."""

    from_state: BreakerState
    to_state: BreakerState
    reason: StepReason
    failures: int  # in a row, after the step
    cooldown_ms: int | None = None  # when it opened
    figures: Figures | None = None  # rolling, when a closed breaker opened or heard


def clamp_retry_after(retry_after_ms: int | None) -> int | None:
    if retry_after_ms is None:
        return None
    return max(0, min(retry_after_ms, MAX_RETRY_AFTER_MS))


def is_slow(settings: BreakerSettings, duration_ms: int | None) -> bool:
    limit = settings.slow_call_ms
    return limit is not None and duration_ms is not None and duration_ms >= limit


def blocked(record: Record, now: int) -> bool:
    """Whether an attempt would be refused now: open and cooling down, or half-open with a
    live probe lease."""
    if record.state == "open":
        return now < record.cooldown_until
    if record.state == "half_open":
        return now < record.lease_until
    return False


def ramp(elapsed_ms: int, ramp_up_ms: int, floor: Decimal) -> Decimal:
    """The share of its configured weight a mapping gets ``elapsed_ms`` after its breaker
    closed: ``floor`` at the close, rising linearly to 1 at ``ramp_up_ms``, 1 from then on
    (and always, with ``ramp_up_ms`` 0: no ramp). Rounded down to :data:`RAMP_PLACES`, never
    below the floor."""
    if ramp_up_ms <= 0 or elapsed_ms >= ramp_up_ms:
        return Decimal(1)
    elapsed = max(0, elapsed_ms)
    share = floor + (1 - floor) * Decimal(elapsed) / Decimal(ramp_up_ms)
    return max(floor, share.quantize(RAMP_PLACES, rounding=ROUND_DOWN))


def ramp_share(record: Record, settings: BreakerSettings, now: int) -> Decimal:
    """The share of its weight a breaker's endpoint or mapping gets now: below 1 only while
    closed and ramping up after a probe closed it."""
    if record.state != "closed" or not record.closed_at:
        return Decimal(1)
    return ramp(now - record.closed_at, settings.ramp_up_ms, settings.ramp_up_floor)


def admit(record: Record, now: int, lease_ms: int) -> tuple[Admission, Record, Step | None]:
    """Admit one attempt: closed → allowed; cooled down with no live probe → the probe (a
    half-open breaker whose lease ran out passes it on, without a step); else denied."""
    if record.state == "closed":
        return Admission.ALLOWED, record, None
    if blocked(record, now):
        return Admission.DENIED, record, None
    probing = evolve(record, state="half_open", lease_until=now + lease_ms)
    if record.state == "half_open":
        return Admission.PROBE, probing, None
    return Admission.PROBE, probing, Step("open", "half_open", StepReason.PROBE, record.failures)


def release(record: Record) -> Record:
    """A probe that ended without a verdict (an outcome no breaker counts: the client's own
    error, a content policy, the client leaving) gives its lease back: the breaker stays
    half-open and the next attempt takes the probe at once, rather than every tenant waiting
    out the lease. Anything but a half-open breaker is left as it is."""
    if record.state != "half_open" or record.lease_until == 0:
        return record
    return evolve(record, lease_until=0)


def hear(
    record: Record, call: Call, settings: BreakerSettings, now: int
) -> tuple[Record, Step | None]:
    """The breaker after an attempt's outcome (a success, or a failure of its scope)."""
    workspace = counted_when_shared(call)
    if workspace is None:
        return _hear(record, call, settings, now)
    if not _another_held(record, settings, now, workspace):
        # One workspace's alone: remembered, not counted; no verdict on a probe.
        return release(_remember(record, workspace, _stamp(record, settings, now))), None
    # Counted: remembered with the stamp it has once heard (an opening forgets it, as it
    # empties the window).
    heard = record.heard + 1 if _counts_calls(record, settings) else record.heard
    remembered = _remember(record, workspace, _stamp(record, settings, now, heard))
    return _hear(remembered, call, settings, now)


def counted_when_shared(call: Call) -> str | None:
    """The workspace of a failure counted only when others' are in the window too (None:
    any other outcome, counted as it is)."""
    if call.failed and call.failure_class in COUNTED_WHEN_SHARED:
        return call.workspace
    return None


def _another_held(record: Record, settings: BreakerSettings, now: int, workspace: str) -> bool:
    """Whether the window holds a COUNTED_WHEN_SHARED failure of another workspace."""
    return any(
        other != workspace and _in_window(record, settings, now, stamp)
        for other, stamp in record.shared
    )


def _remember(record: Record, workspace: str, stamp: int) -> Record:
    others = tuple(entry for entry in record.shared if entry[0] != workspace)
    return evolve(record, shared=((workspace, stamp), *others[:1]))


def _counts_calls(record: Record, settings: BreakerSettings) -> bool:
    """Whether a failure heard now is a call of a count-based window."""
    return record.state == "closed" and settings.window_calls is not None


def _stamp(record: Record, settings: BreakerSettings, now: int, heard: int | None = None) -> int:
    """Where in the window a failure heard now stands: a time-based window's bucket, a
    count-based window's count of calls heard (``heard``: once this one is), else 0 (the
    run of failures ends with a success, which forgets them all)."""
    if settings.policy != "rolling":
        return 0
    if settings.window_ms is not None:
        return now // settings.bucket_ms
    return record.heard if heard is None else heard


def _in_window(record: Record, settings: BreakerSettings, now: int, stamp: int) -> bool:
    if settings.policy != "rolling":
        return True
    if settings.window_ms is not None:
        return now // settings.bucket_ms - stamp < TIME_BUCKETS
    assert settings.window_calls is not None
    return record.heard - stamp < settings.window_calls


def _hear(
    record: Record, call: Call, settings: BreakerSettings, now: int
) -> tuple[Record, Step | None]:
    slow = is_slow(settings, call.duration_ms)
    if record.state == "open":
        # An attempt admitted before the trip: its failure still counts as one in a row.
        if call.failed:
            return evolve(record, failures=record.failures + 1), None
        return record, None
    if record.state == "half_open":
        if call.failed:
            return _open(record, settings, now, call, record.failures + 1, StepReason.PROBE_FAILED)
        if slow:
            return _open(record, settings, now, call, record.failures, StepReason.PROBE_SLOW)
        closed = Record(closed_at=now) if settings.ramp_up_ms else CLOSED
        return closed, Step("half_open", "closed", StepReason.PROBE_SUCCEEDED, 0)
    failures = record.failures + 1 if call.failed else 0
    if settings.policy == "consecutive":
        if call.failed and call.opens_at_once:
            return _open(record, settings, now, call, failures, StepReason.OPENS_AT_ONCE)
        if call.failed and failures >= settings.failure_threshold:
            return _open(record, settings, now, call, failures, StepReason.FAILURE_THRESHOLD)
        if call.failed:
            return evolve(record, failures=failures), None
        closed_at = _still_ramping(record, settings, now)
        if record.failures == 0 and not record.shared and closed_at == record.closed_at:
            return record, None  # a success after a success: the usual outcome, no copy
        # The run of failures ended, or the ramp-up did: a breaker back to the empty record
        # is dropped (Redis: deleted), so the usual success writes nothing again.
        return evolve(record, failures=0, shared=(), closed_at=closed_at), None
    heard = _counted(_advanced(record, settings, now), settings, call.failed, slow)
    seen = figures(heard, settings, now)
    reason = _rolling_reason(call, seen, settings)
    if reason is None:
        return evolve(heard, failures=failures), None
    return _open(record, settings, now, call, failures, reason, seen)


def _still_ramping(record: Record, settings: BreakerSettings, now: int) -> int:
    """The record's ``closed_at`` while its ramp-up lasts, else 0 (forgotten)."""
    if record.closed_at and now - record.closed_at < settings.ramp_up_ms:
        return record.closed_at
    return 0


def _rolling_reason(call: Call, seen: Figures, settings: BreakerSettings) -> StepReason | None:
    if call.failed and call.opens_at_once:
        return StepReason.OPENS_AT_ONCE
    if seen.calls < settings.minimum_calls:
        return None
    if seen.failed * RATE_SCALE >= settings.failure_rate * seen.calls:
        return StepReason.FAILURE_RATE
    if settings.slow_call_ms is not None and (
        seen.slow * RATE_SCALE >= settings.slow_call_rate * seen.calls
    ):
        return StepReason.SLOW_CALL_RATE
    return None


def _open(
    record: Record,
    settings: BreakerSettings,
    now: int,
    call: Call,
    failures: int,
    reason: StepReason,
    seen: Figures | None = None,
) -> tuple[Record, Step]:
    """Open (or re-open) the breaker with the next cool-down; its window starts empty."""
    trips = record.trips + 1
    cooldown = clamp_retry_after(call.retry_after_ms)
    if cooldown is None:
        doublings = min(trips - 1, MAX_DOUBLINGS)
        cooldown = min(settings.max_cooldown_ms, settings.base_cooldown_ms << doublings)
    opened = Record(
        state="open",
        failures=failures,
        trips=trips,
        cooldown_ms=cooldown,
        cooldown_until=now + cooldown,
    )
    return opened, Step(record.state, "open", reason, failures, cooldown, seen)


# --- the rolling window ---------------------------------------------------------------------


def _advanced(record: Record, settings: BreakerSettings, now: int) -> Record:
    """A time-based window moved on to ``now``: the buckets that left it dropped (an empty
    window starts at ``now``; a clock that went back moves nothing)."""
    if settings.window_ms is None:
        return record
    newest = now // settings.bucket_ms
    if not record.buckets:
        return evolve(record, buckets=_EMPTY_BUCKETS, newest=newest)
    gone = min(max(0, newest - record.newest), TIME_BUCKETS)
    if not gone:
        return record
    buckets = record.buckets[gone:] + _EMPTY_BUCKETS[:gone]
    return evolve(record, buckets=buckets, newest=newest)


def _counted(record: Record, settings: BreakerSettings, failed: bool, slow: bool) -> Record:
    """One call added to the (advanced) window."""
    if settings.window_ms is None:
        assert settings.window_calls is not None
        calls = (record.calls + _CODES[(failed, slow)])[-settings.window_calls :]
        return evolve(record, calls=calls, heard=record.heard + 1)
    calls_, failed_, slow_ = record.buckets[-1]
    newest = (calls_ + 1, failed_ + int(failed), slow_ + int(slow))
    return evolve(record, buckets=(*record.buckets[:-1], newest))


def figures(record: Record, settings: BreakerSettings, now: int) -> Figures:
    """What the record's window holds at ``now``."""
    if settings.window_ms is None:
        codes = record.calls
        return Figures(
            calls=len(codes),
            failed=codes.count("f") + codes.count("x"),
            slow=codes.count("s") + codes.count("x"),
        )
    held = _advanced(record, settings, now).buckets
    return Figures(
        calls=sum(b[0] for b in held), failed=sum(b[1] for b in held), slow=sum(b[2] for b in held)
    )
