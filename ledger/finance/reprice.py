"""Repricing (contract §6): the costs the ledger recorded against a provider's cost report,
by model and day, naming the days where they part — the mark of a price change the config
missed (or traffic around the gateway).

The ledger side is the spend read model: settled USD of the attempts reserved that day (UTC),
by upstream model. The provider side is a cost report's pages (OpenAI costs, Anthropic's cost
report or its analytics cost pages; ``ledger.finance.provider_reports``) or a plain CSV of
``day,model,cost_usd``. Models meet without their snapshot date
(``ledger.finance.buckets.model_key``). OpenAI's costs name no model: their ``line_item`` does
(``gpt-4o-mini-2024-07-18, input``), and its part before the comma is taken as the model.
Nothing is recorded: repricing is a read.
"""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date
from decimal import Decimal, InvalidOperation
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from ledger.finance.buckets import model_key
from ledger.finance.provider_reports import ExportError, detect_format, parse_report
from ledger.finance.reconcile import within_tolerance
from ledger.store.schema import all_spend_attempts
from ledger.types import money_str

__all__ = ["CostsByDay", "RepriceRow", "compare", "provider_costs", "recorded_costs"]

CostsByDay = dict[tuple[str, str], Decimal]
"""(ISO day, model without snapshot) → USD."""


@dataclass(frozen=True, slots=True)
class RepriceRow:
    day: str
    model: str
    ledger_usd: Decimal
    provider_usd: Decimal

    @property
    def parted(self) -> bool:
        return not within_tolerance(self.provider_usd, self.ledger_usd)

    def as_json(self) -> dict[str, Any]:
        return {
            "day": self.day,
            "model": self.model,
            "ledger_usd": money_str(self.ledger_usd),
            "provider_usd": money_str(self.provider_usd),
            "difference_usd": money_str(self.provider_usd - self.ledger_usd),
            "status": "parted" if self.parted else "match",
        }


def compare(recorded: CostsByDay, provider: CostsByDay) -> list[RepriceRow]:
    """One row per (day, model) either side knows, in order; a side that has nothing is 0."""
    keys = sorted(set(recorded) | set(provider))
    return [
        RepriceRow(
            day,
            model,
            recorded.get((day, model), Decimal(0)),
            provider.get((day, model), Decimal(0)),
        )
        for day, model in keys
    ]


async def recorded_costs(
    engine: AsyncEngine, since: date, until: date, endpoint: str | None = None
) -> CostsByDay:
    """Settled USD by reservation day and upstream model, ``since``..``until`` inclusive;
    only ``endpoint``'s attempts when given (a cost report of that endpoint's key alone)."""
    query = select(
        all_spend_attempts.c.day, all_spend_attempts.c.model, all_spend_attempts.c.settled_usd
    ).where(
        all_spend_attempts.c.day >= since.isoformat(), all_spend_attempts.c.day <= until.isoformat()
    )
    if endpoint is not None:
        query = query.where(all_spend_attempts.c.endpoint == endpoint)
    totals: CostsByDay = defaultdict(Decimal)
    async with engine.connect() as conn:
        for day, model, settled in (await conn.execute(query)).all():
            totals[(str(day), model_key(str(model)))] += settled
    return dict(totals)


def provider_costs(
    files: Sequence[tuple[str | None, bytes]], since: date, until: date
) -> CostsByDay:
    """A cost report's pages, or one ``day,model,cost_usd`` CSV, summed by day and model
    within ``since``..``until``; :class:`ExportError` names what cannot be read."""
    if len(files) == 1 and detect_format(files[0][1]) == "lines":
        rows = _csv_costs(files[0][1])
    else:
        report = parse_report(files)
        if report.usage:
            raise ExportError(
                f"these {report.format} pages count usage, not costs: give a cost report"
            )
        rows = [
            (r.start.date(), r.model or (r.item or "").split(",")[0], r.cost_usd or Decimal(0))
            for r in report.rows
        ]
    totals: CostsByDay = defaultdict(Decimal)
    for day, model, cost in rows:
        if since <= day <= until:
            totals[(day.isoformat(), model_key(model) or "(no model)")] += cost
    return dict(totals)


def _csv_costs(data: bytes) -> list[tuple[date, str, Decimal]]:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise ExportError("the file is not UTF-8") from None
    reader = csv.DictReader(io.StringIO(text))
    missing = {"day", "model", "cost_usd"} - set(reader.fieldnames or ())
    if missing:
        raise ExportError(f"line 1: the header lacks {', '.join(sorted(missing))}")
    rows = []
    for number, line in enumerate(reader, start=2):
        try:
            day = date.fromisoformat(line["day"].strip()[:10])
        except ValueError:
            raise ExportError(f"line {number}: day must be a date like 2026-11-30") from None
        try:
            cost = Decimal(line["cost_usd"].strip())
        except InvalidOperation:
            raise ExportError(f"line {number}: cost_usd must be a decimal amount") from None
        if not cost.is_finite():
            raise ExportError(f"line {number}: cost_usd must be a decimal amount")
        rows.append((day, line["model"].strip(), cost))
    return rows
