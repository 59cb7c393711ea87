"""The rows a report's pages are read into: plain values, one per provider result."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from ledger.events import Usage
from ledger.finance.provider_reports._fields import Where

__all__ = ["Bucket", "ReportRow", "instant_label"]


def instant_label(moment: datetime) -> str:
    """``2026-11-30T14:00Z``: a bucket boundary, to the minute (to the second if it has one)."""
    pattern = "%Y-%m-%dT%H:%M:%SZ" if moment.second else "%Y-%m-%dT%H:%MZ"
    return moment.strftime(pattern)


@dataclass(frozen=True, slots=True)
class ReportRow:
    """One result of one bucket: what the provider counted for one group."""

    where: str  # "usage-1.json, line 1, data[3].results[0]": for messages
    start: datetime  # the bucket, UTC, start inclusive
    end: datetime  # end exclusive
    model: str | None  # None: the report is not grouped by model
    project_id: str | None = None  # OpenAI
    api_key_id: str | None = None
    workspace_id: str | None = None  # Anthropic
    item: str | None = None  # a cost's line_item (OpenAI) or description (Anthropic)
    usage: Usage | None = None  # usage reports
    requests: int | None = None  # OpenAI's num_model_requests
    cost_usd: Decimal | None = None  # cost reports


@dataclass(frozen=True, slots=True)
class Bucket:
    start: datetime
    end: datetime
    rows: tuple[ReportRow, ...]
    where: Where
    # Which of a report's endpoints its results came from, where a report has several for
    # one span (OpenAI's usage: "completions", "embeddings"); None: the report's one, or an
    # empty bucket, which could be any.
    source: str | None = None

    @property
    def label(self) -> str:
        return instant_label(self.start)

    @property
    def where_text(self) -> str:
        parts = [self.where.source, f"line {self.where.line}", self.where.path]
        return ", ".join(p for p in parts if p)
