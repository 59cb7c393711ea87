"""A provider's bucket report held against the ledger (contract §3, §6): the pure core.

**Which rows are ours.** The config maps an endpoint to its provider-side identity
(``provider_project_id``, ``provider_api_key_id``, ``provider_workspace_id``). A report
*groups by* the identity keys some of its results carry. An endpoint is **covered** by a
report of its driver's provider when the report groups by at least one key the endpoint
configures (a report with no results at all covers every mapped endpoint: nothing was
billed anywhere). A result belongs to a covered endpoint when it agrees on every configured
key the report groups by. Endpoints that share results (two endpoints on one project) are
compared together, so no usage is counted twice.

**Which bucket an attempt is in.** Its start, ``reserved_at``: the reservation is recorded
atomically with ``AttemptStarted``, just before the call is sent upstream, and a provider
buckets a request by when it received it, not by when its answer ended (a stream that
crosses an hour is in the hour it began). Clocks differ by milliseconds, so an attempt
started right at a boundary may sit in the neighbouring bucket on the provider's side.

**One comparison per bucket x model x identity.** Models compare without their snapshot
date (``gpt-4o-mini-2024-07-18`` is ``gpt-4o-mini``); a report whose results name no model
(cost reports) compares every model together. The provider's side is its tokens and cost
(a usage report's tokens priced at the mapping's rates, as the ledger settles them); the
ledger's is the attempts started in the bucket: known usage and settled cost, open
unknown-usage holds. What the provider billed above the known cost is the **excess**:

- open unknown holds in the bucket and an excess: the excess is settled on them **in
  proportion to their holds** (:func:`apportion`; exact to $10^-12, the shares add up to the
  excess); above a hold it is an overrun, recorded by the settlement;
- open unknown holds and no excess: the provider shows nothing more, they are released
  (settled at 0);
- no open hold and an excess beyond the tolerance: **unattributed provider usage**
  (traffic that bypassed the gateway, a leaked key);
- attempts still in flight: nothing is settled, the bucket is reported ``in_progress``.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from fractions import Fraction
from typing import Final, Literal, Protocol

from ledger import events as ev
from ledger.books.accounting import Rates, usage_cost
from ledger.finance.provider_reports import ParsedReport, ReportRow, bucket_label, family_of
from ledger.finance.provider_reports._rows import instant_label
from ledger.types import money_str

__all__ = [
    "IDENTITY_KEYS",
    "BucketPlan",
    "BucketSettlement",
    "Coverage",
    "EndpointIdentity",
    "LedgerAttempt",
    "RateBook",
    "apportion",
    "coverage",
    "model_key",
    "reconcile_buckets",
]


class RateBook(Protocol):
    """The settlement rates of (endpoint, :func:`model_key`) in force at an instant (prices
    have history: a bucket is priced as the ledger priced the attempts that started in it),
    or None; and a fingerprint of every price it knows (a reconciliation's id depends on
    what it was priced with)."""

    def __call__(self, endpoint: str, model: str, at: datetime) -> Rates | None: ...

    def fingerprint(self) -> str: ...


Family = Literal["openai", "anthropic"]
IDENTITY_KEYS: Final = ("project_id", "api_key_id", "workspace_id")
QUANTUM: Final = Decimal("0.000000000001")
_ZERO: Final = Decimal(0)
_SNAPSHOT: Final = re.compile(r"-(\d{4}-\d{2}-\d{2}|\d{8})$")
_ALL_MODELS: Final = "*"


def model_key(model: str) -> str:
    """A model without its snapshot date: how a report's model meets the ledger's."""
    return _SNAPSHOT.sub("", model.strip())


def _within(provider: Decimal, ledger: Decimal) -> bool:
    # The rule of per-line reconciliation (ledger.finance.reconcile.within_tolerance), on totals.
    return abs(provider - ledger) <= max(Decimal("0.000001"), abs(provider) * Decimal("0.01"))


@dataclass(frozen=True, slots=True)
class EndpointIdentity:
    """An endpoint as its provider knows it (config keys ``provider_*``)."""

    endpoint: str
    family: Family
    project_id: str | None = None
    api_key_id: str | None = None
    workspace_id: str | None = None

    def configured(self) -> dict[str, str]:
        values = {k: getattr(self, k) for k in IDENTITY_KEYS}
        return {k: v for k, v in values.items() if v is not None}


@dataclass(frozen=True, slots=True)
class LedgerAttempt:
    """An attempt as bucket matching needs it (a ``spend_attempts`` row)."""

    reservation_id: str
    attempt_id: str
    endpoint: str
    model: str
    state: str  # held | settled | released | unknown | unknown_settled
    started_at: datetime  # reserved_at, UTC
    reserved_usd: Decimal
    settled_usd: Decimal = _ZERO
    held_unknown_usd: Decimal = _ZERO
    usage: ev.Usage | None = None  # known usage (settled attempts)
    settlement_id: str | None = None  # the open unknown-usage settlement, if any


@dataclass(frozen=True, slots=True)
class Coverage:
    """What a report can speak for: the endpoints it covers and its time span."""

    endpoints: frozenset[str]
    first: datetime | None  # the first bucket's start (None: no bucket)
    last: datetime | None  # the last bucket's end
    grouped_keys: frozenset[str]


@dataclass(frozen=True, slots=True)
class BucketSettlement:
    """An open unknown-usage settlement to settle at ``amount`` from a bucket."""

    attempt: LedgerAttempt
    amount: Decimal
    bucket: str  # the bucket's start label
    reason: str


@dataclass
class BucketPlan:
    comparisons: list[ev.BucketComparison] = field(default_factory=list)
    unattributed: list[ev.UnattributedUsage] = field(default_factory=list)
    settlements: list[BucketSettlement] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def coverage(report: ParsedReport, identities: Iterable[EndpointIdentity]) -> Coverage:
    family = family_of(report.format)
    grouped = frozenset(
        k for k in IDENTITY_KEYS if any(getattr(r, k) is not None for r in report.rows)
    )
    covered = frozenset(
        i.endpoint
        for i in identities
        if i.family == family
        and i.configured()
        and (not report.rows or set(i.configured()) & grouped)
    )
    first = report.buckets[0].start if report.buckets else None
    last = report.buckets[-1].end if report.buckets else None
    return Coverage(covered, first, last, grouped)


def apportion(total: Decimal, weights: Sequence[Decimal]) -> list[Decimal]:
    """``total`` split in proportion to ``weights`` (equally if they are all 0), in whole
    $10^-12: the shares add up to ``total`` exactly, each within $10^-12 of its exact
    share; the quanta left by rounding down go to the largest remainders, first come first.
    ``total`` is a non-negative amount at the ledger's precision."""
    if not weights:
        return []
    units = int(total / QUANTUM)
    if Decimal(units) * QUANTUM != total or units < 0:
        raise ValueError(f"{total} is not a non-negative amount in whole $10^-12")
    shares = [Fraction(w) for w in weights]
    whole = sum(shares, Fraction(0))
    if whole == 0:
        shares, whole = [Fraction(1)] * len(weights), Fraction(len(weights))
    exact = [units * s / whole for s in shares]
    floors = [int(x) for x in exact]  # exact >= 0: int() rounds down
    left = units - sum(floors)
    order = sorted(range(len(exact)), key=lambda i: (-(exact[i] - floors[i]), i))
    for i in order[:left]:
        floors[i] += 1
    return [Decimal(n) * QUANTUM for n in floors]


# --- the matching ---


@dataclass
class _Unit:
    start: datetime
    end: datetime
    model: str
    endpoints: tuple[str, ...]
    rows: list[ReportRow] = field(default_factory=list)
    attempts: list[LedgerAttempt] = field(default_factory=list)


class _Components:
    """Endpoints joined by the results they share (union-find)."""

    def __init__(self, endpoints: Iterable[str]) -> None:
        self._parent = {e: e for e in endpoints}

    def find(self, endpoint: str) -> str:
        while self._parent[endpoint] != endpoint:
            self._parent[endpoint] = self._parent[self._parent[endpoint]]
            endpoint = self._parent[endpoint]
        return endpoint

    def join(self, endpoints: Iterable[str]) -> None:
        roots = sorted({self.find(e) for e in endpoints})
        for root in roots[1:]:
            self._parent[root] = roots[0]

    def members(self) -> dict[str, tuple[str, ...]]:
        groups: dict[str, list[str]] = {}
        for endpoint in self._parent:
            groups.setdefault(self.find(endpoint), []).append(endpoint)
        return {root: tuple(sorted(members)) for root, members in groups.items()}


def _owners(
    row: ReportRow, covered: Sequence[EndpointIdentity], grouped: frozenset[str]
) -> set[str]:
    owners = set()
    for identity in covered:
        keys = set(identity.configured()) & grouped
        if keys and all(getattr(row, k) == identity.configured()[k] for k in keys):
            owners.add(identity.endpoint)
    return owners


def reconcile_buckets(
    report: ParsedReport,
    identities: Sequence[EndpointIdentity],
    attempts: Iterable[LedgerAttempt],
    rates: Mapping[tuple[str, str], Rates] | RateBook,
) -> BucketPlan:
    """Every bucket x model x identity compared, the settlements it calls for, and the
    usage nobody explains. ``attempts``: the ledger's attempts of the covered endpoints in
    the report's span; ``rates``: by (endpoint, :func:`model_key`) and, as a
    :data:`RateBook`, by the bucket's start, to price usage."""
    book = rates if not isinstance(rates, Mapping) else _Fixed(rates)
    scope = coverage(report, identities)
    covered = [i for i in identities if i.endpoint in scope.endpoints]
    plan = BucketPlan()
    _note_uncovered(report, identities, scope, plan)
    components = _Components(scope.endpoints)
    owned: list[tuple[ReportRow, set[str]]] = []
    for row in report.rows:
        owners = _owners(row, covered, scope.grouped_keys)
        if owners:
            components.join(owners)
            owned.append((row, owners))
    unmapped = len(report.rows) - len(owned)
    if unmapped:
        plan.notes.append(
            f"{unmapped} result(s) of the report belong to no endpoint in scope: not compared"
        )
    members = components.members()
    by_model = bool(report.rows) and all(r.model is not None for r in report.rows)
    units: dict[tuple[datetime, str, str], _Unit] = {}

    def unit(start: datetime, end: datetime, model: str, endpoint: str) -> _Unit:
        group = members[components.find(endpoint)]
        key = (start, model if by_model else _ALL_MODELS, group[0])
        found = units.get(key)
        if found is None:
            found = units[key] = _Unit(start, end, key[1], group)
        return found

    for row, owners in owned:
        unit(row.start, row.end, model_key(row.model or ""), min(owners)).rows.append(row)
    starts = [b.start for b in report.buckets]
    for attempt in attempts:
        if attempt.endpoint not in scope.endpoints:
            continue
        index = bisect.bisect_right(starts, attempt.started_at) - 1
        if index < 0 or attempt.started_at >= report.buckets[index].end:
            continue  # in no bucket of the report (a gap between pages)
        bucket = report.buckets[index]
        unit(bucket.start, bucket.end, model_key(attempt.model), attempt.endpoint).attempts.append(
            attempt
        )
    for key in sorted(units):
        _judge(report, units[key], covered, book, plan)
    return plan


def _note_uncovered(
    report: ParsedReport,
    identities: Sequence[EndpointIdentity],
    scope: Coverage,
    plan: BucketPlan,
) -> None:
    family = family_of(report.format)
    for identity in identities:
        if identity.family != family or identity.endpoint in scope.endpoints:
            continue
        if not identity.configured():
            plan.notes.append(
                f"endpoint {identity.endpoint} has no provider_* identity: not compared"
            )
        else:
            keys = ", ".join(sorted(identity.configured()))
            plan.notes.append(
                f"endpoint {identity.endpoint}: the report is not grouped by {keys}: not compared"
            )


def _sum_usage(usages: Iterable[ev.Usage]) -> ev.Usage | None:
    total: ev.Usage | None = None
    for u in usages:
        if total is None:
            total = u
            continue
        total = ev.Usage(
            input_tokens=total.input_tokens + u.input_tokens,
            output_tokens=total.output_tokens + u.output_tokens,
            cached_input_tokens=total.cached_input_tokens + u.cached_input_tokens,
            cache_write_input_tokens=total.cache_write_input_tokens + u.cache_write_input_tokens,
            cache_write_1h_input_tokens=total.cache_write_1h_input_tokens
            + u.cache_write_1h_input_tokens,
            audio_input_tokens=total.audio_input_tokens + u.audio_input_tokens,
            audio_output_tokens=total.audio_output_tokens + u.audio_output_tokens,
            web_searches=total.web_searches + u.web_searches,
        )
    return total


def _provider_usd(report: ParsedReport, unit: _Unit, rates: RateBook) -> Decimal | None:
    if not report.usage:
        return sum((r.cost_usd or _ZERO for r in unit.rows), _ZERO)
    total = _ZERO
    for row in unit.rows:
        assert row.usage is not None
        if row.model is None:
            return None
        key = model_key(row.model)
        found = next(
            (r for e in unit.endpoints if (r := rates(e, key, unit.start)) is not None), None
        )
        if found is None:
            return None
        try:
            total += usage_cost(row.usage, found)
        except ValueError:  # web searches and no price for them
            return None
    return total


def _identity(unit: _Unit, covered: Sequence[EndpointIdentity]) -> dict[str, str | None]:
    """The identity values every endpoint of the unit agrees on."""
    mine = [i for i in covered if i.endpoint in unit.endpoints]
    values: dict[str, str | None] = {}
    for k in IDENTITY_KEYS:
        seen = {getattr(i, k) for i in mine}
        values[k] = seen.pop() if len(seen) == 1 else None
    return values


@dataclass(frozen=True, slots=True)
class _Fixed:
    """Rates without history."""

    rates: Mapping[tuple[str, str], Rates]

    def __call__(self, endpoint: str, model: str, at: datetime) -> Rates | None:
        return self.rates.get((endpoint, model))

    def fingerprint(self) -> str:
        return repr(sorted((key, repr(value)) for key, value in self.rates.items()))


def _judge(
    report: ParsedReport,
    unit: _Unit,
    covered: Sequence[EndpointIdentity],
    rates: RateBook,
    plan: BucketPlan,
) -> None:
    label = instant_label(unit.start)
    where = bucket_label(report.format, label)
    provider_usage = _sum_usage(r.usage for r in unit.rows if r.usage is not None)
    if report.usage and provider_usage is None:
        provider_usage = ev.Usage(input_tokens=0, output_tokens=0)
    counted = report.format == "openai-usage" or (
        report.format == "anthropic-analytics" and report.usage
    )
    requests = sum(r.requests or 0 for r in unit.rows) if counted else None
    provider_usd = _provider_usd(report, unit, rates)
    billable = [a for a in unit.attempts if a.state != "released"]
    known = [a for a in billable if a.state in ("settled", "unknown_settled")]
    open_unknown = [a for a in billable if a.state == "unknown" and a.settlement_id is not None]
    in_flight = [
        a for a in billable if a.state == "held" or (a.state == "unknown" and not a.settlement_id)
    ]
    ledger_usage = _sum_usage(a.usage for a in known if a.usage is not None)
    ledger_usd = sum((a.settled_usd for a in known), _ZERO)
    held = sum((a.held_unknown_usd for a in open_unknown), _ZERO)
    settled_now = _ZERO
    status: ev.ReportStatus
    identity = _identity(unit, covered)
    model = None if unit.model == _ALL_MODELS else unit.model
    common = {
        "bucket": label,
        "bucket_end": instant_label(unit.end),
        "model": model,
        "endpoints": unit.endpoints,
        **identity,
    }
    if provider_usd is None:
        status = "unpriced"
        if not billable and provider_usage is not None and _tokens(provider_usage):
            status = "unattributed"
            plan.unattributed.append(
                ev.UnattributedUsage(
                    **common, **_token_excess(provider_usage, None), requests=requests
                )
            )
    elif in_flight:
        status = "in_progress"
    elif open_unknown:
        excess = provider_usd - ledger_usd
        if excess > 0:
            status = "settled_unknown"
            shares = apportion(excess, [a.held_unknown_usd for a in open_unknown])
            for attempt, share in zip(open_unknown, shares, strict=True):
                plan.settlements.append(
                    BucketSettlement(
                        attempt,
                        share,
                        label,
                        f"settled from {where} ({_what(model, unit.endpoints)}): "
                        f"${money_str(share)} of the ${money_str(excess)} billed above the "
                        f"ledger's known ${money_str(ledger_usd)}, in proportion to the "
                        f"{len(open_unknown)} unknown hold(s)",
                    )
                )
            settled_now = excess
        else:
            status = "released_unknown"
            for attempt in open_unknown:
                plan.settlements.append(
                    BucketSettlement(
                        attempt,
                        _ZERO,
                        label,
                        f"released: {where} ({_what(model, unit.endpoints)}) shows nothing "
                        f"billed above the ledger's known ${money_str(ledger_usd)}",
                    )
                )
    elif _within(provider_usd, ledger_usd):
        status = "matched"
    elif provider_usd > ledger_usd:
        status = "unattributed"
        plan.unattributed.append(
            ev.UnattributedUsage(
                **common,
                **_token_excess(provider_usage, ledger_usage),
                requests=None if requests is None else max(0, requests - len(billable)),
                usd=provider_usd - ledger_usd,
            )
        )
    else:
        status = "ledger_above_provider"
    difference = None if provider_usd is None else provider_usd - ledger_usd - settled_now
    plan.comparisons.append(
        ev.BucketComparison(
            **common,
            provider_usage=provider_usage,
            provider_requests=requests,
            provider_usd=provider_usd,
            ledger_attempts=len(billable),
            ledger_usage=ledger_usage,
            ledger_usd=ledger_usd,
            held_unknown_usd=held,
            settled_unknown_usd=settled_now,
            unknown_settlements=len(open_unknown) if status.endswith("_unknown") else 0,
            **_token_difference(provider_usage, ledger_usage),
            difference_usd=difference,
            within_tolerance=difference is not None
            and _within(provider_usd or _ZERO, ledger_usd + settled_now),
            status=status,
        )
    )


def _what(model: str | None, endpoints: tuple[str, ...]) -> str:
    on = f"endpoint {endpoints[0]}" if len(endpoints) == 1 else f"endpoints {', '.join(endpoints)}"
    return f"model {model}, {on}" if model else on


def _tokens(usage: ev.Usage) -> int:
    return usage.input_tokens + usage.output_tokens


def _token_excess(provider: ev.Usage | None, ledger: ev.Usage | None) -> dict[str, int]:
    if provider is None:
        return {}
    mine = ledger or ev.Usage(input_tokens=0, output_tokens=0)
    return {
        "input_tokens": max(0, provider.input_tokens - mine.input_tokens),
        "cached_input_tokens": max(0, provider.cached_input_tokens - mine.cached_input_tokens),
        "output_tokens": max(0, provider.output_tokens - mine.output_tokens),
    }


def _token_difference(provider: ev.Usage | None, ledger: ev.Usage | None) -> dict[str, int]:
    if provider is None:
        return {}
    mine = ledger or ev.Usage(input_tokens=0, output_tokens=0)
    return {
        "difference_input_tokens": provider.input_tokens - mine.input_tokens,
        "difference_cached_input_tokens": provider.cached_input_tokens - mine.cached_input_tokens,
        "difference_output_tokens": provider.output_tokens - mine.output_tokens,
    }
