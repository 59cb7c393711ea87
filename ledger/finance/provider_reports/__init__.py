"""Providers' usage and cost reports (contract §3): saved pages read into bucket rows.

OpenAI and Anthropic export no per-request lines, only aggregates over time buckets:

- ``openai-usage``: ``GET /v1/organization/usage/completions`` pages (``object: page``,
  buckets of ``organization.usage.completions.result``), and those of
  ``/v1/organization/usage/embeddings`` (``organization.usage.embeddings.result``) beside
  them: both endpoints' buckets of one span are that span's usage;
- ``openai-costs``: ``GET /v1/organization/costs`` pages (``organization.costs.result``,
  ``amount.value`` in dollars);
- ``anthropic-usage``: ``GET /v1/organizations/usage_report/messages`` pages (buckets with
  ``starting_at`` / ``ending_at``, results with ``uncached_input_tokens`` ...);
- ``anthropic-costs``: ``GET /v1/organizations/cost_report`` pages (``amount`` a decimal
  string in cents: ``"123.45"`` is $1.2345);
- ``anthropic-analytics``: the Usage and Cost Analytics API's pages,
  ``GET /v1/organizations/analytics/usage`` or ``/analytics/cost`` (rows of
  ``starting_at`` / ``ending_at``, ``group`` and ``usage`` or ``cost``): one format for both,
  whose rows say which (``_anthropic_analytics``).

:func:`parse_report` reads the pages of one report, from one or several files, into
:class:`ReportRow`s: one per result, with its bucket, its provider-side identity
(``project_id``, ``api_key_id``, ``workspace_id``), its model, and its usage (in the
ledger's :class:`~ledger.events.Usage` terms) or its cost. The format is told by the
content unless named. Pages may overlap: a bucket saved twice with the same results counts
once; the same bucket with other results, buckets that overlap without being the same, or
pages of two formats refuse the import. Everything is all or nothing, as for usage exports.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Final, Literal, get_args

from ledger.finance.provider_reports import _anthropic, _anthropic_analytics, _openai
from ledger.finance.provider_reports._fields import Page, Where, items, read_pages
from ledger.finance.provider_reports._rows import Bucket, ReportRow
from ledger.finance.usage_export import ExportError

__all__ = [
    "REPORT_FORMATS",
    "Bucket",
    "ExportError",
    "ParsedReport",
    "ReportFormat",
    "ReportRow",
    "bucket_label",
    "detect_format",
    "family_of",
    "parse_report",
]

ReportFormat = Literal[
    "openai-usage", "openai-costs", "anthropic-usage", "anthropic-costs", "anthropic-analytics"
]
REPORT_FORMATS: Final[tuple[ReportFormat, ...]] = get_args(ReportFormat)
_TITLES: Final[dict[str, str]] = {
    "openai-usage": "OpenAI usage",
    "openai-costs": "OpenAI costs",
    "anthropic-usage": "Anthropic usage",
    "anthropic-costs": "Anthropic costs",
    "anthropic-analytics": "Anthropic analytics",
}


def family_of(report_format: ReportFormat) -> Literal["openai", "anthropic"]:
    """The driver whose endpoints a report's rows can belong to."""
    return "openai" if report_format.startswith("openai") else "anthropic"


def bucket_label(report_format: str, start: str) -> str:
    """``OpenAI usage bucket 2026-11-30T14:00Z``: how a settlement names its bucket."""
    return f"{_TITLES.get(report_format, report_format)} bucket {start}"


@dataclass(frozen=True, slots=True)
class ParsedReport:
    format: ReportFormat
    buckets: tuple[Bucket, ...]  # in time order, none overlapping
    rows: tuple[ReportRow, ...]  # every bucket's results, in time order
    # What the rows count, for a format of both (anthropic-analytics); None: as its name says.
    measure: _anthropic_analytics.Measure | None = None

    @property
    def usage(self) -> bool:
        if self.measure is not None:
            return self.measure == "usage"
        return self.format.endswith("usage")


def detect_format(data: bytes) -> ReportFormat | Literal["lines"] | None:
    """What a file holds, from its content: a report's pages (and which report, when a
    result says so), ``lines`` (a per-request export), or None (pages without results)."""
    start = data.lstrip(b"\xef\xbb\xbf \t\r\n")[:1]
    if start not in (b"{", b"["):
        return "lines"  # CSV
    # Told from the first page alone (a JSONL export may be large: it is read once, later).
    first_line = data.lstrip(b"\xef\xbb\xbf \t\r\n").split(b"\n", 1)[0]
    try:
        head = read_pages(first_line, None)
    except ExportError:
        head = []  # a page written over several lines: read it whole
    if head and not all(_is_page(p.body) for p in head):
        return "lines"
    try:
        pages = read_pages(data, None)
    except ExportError:
        return "lines"
    if not pages or not all(_is_page(p.body) for p in pages):
        return "lines"
    for page in pages:
        found = _format_of_page(page.body)
        if found is not None:
            return found
    return None


def _is_page(body: dict[str, Any]) -> bool:
    return isinstance(body.get("data"), list) and (
        "has_more" in body or body.get("object") == "page"
    )


def _format_of_page(body: dict[str, Any]) -> ReportFormat | None:
    for bucket in body.get("data") or ():
        if not isinstance(bucket, dict):
            continue
        if _anthropic_analytics.measure_of(bucket) is not None:
            return "anthropic-analytics"
        for result in bucket.get("results") or ():
            if not isinstance(result, dict):
                continue
            kind = result.get("object")
            if kind in (_openai.USAGE_OBJECT, _openai.EMBEDDINGS_USAGE_OBJECT):
                return "openai-usage"
            if kind == _openai.COSTS_OBJECT:
                return "openai-costs"
            if "uncached_input_tokens" in result:
                return "anthropic-usage"
            if "amount" in result and "starting_at" in bucket:
                return "anthropic-costs"
    return None


def parse_report(
    files: Sequence[tuple[str | None, bytes]], report_format: ReportFormat | None = None
) -> ParsedReport:
    """Every bucket of one report's pages (``(file name, bytes)`` each), or
    :class:`ExportError` at the first problem: nothing is half read."""
    pages: list[tuple[str | None, Page]] = []
    for source, data in files:
        pages.extend((source, page) for page in read_pages(data, source))
    if not pages:
        raise ExportError("the report has no pages")
    chosen = report_format or _detected(pages)
    buckets: list[Bucket] = []
    for source, page in pages:
        where = Where(source, page.line, page.path)
        if not _is_page(page.body):
            raise where.error("not a report page: it has no data array and has_more")
        found = _format_of_page(page.body)
        if found is not None and found != chosen:
            raise where.error(f"a {found} page among {chosen} pages: import one report at a time")
        if chosen != "anthropic-analytics":
            buckets.extend(_page_buckets(chosen, page.body, where))
    measure = None
    if chosen == "anthropic-analytics":
        measure = _analytics_measure(pages)
        buckets = _anthropic_analytics.buckets(pages, measure)
    merged = _merge(buckets)
    return ParsedReport(chosen, merged, tuple(row for b in merged for row in b.rows), measure)


def _analytics_measure(pages: list[tuple[str | None, Page]]) -> _anthropic_analytics.Measure:
    """Whether analytics pages are of usage or of cost: their first row says (pages with no
    row at all are of neither, and add no bucket)."""
    for _, page in pages:
        for item in page.body.get("data") or ():
            measure = _anthropic_analytics.measure_of(item)
            if measure is not None:
                return measure
    return "usage"


def _detected(pages: list[tuple[str | None, Page]]) -> ReportFormat:
    for _, page in pages:
        found = _format_of_page(page.body) if _is_page(page.body) else None
        if found is not None:
            return found
    raise ExportError(
        "cannot tell which report these pages are (no page has a result): name it with "
        "--format (or ?format=)"
    )


def _page_buckets(report_format: ReportFormat, body: dict[str, Any], where: Where) -> list[Bucket]:
    parse = {
        "openai-usage": _openai.usage_bucket,
        "openai-costs": _openai.costs_bucket,
        "anthropic-usage": _anthropic.usage_bucket,
        "anthropic-costs": _anthropic.costs_bucket,
    }[report_format]
    return [parse(bucket, at) for bucket, at in items(body.get("data"), where.at("data"))]


def _merge(buckets: list[Bucket]) -> tuple[Bucket, ...]:
    """One copy of each bucket, in time order; overlapping pages must agree. Buckets of one
    span from several sources (OpenAI's completions and embeddings usage) are one bucket
    with the results of each; an empty bucket, whose source cannot be told, adds none."""
    by_source: dict[tuple[datetime, datetime, str], Bucket] = {}
    for bucket in buckets:
        key = (bucket.start, bucket.end, bucket.source or "")
        seen = by_source.get(key)
        if seen is None:
            by_source[key] = bucket
        elif _content(seen) != _content(bucket):
            raise bucket.where.error(
                f"bucket {bucket.label} is also on {seen.where_text} with other results: "
                "import the pages of one fetch"
            )
    by_start: dict[tuple[datetime, datetime], Bucket] = {}
    for (start, end, _), bucket in sorted(by_source.items(), key=lambda item: item[0]):
        seen = by_start.get((start, end))
        if seen is None:
            by_start[(start, end)] = bucket
        elif seen.source and bucket.source and seen.source != bucket.source:
            by_start[(start, end)] = replace(seen, rows=seen.rows + bucket.rows)
        elif bucket.rows:  # an empty bucket of the span was seen first
            by_start[(start, end)] = bucket
    ordered = sorted(by_start.values(), key=lambda b: (b.start, b.end))
    for before, after in itertools.pairwise(ordered):
        if after.start < before.end:
            raise after.where.error(
                f"bucket {after.label} overlaps bucket {before.label} ({before.where_text}): "
                "import buckets of one width"
            )
    return tuple(ordered)


def _content(bucket: Bucket) -> tuple[Any, ...]:
    return tuple(sorted((_row_key(r) for r in bucket.rows), key=repr))


def _row_key(row: ReportRow) -> tuple[Any, ...]:
    plain = replace(row, where="")
    return (
        plain.model,
        plain.project_id,
        plain.api_key_id,
        plain.workspace_id,
        plain.item,
        None if plain.usage is None else plain.usage.model_dump_json(),
        plain.requests,
        plain.cost_usd,
    )
