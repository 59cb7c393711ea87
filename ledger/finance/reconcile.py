"""Reconciliation (contract §3, §6): a provider's usage export held against the ledger.

Each line of the export (``ledger.finance.usage_export``) is matched to an attempt of the spend read
model — by ``attempt_id`` (the id Waybill sends upstream as ``X-Waybill-Attempt-Id``), else
by ``provider_request_id`` against the attempt's recorded upstream request id, else against
its response id — and lands in exactly one list of the report:

- ``matched``: an attempt whose cost the ledger knows, and the provider agrees within
  :func:`within_tolerance`;
- ``amount_mismatches``: the same, beyond the tolerance (both amounts are reported); a
  provider that bills an attempt the ledger released as not started lands here too;
- ``settled_unknown``: the attempt's hold was an open unknown-usage settlement; the line
  settles it (``UnknownUsageSettled``, source ``reconciliation``), posting the provider's
  cost and releasing what is left of the hold. A cost above the hold is settled all the
  same, as an overrun (``BudgetOverrun``): that line goes to ``amount_mismatches`` (the
  hold and the cost) and is listed in ``overruns`` too. A cost over 1,000x its hold
  refuses the whole import before anything is settled, unless it is forced;
- ``unmatched_provider_lines``: no attempt in the caller's scope (another workspace's
  attempt is never revealed: it reads exactly like no attempt), an attempt still in flight,
  or a second line for an attempt already billed;
- ``unmatched_attempts``: attempts of the reconciled workspace and endpoints, reserved in
  the export's time window, that the provider may have billed (usage known or unknown) but
  no line names.

The report is recorded as ``ReconciliationImported`` on ``reconciliation-<id>``, the id
derived from the file's bytes and the scope. Importing the same file again returns the
recorded report and changes nothing; two imports racing are decided by the stream's
expected version (NO_STREAM), and each unknown-usage settlement is resolved exactly once by
the books whoever gets there first.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Final, Literal, TypeAlias

from sqlalchemy import Select, and_, select
from sqlalchemy.ext.asyncio import AsyncEngine

from ledger import events as ev
from ledger.books.accounting import reservation_id, settlement_refusal
from ledger.books.settlements import SettlementError, settle_unknown
from ledger.finance.usage_export import ExportError, ExportFormat, ProviderLine, parse_export
from ledger.store import NO_STREAM, EventStore, WrongExpectedVersion, decode_row
from ledger.store.schema import all_spend_attempts, appends, unknown_settlements
from ledger.store.stored import holding, previous_hash
from ledger.types import money_str
from ledger.views import all_projections
from ledger.views.projection import ProjectionRunner

__all__ = [
    "AttemptRecord",
    "Classification",
    "ExportError",
    "ReconcileScope",
    "RecordedReport",
    "Settlement",
    "classify",
    "find_reconciliation",
    "import_reconciliation",
    "is_reconciliation_id",
    "judge",
    "list_reconciliations",
    "money_fields",
    "reconciliation_id",
    "record_reconciliation",
    "report_json",
    "unmatched_attempts",
    "within_tolerance",
]

TOLERANCE_FLOOR: Final = Decimal("0.000001")
TOLERANCE_SHARE: Final = Decimal("0.01")
# States of a hold the upstream may have billed: usage known, or unknown (settled or not).
BILLABLE_STATES: Final = ("settled", "unknown", "unknown_settled")
_CHUNK: Final = 500
_ZERO: Final = Decimal(0)

Progress = Callable[[int, int], None]
"""Called with (lines looked up and settled so far, total)."""

Category: TypeAlias = Literal[
    "matched", "settled_unknown", "amount_mismatches", "unmatched_provider_lines", "overruns"
]
Outcome: TypeAlias = tuple[Category, ev.ReconciliationLine]


def within_tolerance(provider_usd: Decimal, ledger_usd: Decimal) -> bool:
    """|provider − ledger| ≤ max(0.000001, 1% of provider): rounding, not a discrepancy."""
    return abs(provider_usd - ledger_usd) <= max(TOLERANCE_FLOOR, provider_usd * TOLERANCE_SHARE)


@dataclass(frozen=True, slots=True)
class ReconcileScope:
    """What one import reconciles. None leaves a field unnarrowed."""

    workspace: str | None = None  # a finance key: its own workspace; an admin: every one
    provider: str | None = None  # an endpoint id: only that endpoint's attempts


def reconciliation_id(file_sha256: str, scope: ReconcileScope) -> str:
    """``rec_`` + 16 hex of sha256(file, scope): the same file in the same scope is the same
    reconciliation; a narrower scope is another one (it sees, and settles, less)."""
    key = f"{file_sha256}\nworkspace={scope.workspace or '*'}\nprovider={scope.provider or '*'}"
    return "rec_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def is_reconciliation_id(value: str) -> bool:
    suffix = value.removeprefix("rec_")
    return (
        value.startswith("rec_")
        and len(suffix) == 16
        and all(c in "0123456789abcdef" for c in suffix)
    )


@dataclass(frozen=True, slots=True)
class AttemptRecord:
    """An attempt's hold as matching needs it (a ``spend_attempts`` row)."""

    reservation_id: str
    request_id: str
    attempt_id: str
    endpoint: str
    model: str
    state: str  # held | settled | released | unknown | unknown_settled
    reserved_usd: Decimal
    settled_usd: Decimal
    held_unknown_usd: Decimal
    reserved_at: datetime
    upstream_request_id: str | None = None
    response_id: str | None = None
    settlement_id: str | None = None  # the open unknown-usage settlement of an unknown hold
    settled_by: str | None = None  # unknown_settled: the reconciliation that did it, if any


@dataclass(frozen=True, slots=True)
class Settlement:
    """An open unknown-usage settlement that a line settles."""

    line: ProviderLine
    attempt: AttemptRecord
    via: str


@dataclass
class Classification:
    matched: list[ev.ReconciliationLine] = field(default_factory=list)
    settled_unknown: list[ev.ReconciliationLine] = field(default_factory=list)
    amount_mismatches: list[ev.ReconciliationLine] = field(default_factory=list)
    unmatched_provider_lines: list[ev.ReconciliationLine] = field(default_factory=list)
    overruns: list[ev.ReconciliationLine] = field(default_factory=list)
    to_settle: list[Settlement] = field(default_factory=list)
    matched_reservations: set[str] = field(default_factory=set)

    def add(self, outcome: Outcome | list[Outcome]) -> None:
        for category, entry in outcome if isinstance(outcome, list) else [outcome]:
            getattr(self, category).append(entry)


# --- matching and judging: pure ---


class _Index:
    def __init__(self, attempts: Iterable[AttemptRecord]) -> None:
        self.by_attempt: dict[str, AttemptRecord] = {}
        self.by_upstream: dict[str, list[AttemptRecord]] = {}
        self.by_response: dict[str, list[AttemptRecord]] = {}
        for a in attempts:
            self.by_attempt[a.attempt_id] = a
            if a.upstream_request_id:
                self.by_upstream.setdefault(a.upstream_request_id, []).append(a)
            if a.response_id:
                self.by_response.setdefault(a.response_id, []).append(a)

    def find(self, line: ProviderLine) -> tuple[AttemptRecord, str] | str:
        """The attempt and how it was found, or why none was."""
        if line.attempt_id and (found := self.by_attempt.get(line.attempt_id)):
            return found, "attempt_id"
        pid = line.provider_request_id
        if pid:
            for via, index in (
                ("provider_request_id", self.by_upstream),
                ("response_id", self.by_response),
            ):
                candidates = index.get(pid, [])
                if len(candidates) == 1:
                    return candidates[0], via
                if candidates:
                    endpoints = ", ".join(sorted({a.endpoint for a in candidates}))
                    return (
                        f"provider_request_id matches {len(candidates)} attempts "
                        f"(endpoints {endpoints}): reconcile one provider at a time"
                    )
        return "no attempt with this attempt_id or provider_request_id"


def _entry(
    line: ProviderLine | None,
    attempt: AttemptRecord | None,
    detail: str,
    expected: Decimal | None = None,
) -> ev.ReconciliationLine:
    return ev.ReconciliationLine(
        line=line.line if line else None,
        attempt_id=attempt.attempt_id if attempt else (line.attempt_id if line else None),
        provider_request_id=(line.provider_request_id if line else None)
        or (attempt.upstream_request_id if attempt else None),
        detail=detail,
        expected_usd=expected,
        provider_usd=line.cost_usd if line else None,
    )


def _compare(line: ProviderLine, attempt: AttemptRecord, ledger_usd: Decimal, note: str) -> Outcome:
    if within_tolerance(line.cost_usd, ledger_usd):
        return "matched", _entry(line, attempt, note, ledger_usd)
    detail = f"{note}; provider billed {money_str(line.cost_usd)}, ledger {money_str(ledger_usd)}"
    return "amount_mismatches", _entry(line, attempt, detail, ledger_usd)


def _settled_detail(via: str, held: Decimal, settled: Decimal) -> str:
    if settled > held:
        return (
            f"by {via}; unknown usage settled at the provider's {money_str(settled)}, "
            f"{money_str(settled - held)} above the {money_str(held)} held: overrun recorded"
        )
    return (
        f"by {via}; unknown usage settled at {money_str(settled)} of {money_str(held)} held, "
        f"{money_str(held - settled)} released"
    )


def _settled_outcomes(
    line: ProviderLine, attempt: AttemptRecord, via: str, settled: Decimal
) -> list[Outcome]:
    """Where a line that settled an unknown hold at ``settled`` is reported: above the
    hold, as a mismatch (the hold and the provider's cost) and an overrun."""
    held = attempt.reserved_usd
    detail = _settled_detail(via, held, settled)
    if settled <= held:
        return [("settled_unknown", _entry(line, attempt, detail, settled))]
    entry = _entry(line, attempt, detail, held)
    return [("amount_mismatches", entry), ("overruns", entry)]


def judge(
    line: ProviderLine, attempt: AttemptRecord, via: str, reconciliation: str
) -> Outcome | list[Outcome] | Settlement:
    """Where one matched line belongs, or the settlement it makes."""
    note = f"by {via}"
    if line.model != attempt.model:
        note += f" (provider model {line.model}, ledger {attempt.model})"
    match attempt.state:
        case "settled":
            return _compare(line, attempt, attempt.settled_usd, note)
        case "released":
            return _compare(line, attempt, _ZERO, f"{note}; released as not started")
        case "unknown" if attempt.settlement_id is not None:
            return Settlement(line, attempt, via)
        case "unknown_settled" if attempt.settled_by == reconciliation:
            return _settled_outcomes(line, attempt, via, attempt.settled_usd)
        case "unknown_settled":
            return _compare(
                line, attempt, attempt.settled_usd, f"{note}; unknown usage settled before"
            )
    return "unmatched_provider_lines", _entry(
        line, attempt, f"{note}; the attempt is still in progress (hold {attempt.state})"
    )


def classify(
    lines: Sequence[ProviderLine], attempts: Iterable[AttemptRecord], reconciliation: str
) -> Classification:
    """Every line in one list of the report, or a settlement still to make."""
    index = _Index(attempts)
    result = Classification()
    first_line: dict[str, int] = {}
    for line in lines:
        found = index.find(line)
        if isinstance(found, str):
            result.add(("unmatched_provider_lines", _entry(line, None, found)))
            continue
        attempt, via = found
        billed_on = first_line.get(attempt.reservation_id)
        if billed_on is not None:
            detail = f"by {via}; the attempt was already billed on line {billed_on}"
            result.add(("unmatched_provider_lines", _entry(line, attempt, detail)))
            continue
        first_line[attempt.reservation_id] = line.line
        result.matched_reservations.add(attempt.reservation_id)
        outcome = judge(line, attempt, via, reconciliation)
        if isinstance(outcome, Settlement):
            result.to_settle.append(outcome)
        else:
            result.add(outcome)
    return result


def unmatched_attempts(
    attempts: Iterable[AttemptRecord], matched_reservations: set[str]
) -> list[ev.ReconciliationLine]:
    """Billable attempts (of the window and scope) that no line named."""
    missing = sorted(
        (
            a
            for a in attempts
            if a.state in BILLABLE_STATES and a.reservation_id not in matched_reservations
        ),
        key=lambda a: (a.reserved_at, a.attempt_id),
    )
    return [
        _entry(
            None,
            a,
            f"{a.state} on {a.endpoint}, reserved {a.reserved_at.isoformat()}: "
            "no line of the export",
            a.held_unknown_usd if a.state == "unknown" else a.settled_usd,
        )
        for a in missing
    ]


# --- the import: reads, settlements, the recorded report ---


async def import_reconciliation(
    store: EventStore,
    data: bytes,
    *,
    actor: str,
    scope: ReconcileScope = ReconcileScope(),
    export_format: ExportFormat | None = None,
    progress: Progress | None = None,
    force: bool = False,
) -> ev.ReconciliationImported:
    """Reconcile an export and record the report; the recorded one if it was imported
    before. Raises :class:`ExportError` (nothing recorded, nothing settled) for a file that
    cannot be read, or that would settle a hold at more than 1,000x its amount unless
    ``force``."""
    # Reading a large export is CPU work: off the event loop, which serves requests.
    lines = await asyncio.to_thread(parse_export, data, export_format)
    file_sha256 = hashlib.sha256(data).hexdigest()
    rec_id = reconciliation_id(file_sha256, scope)
    recorded = await find_reconciliation(store, rec_id)
    if recorded is not None:
        return recorded
    # The spend view is a read model: bring it up to the ledger's head before matching.
    runner = ProjectionRunner(store, all_projections())
    await runner.catch_up(runner.get("spend"))
    total = len(lines)
    done = 0

    def advance(step: int) -> None:
        nonlocal done
        done += step
        if progress is not None:
            progress(done, total)

    candidates = await _candidates(store.engine, lines, scope, advance)
    plan = classify(lines, candidates, rec_id)
    for settlement in plan.to_settle:
        refusal = settlement_refusal(
            settlement.attempt.reserved_usd, settlement.line.cost_usd, force=force
        )
        if refusal is not None:
            raise ExportError(refusal, line=settlement.line.line, field="cost_usd")
    total += len(plan.to_settle)
    for settlement in plan.to_settle:
        plan.add(await _settle(store, settlement, rec_id, actor, force))
        advance(1)
    first = min(line.timestamp for line in lines)
    last = max(line.timestamp for line in lines)
    in_window = await _attempts(store.engine, _window_query(first, last, scope))
    event = ev.ReconciliationImported(
        reconciliation_id=rec_id,
        provider=scope.provider,
        workspace=scope.workspace,
        file_sha256=file_sha256,
        lines=len(lines),
        # Settlements are judged last: each list is put back in the file's order.
        matched=_in_file_order(plan.matched),
        settled_unknown=_in_file_order(plan.settled_unknown),
        amount_mismatches=_in_file_order(plan.amount_mismatches),
        unmatched_provider_lines=_in_file_order(plan.unmatched_provider_lines),
        unmatched_attempts=tuple(unmatched_attempts(in_window, plan.matched_reservations)),
        overruns=_in_file_order(plan.overruns),
        imported_by=actor,
    )
    return await record_reconciliation(store, event)


async def record_reconciliation(
    store: EventStore, event: ev.ReconciliationImported
) -> ev.ReconciliationImported:
    """Record a report once: the same input imported at the same moment by two callers
    ends with the first report recorded, which both return."""
    try:
        await store.append(f"reconciliation-{event.reconciliation_id}", NO_STREAM, [event])
    except WrongExpectedVersion:
        recorded = await find_reconciliation(store, event.reconciliation_id)
        if recorded is None:  # pragma: no cover - the stream exists: the append said so
            raise
        return recorded
    return event


async def find_reconciliation(
    store: EventStore, reconciliation: str
) -> ev.ReconciliationImported | None:
    if not is_reconciliation_id(reconciliation):
        return None
    for recorded in await store.read_stream(f"reconciliation-{reconciliation}"):
        event = recorded.event()
        if isinstance(event, ev.ReconciliationImported):
            return event
    return None


@dataclass(frozen=True, slots=True)
class RecordedReport:
    """A recorded reconciliation, as a list shows it."""

    position: int
    recorded_at: datetime
    report: ev.ReconciliationImported


async def list_reconciliations(
    engine: AsyncEngine, *, workspace: str | None, limit: int, before: int | None = None
) -> list[RecordedReport]:
    """Recorded reconciliations, newest first, ``limit`` of them before ledger position
    ``before``: those of ``workspace`` only (a finance key's), or every one (None, an
    admin's). Read from the appends that hold a report, newest first."""
    a = appends.c
    query = (
        select(a.position, previous_hash(), a.payloads)
        .where(holding(ev.ReconciliationImported.type))
        .order_by(a.position.desc())
    )
    if before is not None:
        query = query.where(a.position < before)
    found: list[RecordedReport] = []
    async with engine.connect() as conn:
        for row in await conn.execute(query):
            for recorded in decode_row(row.position, row.previous, row.payloads):
                event = recorded.event()
                if not isinstance(event, ev.ReconciliationImported):
                    continue
                if workspace is not None and event.workspace != workspace:
                    continue
                found.append(RecordedReport(recorded.position, recorded.recorded_at, event))
            if len(found) >= limit:
                break
    return found[:limit]


def report_json(event: ev.ReconciliationImported) -> dict[str, Any]:
    """The report in the API's shape (contract §3); money as decimal strings."""

    def entries(items: tuple[ev.ReconciliationLine, ...]) -> list[dict[str, Any]]:
        return [
            {
                "line": e.line,
                "attempt_id": e.attempt_id,
                "provider_request_id": e.provider_request_id,
                "detail": e.detail,
                "expected_usd": None if e.expected_usd is None else money_str(e.expected_usd),
                "provider_usd": None if e.provider_usd is None else money_str(e.provider_usd),
            }
            for e in items
        ]

    return {
        "id": event.reconciliation_id,
        "provider": event.provider,
        "workspace": event.workspace,
        "file_sha256": event.file_sha256,
        "lines": event.lines,
        "imported_by": event.imported_by,
        "matched": entries(event.matched),
        "settled_unknown": entries(event.settled_unknown),
        "amount_mismatches": entries(event.amount_mismatches),
        "unmatched_provider_lines": entries(event.unmatched_provider_lines),
        "unmatched_attempts": entries(event.unmatched_attempts),
        "overruns": entries(event.overruns),
        "format": event.report_format,
        "buckets": [money_fields(b.model_dump(mode="json")) for b in event.buckets],
        "unattributed_provider_usage": [
            money_fields(u.model_dump(mode="json")) for u in event.unattributed_provider_usage
        ],
        "notes": list(event.notes),
    }


def money_fields(record: dict[str, Any]) -> dict[str, Any]:
    """Amounts as every report writes them (``money_str``): six places at least."""
    return {
        k: money_str(Decimal(v)) if (k.endswith("_usd") or k == "usd") and v is not None else v
        for k, v in record.items()
    }


def _in_file_order(entries: list[ev.ReconciliationLine]) -> tuple[ev.ReconciliationLine, ...]:
    return tuple(sorted(entries, key=lambda e: e.line or 0))


async def _settle(
    store: EventStore, settlement: Settlement, rec_id: str, actor: str, force: bool
) -> Outcome | list[Outcome]:
    line, attempt = settlement.line, settlement.attempt
    assert attempt.settlement_id is not None
    try:
        event, _ = await settle_unknown(
            store,
            attempt.settlement_id,
            line.cost_usd,
            actor=actor,
            source="reconciliation",
            reconciliation_id=rec_id,
            usage=line.usage,
            force=force,
        )
    except SettlementError:
        # Settled since we looked: by an operator, or by a racing import of this very file.
        # Either way it is reported as it now stands, never settled twice.
        found = await _settled_events(store.engine, [attempt])
        settled = found.get(attempt.reservation_id)
        if settled is None:
            raise
        now = replace(
            attempt,
            state="unknown_settled",
            settled_usd=settled.settled_usd,
            settled_by=settled.reconciliation_id,
        )
        outcome = judge(line, now, settlement.via, rec_id)
        assert not isinstance(outcome, Settlement)
        return outcome
    return _settled_outcomes(line, attempt, settlement.via, event.settled_usd)


_COLUMNS: Final = (
    all_spend_attempts,
    unknown_settlements.c.settlement_id,
)


def _scoped(query: Select[Any], scope: ReconcileScope) -> Select[Any]:
    if scope.workspace is not None:
        query = query.where(all_spend_attempts.c.workspace == scope.workspace)
    if scope.provider is not None:
        query = query.where(all_spend_attempts.c.endpoint == scope.provider)
    return query


def _base_query(scope: ReconcileScope) -> Select[Any]:
    joined = all_spend_attempts.outerjoin(
        unknown_settlements,
        and_(
            unknown_settlements.c.reservation_id == all_spend_attempts.c.reservation_id,
            unknown_settlements.c.state == "open",
        ),
    )
    return _scoped(select(*_COLUMNS).select_from(joined), scope)


def _window_query(first: datetime, last: datetime, scope: ReconcileScope) -> Select[Any]:
    c = all_spend_attempts.c
    return _base_query(scope).where(
        c.state.in_(BILLABLE_STATES),
        # The day narrows through the (workspace, day) index; the instant decides.
        c.day >= first.date().isoformat(),
        c.day <= last.date().isoformat(),
        c.reserved_at >= first,
        c.reserved_at <= last,
    )


async def _candidates(
    engine: AsyncEngine,
    lines: Sequence[ProviderLine],
    scope: ReconcileScope,
    advance: Callable[[int], None],
) -> list[AttemptRecord]:
    """Every attempt in scope that some line could name, looked up a chunk at a time."""
    c = all_spend_attempts.c
    found: dict[str, AttemptRecord] = {}
    for start in range(0, len(lines), _CHUNK):
        chunk = lines[start : start + _CHUNK]
        attempt_ids = sorted({line.attempt_id for line in chunk if line.attempt_id})
        request_ids = sorted(
            {line.provider_request_id for line in chunk if line.provider_request_id}
        )
        queries = []
        if attempt_ids:
            # A hold's row is keyed by its attempt's reservation id (ledger.views.spend):
            # found by the primary key, with no index of attempt ids to keep.
            holds = sorted({reservation_id(a) for a in attempt_ids})
            queries.append(
                _base_query(scope).where(c.reservation_id.in_(holds), c.attempt_id.in_(attempt_ids))
            )
        if request_ids:
            queries.append(_base_query(scope).where(c.upstream_request_id.in_(request_ids)))
            queries.append(_base_query(scope).where(c.response_id.in_(request_ids)))
        for query in queries:
            for attempt in await _attempts(engine, query):
                found[attempt.reservation_id] = attempt
        advance(len(chunk))
    settled = await _settled_events(
        engine, [a for a in found.values() if a.state == "unknown_settled"]
    )
    return [
        replace(a, settled_by=settled[a.reservation_id].reconciliation_id)
        if a.reservation_id in settled
        else a
        for a in found.values()
    ]


async def _attempts(engine: AsyncEngine, query: Select[Any]) -> list[AttemptRecord]:
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).all()
    return [
        AttemptRecord(
            reservation_id=r.reservation_id,
            request_id=r.request_id,
            attempt_id=r.attempt_id,
            endpoint=r.endpoint,
            model=r.model,
            state=r.state,
            reserved_usd=r.reserved_usd,
            settled_usd=r.settled_usd,
            held_unknown_usd=r.held_unknown_usd,
            reserved_at=_utc(r.reserved_at),
            upstream_request_id=r.upstream_request_id,
            response_id=r.response_id,
            settlement_id=r.settlement_id,
        )
        for r in rows
    ]


async def _settled_events(
    engine: AsyncEngine, attempts: Sequence[AttemptRecord]
) -> dict[str, ev.UnknownUsageSettled]:
    """The ``UnknownUsageSettled`` of each of ``attempts``' holds, by reservation id."""
    wanted = {a.reservation_id for a in attempts}
    streams = sorted({f"request-{a.request_id}" for a in attempts})
    found: dict[str, ev.UnknownUsageSettled] = {}
    for start in range(0, len(streams), _CHUNK):
        query = select(appends.c.position, previous_hash(), appends.c.payloads).where(
            appends.c.stream_id.in_(streams[start : start + _CHUNK]),
            holding(ev.UnknownUsageSettled.type),
        )
        async with engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        for row in rows:
            for recorded in decode_row(row.position, row.previous, row.payloads):
                if recorded.type != ev.UnknownUsageSettled.type:
                    continue
                event = recorded.event()
                if isinstance(event, ev.UnknownUsageSettled) and event.reservation_id in wanted:
                    found[event.reservation_id] = event
    return found


def _utc(moment: datetime) -> datetime:
    # SQLite hands back naive UTC, PostgreSQL the session's zone: one form for both.
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
