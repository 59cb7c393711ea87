"""Routing for a composed model group (contract §4 "Pools"): the composer's plan carried out
over the request's routes. The planning itself is :mod:`router.request.composer`'s, pure;
this is :class:`~router.request.routing.Routing` for a group whose plan has a composition —
the same evaluation, admission and slots — with its own ``choose``:

- the first attempt: the composer's candidates (its own mappings, one per pool) are selected
  by tier and weight, and a pool is delegated to (``delegate_pool``: the pool's own
  ``select`` over its own candidates, by its own strategy and round-robin);
- a failover: the first binding of the plan fixed by the first route that is eligible now,
  by exact dispatch (``execute_endpoint``: the pool selects nothing);
- a hedge: delegated to the pool of the attempt it runs beside;

each level's evaluation recorded (``RouteEvaluated.group_path``), each directive checked
(:func:`~router.request.composer.check_dispatch`) before a slot or a breaker's admission is
taken. A retry reuses its attempt's route; a resume's route is bound to the broken attempt's
pool.
"""

from __future__ import annotations

import dataclasses
from decimal import Decimal
from typing import Any

from ledger import events as ev
from router.config import ModelGroup, Strategy, Workspace
from router.request.attempt import AttemptRoute
from router.request.composer import (
    Composition,
    Dispatch,
    check_dispatch,
    fallback_order,
    pool_candidate,
    preferred,
)
from router.request.moves import (
    Route,
    Routed,
    Target,
    Unroutable,
)
from router.request.ports import Budget, Journal, Ports
from router.request.records import route_evaluated
from router.request.routing import GroupPlan, Routing
from router.request.selection import select

__all__ = ["ComposedRouting", "routing_for"]


def routing_for(
    ports: Ports,
    plan: GroupPlan,
    workspace: Workspace,
    requirements: ev.Requirements,
    request_id: str,
    budget: Budget,
    journal: Journal[Any],
    *,
    deadline: float | None = None,
) -> Routing:
    """One request's routing: a composed group's when its plan has a composition.
    ``deadline``: the request's, on the ports' monotonic clock."""
    if plan.composition is not None:
        return ComposedRouting(
            ports, plan, workspace, requirements, request_id, budget, journal, deadline=deadline
        )
    return Routing(
        ports, plan, workspace, requirements, request_id, budget, journal, deadline=deadline
    )


class ComposedRouting(Routing):
    """One request's routes through a composed group."""

    __slots__ = ("_composition", "_order", "_scope")

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
        super().__init__(
            ports, plan, workspace, requirements, request_id, budget, journal, deadline=deadline
        )
        assert plan.composition is not None, "a composed group's plan"
        self._composition: Composition = plan.composition
        # Its pre-planned bindings (flat indices), once the first attempt was routed; the
        # pool (None: the composer's own mappings) the last attempt but a hedge went to.
        self._order: tuple[int, ...] | None = None
        self._scope: str | None = None

    async def choose(self, action: Route) -> Routed | Unroutable:
        """Plan the next attempt of a composed group across its pools: the first into a
        pool a delegation (the pool's router selects inside it), a failover the next
        pre-planned binding by exact dispatch, a hedge a delegation to the running pool.
        Each level's evaluation is recorded; a directive the pool cannot carry out is a
        :class:`~router.request.composer.CompositionError`, before any upstream I/O."""
        ports, journal, composition = self._ports, self._journal, self._composition
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
                self.probe_in_ms = await self._probe_in(self.candidates)
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
        at = _member_holding(composition, flat, members, self._requirements.prefer_endpoint)
        if at is not None:  # the caller's preference, ahead of tier and weight as in a group
            chosen: ev.RouteChoice | None = _choice(members[at]).model_copy(
                update={"preferred": True}
            )
        else:
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
        if not composition.permitted(self._workspace, member):
            return None
        local = _local(flat, member.offset, len(member.group.mappings))
        inner = member.group.priced_at(ports.clock.now())
        chosen = select(
            local, ports.rr, self._workspace.id, inner, self._requirements.prefer_endpoint
        )
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
        composition = self._composition
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
        """One level's evaluation, on the request's journal."""
        self.sequence += 1
        self._journal.queue(
            route_evaluated(
                self._request_id, self.sequence, candidates, action.context, chosen, strategy, path
            )
        )

    def priced(self, target: Target, delivered_bytes: int) -> AttemptRoute:
        """A resume's route, bound to the broken attempt's pool by exact dispatch."""
        route = super().priced(target, delivered_bytes)
        dispatch = Dispatch(
            "execute_endpoint",
            target.pool,
            target.mapping_index,
            target.endpoint,
            route.mapping.model,
        )
        check_dispatch(self._composition, self._plan.group, dispatch)
        return dataclasses.replace(route, dispatch=dispatch)


def _member_holding(
    composition: Composition,
    flat: tuple[ev.Candidate, ...],
    members: tuple[ev.Candidate, ...],
    endpoint: str | None,
) -> int | None:
    """The composer's candidate (its own mapping, or a pool) that holds an eligible mapping
    of the caller's preferred ``endpoint`` (X-Waybill-Prefer-Endpoint), the lowest tier
    first; None when none does (the preference is overruled)."""
    if endpoint is None:
        return None
    holding = [
        at
        for at, member in enumerate(members)
        if member.eligible
        and any(
            c.eligible and c.endpoint == endpoint for c in _members_mappings(composition, flat, at)
        )
    ]
    return min(holding, key=lambda at: (members[at].tier, at), default=None)


def _members_mappings(
    composition: Composition, flat: tuple[ev.Candidate, ...], at: int
) -> tuple[ev.Candidate, ...]:
    """The flat candidates behind the composer's candidate ``at``."""
    if at < composition.own:
        return (flat[at],)
    member = composition.pools[at - composition.own]
    return flat[member.offset : member.offset + len(member.group.mappings)]


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
