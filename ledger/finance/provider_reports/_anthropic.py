"""Anthropic's Admin API reports: messages usage and cost pages.

A bucket is ``{"starting_at", "ending_at", "results": [...]}`` with RFC 3339 instants. A
usage result counts ``uncached_input_tokens``, ``cache_read_input_tokens``,
``cache_creation: {ephemeral_5m_input_tokens, ephemeral_1h_input_tokens}``,
``output_tokens`` and ``server_tool_use: {web_search_requests}``, grouped by
``api_key_id``, ``workspace_id``, ``model``, ``service_tier``, ``context_window`` (null
when not grouped). In the ledger's terms, as the Anthropic driver reads a response, input
is all three kinds of input token, the cached part is the cache reads and the cache writes
are kept by lifetime (priced at the cache-write prices).

A cost result's ``amount`` is a decimal string in the currency's lowest unit: cents,
``"123.45"`` is $1.2345. It is grouped by ``workspace_id`` and ``description`` (with
``model``, ``cost_type``, ``token_type`` ... when grouped by description); the default
workspace's costs have a null ``workspace_id``.
"""

from __future__ import annotations

from typing import Any, Final

from ledger.events import Usage
from ledger.finance.provider_reports._fields import Where, amount, count, instant, items, obj, text
from ledger.finance.provider_reports._rows import Bucket, ReportRow

__all__ = ["costs_bucket", "usage_bucket"]

_CENTS: Final = 2


def _bucket(raw: Any, where: Where) -> tuple[dict[str, Any], Any, Any]:
    bucket = obj(raw, where)
    start = instant(bucket.get("starting_at"), where.at("starting_at"))
    end = instant(bucket.get("ending_at"), where.at("ending_at"))
    if end <= start:
        raise where.at("ending_at").error("must be after starting_at")
    return bucket, start, end


def _nested(result: dict[str, Any], key: str, where: Where) -> dict[str, Any]:
    value = result.get(key)
    return {} if value is None else obj(value, where.at(key))


def usage_bucket(raw: Any, where: Where) -> Bucket:
    bucket, start, end = _bucket(raw, where)
    rows = []
    for item, at in items(bucket.get("results"), where.at("results")):
        result = obj(item, at)
        creation = _nested(result, "cache_creation", at)
        tools = _nested(result, "server_tool_use", at)
        cached = count(result, "cache_read_input_tokens", at)
        written_5m = count(creation, "ephemeral_5m_input_tokens", at.at("cache_creation"))
        written_1h = count(creation, "ephemeral_1h_input_tokens", at.at("cache_creation"))
        usage = Usage(
            input_tokens=count(result, "uncached_input_tokens", at, required=True)
            + cached
            + written_5m
            + written_1h,
            output_tokens=count(result, "output_tokens", at, required=True),
            cached_input_tokens=cached,
            cache_write_input_tokens=written_5m,
            cache_write_1h_input_tokens=written_1h,
            web_searches=count(tools, "web_search_requests", at.at("server_tool_use")),
        )
        rows.append(
            ReportRow(
                where=_text(at),
                start=start,
                end=end,
                model=text(result, "model", at),
                api_key_id=text(result, "api_key_id", at),
                workspace_id=text(result, "workspace_id", at),
                usage=usage,
            )
        )
    return Bucket(start, end, tuple(rows), where)


def costs_bucket(raw: Any, where: Where) -> Bucket:
    bucket, start, end = _bucket(raw, where)
    rows = []
    for item, at in items(bucket.get("results"), where.at("results")):
        result = obj(item, at)
        currency = text(result, "currency", at) or "USD"
        if currency.upper() != "USD":
            raise at.at("currency").error(f"must be USD, not {currency!r}")
        if result.get("amount") is None:
            raise at.at("amount").error("is required")
        rows.append(
            ReportRow(
                where=_text(at),
                start=start,
                end=end,
                model=text(result, "model", at),
                workspace_id=text(result, "workspace_id", at),
                item=text(result, "description", at),
                cost_usd=amount(result.get("amount"), at.at("amount"), scale=_CENTS),
            )
        )
    return Bucket(start, end, tuple(rows), where)


def _text(where: Where) -> str:
    return ", ".join(p for p in (where.source, f"line {where.line}", where.path) if p)
