"""Composed model groups (contract §4 "Pools"), free of I/O: how a group that lists pools
plans its attempts across them, and the dispatch directives it hands each pool.

A composed group's router does not select endpoints inside a pool: it admits a request to a
pool (one candidate per pool, with the reason a pool cannot take it) and tells the pool what
it may do with one of two directives — ``delegate_pool`` (the pool's own router selects
inside its group, by its own strategy, breakers and latency figures; the composer's pick is
only a preference) or ``execute_endpoint`` (exactly the bound endpoint: a pre-planned
fallback the pool cannot reorder). :func:`check_dispatch` refuses, before any upstream I/O,
a directive the pool cannot carry out: that is a composition error, never a fallback and
never a provider failure.

The composer serves its requests over one flat list of mappings — its own, then each
pool's, in pool order — so an attempt's binding is one index, as for a plain group
(:class:`Composition` maps it back to its pool).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

from ledger.events import Candidate, ReasonCode
from router.config import Config, ModelGroup, Workspace

__all__ = [
    "POOL_REASONS",
    "RULES",
    "Composition",
    "CompositionError",
    "Directive",
    "Dispatch",
    "PoolMember",
    "check_dispatch",
    "compose",
    "fallback_order",
    "pool_candidate",
    "preferred",
]

Directive: TypeAlias = Literal["delegate_pool", "execute_endpoint"]

POOL_REASONS: Final = frozenset({ReasonCode.POOL_NOT_PERMITTED, ReasonCode.POOL_UNAVAILABLE})
"""The reason codes of a composer's candidate for a pool; every other one is a mapping's
(router.request.selection.CHECK_ORDER)."""

RULES: Final = (
    "unknown_pool",  # the directive names a pool the composer does not have
    "leaf_cannot_delegate",  # delegate_pool to a mapping of the composer's own: a leaf
    "binding_outside_scope",  # the bound endpoint is not a mapping of the pool
    "preference_outside_scope",  # the preferred endpoint is not a mapping of the pool
    "model_excluded",  # the bound upstream model is excluded for this request
)


class CompositionError(Exception):
    """A pool cannot carry out the directive it was given (one of :data:`RULES`)."""

    def __init__(self, rule: str, detail: str) -> None:
        super().__init__(f"{rule}: {detail}")
        self.rule = rule
        self.detail = detail


@dataclass(frozen=True, slots=True)
class PoolMember:
    """One pool of a composed group, as the composer serves it."""

    group: ModelGroup  # the pool's model group, with its own strategy and mappings
    tier: int
    weight: int
    offset: int  # the flat index of its first mapping

    @property
    def name(self) -> str:
        return self.group.name

    def holds(self, index: int) -> bool:
        return self.offset <= index < self.offset + len(self.group.mappings)


@dataclass(frozen=True, slots=True)
class Composition:
    """A composed group: its own mappings (flat indices ``0 .. own - 1``), then its pools'."""

    name: str
    own: int
    pools: tuple[PoolMember, ...]

    def pool_of(self, index: int) -> PoolMember | None:
        """The pool a flat mapping index lies in (None: the composer's own mapping)."""
        return next((p for p in self.pools if p.holds(index)), None)

    def pool(self, name: str) -> PoolMember | None:
        return next((p for p in self.pools if p.name == name), None)

    def path(self, pool: str | None) -> tuple[str, ...]:
        """The model groups from the requested one down to the one a binding lies in."""
        return (self.name,) if pool is None else (self.name, pool)

    def permitted(self, workspace: Workspace, pool: PoolMember) -> bool:
        """A workspace may use a pool only if it may use the pool's group (contract §2)."""
        return pool.name in workspace.models


def compose(config: Config, group: ModelGroup) -> tuple[Composition, ModelGroup]:
    """The composition of ``group`` and its flat group: its own mappings, then each pool's,
    in pool order (config validation refused unknown, nested and cyclic pools)."""
    mappings = list(group.mappings)
    members = []
    for pool in group.pools:
        member_group = config.model_group(pool.group)
        if member_group is None:
            raise ValueError(f"model group {group.name!r}: pool {pool.group!r} is unknown")
        members.append(PoolMember(member_group, pool.tier, pool.weight, len(mappings)))
        mappings.extend(member_group.mappings)
    flat = group.model_copy(update={"mappings": tuple(mappings), "pools": ()})
    return Composition(group.name, len(group.mappings), tuple(members)), flat


@dataclass(frozen=True, slots=True)
class Dispatch:
    """What the composer tells the pool an attempt goes to (contract §4 "Pools")."""

    directive: Directive
    pool: str | None  # None: a mapping of the composer's own (a leaf)
    index: int  # the flat index of the bound mapping (delegate_pool: the pool's choice)
    endpoint: str  # that mapping's endpoint
    model: str  # and upstream model
    preferred: str | None = None  # delegate_pool: the composer's preferred endpoint


def check_dispatch(
    composition: Composition,
    flat: ModelGroup,
    dispatch: Dispatch,
    excluded_models: frozenset[str] = frozenset(),
) -> None:
    """Raise :class:`CompositionError` unless the pool can carry out ``dispatch``: it names
    a pool of the composer (or a leaf, executed exactly), its binding is a mapping of that
    pool, a preference lies inside it, and the bound model is not excluded."""
    if dispatch.pool is None:
        if dispatch.directive == "delegate_pool":
            raise CompositionError(
                "leaf_cannot_delegate",
                f"{dispatch.endpoint} is a mapping of {composition.name} itself: a leaf "
                "executes exactly its endpoint and cannot select",
            )
        where, offset, scope = composition.name, 0, flat.mappings[: composition.own]
    else:
        member = composition.pool(dispatch.pool)
        if member is None:
            raise CompositionError(
                "unknown_pool", f"{dispatch.pool} is not a pool of {composition.name}"
            )
        # The pool's own group, not the composer's view of it: its scope is what it serves.
        where, offset, scope = member.name, member.offset, member.group.mappings
    local = dispatch.index - offset
    bound = scope[local] if 0 <= local < len(scope) else None
    if bound is None or (bound.endpoint, bound.model) != (dispatch.endpoint, dispatch.model):
        raise CompositionError(
            "binding_outside_scope",
            f"{dispatch.endpoint}/{dispatch.model} is not a mapping of {where}",
        )
    if dispatch.preferred is not None and all(m.endpoint != dispatch.preferred for m in scope):
        raise CompositionError(
            "preference_outside_scope", f"{dispatch.preferred} is not an endpoint of {where}"
        )
    if dispatch.model in excluded_models:
        raise CompositionError(
            "model_excluded", f"{dispatch.model} is excluded for this request ({where})"
        )


def preferred(candidates: Sequence[Candidate]) -> Candidate | None:
    """The composer's preference inside a pool: its first eligible mapping of the best
    tier, in mapping order (the pool's router may choose another by its strategy)."""
    eligible = [c for c in candidates if c.eligible]
    if not eligible:
        return None
    tier = min(c.tier for c in eligible)
    return next(c for c in eligible if c.tier == tier)


def pool_candidate(
    index: int,
    member: PoolMember,
    evaluated: Sequence[Candidate],
    *,
    permitted: bool,
) -> Candidate:
    """The composer's candidate for a pool: eligible when the workspace may use it and one
    of its mappings is eligible; else excluded ``pool_not_permitted`` or
    ``pool_unavailable`` (its mappings' reasons in the detail, its own evaluation in full).
    Its endpoint and model are the preferred binding (else its first mapping's)."""
    pick = preferred(evaluated) if permitted else None
    shown = pick or (evaluated[0] if evaluated else None)
    first = member.group.mappings[0]
    reason: ReasonCode | None = None
    detail = None
    if not permitted:
        reason = ReasonCode.POOL_NOT_PERMITTED
        detail = f"the workspace may not use model group {member.name}"
    elif pick is None:
        reason = ReasonCode.POOL_UNAVAILABLE
        detail = ", ".join(f"{c.endpoint}: {c.reason_code}" for c in evaluated)
    return Candidate(
        endpoint=shown.endpoint if shown else first.endpoint,
        model=shown.model if shown else first.model,
        mapping_index=index,
        tier=member.tier,
        weight=member.weight,
        eligible=reason is None,
        reason_code=reason,
        detail=detail,
        worst_case_usd=pick.worst_case_usd if pick else None,
        latency_ms=pick.latency_ms if pick else None,
        pool=member.name,
    )


def fallback_order(composition: Composition, flat: ModelGroup, first: int) -> tuple[int, ...]:
    """The composer's pre-planned bindings, as flat indices: ``first`` (the binding the
    first attempt ran on), then every other mapping — the members (its own mappings, its
    pools) by tier, in config order, a pool's mappings by their tier then order. A
    failover takes the first one left, by exact dispatch."""
    own = [(flat.mappings[i].tier, 0, i) for i in range(composition.own)]
    pooled = [
        (member.tier, 1 + k, member.offset + j)
        for k, member in enumerate(composition.pools)
        for j, _ in sorted(
            enumerate(member.group.mappings), key=lambda item: (item[1].tier, item[0])
        )
    ]
    ordered = [i for _, _, i in sorted(own + pooled, key=lambda e: (e[0], e[1]))]
    return (first, *(i for i in ordered if i != first))
