"""Finding the mapping for the walk's next attempt, and admitting it (contract §4): every
mapping evaluated (:func:`router.request.selection.evaluate`, with the breakers, the
endpoints' slots, the budget and disabled endpoints asked through the ports), one selected,
then its endpoint slot taken and its breakers' admission won — or, for a retry or a resume,
only the targets the walk names admitted.

:class:`GroupPlan` is what a config generation works out once per model group for all its
requests; :class:`Routing` is one request's: its evaluations and what its admissions were
refused.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from ledger import events as ev
from ledger.support.frozen import evolve
from router.adapters.breaker_interface import FULL_STANDING, Standing
from router.adapters.breakers import Admission, BreakerKey
from router.adapters.disabling import detail as disabled_detail
from router.config import Config, Defaults, ModelGroup, Workspace
from router.config import Mapping as ModelMapping
from router.request.attempt import AttemptRoute
from router.request.composer import Composition, compose
from router.request.moves import (
    Refusal,
    Route,
    Routed,
    Target,
    Unroutable,
)
from router.request.policy import group_targets
from router.request.ports import Budget, Journal, Ports
from router.request.records import route_evaluated
from router.request.selection import evaluate, select
from router.request.worst_case import worst_case_cost
from router.support.ids import new_id

__all__ = ["GroupPlan", "Routing", "plan_for"]


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """A model group as one config generation serves it."""

    group: ModelGroup
    defaults: Defaults  # its effective policy (Config.policy_for)
    targets: tuple[Target, ...]  # every mapping, as the walk knows it
    places: tuple[tuple[str, str], ...]  # every mapping's (endpoint, model), for latency
    limits: Mapping[str, int]  # the max_in_flight of its endpoints that have one
    endpoint_keys: tuple[BreakerKey, ...]  # each mapping's endpoint breaker
    mapping_keys: tuple[BreakerKey, ...]  # each mapping's own breaker
    breaker_keys: tuple[BreakerKey, ...]  # all of them: the endpoints', then the mappings'
    can_resume: bool  # some mapping can continue a broken stream
    # A composed group (contract §4 "Pools"): ``group`` is then its flat group — its own
    # mappings, then each pool's — and this maps a flat index back to its pool.
    composition: Composition | None = None
    observes_latency: bool = False  # a strategy of it (or of a pool) reads latency figures
    pool_policies: tuple[tuple[str, Defaults], ...] = ()  # each pool's, for its hedging


def plan_for(config: Config, group: ModelGroup) -> GroupPlan:
    composition = None
    strategies = {group.strategy}
    if group.pools:
        composition, group = compose(config, group)
        strategies |= {member.group.strategy for member in composition.pools}
    mappings = group.mappings
    targets = group_targets(group)
    if composition is not None:
        targets = tuple(
            dataclasses.replace(t, pool=p.name if (p := composition.pool_of(i)) else None)
            for i, t in enumerate(targets)
        )
    endpoint_keys = tuple(BreakerKey.endpoint(m.endpoint) for m in mappings)
    mapping_keys = tuple(BreakerKey.mapping(m.endpoint, m.model) for m in mappings)
    return GroupPlan(
        group=group,
        defaults=config.policy_for(group.name),
        targets=targets,
        places=tuple((m.endpoint, m.model) for m in mappings),
        limits={
            m.endpoint: limit
            for m in mappings
            if (endpoint := config.endpoint(m.endpoint)) is not None
            and (limit := endpoint.max_in_flight) is not None
        },
        endpoint_keys=endpoint_keys,
        mapping_keys=mapping_keys,
        breaker_keys=endpoint_keys + mapping_keys,
        can_resume=any(target.resume != "none" for target in targets),
        composition=composition,
        observes_latency="least_latency" in strategies,
        pool_policies=tuple(
            (member.name, config.policy_for(member.name))
            for member in (composition.pools if composition else ())
        ),
    )


class Routing:
    """One request's routes: found, admitted, and handed to the attempt that starts next."""

    __slots__ = (
        "_budget",
        "_deadline",
        "_denied",
        "_journal",
        "_plan",
        "_ports",
        "_request_id",
        "_requirements",
        "_saturated",
        "_slot",
        "_workspace",
        "admitted_as",
        "candidates",
        "probe_in_ms",
        "probes",
        "refused",
        "routed",
        "sequence",
    )

    def __init__(
        self,
        ports: Ports,
        plan: GroupPlan,
        workspace: Workspace,
        requirements: ev.Requirements,
        request_id: str,
        budget: Budget,
        journal: Journal[Any],
        *,
        deadline: float | None = None,
    ) -> None:
        self._ports = ports
        self._deadline = deadline  # the request's, on the ports' monotonic clock
        self._plan = plan
        self._workspace = workspace
        self._requirements = requirements
        self._request_id = request_id
        self._budget = budget
        self._journal = journal
        self._denied: set[BreakerKey] = set()  # breakers that refused this request
        self._saturated: set[str] = set()  # endpoints whose slot this request was refused
        self._slot: str | None = None  # the endpoint slot taken for the route
        self.sequence = 0  # evaluations made
        self.candidates: tuple[ev.Candidate, ...] = ()  # the last evaluation's, if it failed
        # Of its candidates refused by an open breaker: mapping index → ms until a probe.
        self.probe_in_ms: dict[int, int] = {}
        self.routed: AttemptRoute | None = None  # the route the walk's next start takes
        self.admitted_as = "closed"  # the breakers' admission of it
        self.probes: tuple[BreakerKey, ...] = ()  # the breakers whose probe it holds
        self.refused: Refusal = "unavailable"  # why the last retry or resume was refused

    async def choose(self, action: Route) -> Routed | Unroutable:
        """Evaluate every mapping, choose one and admit it (contract §4); a refused
        admission is evaluated again, counted as such."""
        ports, plan, journal = self._ports, self._plan, self._journal
        while True:
            group, candidates = await self._evaluate(action)
            prefer = self._requirements.prefer_endpoint
            choice = select(candidates, ports.rr, self._workspace.id, group, prefer)
            self.sequence += 1
            journal.queue(
                route_evaluated(
                    self._request_id,
                    self.sequence,
                    candidates,
                    action.context,
                    choice,
                    group.strategy,
                )
            )
            if choice is None:
                over = [c for c in candidates if c.reason_code is ev.ReasonCode.OVER_BUDGET]
                if over and action.purpose != "hedge":
                    journal.queue(self._budget.denied_candidate(over[0]))
                self.candidates = candidates
                self.probe_in_ms = await self._probe_in(candidates)
                return Unroutable()
            mapping = group.mappings[choice.mapping_index]
            if await self._acquire(choice.mapping_index, mapping):
                endpoint = ports.config.endpoint(choice.endpoint)
                assert endpoint is not None, "evaluate found the mapping's endpoint"
                worst = candidates[choice.mapping_index].worst_case_usd or Decimal(0)
                driver = ports.drivers[choice.endpoint]
                self.routed = AttemptRoute(choice, mapping, driver, endpoint.driver, "first", worst)
                return Routed(plan.targets[choice.mapping_index])

    async def _evaluate(self, action: Route) -> tuple[ModelGroup, tuple[ev.Candidate, ...]]:
        """Every mapping of the plan's group evaluated (contract §4), with the group as
        priced now."""
        ports, plan, journal = self._ports, self._plan, self._journal
        if journal.has_effects:
            # A failed attempt's hold was just released or kept: the balances this
            # evaluation reads must include that.
            await journal.flush()
        standing = await ports.breakers.standing(plan.breaker_keys)
        breaker_open = self._breaker_lookup(standing)
        saturated = await self._saturation_lookup()
        latencies = None
        if plan.observes_latency:
            latencies = await ports.latency.read(plan.places)
        disabled = await ports.disabled.current()
        # Priced as at this attempt's start: its reservation and its settlement use the
        # price in force now (contract §2, price history), whenever it ends.
        group = plan.group.priced_at(ports.clock.now())
        context = action.context
        if self._deadline is not None:
            # contract §4 deadline_insufficient: held against what is left right now, so a
            # failover does not start what cannot finish.
            left_ms = max(0, int((self._deadline - ports.clock.monotonic()) * 1000))
            context = evolve(context, remaining_ms=left_ms)
        candidates = evaluate(
            ports.config,
            self._workspace,
            group,
            self._requirements,
            context,
            breaker_open=breaker_open,
            over_budget=await self._budget.over_budget_check(),
            latencies=latencies,
            saturated=saturated,
            credentials_disabled=functools.partial(disabled_detail, disabled),
            first_content_p95=ports.first_answers.place_p95s(
                plan.places, self._requirements.stream
            ),
            quota_exhausted=_quota_lookup(ports.breakers.quota_opened(), standing),
            # Asked only while some breaker ramps up: the usual evaluation pays nothing for it.
            ramp_share=_ramp_lookup(standing)
            if any(s.share < 1 for s in standing.values())
            else None,
        )
        return group, candidates

    async def admit_one_of(self, targets: tuple[Target, ...]) -> Target | None:
        """The first of ``targets`` (a retry's or a resume's) not disabled whose slot and
        breakers admit it; the caller binds its route (:attr:`routed`)."""
        disabled = await self._ports.disabled.current()
        mappings = self._plan.group.mappings
        self.refused = "unavailable"
        for target in targets:
            if target.endpoint in disabled:
                self.refused = "credentials_disabled"
                continue
            if await self._acquire(target.mapping_index, mappings[target.mapping_index]):
                return target
            saturated = target.endpoint in self._saturated
            self.refused = "saturated" if saturated else "breaker_open"
        return None

    def priced(self, target: Target, delivered_bytes: int) -> AttemptRoute:
        """A resume's route: priced now, with the delivered text counted in its input (it is
        sent back as the partial answer)."""
        ports = self._ports
        group = self._plan.group.priced_at(ports.clock.now())
        mapping = group.mappings[target.mapping_index]
        endpoint = ports.config.endpoint(target.endpoint)
        assert endpoint is not None
        requirements = self._requirements
        requirements = requirements.model_copy(
            update={"estimated_input_tokens": requirements.estimated_input_tokens + delivered_bytes}
        )
        worst = worst_case_cost(mapping, requirements, endpoint.driver)
        choice = ev.RouteChoice(
            endpoint=target.endpoint,
            model=mapping.model,
            mapping_index=target.mapping_index,
            tier=mapping.tier,
            weight=mapping.weight,
            selection_position=0,
        )
        driver = ports.drivers[target.endpoint]
        return AttemptRoute(choice, mapping, driver, endpoint.driver, "first", worst)

    def take_slot(self) -> str | None:
        """The slot taken for the route, now the started attempt's to give back."""
        slot, self._slot = self._slot, None
        return slot

    def give_back_routed(self, route: AttemptRoute) -> None:
        """A start that did not happen: the slot its route took goes back."""
        if self._slot is not None:
            self.give_back(route.choice.endpoint, self._slot)
            self._slot = None

    def give_back(self, endpoint: str, slot: str) -> None:
        self._ports.keep(self._ports.slots.give_back(endpoint, slot))

    async def _saturation_lookup(self) -> Callable[[str], str | None] | None:
        """Which of the group's endpoints have their ``max_in_flight`` attempts in flight (a
        read; the slot is taken atomically at admission)."""
        limits = self._plan.limits
        if not limits:
            return None
        in_use = await self._ports.slots.in_use(list(limits))
        refused = self._saturated

        def saturated(endpoint_id: str) -> str | None:
            limit = limits.get(endpoint_id)
            if limit is None:
                return None
            taken = in_use.get(endpoint_id, 0)
            if endpoint_id not in refused and taken < limit:
                return None
            return f"{max(taken, limit)} of {limit} in flight"

        return saturated

    async def _acquire(self, index: int, mapping: ModelMapping) -> bool:
        """Take a slot of the mapping's endpoint (its ``max_in_flight``), then its breakers'
        admission; False (nothing kept) if either refuses: evaluate again with it counted
        as such."""
        endpoint_id = mapping.endpoint
        limit = self._plan.limits.get(endpoint_id)
        slot = None
        if limit is not None:
            slot = new_id("slot")
            if not await self._ports.slots.take(endpoint_id, slot, limit):
                self._saturated.add(endpoint_id)
                return False
        if not await self._admitted(index):
            if slot is not None:
                self.give_back(endpoint_id, slot)
            return False
        self._slot = slot
        return True

    async def _probe_in(self, candidates: tuple[ev.Candidate, ...]) -> dict[int, int]:
        """For each candidate an open breaker refused, how long until both its breakers admit
        a probe (for the answer's ``Retry-After``); read only when nothing is eligible."""
        refused = [
            c.mapping_index for c in candidates if c.reason_code is ev.ReasonCode.BREAKER_OPEN
        ]
        if not refused:
            return {}
        plan = self._plan
        keys = [key for i in refused for key in (plan.endpoint_keys[i], plan.mapping_keys[i])]
        waits = await self._ports.breakers.probe_in(keys)
        return {
            i: max(
                waits.get(plan.endpoint_keys[i]) or 0,
                waits.get(plan.mapping_keys[i]) or 0,
            )
            for i in refused
        }

    def _breaker_lookup(
        self, standing: Mapping[BreakerKey, Standing]
    ) -> Callable[[str, ModelMapping], str | None]:
        denied = self._denied

        def breaker_open(endpoint_id: str, mapping: ModelMapping) -> str | None:
            endpoint_key = BreakerKey.endpoint(endpoint_id)
            if standing.get(endpoint_key, FULL_STANDING).blocked or endpoint_key in denied:
                return "endpoint"
            mapping_key = BreakerKey.mapping(endpoint_id, mapping.model)
            if standing.get(mapping_key, FULL_STANDING).blocked or mapping_key in denied:
                return "mapping"
            return None

        return breaker_open

    async def _admitted(self, index: int) -> bool:
        # blocked() was a read; the half-open probe is taken atomically here, and a lost
        # race for it sends us back to evaluation with that breaker counted as open.
        probes: list[BreakerKey] = []
        breakers, plan = self._ports.breakers, self._plan
        for key in (plan.endpoint_keys[index], plan.mapping_keys[index]):
            admission = await breakers.admit(key, self._request_id)
            if admission is Admission.DENIED:
                self._denied.add(key)
                if probes:  # the endpoint's probe, taken for an attempt that will not run
                    await breakers.release_probes(probes)
                return False
            if admission is Admission.PROBE:
                probes.append(key)
        # What the attempt was admitted under, for its start: closed, or the half-open probe.
        scopes = "+".join(key.scope for key in probes)
        self.admitted_as = "probe:" + scopes if probes else "closed"
        self.probes = tuple(probes)
        return True


def _ramp_lookup(standing: Mapping[BreakerKey, Standing]) -> Callable[[str, ModelMapping], Decimal]:
    """A mapping's share of its weight while its endpoint's or its own breaker ramps up
    after closing (contract §5 "Circuit breakers"): the lower of the two, so that whichever
    recovered last sets the pace."""

    def ramp_share(endpoint_id: str, mapping: ModelMapping) -> Decimal:
        endpoint = standing.get(BreakerKey.endpoint(endpoint_id), FULL_STANDING)
        own = standing.get(BreakerKey.mapping(endpoint_id, mapping.model), FULL_STANDING)
        return min(endpoint.share, own.share)

    return ramp_share


def _quota_lookup(
    opened: frozenset[str], standing: Mapping[BreakerKey, Standing]
) -> Callable[[str], str | None]:
    """An endpoint whose breaker an insufficient_quota opened is excluded ``quota_exhausted``
    until that breaker's cool-down passes (contract §4 "Quota failover")."""

    def quota_exhausted(endpoint_id: str) -> str | None:
        key = BreakerKey.endpoint(endpoint_id)
        if endpoint_id in opened and standing.get(key, FULL_STANDING).blocked:
            return f"{endpoint_id} answered insufficient_quota; its breaker is cooling down"
        return None

    return quota_exhausted
