"""Anthropic's Usage and Cost Analytics API pages (``anthropic-analytics``): the reports
Anthropic recommends over its legacy ``usage_report`` / ``cost_report``.

``GET /v1/organizations/analytics/usage`` and ``GET /v1/organizations/analytics/cost`` answer
pages of rows, not of buckets: each item of ``data`` is one row, ``{"starting_at",
"ending_at", "group", "usage" | "cost"}``, with RFC 3339 instants (the row's time bucket),
``group`` the dimension values it is broken out by (``model``, ``api_key_id``,
``workspace_id``, ``service_tier``, ...; each null unless grouped by), and

- ``usage``: ``uncached_input_tokens``, ``cache_read_input_tokens``, ``cache_creation:
  {ephemeral_5m_input_tokens, ephemeral_1h_input_tokens}``, ``output_tokens``,
  ``requests`` and ``server_tool_use: {web_search_requests}``; read as the legacy usage
  report is (input is all three kinds of input token, the cached part the cache reads, the
  writes kept by lifetime);
- ``cost``: ``amount`` (a decimal string in cents, post-discount), ``currency`` (USD).

Rows are paged by row, so one bucket's rows may span pages: they are gathered by
``(starting_at, ending_at)``. A page saved twice, or pages of overlapping fetches, repeat
rows: within a bucket a group appears once, so a row whose group was already read counts
once when it says the same, and refuses the import when it says otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from datetime import datetime
from decimal import Decimal
from typing import Any, Final, Literal

import orjson

from ledger.events import Usage
from ledger.finance.provider_reports._fields import (
    Page,
    Where,
    amount,
    count,
    instant,
    items,
    obj,
    text,
)
from ledger.finance.provider_reports._rows import Bucket, ReportRow

__all__ = ["Measure", "buckets", "measure_of"]

Measure = Literal["usage", "costs"]
_CENTS: Final = 2


def measure_of(item: Any) -> Measure | None:
    """Whether an item of a page's ``data`` is an analytics usage row, a cost row, or
    neither."""
    if not isinstance(item, dict) or "starting_at" not in item:
        return None
    if isinstance(item.get("usage"), dict) and "uncached_input_tokens" in item["usage"]:
        return "usage"
    if isinstance(item.get("cost"), dict) and "amount" in item["cost"]:
        return "costs"
    return None


def buckets(pages: Iterable[tuple[str | None, Page]], measure: Measure) -> list[Bucket]:
    """The buckets the rows of every page make, each row once (module docstring)."""
    gathered: dict[tuple[datetime, datetime], tuple[Where, dict[str, tuple[str, ReportRow]]]] = {}
    for source, page in pages:
        where = Where(source, page.line, page.path)
        for item, at in items(page.body.get("data"), where.at("data")):
            row, group = _row(item, at, measure)
            _, rows = gathered.setdefault((row.start, row.end), (at, {}))
            content = _content(row)
            seen = rows.get(group)
            if seen is None:
                rows[group] = (content, row)
            elif seen[0] != content:
                raise at.error(
                    f"the row of group {group} in bucket {row.start.isoformat()} is also on "
                    f"{seen[1].where} with other figures: import the pages of one fetch"
                )
    return [
        Bucket(start, end, tuple(row for _, row in rows.values()), where)
        for (start, end), (where, rows) in gathered.items()
    ]


def _row(item: Any, at: Where, measure: Measure) -> tuple[ReportRow, str]:
    record = obj(item, at)
    start = instant(record.get("starting_at"), at.at("starting_at"))
    end = instant(record.get("ending_at"), at.at("ending_at"))
    if end <= start:
        raise at.at("ending_at").error("must be after starting_at")
    raw_group = record.get("group")
    group = {} if raw_group is None else obj(raw_group, at.at("group"))
    found = measure_of(record)
    if found != measure:
        kind = "a usage row" if measure == "usage" else "a cost row"
        raise at.error(f"not {kind}: import the usage and the cost pages apart")
    row = ReportRow(
        where=_text(at),
        start=start,
        end=end,
        model=text(group, "model", at.at("group")),
        api_key_id=text(group, "api_key_id", at.at("group")),
        workspace_id=text(group, "workspace_id", at.at("group")),
    )
    if measure == "usage":
        usage, requests = _usage(obj(record["usage"], at.at("usage")), at.at("usage"))
        row = replace(row, usage=usage, requests=requests)
    else:
        row = replace(row, cost_usd=_cost(obj(record["cost"], at.at("cost")), at.at("cost")))
    return row, orjson.dumps(group, option=orjson.OPT_SORT_KEYS).decode()


def _usage(usage: dict[str, Any], at: Where) -> tuple[Usage, int | None]:
    creation = _nested(usage, "cache_creation", at)
    tools = _nested(usage, "server_tool_use", at)
    cached = count(usage, "cache_read_input_tokens", at)
    written_5m = count(creation, "ephemeral_5m_input_tokens", at.at("cache_creation"))
    written_1h = count(creation, "ephemeral_1h_input_tokens", at.at("cache_creation"))
    counted = Usage(
        input_tokens=count(usage, "uncached_input_tokens", at, required=True)
        + cached
        + written_5m
        + written_1h,
        output_tokens=count(usage, "output_tokens", at, required=True),
        cached_input_tokens=cached,
        cache_write_input_tokens=written_5m,
        cache_write_1h_input_tokens=written_1h,
        web_searches=count(tools, "web_search_requests", at.at("server_tool_use")),
    )
    requests = count(usage, "requests", at) if usage.get("requests") is not None else None
    return counted, requests


def _cost(cost: dict[str, Any], at: Where) -> Decimal:
    currency = text(cost, "currency", at) or "USD"
    if currency.upper() != "USD":
        raise at.at("currency").error(f"must be USD, not {currency!r}")
    if cost.get("amount") is None:
        raise at.at("amount").error("is required")
    return amount(cost.get("amount"), at.at("amount"), scale=_CENTS)


def _nested(record: dict[str, Any], key: str, where: Where) -> dict[str, Any]:
    value = record.get(key)
    return {} if value is None else obj(value, where.at(key))


def _content(row: ReportRow) -> str:
    return repr(
        (None if row.usage is None else row.usage.model_dump_json(), row.requests, row.cost_usd)
    )


def _text(where: Where) -> str:
    return ", ".join(p for p in (where.source, f"line {where.line}", where.path) if p)
