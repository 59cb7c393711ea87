"""What the walk is told before a request starts (:class:`router.request.walk.WalkPolicy`):
the model group's effective policy, the caller's narrowing of it, the hedge delay, and every
mapping of the group as a :class:`~router.request.walk.Target`, which a broken stream may be
resumed on (contract §5 "Resume": another mapping of the same upstream model).

Pure: config values and plain numbers in, a frozen policy out. :class:`FirstAnswerTimes` is
the one piece of state, kept by the gateway per config generation, that ``hedge.after_p95``
(per model group) and the ``deadline_insufficient`` check (per mapping) read.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from typing import Final, TypeVar

from ledger.events import Requirements
from router.config import Defaults, ModelGroup
from router.request.moves import (
    Target,
)
from router.request.scope import EndpointScope
from router.request.walk import (
    WalkPolicy,
)

__all__ = ["FirstAnswerTimes", "group_targets", "hedge_p95", "walk_policy"]

_LATENCY_WINDOW: Final = 200  # the answers a group's (or a mapping's) p95 is taken over
_LATENCY_MIN_SAMPLES: Final = 20  # fewer: hedge.after_ms stands, the mapping is unmeasured


def group_targets(group: ModelGroup) -> tuple[Target, ...]:
    """Every mapping of ``group``, in order, as the walk knows it."""
    return tuple(
        Target(m.endpoint, i, m.model, m.context_window, m.resume)
        for i, m in enumerate(group.mappings)
    )


def walk_policy(
    defaults: Defaults,
    requirements: Requirements,
    siblings: tuple[Target, ...],
    p95_ms: int | None = None,
    pools: tuple[tuple[str, Defaults], ...] = (),
    scope: EndpointScope | None = None,
) -> WalkPolicy:
    """The walk's policy for one request: ``defaults`` (the group's, ``Config.policy_for``),
    narrowed by ``requirements`` (the caller's headers, the body's server-side effects);
    ``siblings``, every mapping of the group (:func:`group_targets`); ``p95_ms``, the group's
    observed time to a first answer (:meth:`FirstAnswerTimes.p95`), which replaces
    ``hedge.after_ms`` under ``hedge.after_p95``; ``pools``, a composed group's pools and
    their policies, whose hedging holds for the attempts in them (``after_p95`` falls back
    to ``after_ms`` there: first answers are counted per requested group); ``scope``, the
    caller's endpoint scope (:func:`router.request.scope.endpoint_scope`), which a resume
    stays inside too."""
    after_ms, max_ways = _hedging(defaults, requirements, p95_ms)
    if scope is not None:
        siblings = tuple(t for t in siblings if t.endpoint in scope.endpoints)
    # `failover: on_grant`: moving to another endpoint waits for the caller's explicit grant.
    not_granted = (
        defaults.failover == "on_grant"
        and requirements.allow_failover
        and not requirements.failover_granted
    )
    return WalkPolicy(
        defaults=defaults,
        # A pinned request (X-Waybill-Require-Endpoint) never moves to another endpoint: a
        # failure that would fail over stops, as X-Waybill-Allow-Failover: false makes it.
        allow_failover=(
            requirements.allow_failover
            and requirements.require_endpoint is None
            and not not_granted
        ),
        failover_not_granted=not_granted,
        allow_unknown_execution=requirements.allow_unknown_execution,
        server_side_effects=requirements.server_side_effects,
        hedge_after_ms=after_ms,
        max_ways=max_ways,
        siblings=siblings,
        pool_hedging=tuple((name, *_hedging(policy, requirements, None)) for name, policy in pools),
    )


def _hedging(
    defaults: Defaults, requirements: Requirements, p95_ms: int | None
) -> tuple[int | None, int]:
    """The hedge delay (None: never hedged) and the ways of a policy, for this request."""
    hedge = defaults.hedge
    # A request that asks the provider for server-side effects is never sent twice.
    if not hedge.enabled or requirements.server_side_effects:
        return None, 1
    after_ms = hedge.after_ms
    if hedge.after_p95:
        after_ms = p95_ms or after_ms
    return after_ms, hedge.max_ways


def hedge_p95(defaults: Defaults) -> bool:
    """Whether :func:`walk_policy` reads the observed p95 (only then is it worth sorting)."""
    return defaults.hedge.enabled and defaults.hedge.after_p95


Place = tuple[str, str]
"""(endpoint id, upstream model): one mapping."""


class FirstAnswerTimes:
    """How long attempts took to answer (a stream: to its first content), the last
    :data:`_LATENCY_WINDOW` of each model group and shape, for ``hedge.after_p95``, and of
    each mapping and shape, for the ``deadline_insufficient`` check (contract §4). Kept in
    process: each gateway counts the answers it saw."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, bool], _Window] = {}
        self._by_place: dict[tuple[Place, bool], _Window] = {}

    def add(self, group: str, stream: bool, ms: int, place: Place | None = None) -> None:
        """One answer of ``group`` (through the mapping at ``place``, when given)."""
        _window(self._seen, (group, stream)).add(ms)
        if place is not None:
            _window(self._by_place, (place, stream)).add(ms)

    def p95(self, group: str, stream: bool) -> int | None:
        """The group's 95th percentile, once :data:`_LATENCY_MIN_SAMPLES` were seen (else
        None)."""
        window = self._seen.get((group, stream))
        return None if window is None else window.p95()

    def place_p95s(self, places: tuple[Place, ...], stream: bool) -> dict[Place, int]:
        """Each mapping's 95th percentile, where measured (once :data:`_LATENCY_MIN_SAMPLES`
        were seen); a mapping left out is unmeasured."""
        figures = {}
        by_place = self._by_place
        for place in places:
            window = by_place.get((place, stream))
            ms = None if window is None else window.p95()
            if ms is not None:
                figures[place] = ms
        return figures


_K = TypeVar("_K")

# The rank of the 95th percentile among n figures, for each n a window may hold.
_P95_RANKS: Final = tuple(min(n - 1, math.ceil(0.95 * n) - 1) for n in range(_LATENCY_WINDOW + 1))


class _Window:
    """The last :data:`_LATENCY_WINDOW` figures, in the order they came and sorted: every
    request reads the p95 of each of its group's mappings, and sorting a window for each
    read cost many times what keeping it sorted as figures come does (bench/README.md
    "Decisions")."""

    __slots__ = ("_came", "_sorted")

    def __init__(self) -> None:
        self._came: deque[int] = deque()
        self._sorted: list[int] = []

    def add(self, ms: int) -> None:
        came, ordered = self._came, self._sorted
        if len(came) == _LATENCY_WINDOW:
            del ordered[bisect.bisect_left(ordered, came.popleft())]
        came.append(ms)
        bisect.insort(ordered, ms)

    def p95(self) -> int | None:
        ordered = self._sorted
        count = len(ordered)
        if count < _LATENCY_MIN_SAMPLES:
            return None
        return max(1, ordered[_P95_RANKS[count]])


def _window(windows: dict[_K, _Window], key: _K) -> _Window:
    window = windows.get(key)
    if window is None:
        window = windows[key] = _Window()
    return window
