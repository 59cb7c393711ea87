"""OpenAI's organization reports: usage (completions and embeddings) and costs pages.

A bucket is ``{"object": "bucket", "start_time", "end_time", "results": [...]}`` with Unix
seconds. A usage result (``organization.usage.completions.result``) counts
``input_tokens`` (cached and audio included), ``input_cached_tokens``, ``output_tokens``
(audio included), ``input_audio_tokens``, ``output_audio_tokens`` and
``num_model_requests``, grouped by what the request asked (``project_id``, ``api_key_id``,
``model``, ``user_id``, ``batch``; null when not grouped). The embeddings usage endpoint's
results (``organization.usage.embeddings.result``) count ``input_tokens`` and
``num_model_requests`` alone, by the same groups: one usage report reads both, each bucket
naming its source, since both endpoints page the same spans. A cost result
(``organization.costs.result``) has ``amount: {value, currency}`` in dollars, by
``line_item`` and ``project_id``; costs name no model.
"""

from __future__ import annotations

from typing import Any, Final

from ledger.events import Usage
from ledger.finance.provider_reports._fields import Where, amount, count, instant, items, obj, text
from ledger.finance.provider_reports._rows import Bucket, ReportRow

__all__ = [
    "COSTS_OBJECT",
    "EMBEDDINGS_USAGE_OBJECT",
    "USAGE_OBJECT",
    "costs_bucket",
    "usage_bucket",
]

USAGE_OBJECT: Final = "organization.usage.completions.result"
EMBEDDINGS_USAGE_OBJECT: Final = "organization.usage.embeddings.result"
_SOURCES: Final = {USAGE_OBJECT: "completions", EMBEDDINGS_USAGE_OBJECT: "embeddings"}
COSTS_OBJECT: Final = "organization.costs.result"


def _bucket(raw: Any, where: Where) -> tuple[dict[str, Any], Any, Any]:
    bucket = obj(raw, where)
    start = instant(bucket.get("start_time"), where.at("start_time"))
    end = instant(bucket.get("end_time"), where.at("end_time"))
    if end <= start:
        raise where.at("end_time").error("must be after start_time")
    return bucket, start, end


def _identity(result: dict[str, Any], where: Where) -> tuple[str | None, str | None]:
    return text(result, "project_id", where), text(result, "api_key_id", where)


def usage_bucket(raw: Any, where: Where) -> Bucket:
    bucket, start, end = _bucket(raw, where)
    rows = []
    sources: set[str] = set()
    for item, at in items(bucket.get("results"), where.at("results")):
        result = obj(item, at)
        kind = result.get("object")
        if kind is not None and kind not in _SOURCES:
            raise at.at("object").error(f"must be {USAGE_OBJECT} or {EMBEDDINGS_USAGE_OBJECT}")
        sources.add(_SOURCES[kind or USAGE_OBJECT])
        if len(sources) > 1:
            raise at.at("object").error("a bucket holds the results of one usage endpoint")
        input_tokens = count(result, "input_tokens", at, required=True)
        # Embeddings have no output: their results leave it out.
        output_tokens = count(result, "output_tokens", at, required=kind != EMBEDDINGS_USAGE_OBJECT)
        cached = count(result, "input_cached_tokens", at)
        if cached > input_tokens:
            raise at.at("input_cached_tokens").error("must not exceed input_tokens")
        usage = Usage(
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            cached_input_tokens=cached,
            audio_input_tokens=min(count(result, "input_audio_tokens", at), input_tokens),
            audio_output_tokens=min(count(result, "output_audio_tokens", at), output_tokens),
        )
        project_id, api_key_id = _identity(result, at)
        rows.append(
            ReportRow(
                where=_text(at),
                start=start,
                end=end,
                model=text(result, "model", at),
                usage=usage,
                requests=count(result, "num_model_requests", at),
                project_id=project_id,
                api_key_id=api_key_id,
            )
        )
    source = next(iter(sources)) if sources else None
    return Bucket(start, end, tuple(rows), where, source)


def costs_bucket(raw: Any, where: Where) -> Bucket:
    bucket, start, end = _bucket(raw, where)
    rows = []
    for item, at in items(bucket.get("results"), where.at("results")):
        result = obj(item, at)
        if result.get("object") not in (None, COSTS_OBJECT):
            raise at.at("object").error(f"must be {COSTS_OBJECT}")
        money = obj(result.get("amount"), at.at("amount"))
        currency = text(money, "currency", at.at("amount")) or "usd"
        if currency.lower() != "usd":
            raise at.at("amount").at("currency").error(f"must be usd, not {currency!r}")
        project_id, api_key_id = _identity(result, at)
        rows.append(
            ReportRow(
                where=_text(at),
                start=start,
                end=end,
                model=None,
                item=text(result, "line_item", at),
                cost_usd=amount(money.get("value"), at.at("amount").at("value")),
                project_id=project_id,
                api_key_id=api_key_id,
            )
        )
    return Bucket(start, end, tuple(rows), where)


def _text(where: Where) -> str:
    return ", ".join(p for p in (where.source, f"line {where.line}", where.path) if p)
