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
from router.adapters.breakers import Admission, BreakerKey
from router.adapters.disabling import detail as disabled_detail
from router.config import Config, Defaults, ModelGroup, Strategy, Workspace
from router.config import Mapping as ModelMapping
from router.request.attempt import AttemptRoute
from router.request.composer import (
    Composition,
    Dispatch,
    check_dispatch,
    compose,
    fallback_order,
    pool_candidate,
    preferred,
)
from router.request.policy import group_targets
from router.request.ports import Budget, Journal, Ports
from router.request.records import route_evaluated
from router.request.selection import evaluate, select
from router.request.walk import Refusal, Route, Routed, Target, Unroutable
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
    )


class Routing:
    """One request's routes: found, admitted, and handed to the attempt that starts next."""

    __slots__ = (
        "_budget",
        "_denied",
        "_journal",
        "_order",
        "_plan",
        "_ports",
        "_request_id",
        "_requirements",
        "_saturated",
        "_scope",
        "_slot",
        "_workspace",
        "admitted_as",
        "candidates",
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
    ) -> None:
        self._ports = ports
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
        self.routed: AttemptRoute | None = None  # the route the walk's next start takes
        self.admitted_as = "closed"  # the breakers' admission of it
        self.probes: tuple[BreakerKey, ...] = ()  # the breakers whose probe it holds
        self.refused: Refusal = "unavailable"  # why the last retry or resume was refused
        # A composed group's: its pre-planned bindings (flat indices), once the first
        # attempt was routed; the pool (None: its own mappings) the last route went to.
        self._order: tuple[int, ...] | None = None
        self._scope: str | None = None

    async def choose(self, action: Route) -> Routed | Unroutable:
        """Evaluate every mapping, choose one and admit it (contract §4); a refused
        admission is evaluated again, counted as such."""
        if self._plan.composition is not None:
            return await self._compose(action, self._plan.composition)
        ports, plan, journal = self._ports, self._plan, self._journal
        while True:
            group, candidates = await self._evaluate(action)
            choice = select(candidates, ports.rr, self._workspace.id, group)
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
        breaker_open = self._breaker_lookup(await ports.breakers.blocked(plan.breaker_keys))
        saturated = await self._saturation_lookup()
        latencies = None
        if plan.observes_latency:
            latencies = await ports.latency.read(plan.places)
        disabled = await ports.disabled.current()
        # Priced as at this attempt's start: its reservation and its settlement use the
        # price in force now (contract §2, price history), whenever it ends.
        group = plan.group.priced_at(ports.clock.now())
        candidates = evaluate(
            ports.config,
            self._workspace,
            group,
            self._requirements,
            action.context,
            breaker_open=breaker_open,
            over_budget=await self._budget.over_budget_check(),
            latencies=latencies,
            saturated=saturated,
            credentials_disabled=functools.partial(disabled_detail, disabled),
        )
        return group, candidates

    # --- a composed group (contract §4 "Pools") ---

    async def _compose(self, action: Route, composition: Composition) -> Routed | Unroutable:
        """Plan the next attempt of a composed group across its pools: the first into a
        pool a delegation (the pool's router selects inside it), a failover the next
        pre-planned binding by exact dispatch, a hedge a delegation to the running pool.
        Each level's evaluation is recorded; a directive the pool cannot carry out is a
        :class:`~router.request.composer.CompositionError`, before any upstream I/O."""
        ports, journal = self._ports, self._journal
        while True:
            group, flat = await self._evaluate(action)
            members = self._member_candidates(composition, flat)
            dispatch: Dispatch | None
            if action.purpose == "hedge":
                dispatch = self._delegate(composition, group, flat, self._scope, action)
            elif action.purpose == "failover" and self._order is not None:
                dispatch = self._exact(composition, group, flat, members, action)
            else:
                dispatch = self._admit_to_pool(composition, group, flat, members, action)
            if dispatch is None:
                self.candidates = self._flat_reasons(composition, flat)
                over = [c for c in flat if c.reason_code is ev.ReasonCode.OVER_BUDGET]
                if over and action.purpose != "hedge":
                    journal.queue(self._budget.denied_candidate(over[0]))
                return Unroutable()
            check_dispatch(composition, group, dispatch, action.context.excluded_models)
            if self._order is None:
                self._order = fallback_order(composition, group, dispatch.index)
            if action.purpose != "hedge":
                self._scope = dispatch.pool
            mapping = group.mappings[dispatch.index]
            if await self._acquire(dispatch.index, mapping):
                endpoint = ports.config.endpoint(mapping.endpoint)
                assert endpoint is not None, "evaluate found the mapping's endpoint"
                choice = ev.RouteChoice(
                    endpoint=mapping.endpoint,
                    model=mapping.model,
                    mapping_index=dispatch.index,
                    tier=mapping.tier,
                    weight=mapping.weight,
                    selection_position=0,
                )
                worst = flat[dispatch.index].worst_case_usd or Decimal(0)
                driver = ports.drivers[mapping.endpoint]
                self.routed = AttemptRoute(
                    choice, mapping, driver, endpoint.driver, "first", worst, dispatch
                )
                return Routed(self._plan.targets[dispatch.index])

    def _member_candidates(
        self, composition: Composition, flat: tuple[ev.Candidate, ...]
    ) -> tuple[ev.Candidate, ...]:
        """The composer's candidates: its own mappings, then one per pool."""
        own = flat[: composition.own]
        pools = tuple(
            pool_candidate(
                composition.own + k,
                member,
                _local(flat, member.offset, len(member.group.mappings)),
                permitted=composition.permitted(self._workspace, member),
            )
            for k, member in enumerate(composition.pools)
        )
        return own + pools

    def _flat_reasons(
        self, composition: Composition, flat: tuple[ev.Candidate, ...]
    ) -> tuple[ev.Candidate, ...]:
        """What a request no pool could take is answered by: every mapping's reason, a pool
        the workspace may not use named as such."""
        shown = list(flat[: composition.own])
        for member in composition.pools:
            mine = flat[member.offset : member.offset + len(member.group.mappings)]
            if composition.permitted(self._workspace, member):
                shown.extend(mine)
            else:
                shown.extend(
                    c.model_copy(
                        update={
                            "eligible": False,
                            "reason_code": ev.ReasonCode.POOL_NOT_PERMITTED,
                            "detail": f"the workspace may not use model group {member.name}",
                        }
                    )
                    for c in mine
                )
        return tuple(shown)

    def _admit_to_pool(
        self,
        composition: Composition,
        group: ModelGroup,
        flat: tuple[ev.Candidate, ...],
        members: tuple[ev.Candidate, ...],
        action: Route,
    ) -> Dispatch | None:
        """The composer chooses a member by tier and weight: its own mapping, executed
        exactly, or a pool, delegated to with the composer's preference."""
        ports = self._ports
        chosen = select(members, ports.rr, self._workspace.id, group)
        self._record(members, chosen, action, group.strategy, (composition.name,))
        if chosen is None:
            return None
        if chosen.mapping_index < composition.own:
            return Dispatch(
                "execute_endpoint", None, chosen.mapping_index, chosen.endpoint, chosen.model
            )
        member = composition.pools[chosen.mapping_index - composition.own]
        return self._delegate(composition, group, flat, member.name, action, chosen.endpoint)

    def _delegate(
        self,
        composition: Composition,
        group: ModelGroup,
        flat: tuple[ev.Candidate, ...],
        pool: str | None,
        action: Route,
        preference: str | None = None,
    ) -> Dispatch | None:
        """``delegate_pool``: the pool's own router selects inside its group, by its own
        strategy (and a hedge stays inside the running attempt's pool)."""
        ports = self._ports
        member = composition.pool(pool) if pool is not None else None
        if member is None:  # a hedge of the composer's own mapping: among its own
            own = flat[: composition.own]
            chosen = select(own, ports.rr, self._workspace.id, group)
            self._record(own, chosen, action, group.strategy, (composition.name,))
            if chosen is None:
                return None
            return Dispatch(
                "execute_endpoint", None, chosen.mapping_index, chosen.endpoint, chosen.model
            )
        local = _local(flat, member.offset, len(member.group.mappings))
        if not composition.permitted(self._workspace, member):
            return None
        inner = member.group.priced_at(ports.clock.now())
        chosen = select(local, ports.rr, self._workspace.id, inner)
        path = composition.path(member.name)
        self._record(local, chosen, action, inner.strategy, path)
        if chosen is None:
            return None
        if preference is None:
            pick = preferred(local)
            preference = pick.endpoint if pick else None
        index = member.offset + chosen.mapping_index
        return Dispatch(
            "delegate_pool", member.name, index, chosen.endpoint, chosen.model, preference
        )

    def _exact(
        self,
        composition: Composition,
        group: ModelGroup,
        flat: tuple[ev.Candidate, ...],
        members: tuple[ev.Candidate, ...],
        action: Route,
    ) -> Dispatch | None:
        """``execute_endpoint``: the next pre-planned binding that is eligible now, never
        reordered by the pool; the composer's and the pool's evaluations both recorded."""
        assert self._order is not None
        index = next((i for i in self._order if flat[i].eligible and self._may_use(i)), None)
        member = composition.pool_of(index) if index is not None else None
        if index is None:
            self._record(members, None, action, group.strategy, (composition.name,))
            return None
        mapping = group.mappings[index]
        at = index if member is None else composition.own + composition.pools.index(member)
        self._record(members, _choice(members[at]), action, group.strategy, (composition.name,))
        if member is not None:
            local = _local(flat, member.offset, len(member.group.mappings))
            bound = _choice(local[index - member.offset])
            path = composition.path(member.name)
            self._record(local, bound, action, member.group.strategy, path)
        return Dispatch(
            "execute_endpoint",
            member.name if member else None,
            index,
            mapping.endpoint,
            mapping.model,
        )

    def _may_use(self, index: int) -> bool:
        """Whether the workspace may use the pool a flat mapping lies in (its own: yes)."""
        composition = self._plan.composition
        assert composition is not None
        member = composition.pool_of(index)
        return member is None or composition.permitted(self._workspace, member)

    def _record(
        self,
        candidates: tuple[ev.Candidate, ...],
        chosen: ev.RouteChoice | None,
        action: Route,
        strategy: Strategy,
        path: tuple[str, ...],
    ) -> None:
        self.sequence += 1
        evaluated = route_evaluated(
            self._request_id, self.sequence, candidates, action.context, chosen, strategy
        )
        self._journal.queue(evaluated.model_copy(update={"group_path": path}))

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
        dispatch = None
        composition = self._plan.composition
        if composition is not None:
            # A resume continues inside the broken attempt's pool, on the endpoint named.
            dispatch = Dispatch(
                "execute_endpoint",
                target.pool,
                target.mapping_index,
                target.endpoint,
                mapping.model,
            )
            check_dispatch(composition, group, dispatch)
        return AttemptRoute(choice, mapping, driver, endpoint.driver, "first", worst, dispatch)

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

    def _breaker_lookup(
        self, blocked: Mapping[BreakerKey, bool]
    ) -> Callable[[str, ModelMapping], str | None]:
        denied = self._denied

        def breaker_open(endpoint_id: str, mapping: ModelMapping) -> str | None:
            endpoint_key = BreakerKey.endpoint(endpoint_id)
            if blocked.get(endpoint_key) or endpoint_key in denied:
                return "endpoint"
            mapping_key = BreakerKey.mapping(endpoint_id, mapping.model)
            if blocked.get(mapping_key) or mapping_key in denied:
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


def _local(flat: tuple[ev.Candidate, ...], offset: int, size: int) -> tuple[ev.Candidate, ...]:
    """A pool's candidates out of the flat evaluation, indexed as its own mappings."""
    return tuple(
        c.model_copy(update={"mapping_index": c.mapping_index - offset})
        for c in flat[offset : offset + size]
    )


def _choice(candidate: ev.Candidate) -> ev.RouteChoice:
    """An exact dispatch's binding, as its evaluation records it chosen."""
    return ev.RouteChoice(
        endpoint=candidate.endpoint,
        model=candidate.model,
        mapping_index=candidate.mapping_index,
        tier=candidate.tier,
        weight=candidate.weight,
        selection_position=0,
    )
