"""Importing a provider's bucket report (contract §3, §6): the edge around
``ledger.finance.buckets``.

Parse every page (all or nothing), derive the reconciliation's id, return the recorded
report if there is one; otherwise catch the ``spend`` projection up, read the attempts of
the covered endpoints started in the report's span, let
:func:`ledger.finance.buckets.reconcile_buckets`
compare and plan, refuse a settlement over 1,000x its hold unless forced (before anything
is settled), settle through ``settle_unknown`` (each hold resolved once by the books,
whoever comes first), and append ``ReconciliationImported`` at ``NO_STREAM``.

The id hashes the files (their SHA-256s, sorted: the same pages in another order are the
same import), the scope, and the endpoints' identities and prices it was matched with, so a
re-import returns the recorded report and a changed mapping is another reconciliation.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from ledger import events as ev
from ledger.books.accounting import Rates, settlement_refusal
from ledger.books.settlements import SettlementError, settle_unknown
from ledger.finance.buckets import (
    BucketPlan,
    BucketSettlement,
    EndpointIdentity,
    LedgerAttempt,
    RateBook,
    coverage,
    model_key,
    reconcile_buckets,
)
from ledger.finance.provider_reports import ParsedReport, ReportFormat, parse_report
from ledger.finance.reconcile import (
    ReconcileScope,
    find_reconciliation,
    money_fields,
    record_reconciliation,
)
from ledger.finance.usage_export import ExportError
from ledger.store import EventStore
from ledger.store.schema import all_spend_attempts, unknown_settlements
from ledger.types import money_str
from ledger.views import all_projections
from ledger.views.projection import ProjectionRunner

__all__ = [
    "bucket_attempts",
    "bucket_json",
    "find_bucket",
    "import_provider_report",
    "report_files_sha256",
]

_EVERYTHING = ReconcileScope()


def report_files_sha256(files: Sequence[tuple[str | None, bytes]]) -> str:
    """One file: its SHA-256. Several: the SHA-256 of their sorted SHA-256s."""
    digests = sorted(hashlib.sha256(data).hexdigest() for _, data in files)
    if len(digests) == 1:
        return digests[0]
    return hashlib.sha256("\n".join(digests).encode()).hexdigest()


def _reconciliation_id(
    files_sha256: str,
    scope: ReconcileScope,
    identities: Sequence[EndpointIdentity],
    rates: Mapping[tuple[str, str], Rates] | RateBook,
) -> str:
    matched_with = json.dumps(
        {
            "identities": sorted(
                [i.endpoint, i.family, i.project_id, i.api_key_id, i.workspace_id]
                for i in identities
            ),
            "rates": sorted([*key, repr(value)] for key, value in rates.items())
            if isinstance(rates, Mapping)
            else rates.fingerprint(),
        },
        sort_keys=True,
    )
    key = (
        f"{files_sha256}\nworkspace={scope.workspace or '*'}\nprovider={scope.provider or '*'}"
        f"\n{hashlib.sha256(matched_with.encode()).hexdigest()}"
    )
    return "rec_" + hashlib.sha256(key.encode()).hexdigest()[:16]


async def import_provider_report(
    store: EventStore,
    files: Sequence[tuple[str | None, bytes]],
    *,
    actor: str,
    identities: Sequence[EndpointIdentity],
    rates: Mapping[tuple[str, str], Rates] | RateBook,
    scope: ReconcileScope = _EVERYTHING,
    report_format: ReportFormat | None = None,
    force: bool = False,
) -> ev.ReconciliationImported:
    """Reconcile the pages of one provider report and record the report (the recorded
    one if these pages were imported before in this scope). Raises :class:`ExportError`,
    nothing settled or recorded, for pages that cannot be read or a settlement that would
    be over 1,000x its hold unless ``force``."""
    report = await asyncio.to_thread(parse_report, files, report_format)
    files_sha256 = report_files_sha256(files)
    if scope.provider is not None:
        identities = [i for i in identities if i.endpoint == scope.provider]
    rec_id = _reconciliation_id(files_sha256, scope, identities, rates)
    recorded = await find_reconciliation(store, rec_id)
    if recorded is not None:
        return recorded
    runner = ProjectionRunner(store, all_projections())
    await runner.catch_up(runner.get("spend"))
    attempts = await _attempts(store.engine, report, identities, scope)
    plan = reconcile_buckets(report, identities, attempts, rates)
    for planned in plan.settlements:
        refusal = settlement_refusal(planned.attempt.held_unknown_usd, planned.amount, force=force)
        if refusal is not None:
            raise ExportError(refusal, field=f"bucket {planned.bucket}")
    settled, overruns = [], []
    for planned in plan.settlements:
        entry, overrun = await _settle(store, planned, rec_id, actor, force, plan)
        if entry is not None:
            settled.append(entry)
        if overrun is not None:
            overruns.append(overrun)
    event = ev.ReconciliationImported(
        reconciliation_id=rec_id,
        provider=scope.provider,
        workspace=scope.workspace,
        file_sha256=files_sha256,
        lines=len(report.rows),
        settled_unknown=tuple(settled),
        overruns=tuple(overruns),
        imported_by=actor,
        report_format=report.format,
        buckets=tuple(plan.comparisons),
        unattributed_provider_usage=tuple(plan.unattributed),
        notes=tuple(plan.notes),
    )
    return await record_reconciliation(store, event)


async def _settle(
    store: EventStore,
    planned: BucketSettlement,
    rec_id: str,
    actor: str,
    force: bool,
    plan: BucketPlan,
) -> tuple[ev.ReconciliationLine | None, ev.ReconciliationLine | None]:
    attempt = planned.attempt
    assert attempt.settlement_id is not None
    try:
        event, overrun = await settle_unknown(
            store,
            attempt.settlement_id,
            planned.amount,
            actor=actor,
            source="reconciliation",
            reason=planned.reason,
            reconciliation_id=rec_id,
            force=force,
            bucket=planned.bucket,
        )
    except SettlementError:
        # Settled since we looked (an operator, another import): reported, never settled twice.
        plan.notes.append(
            f"{attempt.settlement_id} (attempt {attempt.attempt_id}) was settled meanwhile: "
            f"bucket {planned.bucket} did not settle it again"
        )
        return None, None
    entry = ev.ReconciliationLine(
        attempt_id=attempt.attempt_id,
        detail=planned.reason,
        expected_usd=event.settled_usd,
    )
    if overrun is None:
        return entry, None
    above = ev.ReconciliationLine(
        attempt_id=attempt.attempt_id,
        detail=(
            f"{planned.reason}; ${money_str(overrun.excess_usd)} above the "
            f"${money_str(overrun.held_usd)} held: overrun recorded"
        ),
        expected_usd=event.settled_usd,
    )
    return entry, above


async def _attempts(
    engine: AsyncEngine,
    report: ParsedReport,
    identities: Sequence[EndpointIdentity],
    scope: ReconcileScope,
) -> list[LedgerAttempt]:
    """The attempts of the endpoints the report covers, started in its span."""
    span = coverage(report, identities)
    if not span.endpoints or span.first is None or span.last is None:
        return []
    query = _attempt_query(span.endpoints, span.first, span.last, scope.workspace)
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).all()
    return [_attempt(row) for row in rows]


def _attempt_query(
    endpoints: frozenset[str], first: datetime, last: datetime, workspace: str | None
) -> Any:
    c = all_spend_attempts.c
    joined = all_spend_attempts.outerjoin(
        unknown_settlements,
        (unknown_settlements.c.reservation_id == c.reservation_id)
        & (unknown_settlements.c.state == "open"),
    )
    query = (
        select(all_spend_attempts, unknown_settlements.c.settlement_id)
        .select_from(joined)
        .where(
            c.endpoint.in_(sorted(endpoints)),
            # The day narrows through the (workspace, day) index; the instant decides.
            c.day >= first.date().isoformat(),
            c.day <= (last - timedelta(microseconds=1)).date().isoformat(),
            c.reserved_at >= first,
            c.reserved_at < last,
        )
    )
    if workspace is not None:
        query = query.where(c.workspace == workspace)
    return query


def _utc(moment: datetime) -> datetime:
    # SQLite hands back naive UTC, PostgreSQL the session's zone: one form for both.
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _attempt(row: Any) -> LedgerAttempt:
    usage = None
    if row.state == "settled" and row.input_tokens is not None and row.output_tokens is not None:
        usage = ev.Usage(
            input_tokens=row.input_tokens,
            output_tokens=row.output_tokens,
            cached_input_tokens=row.cached_input_tokens or 0,
        )
    return LedgerAttempt(
        reservation_id=row.reservation_id,
        attempt_id=row.attempt_id,
        endpoint=row.endpoint,
        model=row.model,
        state=row.state,
        started_at=_utc(row.reserved_at),
        reserved_usd=Decimal(row.reserved_usd),
        settled_usd=Decimal(row.settled_usd),
        held_unknown_usd=Decimal(row.held_unknown_usd),
        usage=usage,
        settlement_id=row.settlement_id,
    )


async def bucket_attempts(
    store: EventStore, comparison: ev.BucketComparison, workspace: str | None = None
) -> list[dict[str, Any]]:
    """The attempts a recorded comparison speaks for, as they stand now: those of its
    endpoints started in its bucket (of its model, when it has one), oldest first."""
    start = _label_instant(comparison.bucket)
    end = _label_instant(comparison.bucket_end)
    query = _attempt_query(frozenset(comparison.endpoints), start, end, workspace)
    async with store.engine.connect() as conn:
        rows = (await conn.execute(query.order_by(all_spend_attempts.c.reserved_at))).all()
    found = []
    for row in rows:
        if comparison.model is not None and model_key(row.model) != comparison.model:
            continue
        found.append(
            {
                "attempt_id": row.attempt_id,
                "request_id": row.request_id,
                "endpoint": row.endpoint,
                "model": row.model,
                "workspace": row.workspace,
                "state": row.state,
                "started_at": _utc(row.reserved_at).isoformat(),
                "input_tokens": row.input_tokens,
                "cached_input_tokens": row.cached_input_tokens,
                "output_tokens": row.output_tokens,
                "reserved_usd": money_str(Decimal(row.reserved_usd)),
                "settled_usd": money_str(Decimal(row.settled_usd)),
                "held_unknown_usd": money_str(Decimal(row.held_unknown_usd)),
                "settlement_id": row.settlement_id,
            }
        )
    return found


def _label_instant(label: str) -> datetime:
    return datetime.fromisoformat(label.replace("Z", "+00:00"))


def find_bucket(
    report: ev.ReconciliationImported,
    bucket: str,
    *,
    model: str | None = None,
    endpoint: str | None = None,
) -> list[ev.BucketComparison]:
    """The comparisons of a recorded report whose bucket starts at ``bucket`` (any ISO 8601
    form of the instant), narrowed to a model and an endpoint if given."""
    try:
        moment = _label_instant(bucket.strip())
    except ValueError:
        return []
    moment = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    return [
        c
        for c in report.buckets
        if _label_instant(c.bucket) == moment
        and (model is None or c.model == model_key(model))
        and (endpoint is None or endpoint in c.endpoints)
    ]


async def bucket_json(
    store: EventStore,
    reconciliation_id: str,
    found: Sequence[ev.BucketComparison],
    workspace: str | None = None,
) -> dict[str, Any]:
    """A bucket's comparisons as the API and the CLI show them, each with its attempts."""
    comparisons = []
    for comparison in found:
        data = money_fields(comparison.model_dump(mode="json"))
        data["attempts"] = await bucket_attempts(store, comparison, workspace)
        comparisons.append(data)
    return {
        "reconciliation_id": reconciliation_id,
        "bucket": found[0].bucket,
        "comparisons": comparisons,
    }
