"""The routing core (contract §4, §5): evaluate → select → decide, free of I/O.

For one request this module says which mappings of a model group may carry the next attempt
and why each other one may not (:func:`evaluate`), which eligible mapping is next
(:func:`select`, smooth weighted round-robin inside the best tier), and, after a failed
attempt, whether to retry the same endpoint, fail over to another or stop (:func:`decide`,
then :func:`next_context` for the following evaluation).

It reads no clock and does no I/O: breakers and budgets are asked through callbacks the
caller passes in, randomness comes only from the caller's ``random.Random``, and the only
mutable state is the round-robin's, kept in the :class:`WeightedRoundRobin` the caller owns.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from collections.abc import Mapping as AbcMapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Final, Literal, Protocol, TypeAlias

from ledger.events import (
    Candidate,
    DataClass,
    Evidence,
    FailureClass,
    ReasonCode,
    Requirements,
    RouteChoice,
    data_class_rank,
)
from router.config import Config, Defaults, Endpoint, Mapping, ModelGroup, Workspace
from router.request.classify import Classification
from router.request.worst_case import input_tokens, output_tokens, unpriced, worst_case_cost

__all__ = [
    "BREAKER_SCOPES",
    "CHECK_ORDER",
    "DECISION_REASONS",
    "REFUSALS",
    "WALK_REASONS",
    "Action",
    "AttemptOutcome",
    "BreakerOpen",
    "CredentialsDisabled",
    "Decision",
    "OverBudget",
    "Place",
    "RouteContext",
    "Saturated",
    "Scope",
    "TierKey",
    "WeightedRoundRobin",
    "decide",
    "effective_scope",
    "evaluate",
    "next_context",
    "select",
    "worst_case_cost",
]

TierKey: TypeAlias = tuple[str, str, str, int]
"""(workspace id, model group name, kind, tier): one smooth weighted round-robin each."""

Action: TypeAlias = Literal["retry", "failover", "resume", "stop"]

BreakerOpen: TypeAlias = Callable[[str, Mapping], "str | None"]
"""(endpoint id, mapping) → None if the breakers admit it, else their scope, e.g. "endpoint"."""

Saturated: TypeAlias = Callable[[str], "str | None"]
"""endpoint id → None if it has a slot free, else how many attempts are in flight there."""

OverBudget: TypeAlias = Callable[[Decimal], "str | None"]
"""worst-case cost → None if every account can cover it, else the account, e.g. "workspace:acme"."""

CredentialsDisabled: TypeAlias = Callable[[str], "str | None"]
"""endpoint id → None unless a credentials failure disabled it, else what was refused."""


# --- the request's policy scope ----------------------------------------------------------


@dataclass(frozen=True)
class Scope:
    """The request's effective policy: the workspace's, narrowed by the caller's headers."""

    regions: frozenset[str]
    data_class: DataClass
    empty: str | None = None  # the narrowing that came out empty, e.g. "regions"


def effective_scope(workspace: Workspace, requirements: Requirements) -> Scope:
    """The workspace's regions narrowed by the request's; the request's data class.

    A narrowing that leaves nothing is marked ``empty``, never read as "unrestricted".
    """
    regions = workspace.regions
    if requirements.regions is not None:
        regions = regions & frozenset(requirements.regions)
    # The app raises the class to the workspace's already; taking the higher one again here
    # keeps contract §2's "a request may raise its workspace's class, never lower it" local.
    data_class = max(workspace.data_class, requirements.data_class, key=data_class_rank)
    return Scope(regions=regions, data_class=data_class, empty=None if regions else "regions")


@dataclass(frozen=True)
class RouteContext:
    """What changes between the evaluations of one request."""

    tried_endpoints: frozenset[str] = frozenset()  # left by a failover: never entered again
    larger_context_than: int | None = None  # after context_too_small: only larger windows
    excluded_models: frozenset[str] = frozenset()  # upstream models never tried again


# --- eligibility ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Subject:
    """Everything one eligibility check may look at, for one mapping."""

    endpoint: Endpoint
    mapping: Mapping
    group: ModelGroup
    requirements: Requirements
    scope: Scope
    context: RouteContext
    unpriced: str | None  # the dimensions the mapping has no price for
    worst_case_usd: Decimal | None  # None while something is unpriced
    breaker_open: BreakerOpen
    saturated: Saturated | None
    over_budget: OverBudget | None
    credentials_disabled: CredentialsDisabled | None


def _endpoint_disabled(s: _Subject) -> str | None:
    return None if s.endpoint.enabled else f"endpoint {s.endpoint.id} disabled"


def _model_kind_mismatch(s: _Subject) -> str | None:
    if s.group.kind == s.requirements.kind:
        return None
    return f"group kind {s.group.kind} != requested {s.requirements.kind}"


def _already_tried(s: _Subject) -> str | None:
    if s.endpoint.id in s.context.tried_endpoints:
        return f"failed over from {s.endpoint.id}"
    return None


def _scope_empty(s: _Subject) -> str | None:
    return s.scope.empty


def _region_not_allowed(s: _Subject) -> str | None:
    return None if s.endpoint.region in s.scope.regions else s.endpoint.region


def _data_class_not_allowed(s: _Subject) -> str | None:
    return None if s.scope.data_class in s.endpoint.data_classes else s.scope.data_class


def _missing_capability(s: _Subject) -> str | None:
    missing = set(s.requirements.capabilities) - s.mapping.capabilities
    return ",".join(sorted(missing)) if missing else None


def _context_too_small(s: _Subject) -> str | None:
    mapping, context = s.mapping, s.context
    if mapping.model in context.excluded_models:
        return f"model {mapping.model} already failed as context_too_small"
    floor = context.larger_context_than
    if floor is not None and mapping.context_window <= floor:
        return f"context_window {mapping.context_window} <= failed {floor}"
    needed = input_tokens(mapping, s.requirements, s.endpoint.driver) + output_tokens(
        mapping, s.requirements
    )
    if needed > mapping.context_window:
        return f"context_window {mapping.context_window} < needed {needed}"
    return None


def _unpriced_input(s: _Subject) -> str | None:
    return s.unpriced


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
    (ReasonCode.ALREADY_TRIED, _already_tried),
    (ReasonCode.SCOPE_EMPTY, _scope_empty),
    (ReasonCode.REGION_NOT_ALLOWED, _region_not_allowed),
    (ReasonCode.DATA_CLASS_NOT_ALLOWED, _data_class_not_allowed),
    (ReasonCode.MISSING_CAPABILITY, _missing_capability),
    (ReasonCode.UNPRICED_INPUT, _unpriced_input),
    (ReasonCode.CONTEXT_TOO_SMALL, _context_too_small),
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
) -> tuple[Candidate, ...]:
    """One candidate per mapping of ``group``, in mapping order: eligible, or excluded with
    the reason code of the first failing check in :data:`CHECK_ORDER`. ``latencies``: each
    (endpoint, upstream model)'s moving average of time to first content, where measured,
    recorded on its candidate for the ``least_latency`` strategy.

    ``credentials_disabled``, ``breaker_open``, ``saturated`` and ``over_budget`` are called at
    most once per mapping, in mapping order, and only for a mapping that passed every check
    before theirs.
    """
    scope = effective_scope(workspace, requirements)
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
            unpriced=missing,
            worst_case_usd=None
            if missing is not None
            else worst_case_cost(mapping, requirements, endpoint.driver),
            breaker_open=breaker_open,
            saturated=saturated,
            over_budget=over_budget,
            credentials_disabled=credentials_disabled,
        )
        reason, detail = _first_failure(subject)
        candidates.append(
            Candidate(
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
        )
    return tuple(candidates)


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


class WeightedRoundRobin:
    """Smooth weighted round-robin (nginx's algorithm) per TierKey: deterministic; long-run
    shares equal the weights.

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
            current[index] = current.get(index, 0) + candidate.weight
            total += candidate.weight
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
) -> RouteChoice | None:
    """The lowest tier with an eligible candidate, then the group's strategy inside it; None
    if none is eligible.

    ``weighted``: smooth weighted round-robin over the tier. ``least_cost``: the candidates
    with the lowest worst-case cost for this request. ``least_latency``: the candidates not
    measured yet (each mapping is tried before figures rank it), else those with the lowest
    ``latency_ms``. Ties share the round-robin, so the choice is deterministic for a given
    state and spread over equals."""
    eligible = [c for c in candidates if c.eligible]
    if not eligible:
        return None
    # contract §4: a lower tier is never chosen while a higher-priority one has a candidate.
    tier = min(c.tier for c in eligible)
    pool = _best_by_strategy([c for c in eligible if c.tier == tier], group.strategy)
    chosen, position = rr.choose((workspace_id, group.name, group.kind, tier), pool)
    return RouteChoice(
        endpoint=chosen.endpoint,
        model=chosen.model,
        mapping_index=chosen.mapping_index,
        tier=chosen.tier,
        weight=chosen.weight,
        selection_position=position,
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


# --- after a failed attempt: retry, failover or stop ----------------------------------------

# Step 2's stop for a class whose "may fail over" is "no", e.g. "quota_exhausted_stops";
# client_canceled and deadline_exceeded have stopped in step 1 before.
_STOPS_BY_CLASS: Final = tuple(
    f"{c.value}_stops"
    for c in FailureClass
    if c not in (FailureClass.CLIENT_CANCELED, FailureClass.DEADLINE_EXCEEDED)
)

DECISION_REASONS: Final[tuple[str, ...]] = (
    # stop: limits of the whole request
    "stream_committed",
    "client_canceled",
    "deadline_exceeded",
    "max_attempts_reached",
    # stop: the failure class or the config's policy for it
    *_STOPS_BY_CLASS,
    "policy_denied_never_routed_around",
    "on_credentials_error_stop",
    "on_unknown_execution_stop",
    "server_side_effects_strict",
    # retry the same endpoint
    "retry_after_honoured",
    "retry_with_backoff",
    # stop: the caller forbade moving
    "failover_forbidden_by_header",
    # failover
    "larger_context_failover",
    "credentials_policy_failover",
    "invalid_output_policy_failover",
    "not_started_failover",
    "unknown_execution_policy_failover",
    "unknown_execution_allowed_by_header",
    "class_allows_failover",
)
"""Every reason :func:`decide` may give, a stable code recorded on ``FailoverDecided``."""

BREAKER_SCOPES: Final = ("endpoint", "mapping")
REFUSALS: Final = (
    "breaker_open",
    "saturated",
    "credentials_disabled",
    "over_budget",
    "unavailable",
)
"""Why the target of a planned retry or resume refused it when it came to start (the probe
taken by another request, the endpoint's slots full, its key refused, the budget taken by
another request; ``unavailable``: none of those was told)."""

WALK_REASONS: Final[tuple[str, ...]] = (
    # a hedged request: another way still runs and carries it on
    "other_way_running",
    # a committed stream broke: continue it on the same upstream model
    "resume_same_model",
    # the failed attempt's own outcome opened its endpoint's or mapping's breaker: a retry
    # would be refused, so fail over at once (or stop, where moving is forbidden)
    *(f"{scope}_breaker_opened" for scope in BREAKER_SCOPES),
    # a planned retry or resume refused when it came to start: the plan changes, and says why
    *(f"retry_refused_{why}" for why in REFUSALS),
    *(f"resume_refused_{why}" for why in REFUSALS if why != "over_budget"),
)
"""The reasons only the request's walk (:mod:`router.request.walk`) gives, beside
:func:`decide`'s."""


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str  # one of DECISION_REASONS
    backoff_ms: int | None = None  # retry: how long to wait first
    # The rule the failure class defers to, as it stood for this request, e.g.
    # "on_unknown_execution=stop" (recorded as FailoverDecided.policy); None: the class does
    # not defer to one.
    policy: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.reason not in DECISION_REASONS and self.reason not in WALK_REASONS:
            raise ValueError(f"unknown decision reason {self.reason!r}")

    @property
    def allowed(self) -> bool:
        return self.action != "stop"


@dataclass(frozen=True)
class AttemptOutcome:
    classification: Classification
    attempts_made: int  # attempts of this request so far, including the one that just failed
    retries_on_endpoint: int  # same-endpoint retries already made for this endpoint
    remaining_ms: int  # whole-request deadline left
    allow_failover: bool = True  # X-Waybill-Allow-Failover
    stream_committed: bool = False  # an event reached the client: the endpoint is fixed
    # X-Waybill-Allow-Failover: unknown: the caller accepts that an attempt of unknown
    # execution is followed by another (a possible duplicate), even where the policy is strict.
    allow_unknown_execution: bool = False
    # The request asks the provider for effects of its own (server-side tools, web search):
    # strict whatever the policy says, for such effects cannot be taken back.
    server_side_effects: bool = False
    # The breaker of the failed attempt's endpoint or mapping that its own outcome opened
    # (or re-opened): a retry there would be refused at admission.
    breaker_opened: Literal["endpoint", "mapping"] | None = None


def _stop(reason: str) -> Decision:
    return Decision("stop", reason)


def decide(outcome: AttemptOutcome, defaults: Defaults, rng: random.Random) -> Decision:
    """What follows a failed attempt (contract §4 "Retry and failover are different acts", §5).

    ``defaults`` is the policy of the request's model group (``Config.policy_for``). Whether a
    candidate is left to fail over to is the next evaluation's question.
    """
    decision = _decide(outcome, defaults, rng)
    return dataclasses.replace(decision, policy=_policy(outcome, defaults))


def _decide(outcome: AttemptOutcome, defaults: Defaults, rng: random.Random) -> Decision:
    c = outcome.classification
    # 1. Limits of the whole request.
    if outcome.stream_committed:
        return _stop("stream_committed")
    if c.failure_class is FailureClass.CLIENT_CANCELED:
        return _stop("client_canceled")
    if c.failure_class is FailureClass.DEADLINE_EXCEEDED or outcome.remaining_ms <= 0:
        return _stop("deadline_exceeded")
    if outcome.attempts_made >= defaults.max_attempts:
        return _stop("max_attempts_reached")
    # 2. May this class go on at all?
    stop_reason = _class_stops(outcome, defaults)
    if stop_reason is not None:
        return _stop(stop_reason)
    # 3. Retry the same endpoint first, where the config allows it — unless this attempt
    # opened a breaker the retry would meet: then the failover (or the stop) comes at once,
    # naming that breaker, rather than a retry the record would contradict.
    retry = _retry(outcome, defaults, rng)
    if retry is not None and outcome.breaker_opened is not None:
        opened = f"{outcome.breaker_opened}_breaker_opened"
        return Decision("failover", opened) if outcome.allow_failover else _stop(opened)
    if retry is not None:
        return retry
    # 4. Otherwise move to another endpoint, if the caller lets us.
    if not outcome.allow_failover:
        return _stop("failover_forbidden_by_header")
    return Decision("failover", _failover_reason(outcome, defaults))


def _strict(outcome: AttemptOutcome, defaults: Defaults) -> str | None:
    """Why an attempt of unknown execution may not be followed by another (contract §5
    "Per on_unknown_execution"), as the stop's reason; None if the request is not strict.
    The group's policy comes first: it would stop the request whatever its body asks for."""
    if defaults.on_unknown_execution == "stop":
        return "on_unknown_execution_stop"
    if outcome.server_side_effects:
        return "server_side_effects_strict"
    return None


def _class_stops(outcome: AttemptOutcome, defaults: Defaults) -> str | None:
    """None if contract §5's "may fail over" column lets the request go on, else why not."""
    c = outcome.classification
    match c.may_fail_over:
        case "yes" | "larger_context_only":
            return None
        case "no":
            return f"{c.failure_class.value}_stops"
        case "never":
            return "policy_denied_never_routed_around"
        case "per_on_credentials_error":
            if defaults.on_credentials_error == "failover":
                return None
            return "on_credentials_error_stop"
        case "per_on_unknown_execution":
            # Not-started evidence makes another execution safe, whatever the policy; a strict
            # request goes on only where its caller allowed a possible duplicate.
            if c.evidence is Evidence.NOT_STARTED or outcome.allow_unknown_execution:
                return None
            return _strict(outcome, defaults)
        case "per_on_invalid_output":
            # With `return` the gateway gives the answer as it is and never asks; here for
            # completeness of the table.
            return None if defaults.on_invalid_output == "failover" else "invalid_output_stops"


def _retry(outcome: AttemptOutcome, defaults: Defaults, rng: random.Random) -> Decision | None:
    c = outcome.classification
    if c.may_fail_over == "larger_context_only" or c.failure_class in (
        FailureClass.CONTEXT_TOO_SMALL,  # the same model would refuse the same prompt again
        FailureClass.TIMEOUT,  # a silent route is never retried, whatever the config says
    ):
        return None
    rule = defaults.retry_same_endpoint.rule(c.failure_class)
    if outcome.retries_on_endpoint >= rule.max:
        return None
    if c.failure_class is FailureClass.RATE_LIMITED:
        # Only a Retry-After that fits both the rule and the deadline is waited for.
        wait = c.retry_after_ms
        if wait is None or wait > rule.max_retry_after_ms or wait >= outcome.remaining_ms:
            return None
        return Decision("retry", "retry_after_honoured", backoff_ms=wait)
    low, high = rule.backoff_ms
    backoff = rng.randint(low, high)
    if backoff >= outcome.remaining_ms:
        return None
    return Decision("retry", "retry_with_backoff", backoff_ms=backoff)


def _failover_reason(outcome: AttemptOutcome, defaults: Defaults) -> str:
    c = outcome.classification
    if c.may_fail_over == "larger_context_only":
        return "larger_context_failover"
    if c.may_fail_over == "per_on_credentials_error":
        return "credentials_policy_failover"
    if c.may_fail_over == "per_on_invalid_output":
        return "invalid_output_policy_failover"
    if c.evidence is Evidence.NOT_STARTED:
        return "not_started_failover"
    if c.may_fail_over == "per_on_unknown_execution":
        # The attempt may have run: the core holds its reservation as unknown usage. A
        # strict request got here only because its caller allowed it (step 2).
        if _strict(outcome, defaults) is not None:
            return "unknown_execution_allowed_by_header"
        return "unknown_execution_policy_failover"
    # "yes" with the work started (response_too_large): the table allows it outright.
    return "class_allows_failover"


def _policy(outcome: AttemptOutcome, defaults: Defaults) -> str | None:
    """The rule the failure class defers to, as it stood for this request: the group's
    ``on_credentials_error`` or ``on_unknown_execution``, the strictness a request with
    server-side effects gets, or the caller's ``X-Waybill-Allow-Failover: unknown`` that
    lifted a strict one."""
    c = outcome.classification
    if c.may_fail_over == "per_on_credentials_error":
        return f"on_credentials_error={defaults.on_credentials_error}"
    if c.may_fail_over == "per_on_invalid_output":
        return f"on_invalid_output={defaults.on_invalid_output}"
    if c.may_fail_over != "per_on_unknown_execution":
        return None
    strict = _strict(outcome, defaults)
    if strict is None or c.evidence is Evidence.NOT_STARTED:
        return f"on_unknown_execution={defaults.on_unknown_execution}"
    if outcome.allow_unknown_execution:
        return "X-Waybill-Allow-Failover=unknown"
    if strict == "server_side_effects_strict":
        return "server_side_effects=strict"
    return "on_unknown_execution=stop"


class Place(Protocol):
    """Where an attempt ran: a mapping of the config, or the walk's target for it."""

    @property
    def endpoint(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def context_window(self) -> int: ...


def next_context(
    context: RouteContext, action: Action, place: Place, failure_class: FailureClass
) -> RouteContext:
    """The context of the next evaluation after ``action`` on ``place``'s endpoint and model."""
    if action != "failover":
        return context
    tried = context.tried_endpoints | {place.endpoint}
    if failure_class is not FailureClass.CONTEXT_TOO_SMALL:
        return dataclasses.replace(context, tried_endpoints=tried)
    floor = context.larger_context_than
    return RouteContext(
        tried_endpoints=tried,
        larger_context_than=place.context_window
        if floor is None
        else max(floor, place.context_window),
        excluded_models=context.excluded_models | {place.model},
    )
