"""Route selection (contract §4), free of I/O: for one request, which mappings of a model
group may carry the next attempt and why each other one may not (:func:`evaluate`), and which
eligible mapping is next (:func:`select`, smooth weighted round-robin inside the best tier).
What follows a failed attempt is :mod:`router.request.decision`'s.

It reads no clock and does no I/O: breakers and budgets are asked through callbacks the
caller passes in, randomness comes only from the caller's ``random.Random``, and the only
mutable state is the round-robin's, kept in the :class:`WeightedRoundRobin` the caller owns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Mapping as AbcMapping
from dataclasses import dataclass
from decimal import ROUND_DOWN, Decimal
from typing import Final, TypeAlias

from ledger.events import (
    Candidate,
    DataClass,
    ReasonCode,
    Requirements,
    RouteChoice,
    data_class_rank,
    retention_rank,
)
from ledger.support.frozen import direct_init
from router.adapters.breaker_policy import RAMP_PLACES
from router.config import Config, Endpoint, Mapping, ModelGroup, Workspace
from router.request.scope import EndpointScope, endpoint_scope
from router.request.worst_case import input_tokens, output_tokens, unpriced, worst_case_cost

__all__ = [
    "CHECK_ORDER",
    "BreakerOpen",
    "CredentialsDisabled",
    "OverBudget",
    "QuotaExhausted",
    "RampShare",
    "RouteContext",
    "Saturated",
    "Scope",
    "TierKey",
    "WeightedRoundRobin",
    "effective_scope",
    "effective_weight",
    "evaluate",
    "select",
    "worst_case_cost",
]

TierKey: TypeAlias = tuple[str, str, str, int]
"""(workspace id, model group name, kind, tier): one smooth weighted round-robin each."""

BreakerOpen: TypeAlias = Callable[[str, Mapping], "str | None"]
"""(endpoint id, mapping) → None if the breakers admit it, else their scope, e.g. "endpoint"."""

Saturated: TypeAlias = Callable[[str], "str | None"]
"""endpoint id → None if it has a slot free, else how many attempts are in flight there."""

OverBudget: TypeAlias = Callable[[Decimal], "str | None"]
"""worst-case cost → None if every account can cover it, else the account, e.g. "workspace:acme"."""

CredentialsDisabled: TypeAlias = Callable[[str], "str | None"]
"""endpoint id → None unless a credentials failure disabled it, else what was refused."""

RampShare: TypeAlias = Callable[[str, Mapping], Decimal]
"""(endpoint id, mapping) → the share of its weight it gets now: 1, or less while a breaker
of its endpoint or mapping ramps up after closing (``breaker_policy.ramp_share``)."""

QuotaExhausted: TypeAlias = Callable[[str], "str | None"]
"""endpoint id → None unless an earlier request found its quota exhausted and its breaker is
still cooling down, else what happened."""


# --- the request's policy scope ----------------------------------------------------------


@direct_init
@dataclass(frozen=True, slots=True)
class Scope:
    """The request's effective policy: the workspace's, narrowed by the caller's headers."""

    regions: frozenset[str]
    data_class: DataClass
    empty: str | None = None  # the narrowing that came out empty, e.g. "regions"
    endpoints: EndpointScope | None = None  # the caller's endpoint scope; None: unnarrowed


def effective_scope(
    workspace: Workspace, requirements: Requirements, endpoints: EndpointScope | None = None
) -> Scope:
    """The workspace's regions narrowed by the request's; the request's data class; the
    caller's endpoint scope (:func:`router.request.scope.endpoint_scope`).

    A narrowing that leaves nothing is marked ``empty``, never read as "unrestricted".
    """
    regions = workspace.regions
    if requirements.regions is not None:
        regions = regions & frozenset(requirements.regions)
    # The app raises the class to the workspace's already; taking the higher one again here
    # keeps contract §2's "a request may raise its workspace's class, never lower it" local.
    data_class = max(workspace.data_class, requirements.data_class, key=data_class_rank)
    empty = None
    if not regions:
        empty = "regions"
    elif endpoints is not None and not endpoints.endpoints:
        empty = "endpoints"
    return Scope(regions=regions, data_class=data_class, empty=empty, endpoints=endpoints)


@direct_init
@dataclass(frozen=True, slots=True)
class RouteContext:
    """What changes between the evaluations of one request."""

    tried_endpoints: frozenset[str] = frozenset()  # left by a failover: never entered again
    larger_context_than: int | None = None  # after context_too_small: only larger windows
    excluded_models: frozenset[str] = frozenset()  # upstream models never tried again
    remaining_ms: int | None = None  # of the request's deadline, when this evaluation runs
    # Endpoints whose provider account answered insufficient_quota in this request (a quota
    # failover, contract §4 "Quota failover"): no endpoint of those accounts is entered again.
    quota_exhausted: frozenset[str] = frozenset()
    # This evaluation looks for a way beside the running one (a hedge) for a request that may
    # not move to another endpoint: the group's `failover: on_grant` got no grant. Every
    # endpoint the request is not already on or has not left is excluded for it.
    failover_not_granted: bool = False


# --- eligibility ---------------------------------------------------------------------------


@direct_init
@dataclass(frozen=True, slots=True)
class _Subject:
    """Everything one eligibility check may look at, for one mapping."""

    endpoint: Endpoint
    mapping: Mapping
    group: ModelGroup
    requirements: Requirements
    scope: Scope
    context: RouteContext
    exhausted_accounts: AbcMapping[str, str]  # account → an endpoint that ran out on it
    unpriced: str | None  # the dimensions the mapping has no price for
    worst_case_usd: Decimal | None  # None while something is unpriced
    first_content_p95_ms: int | None  # the mapping's measured p95; None: unmeasured
    breaker_open: BreakerOpen
    saturated: Saturated | None
    over_budget: OverBudget | None
    credentials_disabled: CredentialsDisabled | None
    quota_exhausted: QuotaExhausted | None


def _endpoint_disabled(s: _Subject) -> str | None:
    return None if s.endpoint.enabled else f"endpoint {s.endpoint.id} disabled"


def _model_kind_mismatch(s: _Subject) -> str | None:
    if s.group.kind == s.requirements.kind:
        return None
    return f"group kind {s.group.kind} != requested {s.requirements.kind}"


def _quota_exhausted(s: _Subject) -> str | None:
    exhausted = s.exhausted_accounts.get(s.endpoint.account)
    if exhausted is None:
        # An earlier request's: until the endpoint's breaker, opened by it, cools down.
        return None if s.quota_exhausted is None else s.quota_exhausted(s.endpoint.id)
    if exhausted == s.endpoint.id:
        return f"{exhausted} answered insufficient_quota"
    return f"same provider account as {exhausted}, which answered insufficient_quota"


def _response_affinity(s: _Subject) -> str | None:
    pinned = s.requirements.affinity_endpoint
    if pinned is None or pinned == s.endpoint.id:
        return None
    return f"the previous response is held by {pinned}"


def _already_tried(s: _Subject) -> str | None:
    if s.endpoint.id in s.context.tried_endpoints:
        return f"failed over from {s.endpoint.id}"
    return None


def _failover_not_granted(s: _Subject) -> str | None:
    if not s.context.failover_not_granted:
        return None
    return (
        f"another endpoint than the request's; model group {s.group.name} fails over on "
        "grant only (X-Waybill-Allow-Failover: true)"
    )


def _scope_empty(s: _Subject) -> str | None:
    return s.scope.empty


def _out_of_scope(s: _Subject) -> str | None:
    return None if s.scope.endpoints is None else s.scope.endpoints.excluded_by(s.endpoint.id)


def _region_not_allowed(s: _Subject) -> str | None:
    return None if s.endpoint.region in s.scope.regions else s.endpoint.region


def _data_class_not_allowed(s: _Subject) -> str | None:
    return None if s.scope.data_class in s.endpoint.data_classes else s.scope.data_class


def _retention_exceeded(s: _Subject) -> str | None:
    bound = s.requirements.retention
    if bound is None:
        return None
    kept = s.endpoint.retention
    if kept is None:
        return f"endpoint {s.endpoint.id} does not declare its retention; required {bound}"
    if retention_rank(kept) > retention_rank(bound):
        return f"endpoint {s.endpoint.id} keeps {kept}; required {bound}"
    return None


def _missing_capability(s: _Subject) -> str | None:
    missing = set(s.requirements.capabilities) - s.mapping.capabilities
    return ",".join(sorted(missing)) if missing else None


def _dialect_unsupported(s: _Subject) -> str | None:
    driver = s.endpoint.driver
    for dialect, feature in s.requirements.unsupported:
        if dialect == driver:
            return feature
    return None


def _context_too_small(s: _Subject) -> str | None:
    mapping, context = s.mapping, s.context
    if mapping.model in context.excluded_models:
        return f"model {mapping.model} already failed as context_too_small"
    floor = context.larger_context_than
    if floor is not None and mapping.context_window <= floor:
        return f"context_window {mapping.context_window} <= failed {floor}"
    if s.requirements.kind == "embeddings":
        needed = s.requirements.largest_input_tokens  # each input is embedded on its own
    else:
        needed = input_tokens(mapping, s.requirements, s.endpoint.driver) + output_tokens(
            mapping, s.requirements
        )
    if needed > mapping.context_window:
        return f"context_window {mapping.context_window} < needed {needed}"
    return None


def _unpriced_input(s: _Subject) -> str | None:
    return s.unpriced


def _deadline_insufficient(s: _Subject) -> str | None:
    remaining, p95 = s.context.remaining_ms, s.first_content_p95_ms
    if remaining is None or p95 is None or p95 <= remaining:
        return None  # an unmeasured mapping may always try
    return f"p95 time to first content {p95} ms > {remaining} ms left of the deadline"


def _credentials_disabled(s: _Subject) -> str | None:
    return None if s.credentials_disabled is None else s.credentials_disabled(s.endpoint.id)


def _breaker_open(s: _Subject) -> str | None:
    return s.breaker_open(s.endpoint.id, s.mapping)


def _endpoint_saturated(s: _Subject) -> str | None:
    return None if s.saturated is None else s.saturated(s.endpoint.id)


def _over_budget(s: _Subject) -> str | None:
    if s.over_budget is None or s.worst_case_usd is None:
        return None  # a mapping without a worst case was excluded as unpriced_input before
    return s.over_budget(s.worst_case_usd)


# The eligibility checks of contract §4, in the order they are applied; the FIRST one that fails
# is the reason recorded on the candidate. The config's static facts come first, then the
# request's history, its policy scope and its needs (a mapping must price every billable
# dimension of the request before its input can be counted against its context window); live
# state (disabled endpoints, breakers, budgets) last, so their callbacks are asked only about
# mappings that could otherwise carry the attempt. A disabled endpoint is named before its
# breaker: only an operator or a new key lifts it, whatever its breaker says.
_Check: TypeAlias = Callable[[_Subject], "str | None"]
_CHECKS: Final[tuple[tuple[ReasonCode, _Check], ...]] = (
    (ReasonCode.ENDPOINT_DISABLED, _endpoint_disabled),
    (ReasonCode.MODEL_KIND_MISMATCH, _model_kind_mismatch),
    (ReasonCode.QUOTA_EXHAUSTED, _quota_exhausted),
    (ReasonCode.RESPONSE_AFFINITY, _response_affinity),
    (ReasonCode.ALREADY_TRIED, _already_tried),
    (ReasonCode.FAILOVER_NOT_GRANTED, _failover_not_granted),
    (ReasonCode.SCOPE_EMPTY, _scope_empty),
    (ReasonCode.OUT_OF_SCOPE, _out_of_scope),
    (ReasonCode.REGION_NOT_ALLOWED, _region_not_allowed),
    (ReasonCode.DATA_CLASS_NOT_ALLOWED, _data_class_not_allowed),
    (ReasonCode.RETENTION_EXCEEDED, _retention_exceeded),
    (ReasonCode.MISSING_CAPABILITY, _missing_capability),
    (ReasonCode.DIALECT_UNSUPPORTED, _dialect_unsupported),
    (ReasonCode.UNPRICED_INPUT, _unpriced_input),
    (ReasonCode.CONTEXT_TOO_SMALL, _context_too_small),
    (ReasonCode.DEADLINE_INSUFFICIENT, _deadline_insufficient),
    (ReasonCode.CREDENTIALS_DISABLED, _credentials_disabled),
    (ReasonCode.BREAKER_OPEN, _breaker_open),
    (ReasonCode.ENDPOINT_SATURATED, _endpoint_saturated),
    (ReasonCode.OVER_BUDGET, _over_budget),
)

CHECK_ORDER: Final[tuple[ReasonCode, ...]] = tuple(code for code, _ in _CHECKS)
"""Every reason code, in the order the checks run."""


def evaluate(
    config: Config,
    workspace: Workspace,
    group: ModelGroup,
    requirements: Requirements,
    context: RouteContext,
    *,
    breaker_open: BreakerOpen,
    over_budget: OverBudget | None = None,
    latencies: AbcMapping[tuple[str, str], float] | None = None,
    saturated: Saturated | None = None,
    credentials_disabled: CredentialsDisabled | None = None,
    first_content_p95: AbcMapping[tuple[str, str], int] | None = None,
    quota_exhausted: QuotaExhausted | None = None,
    ramp_share: RampShare | None = None,
) -> tuple[Candidate, ...]:
    """One candidate per mapping of ``group``, in mapping order: eligible, or excluded with
    the reason code of the first failing check in :data:`CHECK_ORDER`. ``latencies``: each
    (endpoint, upstream model)'s moving average of time to first content, where measured,
    recorded on its candidate for the ``least_latency`` strategy. ``first_content_p95``: each
    (endpoint, upstream model)'s p95 time to first content over its recent answers, where
    measured, held against ``context.remaining_ms`` (``deadline_insufficient``).
    ``ramp_share``: the share of its weight each mapping gets while a breaker ramps up,
    recorded as its ``effective_weight`` when below 1 (:func:`effective_weight`).

    ``credentials_disabled``, ``breaker_open``, ``saturated`` and ``over_budget`` are called at
    most once per mapping, in mapping order, and only for a mapping that passed every check
    before theirs.
    """
    scope = effective_scope(workspace, requirements, endpoint_scope(config, group, requirements))
    exhausted_accounts = _exhausted_accounts(config, context)
    candidates = []
    for index, mapping in enumerate(group.mappings):
        endpoint = config.endpoint(mapping.endpoint)
        if endpoint is None:
            # parse_config refuses dangling references: this is a group from another config.
            raise ValueError(
                f"model group {group.name!r} mapping {index} names endpoint "
                f"{mapping.endpoint!r}, unknown to config generation {config.generation!r}"
            )
        missing = unpriced(mapping, requirements, endpoint.driver)
        subject = _Subject(
            endpoint=endpoint,
            mapping=mapping,
            group=group,
            requirements=requirements,
            scope=scope,
            context=context,
            exhausted_accounts=exhausted_accounts,
            unpriced=missing,
            worst_case_usd=None
            if missing is not None
            else worst_case_cost(mapping, requirements, endpoint.driver),
            first_content_p95_ms=None
            if first_content_p95 is None
            else first_content_p95.get((mapping.endpoint, mapping.model)),
            breaker_open=breaker_open,
            saturated=saturated,
            over_budget=over_budget,
            credentials_disabled=credentials_disabled,
            quota_exhausted=quota_exhausted,
        )
        reason, detail = _first_failure(subject)
        # Trusted: config's validated mappings and the checks' own typed results.
        candidate = Candidate.trusted(
            endpoint=mapping.endpoint,
            model=mapping.model,
            mapping_index=index,
            tier=mapping.tier,
            weight=mapping.weight,
            eligible=reason is None,
            reason_code=reason,
            detail=detail,
            worst_case_usd=subject.worst_case_usd,
            latency_ms=_latency(latencies, mapping),
        )
        if ramp_share is not None:
            ramped = effective_weight(mapping.weight, ramp_share(mapping.endpoint, mapping))
            if ramped is not None:
                candidate = candidate.model_copy(update={"effective_weight": ramped})
        candidates.append(candidate)
    return tuple(candidates)


def effective_weight(weight: int, share: Decimal) -> Decimal | None:
    """``weight`` scaled by a ramp-up's ``share`` (contract §5 "Circuit breakers"), exact to
    a thousandth and never 0; None at full weight."""
    if share >= 1:
        return None
    scaled = (weight * share).quantize(RAMP_PLACES, rounding=ROUND_DOWN)
    return max(RAMP_PLACES, scaled)


def _exhausted_accounts(config: Config, context: RouteContext) -> dict[str, str]:
    """The provider accounts this request found out of quota, each with its endpoint."""
    accounts: dict[str, str] = {}
    for endpoint_id in sorted(context.quota_exhausted):
        endpoint = config.endpoint(endpoint_id)
        if endpoint is not None:
            accounts.setdefault(endpoint.account, endpoint_id)
    return accounts


def _latency(latencies: AbcMapping[tuple[str, str], float] | None, mapping: Mapping) -> int | None:
    if latencies is None:
        return None
    figure = latencies.get((mapping.endpoint, mapping.model))
    return None if figure is None else max(0, round(figure))


def _first_failure(subject: _Subject) -> tuple[ReasonCode | None, str | None]:
    for code, check in _CHECKS:
        detail = check(subject)
        if detail is not None:
            return code, detail
    return None, None


# --- selection ---------------------------------------------------------------------------


@dataclass
class _TierState:
    current: dict[int, int]  # mapping index → current weight
    selections: int = 0


_WEIGHT_SCALE: Final = int(1 / RAMP_PLACES)
"""The round-robin counts weights in thousandths (a ramp-up's precision)."""


class WeightedRoundRobin:
    """Smooth weighted round-robin (nginx's algorithm) per TierKey: deterministic; long-run
    shares equal the weights (a candidate's effective weight while its breaker ramps up).

    Each round the current weight of every candidate taking part grows by its weight; the highest
    current weight wins (ties: the lowest mapping index) and gives back the round's total.
    State is kept per (key, mapping index), so a candidate sitting a round out (breaker,
    budget, already tried) keeps its place. Not thread-safe: the gateway runs one event loop.
    """

    def __init__(self) -> None:
        self._tiers: dict[TierKey, _TierState] = {}

    def choose(self, key: TierKey, eligible: Sequence[Candidate]) -> tuple[Candidate, int]:
        """The next candidate of ``key`` among ``eligible`` (ineligible ones take no part),
        and its selection position: how many selections ``key`` made before this one."""
        state = self._tiers.setdefault(key, _TierState(current={}))
        current = state.current
        best: Candidate | None = None
        total = 0
        for candidate in eligible:
            if not candidate.eligible:
                continue
            index = candidate.mapping_index
            # In thousandths, so that a ramp-up's effective weight counts exactly; scaling
            # every weight alike leaves the order of the choices as it was.
            ramped = candidate.effective_weight
            weight = (
                candidate.weight * _WEIGHT_SCALE if ramped is None else int(ramped * _WEIGHT_SCALE)
            )
            current[index] = current.get(index, 0) + weight
            total += weight
            if best is None or _ahead(current, candidate, best):
                best = candidate
        if best is None:
            raise ValueError(f"no eligible candidate to choose from for {key}")
        current[best.mapping_index] -= total
        position = state.selections
        state.selections += 1
        return best, position


def _ahead(current: dict[int, int], candidate: Candidate, best: Candidate) -> bool:
    mine, theirs = current[candidate.mapping_index], current[best.mapping_index]
    return mine > theirs or (mine == theirs and candidate.mapping_index < best.mapping_index)


def select(
    candidates: Sequence[Candidate],
    rr: WeightedRoundRobin,
    workspace_id: str,
    group: ModelGroup,
    prefer: str | None = None,
) -> RouteChoice | None:
    """The lowest tier with an eligible candidate, then the group's strategy inside it; None
    if none is eligible. ``prefer``: the caller's X-Waybill-Prefer-Endpoint, chosen ahead of
    tier and strategy when one of its mappings is eligible (its lowest tier, then its first
    mapping), and overruled when none is.

    ``weighted``: smooth weighted round-robin over the tier. ``least_cost``: the candidates
    with the lowest worst-case cost for this request. ``least_latency``: the candidates not
    measured yet (each mapping is tried before figures rank it), else those with the lowest
    ``latency_ms``. Ties share the round-robin, so the choice is deterministic for a given
    state and spread over equals."""
    eligible = [c for c in candidates if c.eligible]
    if not eligible:
        return None
    preferred = [c for c in eligible if c.endpoint == prefer]
    if preferred:
        # The caller chose among what is eligible; the round-robin is not consulted.
        return _choice(min(preferred, key=lambda c: (c.tier, c.mapping_index)), 0, True)
    # contract §4: a lower tier is never chosen while a higher-priority one has a candidate.
    tier = min(c.tier for c in eligible)
    pool = _best_by_strategy([c for c in eligible if c.tier == tier], group.strategy)
    chosen, position = rr.choose((workspace_id, group.name, group.kind, tier), pool)
    return _choice(chosen, position)


def _choice(chosen: Candidate, position: int, preferred: bool = False) -> RouteChoice:
    return RouteChoice.trusted(
        endpoint=chosen.endpoint,
        model=chosen.model,
        mapping_index=chosen.mapping_index,
        tier=chosen.tier,
        weight=chosen.weight,
        selection_position=position,
        preferred=preferred,
    )


def _best_by_strategy(tier: list[Candidate], strategy: str) -> list[Candidate]:
    match strategy:
        case "least_cost":
            # Eligible candidates are priced (unpriced_input is checked before).
            costs = [c.worst_case_usd for c in tier if c.worst_case_usd is not None]
            if not costs:
                return tier
            return [c for c in tier if c.worst_case_usd == min(costs)]
        case "least_latency":
            unmeasured = [c for c in tier if c.latency_ms is None]
            if unmeasured:
                return unmeasured
            fastest = min(c.latency_ms for c in tier if c.latency_ms is not None)
            return [c for c in tier if c.latency_ms == fastest]
    return tier
