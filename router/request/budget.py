"""One request's budget (contract §6): the accounts it is charged to, the over-budget check of
route evaluation, and the events + book effects of each step of an attempt's hold.

The rules live in :mod:`ledger.books.accounting`; this module only names, for the request path,
which effect goes with which event. Each pair is appended together, so a balance never
changes without its event, nor an event without its balance. The balances are read through
a port (:class:`Balances`; the ledger's: :class:`StoreBalances`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Protocol

from ledger import events as ev
from ledger.books.accounting import (
    AccountSpec,
    BudgetDenied,
    Effect,
    Hold,
    Window,
    account_specs,
    effect_of,
    overrun_event,
    reservation_id,
    settlement_id,
)
from ledger.events import Api
from ledger.store import EventStore
from ledger.support.frozen import direct_init
from ledger.types import money_of
from router.config import Workspace

__all__ = ["Balances", "Hold", "RequestBudget", "StepRecord", "StoreBalances"]


@direct_init
@dataclass(frozen=True, slots=True)
class StepRecord:
    """Events and the book effects that must be appended with them."""

    events: tuple[ev.Event, ...]
    effects: tuple[Effect, ...]

    @staticmethod
    def of(*events: ev.Event | None) -> StepRecord:
        """The events (None: left out) with the effects they are the meaning of."""
        kept = tuple(e for e in events if e is not None)
        return StepRecord(kept, tuple(e for e in map(effect_of, kept) if e is not None))


class Balances(Protocol):
    """What the over-budget check reads: each account's held and settled spend."""

    async def used(self, account_ids: Sequence[str]) -> Mapping[str, Decimal]:
        """Held plus settled, by account (one not found has used nothing)."""
        ...


class StoreBalances:
    """The ledger's balances (``budget_accounts``), read on the request path's connections."""

    __slots__ = ("_store",)

    def __init__(self, store: EventStore) -> None:
        self._store = store

    async def used(self, account_ids: Sequence[str]) -> Mapping[str, Decimal]:
        ids = {f"a{i}": account_id for i, account_id in enumerate(account_ids)}
        rows = await self._store.hot.rows(
            "SELECT account_id, held_usd, settled_usd FROM budget_accounts "
            f"WHERE account_id IN ({', '.join(':' + name for name in ids)})",
            ids,
        )
        return {row.account_id: money_of(row.held_usd) + money_of(row.settled_usd) for row in rows}


class RequestBudget:
    def __init__(
        self,
        balances: Balances,
        *,
        request_id: str,
        workspace: Workspace,
        key_id: str,
        model_group: str,
        request_limit: Decimal | None,
        owner: str,
        key_budget: tuple[Decimal, Window] | None = None,
        now: datetime | None = None,
        api: Api = "openai.chat_completions",
    ) -> None:
        self._balances = balances
        self.api: Api = api
        self.request_id = request_id
        self.workspace = workspace.id
        self.key_id = key_id
        self.model_group = model_group
        self.owner = owner
        default_key_budget = workspace.key_budget
        if key_budget is None and default_key_budget is not None:
            key_budget = (default_key_budget.limit_usd, default_key_budget.window)
        workspace_budget = workspace.budget
        self.specs: tuple[AccountSpec, ...] = account_specs(
            request_id=request_id,
            workspace=workspace.id,
            key_id=key_id,
            now=now or datetime.now(UTC),
            request_limit=request_limit,
            key_budget=key_budget,
            workspace_budget=(
                (workspace_budget.limit_usd, workspace_budget.window) if workspace_budget else None
            ),
        )
        self._account_ids = tuple(spec.account_id for spec in self.specs)
        self._holds: dict[str, Hold] = {}  # attempt id -> its hold
        self._last_available: Mapping[str, Decimal] = {}

    async def over_budget_check(self) -> Callable[[Decimal], str | None] | None:
        """For route evaluation: given a worst case, the account that cannot cover it."""
        if not self.specs:
            return None
        used = await self._balances.used(self._account_ids)
        available = self._last_available = {
            s.account_id: s.limit_usd - used.get(s.account_id, Decimal(0)) for s in self.specs
        }

        def over_budget(worst_case: Decimal) -> str | None:
            for spec in self.specs:
                if worst_case > available[spec.account_id]:
                    return spec.account_id
            return None

        return over_budget

    # --- the steps of one attempt's hold ---

    def reserve(self, attempt_id: str, endpoint: str, model: str, amount: Decimal) -> StepRecord:
        hold = Hold(
            reservation_id=reservation_id(attempt_id),
            request_id=self.request_id,
            attempt_id=attempt_id,
            workspace=self.workspace,
            key_id=self.key_id,
            endpoint=endpoint,
            model=model,
            amount_usd=amount,
            accounts=(),
            owner=self.owner,
        )
        self._holds[attempt_id] = hold
        event = ev.BudgetReserved.trusted(
            request_id=self.request_id,
            attempt_id=attempt_id,
            reservation_id=hold.reservation_id,
            amount_usd=amount,
            accounts=tuple(
                ev.AccountRef.trusted(
                    account_id=s.account_id,
                    kind=s.kind,
                    window_start=s.window_start,
                    limit_usd=s.limit_usd,
                )
                for s in self.specs
            ),
            endpoint=endpoint,
            model=model,
            workspace=self.workspace,
            key_id=self.key_id,
            model_group=self.model_group,
            owner=self.owner,
            api=self.api,
        )
        return StepRecord.of(event)

    def denied(self, refusal: BudgetDenied, endpoint: str, model: str) -> ev.Event:
        return ev.BudgetReservationDenied(
            request_id=self.request_id,
            endpoint=endpoint,
            model=model,
            amount_usd=refusal.amount_usd,
            account_id=refusal.account_id,
            account_kind=refusal.kind,
            limit_usd=refusal.limit_usd,
            available_usd=refusal.available_usd,
        )

    def settle(self, attempt_id: str, cost: Decimal, usage: ev.Usage) -> StepRecord:
        """Usage known: the whole cost is settled; beyond the hold it is an overrun."""
        hold = self._holds.pop(attempt_id)
        settled = ev.BudgetSettled.trusted(
            request_id=self.request_id,
            attempt_id=attempt_id,
            reservation_id=hold.reservation_id,
            reserved_usd=hold.amount_usd,
            settled_usd=cost,
            released_usd=max(Decimal(0), hold.amount_usd - cost),
            usage=usage,
        )
        overrun = overrun_event(
            request_id=self.request_id,
            attempt_id=attempt_id,
            reservation_id=hold.reservation_id,
            accounts=[spec.account_id for spec in self.specs],
            held=hold.amount_usd,
            actual=cost,
            cause="usage_above_reservation",
        )
        return StepRecord.of(settled, overrun)

    def release(self, attempt_id: str, reason: str) -> StepRecord:
        hold = self._holds.pop(attempt_id)
        event = ev.BudgetReleased.trusted(
            request_id=self.request_id,
            attempt_id=attempt_id,
            reservation_id=hold.reservation_id,
            released_usd=hold.amount_usd,
            reason=reason,
        )
        return StepRecord.of(event)

    def hold_unknown(self, attempt_id: str, cause: str) -> StepRecord:
        """Usage unknown: the whole hold stays counted until it is settled (contract §6)."""
        hold = self._holds.pop(attempt_id)
        event = ev.UnknownUsageOpened(
            settlement_id=settlement_id(attempt_id),
            request_id=self.request_id,
            attempt_id=attempt_id,
            reservation_id=hold.reservation_id,
            workspace=self.workspace,
            key_id=self.key_id,
            endpoint=hold.endpoint,
            model=hold.model,
            held_usd=hold.amount_usd,
            cause=cause,
        )
        return StepRecord.of(event)

    def has_hold(self, attempt_id: str) -> bool:
        return attempt_id in self._holds

    def adopt(self, hold: Hold) -> None:
        """A reservation taken after all (its append's answer was lost): hold it again."""
        self._holds[hold.attempt_id] = hold

    def forget(self, attempt_id: str) -> None:
        """A reservation the books refused: there is no hold to resolve."""
        self._holds.pop(attempt_id, None)

    def denied_candidate(self, candidate: ev.Candidate) -> ev.Event:
        """The refusal behind an ``over_budget`` exclusion, for the request's record."""
        spec = next(s for s in self.specs if s.account_id == candidate.detail)
        available = self._last_available.get(spec.account_id, spec.limit_usd)
        amount = candidate.worst_case_usd or Decimal(0)
        return self.denied(
            BudgetDenied(spec.account_id, spec.kind, spec.limit_usd, available, amount),
            candidate.endpoint,
            candidate.model,
        )
