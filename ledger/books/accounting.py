"""The accounting rules (contract §4 cost, §6 budgets), in exact decimal arithmetic, free of I/O.

Money moves in two phases, TigerBeetle style. Before an attempt its worst-case cost is
*reserved*: a hold counted against every account it touches (the request's, the key's and
the workspace's, each in its window). After the attempt the hold is resolved exactly once:

- usage known  → **settled** at the actual cost, the rest released;
- not started  → **released** entirely;
- usage unknown → the hold becomes an **unknown-usage settlement**: still counted, until a
  reconciliation or an operator settles it (``settle_unknown``).

A settlement is never capped: when the actual cost exceeds the hold, the whole cost is
settled and the excess is an **overrun**, counted on every account of the hold and recorded
as its own event (``BudgetOverrun``). The invariant, for every account at every instant:

    held + (settled - overrun) <= limit

— reservations never exceed the limit, and whatever was settled beyond them is exactly the
recorded overruns. A reservation must fit in ``limit - held - settled`` (overruns included),
so an account whose spend went over its limit admits no new reservation until its window
turns or its limit is raised. A reservation that does not fit is refused
(:class:`BudgetDenied`). :class:`Books` applies these rules to balances and holds held in
memory; ``ledger.books.balances`` loads and saves them in the very transaction that appends the
matching events, under the ledger's head-row lock, so every replica sees every other's
reservations (and PostgreSQL also enforces the invariant with a CHECK constraint).

Each effect is the meaning of exactly one budget event (:func:`effect_of`): the request
path derives the effects it appends from the events it appends, and :func:`fold_books`
derives the balances from the recorded events, so the live tables can be checked against
the ledger and rebuilt from it.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from decimal import (
    ROUND_CEILING,
    Context,
    Decimal,
    Inexact,
    InvalidOperation,
    Overflow,
    localcontext,
)
from typing import Any, Final, Literal, TypeAlias, TypeVar

from ledger import events as ev
from ledger.events import Usage

_R = TypeVar("_R")
_C = TypeVar("_C")

__all__ = [
    "BOOK_EVENTS",
    "EXACT",
    "MONEY_QUANTUM",
    "AccountSpec",
    "Balance",
    "Books",
    "BudgetDenied",
    "Effect",
    "FoldProblem",
    "Hold",
    "HoldStateError",
    "HoldUnknown",
    "Rates",
    "Release",
    "Reserve",
    "Resolution",
    "Settle",
    "SettleUnknown",
    "Window",
    "account_specs",
    "effect_of",
    "fold_books",
    "overrun_event",
    "quantize",
    "reservation_id",
    "reservation_of_settlement",
    "settlement_id",
    "settlement_refusal",
    "usage_cost",
    "window_start",
]

MONEY_QUANTUM: Final = Decimal("0.000000000001")
_MONEY_CONTEXT: Final = Context(prec=60)
EXACT: Final = Context(prec=100, traps=[Inexact, InvalidOperation, Overflow])
"""Enough digits for any token count times any price, and a trap so that an inexact
result raises instead of silently rounding money (only :func:`quantize` rounds, and up)."""
_PER_MTOK_EXPONENT: Final = -6
_ZERO: Final = Decimal(0)

AccountKind: TypeAlias = Literal["request", "key", "workspace"]
Window: TypeAlias = Literal["day", "month", "total"]
HoldState: TypeAlias = Literal["held", "unknown", "resolved"]


# Ids follow from the attempt's: one attempt, one reservation, at most one unknown-usage
# settlement. A repeated step therefore finds the same hold (contract §6: idempotent steps).
def reservation_id(attempt_id: str) -> str:
    return "res_" + attempt_id.removeprefix("att_")


def settlement_id(attempt_id: str) -> str:
    return "unk_" + attempt_id.removeprefix("att_")


def reservation_of_settlement(settlement: str) -> str | None:
    """The reservation an unknown-usage settlement id stands for; None if it is not one."""
    if not settlement.startswith("unk_"):
        return None
    return "res_" + settlement.removeprefix("unk_")


def quantize(amount: Decimal) -> Decimal:
    """Round up to the ledger's money precision: a charge is never understated."""
    # Enough digits for any amount the books can hold (NUMERIC(38, 12)); the default
    # context's 28 would refuse large amounts with their 12 decimals.
    return amount.quantize(MONEY_QUANTUM, rounding=ROUND_CEILING, context=_MONEY_CONTEXT)


@dataclass(frozen=True, slots=True)
class Rates:
    """What each dimension of usage is settled at: US dollars per million tokens of each
    kind, and per web search (None: none is priced). The gateway derives them from a
    mapping's price with the rules its worst case uses, so a dimension is settled at the
    very rate its bound was reserved at; an audio rate is never below the text rates."""

    input_per_mtok: Decimal
    cached_input_per_mtok: Decimal
    output_per_mtok: Decimal
    audio_input_per_mtok: Decimal
    audio_output_per_mtok: Decimal
    web_search_usd: Decimal | None = None
    # Prompt-cache writes, for 5 minutes and for an hour (None: at the input rate).
    cache_write_per_mtok: Decimal | None = None
    cache_write_1h_per_mtok: Decimal | None = None


def usage_cost(usage: Usage, rates: Rates) -> Decimal:
    """The cost of known usage, each token at its kind's rate and each web search at its
    fee, rounded up to the ledger's precision (contract §6).

    Audio, cached and cache-write tokens are parts of the input and output counts. A
    provider does not say whether its cached tokens are text or audio, so they are taken as
    audio first: a token that may be audio is priced as audio, and text is discounted only
    for cached tokens that cannot be audio. Cache writes (Anthropic's, all text) are
    claimed from the text before cached reads, hour-long ones first. The bill is never
    understated.
    """
    audio_input = min(usage.audio_input_tokens, usage.input_tokens)
    text_input = usage.input_tokens - audio_input
    written_1h = min(usage.cache_write_1h_input_tokens, text_input)
    written_5m = min(usage.cache_write_input_tokens, text_input - written_1h)
    unwritten = text_input - written_1h - written_5m
    cached_text = min(max(0, usage.cached_input_tokens - audio_input), unwritten)
    audio_output = min(usage.audio_output_tokens, usage.output_tokens)
    write_5m = rates.cache_write_per_mtok
    write_5m = rates.input_per_mtok if write_5m is None else write_5m
    write_1h = rates.cache_write_1h_per_mtok
    write_1h = write_5m if write_1h is None else write_1h
    with localcontext(EXACT):
        micro = (
            (unwritten - cached_text) * rates.input_per_mtok
            + cached_text * rates.cached_input_per_mtok
            + written_5m * write_5m
            + written_1h * write_1h
            + audio_input * rates.audio_input_per_mtok
            + (usage.output_tokens - audio_output) * rates.output_per_mtok
            + audio_output * rates.audio_output_per_mtok
        )
        amount = micro.scaleb(_PER_MTOK_EXPONENT)
        if usage.web_searches:
            if rates.web_search_usd is None:
                raise ValueError(f"{usage.web_searches} web searches and no price for them")
            amount += usage.web_searches * rates.web_search_usd
    return quantize(amount)


# --- accounts ---


def window_start(window: Window, now: datetime) -> str | None:
    """The first day (UTC, ISO date) of the window ``now`` falls in; None for ``total``."""
    if window == "day":
        return now.date().isoformat()
    if window == "month":
        return now.date().replace(day=1).isoformat()
    return None


@dataclass(frozen=True, slots=True)
class AccountSpec:
    """An account a reservation is charged to, with the limit the config gives it now."""

    account_id: str
    kind: AccountKind
    workspace: str
    key_id: str | None
    window_start: str | None
    limit_usd: Decimal


def account_specs(
    *,
    request_id: str,
    workspace: str,
    key_id: str,
    now: datetime,
    request_limit: Decimal | None,
    key_budget: tuple[Decimal, Window] | None,
    workspace_budget: tuple[Decimal, Window] | None,
) -> tuple[AccountSpec, ...]:
    """The accounts one request's attempts are reserved against (contract §6)."""
    specs: list[AccountSpec] = []
    if request_limit is not None:
        specs.append(
            AccountSpec(f"request:{request_id}", "request", workspace, key_id, None, request_limit)
        )
    if key_budget is not None:
        limit, window = key_budget
        start = window_start(window, now)
        specs.append(
            AccountSpec(f"key:{key_id}:{start or 'total'}", "key", workspace, key_id, start, limit)
        )
    if workspace_budget is not None:
        limit, window = workspace_budget
        start = window_start(window, now)
        specs.append(
            AccountSpec(
                f"workspace:{workspace}:{start or 'total'}",
                "workspace",
                workspace,
                None,
                start,
                limit,
            )
        )
    return tuple(specs)


def _copied_by_fields(cls: type[_C]) -> type[_C]:
    """Give a slots dataclass a ``__copy__`` that passes its fields to the constructor:
    ``copy.copy``'s generic way (``__reduce_ex__``) took several times as long
    (bench/README.md, "Decisions"), and the books copy holds and balances on every append."""
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    values = operator.attrgetter(*names)
    cls.__copy__ = lambda self: cls(*values(self))  # type: ignore[attr-defined]
    return cls


@_copied_by_fields
@dataclass(slots=True)
class Balance:
    """An account's live balance."""

    account_id: str
    kind: AccountKind
    workspace: str
    key_id: str | None
    window_start: str | None
    limit_usd: Decimal
    held_usd: Decimal = _ZERO
    settled_usd: Decimal = _ZERO  # every settlement in full, overruns included
    overrun_usd: Decimal = _ZERO  # the part of settled_usd beyond the holds it settled

    @property
    def available_usd(self) -> Decimal:
        """What a new reservation may take: nothing while spend is over the limit."""
        return max(_ZERO, self.limit_usd - self.held_usd - self.settled_usd)

    @staticmethod
    def opened(spec: AccountSpec) -> Balance:
        return Balance(
            spec.account_id,
            spec.kind,
            spec.workspace,
            spec.key_id,
            spec.window_start,
            spec.limit_usd,
        )


@_copied_by_fields
@dataclass(slots=True)
class Hold:
    """One attempt's reservation."""

    reservation_id: str
    request_id: str
    attempt_id: str
    workspace: str
    key_id: str
    endpoint: str
    model: str
    amount_usd: Decimal
    accounts: tuple[str, ...]
    # The gateway incarnation that took it; the books keep it while the hold is open, so a
    # resolved hold read back from them has none.
    owner: str | None
    state: HoldState = "held"


@dataclass(frozen=True, slots=True)
class Resolution:
    reservation_id: str
    kind: Literal["settled", "released", "unknown_settled"]
    settled_usd: Decimal
    released_usd: Decimal
    overrun_usd: Decimal = _ZERO


# --- effects: what an append asks the books to do, atomically with its events ---


@dataclass(frozen=True, slots=True)
class Reserve:
    hold: Hold
    specs: tuple[AccountSpec, ...]


@dataclass(frozen=True, slots=True)
class Settle:
    """Usage known: post the actual cost, release what is left of the hold (an excess
    over the hold is an overrun)."""

    reservation_id: str
    cost_usd: Decimal


@dataclass(frozen=True, slots=True)
class Release:
    """Not started: release the whole hold."""

    reservation_id: str


@dataclass(frozen=True, slots=True)
class HoldUnknown:
    """Usage unknown: the hold stays counted as an unknown-usage settlement."""

    reservation_id: str


@dataclass(frozen=True, slots=True)
class SettleUnknown:
    """An unknown-usage settlement settled (by reconciliation or an operator), at the
    amount given (an excess over the hold is an overrun)."""

    reservation_id: str
    cost_usd: Decimal


Effect: TypeAlias = Reserve | Settle | Release | HoldUnknown | SettleUnknown


class BudgetDenied(Exception):
    """A reservation an account cannot cover; nothing of its append is written."""

    def __init__(
        self,
        account_id: str,
        kind: AccountKind,
        limit: Decimal,
        available: Decimal,
        amount: Decimal,
    ) -> None:
        self.account_id = account_id
        self.kind: AccountKind = kind
        self.limit_usd = limit
        self.available_usd = max(_ZERO, available)
        self.amount_usd = amount
        super().__init__(
            f"{kind} account {account_id} cannot cover {amount} USD "
            f"({self.available_usd} of {limit} left)"
        )

    def __reduce__(self) -> tuple[Any, ...]:  # across processes (ledger.store.shared_appends)
        return (
            BudgetDenied,
            (self.account_id, self.kind, self.limit_usd, self.available_usd, self.amount_usd),
        )


class HoldStateError(Exception):
    """An effect that does not fit the hold's state (e.g. resolving it a second time)."""


@dataclass
class Books:
    """Balances and holds in memory, changed only through :meth:`apply`."""

    accounts: dict[str, Balance] = field(default_factory=dict)
    holds: dict[str, Hold] = field(default_factory=dict)
    # False only when recorded events are folded: a reservation the ledger holds was
    # accepted when it was made, against the limit of that time; it is a fact to apply,
    # not a request to judge again.
    enforce_limits: bool = True
    new_accounts: set[str] = field(default_factory=set)
    changed_accounts: set[str] = field(default_factory=set)
    new_holds: set[str] = field(default_factory=set)
    changed_holds: set[str] = field(default_factory=set)
    resolutions: list[Resolution] = field(default_factory=list)

    @staticmethod
    def needs(effects: Iterable[Effect]) -> tuple[set[str], set[str]]:
        """The account ids and reservation ids these effects touch (to load them first)."""
        accounts: set[str] = set()
        holds: set[str] = set()
        for effect in effects:
            if isinstance(effect, Reserve):
                accounts.update(spec.account_id for spec in effect.specs)
            else:
                holds.add(effect.reservation_id)
        return accounts, holds

    def apply(self, effects: Sequence[Effect]) -> None:
        """Apply all of ``effects`` or none: a refusal leaves the books as they were."""
        # Undo by snapshot of what these effects can touch: their holds and those holds'
        # accounts, or a reservation's accounts. Balances and holds are flat records of
        # immutable values, so a shallow copy of each is a full snapshot. (Copying every
        # balance and hold in the books made each apply cost the batch's size.)
        accounts, holds = self.needs(effects)
        for effect in effects:
            if isinstance(effect, Reserve):
                holds.add(effect.hold.reservation_id)
            elif (hold := self.holds.get(effect.reservation_id)) is not None:
                accounts.update(hold.accounts)
        saved_accounts = {k: copy.copy(self.accounts.get(k)) for k in accounts}
        saved_holds = {k: copy.copy(self.holds.get(k)) for k in holds}
        saved_sets = (
            set(self.new_accounts),
            set(self.changed_accounts),
            set(self.new_holds),
            set(self.changed_holds),
        )
        resolutions = len(self.resolutions)
        try:
            for effect in effects:
                self._apply(effect)
        except (BudgetDenied, HoldStateError):
            _restore(self.accounts, saved_accounts)
            _restore(self.holds, saved_holds)
            (
                self.new_accounts,
                self.changed_accounts,
                self.new_holds,
                self.changed_holds,
            ) = saved_sets
            del self.resolutions[resolutions:]
            raise

    def _apply(self, effect: Effect) -> None:
        match effect:
            case Reserve(hold=hold, specs=specs):
                self._reserve(hold, specs)
            case Settle(reservation_id=rid, cost_usd=cost):
                self._resolve(rid, "held", "settled", cost)
            case Release(reservation_id=rid):
                self._resolve(rid, "held", "released", _ZERO)
            case HoldUnknown(reservation_id=rid):
                hold = self._hold(rid, "held")
                hold.state = "unknown"
                self._touch_hold(rid)
            case SettleUnknown(reservation_id=rid, cost_usd=cost):
                self._resolve(rid, "unknown", "unknown_settled", cost)

    def _reserve(self, hold: Hold, specs: tuple[AccountSpec, ...]) -> None:
        # The books keep (and later change) a copy: the effect is the caller's, and the
        # same effects are applied again when a batch is decided a second time.
        hold = copy.copy(hold)
        if hold.reservation_id in self.holds:
            raise HoldStateError(f"reservation {hold.reservation_id} already exists")
        if hold.amount_usd < 0:
            raise ValueError("a reservation cannot be negative")
        for spec in specs:
            account = self.accounts.get(spec.account_id)
            if account is None:
                account = self.accounts[spec.account_id] = Balance.opened(spec)
                self.new_accounts.add(spec.account_id)
            # The limit the config gives now decides; the stored one follows it, but never
            # below what is already committed (that would be a balance over its limit).
            committed = account.held_usd + account.settled_usd
            if self.enforce_limits and committed + hold.amount_usd > spec.limit_usd:
                raise BudgetDenied(
                    spec.account_id,
                    spec.kind,
                    spec.limit_usd,
                    spec.limit_usd - committed,
                    hold.amount_usd,
                )
            account.limit_usd = spec.limit_usd
            account.held_usd += hold.amount_usd
            self.changed_accounts.add(spec.account_id)
        hold.accounts = tuple(spec.account_id for spec in specs)
        self.holds[hold.reservation_id] = hold
        self.new_holds.add(hold.reservation_id)

    def _resolve(
        self,
        reservation_id: str,
        expected: HoldState,
        kind: Literal["settled", "released", "unknown_settled"],
        cost: Decimal,
    ) -> None:
        hold = self._hold(reservation_id, expected)
        if cost < 0:
            raise ValueError("a cost cannot be negative")
        # The whole cost is posted: a cost the hold did not cover is still owed. What
        # exceeds the hold is an overrun, counted apart so the invariant stays checkable.
        overrun = max(_ZERO, cost - hold.amount_usd)
        for account_id in hold.accounts:
            account = self.accounts[account_id]
            account.held_usd -= hold.amount_usd
            account.settled_usd += cost
            account.overrun_usd += overrun
            self.changed_accounts.add(account_id)
        hold.state = "resolved"
        self._touch_hold(reservation_id)
        self.resolutions.append(
            Resolution(reservation_id, kind, cost, max(_ZERO, hold.amount_usd - cost), overrun)
        )

    def _hold(self, reservation_id: str, expected: HoldState) -> Hold:
        hold = self.holds.get(reservation_id)
        if hold is None:
            raise HoldStateError(f"no reservation {reservation_id}")
        if hold.state != expected:
            raise HoldStateError(f"reservation {reservation_id} is {hold.state}, not {expected}")
        return hold

    def _touch_hold(self, reservation_id: str) -> None:
        if reservation_id not in self.new_holds:
            self.changed_holds.add(reservation_id)


def _restore(records: dict[str, _R], saved: dict[str, _R | None]) -> None:
    for key, before in saved.items():
        if before is None:
            records.pop(key, None)
        else:
            records[key] = before


# --- settlements: how much, and what an excess records ---

OVERRUN_REFUSAL_FACTOR: Final = Decimal(1000)
"""A settlement above this many times its hold is taken for a mistake unless forced."""

SETTLEMENT_CEILING: Final = Decimal(10) ** 15
"""No single settlement goes above this, forced or not: it is no bill, only a typo."""


def settlement_refusal(held: Decimal, cost: Decimal, *, force: bool = False) -> str | None:
    """Why settling a hold of ``held`` at ``cost`` is refused, or None. Amounts above the
    hold are settled (as overruns); only the absurd ones need ``force``."""
    if not cost.is_finite() or cost < 0:
        return "the settled amount must be a non-negative decimal"
    if cost > SETTLEMENT_CEILING:
        return f"{cost} USD is beyond any plausible bill (at most {SETTLEMENT_CEILING})"
    if not force and cost > held * OVERRUN_REFUSAL_FACTOR:
        return (
            f"{format(cost, 'f')} USD is more than {OVERRUN_REFUSAL_FACTOR}x the hold of "
            f"{format(held, 'f')} USD; settle it with force if it is really owed"
        )
    return None


def overrun_event(
    *,
    request_id: str,
    attempt_id: str,
    reservation_id: str,
    accounts: Sequence[str],
    held: Decimal,
    actual: Decimal,
    cause: Literal["usage_above_reservation", "operator_settlement", "reconciliation"],
) -> ev.BudgetOverrun | None:
    """The ``BudgetOverrun`` a settlement of ``actual`` against a hold of ``held`` records
    with it (the same excess :class:`Books` counts), or None if the hold covered it."""
    if actual <= held:
        return None
    return ev.BudgetOverrun(
        request_id=request_id,
        attempt_id=attempt_id,
        reservation_id=reservation_id,
        accounts=tuple(accounts),
        held_usd=held,
        actual_usd=actual,
        excess_usd=actual - held,
        cause=cause,
    )


# --- events and effects: one meaning, used when appending and when re-deriving ---

BOOK_EVENTS: Final = frozenset(
    {
        ev.BudgetReserved.type,
        ev.BudgetSettled.type,
        ev.BudgetReleased.type,
        ev.UnknownUsageOpened.type,
        ev.UnknownUsageSettled.type,
        ev.BudgetOverrun.type,
    }
)
"""The event types the books are folded from (:func:`effect_of`'s, and the overruns)."""

UNKNOWN_OWNER: Final = "unknown"
"""The owner of a hold whose event did not record one (taken for a dead gateway's)."""


def effect_of(event: ev.Event) -> Effect | None:
    """The book effect a budget event records; None for every other event. Every effect
    the ledger applies is appended with the event it is the meaning of."""
    match event:
        case ev.BudgetReserved():
            return Reserve(_hold_of(event), _specs_of(event))
        case ev.BudgetSettled():
            return Settle(event.reservation_id, event.settled_usd)
        case ev.BudgetReleased():
            return Release(event.reservation_id)
        case ev.UnknownUsageOpened():
            return HoldUnknown(event.reservation_id)
        case ev.UnknownUsageSettled():
            return SettleUnknown(event.reservation_id, event.settled_usd)
    return None


def _hold_of(event: ev.BudgetReserved) -> Hold:
    return Hold(
        reservation_id=event.reservation_id,
        request_id=event.request_id,
        attempt_id=event.attempt_id,
        workspace=event.workspace or "",
        key_id=event.key_id or "",
        endpoint=event.endpoint,
        model=event.model,
        amount_usd=event.amount_usd,
        accounts=(),
        owner=event.owner or UNKNOWN_OWNER,
    )


def _specs_of(event: ev.BudgetReserved) -> tuple[AccountSpec, ...]:
    return tuple(
        AccountSpec(
            account_id=ref.account_id,
            kind=ref.kind,
            workspace=event.workspace or "",
            key_id=None if ref.kind == "workspace" else event.key_id,
            window_start=ref.window_start,
            limit_usd=ref.limit_usd,
        )
        for ref in event.accounts
    )


@dataclass(frozen=True, slots=True)
class FoldProblem:
    """A recorded budget event that the books could not apply as recorded."""

    position: int
    event_type: str
    detail: str


def fold_books(recorded: Iterable[tuple[int, ev.Event]]) -> tuple[Books, list[FoldProblem]]:
    """The books the recorded budget events add up to, folded in position order, and
    every event that did not fit (an overrun event that disagrees with its settlement
    included). Limits are not judged again (see ``Books.enforce_limits``)."""
    books = Books(enforce_limits=False)
    problems: list[FoldProblem] = []
    recorded_overruns: dict[str, tuple[int, Decimal]] = {}
    settled_at: dict[str, int] = {}
    for position, event in recorded:
        if isinstance(event, ev.BudgetOverrun):
            _, before = recorded_overruns.get(event.reservation_id, (position, _ZERO))
            recorded_overruns[event.reservation_id] = (position, before + event.excess_usd)
            continue
        effect = effect_of(event)
        if effect is None:
            continue
        try:
            books.apply([effect])
        except (HoldStateError, ValueError) as error:
            problems.append(FoldProblem(position, type(event).type, str(error)))
        if isinstance(effect, Settle | SettleUnknown):
            settled_at[effect.reservation_id] = position
    resolved = {r.reservation_id: r.overrun_usd for r in books.resolutions}
    for reservation, (position, excess) in recorded_overruns.items():
        if resolved.get(reservation) != excess:
            problems.append(
                FoldProblem(
                    position,
                    ev.BudgetOverrun.type,
                    f"overrun of {excess} recorded for {reservation}, whose settlement "
                    f"exceeded its hold by {resolved.get(reservation, _ZERO)}",
                )
            )
    for reservation, excess in resolved.items():
        if excess > 0 and reservation not in recorded_overruns:
            problems.append(
                FoldProblem(
                    settled_at[reservation],
                    ev.BudgetOverrun.type,
                    f"{reservation} was settled {excess} above its hold with no overrun recorded",
                )
            )
    return books, problems
