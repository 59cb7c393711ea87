"""The `defaults` block: retry rules, the circuit breaker, hedging and the policy they make up."""

from __future__ import annotations

from decimal import Decimal
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    StrictBool,
    StrictInt,
    create_model,
    field_validator,
    model_validator,
)

from ledger.events import FailureClass
from router.adapters.breaker_policy import (
    DEFAULT_RAMP_UP_FLOOR,
    RAMP_PLACES,
    RATE_SCALE,
    TIME_BUCKETS,
    BreakerSettings,
)
from router.config.fields import Frozen, NonNegativeInt, PositiveInt, custom_error, to_money

# --- defaults ----------------------------------------------------------------------------


class RetryRule(Frozen):
    """How often one failure class may retry the same endpoint (contract §4)."""

    max: NonNegativeInt = 0
    backoff_ms: tuple[NonNegativeInt, NonNegativeInt] = (100, 500)  # jittered between the two
    max_retry_after_ms: NonNegativeInt = 5000  # a longer Retry-After is not waited for

    @field_validator("backoff_ms")
    @classmethod
    def _ordered(cls, value: tuple[int, int]) -> tuple[int, int]:
        if value[0] > value[1]:
            raise custom_error("must be [lo, hi] with lo <= hi")
        return value


class _RetryRules(Frozen):
    """`defaults.retry_same_endpoint`: a rule for each failure class of contract §5."""

    def rule(self, failure_class: FailureClass) -> RetryRule:
        rule: RetryRule = getattr(self, failure_class.value)
        return rule


# A class left out of the file is never retried in place, except these, retried once.
_RETRIED_ONCE: frozenset[FailureClass] = frozenset(
    {FailureClass.RATE_LIMITED, FailureClass.UPSTREAM_UNAVAILABLE}
)

# The model is made from the enum, so the file accepts exactly the classes the classifier
# names, in their order, and an unknown one is refused as an unknown key (`error_message`).
if TYPE_CHECKING:
    RetrySameEndpoint = _RetryRules
else:
    RetrySameEndpoint = create_model(
        "RetrySameEndpoint",
        __doc__=_RetryRules.__doc__,
        __base__=_RetryRules,
        __module__=__name__,
        **{
            c.value: (RetryRule, RetryRule(max=1 if c in _RETRIED_ONCE else 0))
            for c in FailureClass
        },
    )


def _to_rate(value: object) -> Decimal:
    # A share of the calls in a breaker's window, exact to 1/10,000 so that the breakers
    # compare whole numbers (router/adapters/breaker_policy.py), in Python and in Redis alike.
    rate = to_money(value)
    if not 0 < rate <= 1:
        raise custom_error("must be > 0 and <= 1")
    if rate != rate.quantize(Decimal("0.0001")):
        raise custom_error("must have at most 4 decimal places")
    return rate


_Rate = Annotated[Decimal, BeforeValidator(_to_rate)]


def _to_floor(value: object) -> Decimal:
    # The share of its weight a mapping starts a ramp-up with: the ramp is exact to a
    # thousandth (breaker_policy.RAMP_PLACES), so the floor is too.
    floor = to_money(value)
    if not 0 < floor <= 1:
        raise custom_error("must be > 0 and <= 1")
    if floor != floor.quantize(RAMP_PLACES):
        raise custom_error("must have at most 3 decimal places")
    return floor


_Floor = Annotated[Decimal, BeforeValidator(_to_floor)]

MAX_RAMP_UP_MS = 24 * 60 * 60 * 1000
"""The longest ramp-up: a day, as long as the Redis board keeps a breaker it no longer
changes (router/adapters/breakers_redis.py), which must remember when it closed."""

MAX_WINDOW_CALLS = 1000
"""The largest count-based window: every call a breaker hears of walks it once."""

_ROLLING_KEYS = (
    "window_calls",
    "window_ms",
    "minimum_calls",
    "failure_rate",
    "slow_call_ms",
    "slow_call_rate",
)
POLICY_KEYS: dict[str, tuple[str, ...]] = {
    "consecutive": ("failure_threshold",),
    "rolling": _ROLLING_KEYS,
}
"""The keys that mean something under one policy alone (the cool-downs serve both)."""
OTHER_WINDOW = {"window_calls": "window_ms", "window_ms": "window_calls"}


class Breaker(Frozen):
    """Contract §5 "Circuit breakers": when a closed breaker opens, and its cool-downs.

    ``consecutive`` opens after ``failure_threshold`` failures in a row; ``rolling`` opens
    when, over a window of the last ``window_calls`` calls or the last ``window_ms``, at
    least ``minimum_calls`` were heard of and ``failure_rate`` of them failed or
    ``slow_call_rate`` of them took ``slow_call_ms`` or longer. Each policy's keys are
    refused under the other. Under both, ``ramp_up_ms`` > 0 makes a breaker that closes
    give its endpoint's (or mapping's) weight back gradually, from ``ramp_up_floor`` of it.
    :meth:`settings` gives the effective values as plain numbers.
    """

    policy: Literal["consecutive", "rolling"] = "consecutive"
    failure_threshold: PositiveInt = 2
    base_cooldown_ms: PositiveInt = 5000
    max_cooldown_ms: PositiveInt = 30000
    window_calls: Annotated[StrictInt, Field(gt=0, le=MAX_WINDOW_CALLS)] = 20
    window_ms: Annotated[StrictInt, Field(ge=1000)] | None = None
    minimum_calls: PositiveInt | None = None  # 10, or window_calls if fewer
    failure_rate: _Rate = Decimal("0.5")
    slow_call_ms: PositiveInt | None = None  # None: no call is slow
    slow_call_rate: _Rate = Decimal(1)
    ramp_up_ms: Annotated[StrictInt, Field(ge=0, le=MAX_RAMP_UP_MS)] = 0  # 0: no ramp-up
    ramp_up_floor: _Floor = DEFAULT_RAMP_UP_FLOOR

    @model_validator(mode="after")
    def _cooldowns_ordered(self) -> Breaker:
        if self.base_cooldown_ms > self.max_cooldown_ms:
            raise custom_error("base_cooldown_ms must be <= max_cooldown_ms")
        return self

    @model_validator(mode="after")
    def _floor_of_a_ramp(self) -> Breaker:
        if "ramp_up_floor" in self.model_fields_set and "ramp_up_ms" not in self.model_fields_set:
            raise custom_error("ramp_up_floor needs ramp_up_ms: how long the ramp-up lasts")
        return self

    @model_validator(mode="after")
    def _keys_of_its_policy(self) -> Breaker:
        given = self.model_fields_set
        if self.policy == "consecutive":
            foreign = [key for key in _ROLLING_KEYS if key in given]
            if foreign:
                raise custom_error(f"{', '.join(foreign)}: only with policy: rolling")
            return self
        if "failure_threshold" in given:
            raise custom_error(
                "failure_threshold counts failures in a row (policy: consecutive); "
                "policy rolling opens at failure_rate"
            )
        if "window_calls" in given and "window_ms" in given:
            raise custom_error("give window_calls or window_ms, not both")
        if self.window_ms is not None and self.window_ms % TIME_BUCKETS:
            raise custom_error(f"window_ms must be a multiple of {TIME_BUCKETS}")
        if self.window_ms is None and (self.minimum_calls or 0) > self.window_calls:
            raise custom_error("minimum_calls must be <= window_calls: the window holds no more")
        if "slow_call_rate" in given and self.slow_call_ms is None:
            raise custom_error("slow_call_rate needs slow_call_ms: which calls are slow")
        return self

    def settings(self) -> BreakerSettings:
        """The effective values, as the breakers read them."""
        rolling = self.policy == "rolling"
        count = rolling and self.window_ms is None
        minimum = self.minimum_calls or (min(10, self.window_calls) if count else 10)
        return BreakerSettings(
            policy=self.policy,
            failure_threshold=self.failure_threshold,
            base_cooldown_ms=self.base_cooldown_ms,
            max_cooldown_ms=self.max_cooldown_ms,
            window_calls=self.window_calls if count else None,
            window_ms=self.window_ms if rolling else None,
            minimum_calls=minimum,
            failure_rate=int(self.failure_rate * RATE_SCALE),
            slow_call_ms=self.slow_call_ms if rolling else None,
            slow_call_rate=int(self.slow_call_rate * RATE_SCALE),
            ramp_up_ms=self.ramp_up_ms,
            ramp_up_floor=self.ramp_up_floor,
        )

    def summary(self) -> dict[str, Any]:
        """What ``ConfigActivated`` records: the effective values of the policy in force (a
        consecutive breaker's three keys alone, so a config that names no policy keeps its
        summary, and its ConfigActivated is not recorded again)."""
        if self.policy == "consecutive":
            return {
                "failure_threshold": self.failure_threshold,
                "base_cooldown_ms": self.base_cooldown_ms,
                "max_cooldown_ms": self.max_cooldown_ms,
                **self._ramp_summary(),
            }
        settings = self.settings()
        summary: dict[str, Any] = {
            "policy": "rolling",
            "base_cooldown_ms": self.base_cooldown_ms,
            "max_cooldown_ms": self.max_cooldown_ms,
        }
        if settings.window_ms is not None:
            summary["window_ms"] = settings.window_ms
        else:
            summary["window_calls"] = settings.window_calls
        summary["minimum_calls"] = settings.minimum_calls
        summary["failure_rate"] = str(self.failure_rate)
        if self.slow_call_ms is not None:
            summary["slow_call_ms"] = self.slow_call_ms
            summary["slow_call_rate"] = str(self.slow_call_rate)
        return summary | self._ramp_summary()

    def _ramp_summary(self) -> dict[str, Any]:
        # Left out while off, so a config that does not ramp keeps its summary.
        if not self.ramp_up_ms:
            return {}
        return {"ramp_up_ms": self.ramp_up_ms, "ramp_up_floor": str(self.ramp_up_floor)}


class Hedge(Frozen):
    """Hedged requests (contract §5 "Hedging"): a second way to the next failover candidate
    when the first has not answered after ``after_ms`` (its first content, for a stream)."""

    enabled: StrictBool = False
    after_ms: PositiveInt = 2000
    # Instead of after_ms: after the group's observed p95 time to first byte.
    after_p95: StrictBool = False
    max_ways: Annotated[StrictInt, Field(ge=2)] = 2


class Defaults(Frozen):
    """How one request walks its model group (contract §2 `defaults`, §4): a model group's
    `policy:` is read into one of these too, its keys laid over `defaults`."""

    max_attempts: PositiveInt = 4
    deadline_ms: PositiveInt = 60000
    attempt_timeout_ms: PositiveInt = 30000
    first_token_timeout_ms: PositiveInt = 10000
    stream_idle_timeout_ms: PositiveInt = 15000
    retry_same_endpoint: RetrySameEndpoint = RetrySameEndpoint()
    breaker: Breaker = Breaker()
    on_credentials_error: Literal["stop", "failover"] = "stop"
    on_unknown_execution: Literal["failover", "stop"] = "failover"
    # A buffered answer that breaks the shape the request demanded (contract §5 "Output
    # validation"): another mapping answers, or the client gets it as it is.
    on_invalid_output: Literal["failover", "return"] = "failover"
    hedge: Hedge = Hedge()
    # Failover as an approved policy (contract §4 "Failover on grant"): `on_grant` moves to
    # another endpoint only when the request carries X-Waybill-Allow-Failover: true.
    failover: Literal["allowed", "on_grant"] = "allowed"
    # Quota failover as an approved policy (contract §4 "Quota failover"): a provider's
    # insufficient_quota stops (the default), or fails over to another provider account.
    on_quota_exhausted: Literal["stop", "failover"] = "stop"
