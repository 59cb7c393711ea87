"""Providers' report pages, read exactly: one saved page per format (tests/ledger/reports/),
detection from the content, several pages as one report, hostile pages refused whole."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from ledger.events import Usage
from ledger.finance.provider_reports import ExportError, detect_format, parse_report

D = Decimal
REPORTS = Path(__file__).parent / "reports"


def page(name: str) -> bytes:
    return (REPORTS / f"{name}.json").read_bytes()


def body(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(page(name))
    return loaded


@pytest.mark.parametrize(
    "name", ["openai-usage", "openai-costs", "anthropic-usage", "anthropic-costs"]
)
def test_each_saved_page_is_told_by_its_content(name: str) -> None:
    assert detect_format(page(name)) == name
    assert parse_report([(f"{name}.json", page(name))]).format == name


def test_a_per_request_export_is_lines() -> None:
    assert detect_format(b"attempt_id,model\natt_1,m\n") == "lines"
    assert detect_format(b'{"attempt_id": "att_1", "model": "m"}\n') == "lines"


def test_openai_usage_counts_cached_and_audio_inside_input_as_the_ledger_does() -> None:
    report = parse_report([("u.json", page("openai-usage"))])
    assert [b.start for b in report.buckets] == [
        datetime(2026, 11, 30, 14, tzinfo=UTC),
        datetime(2026, 11, 30, 15, tzinfo=UTC),
    ]
    first = report.rows[0]
    assert first.usage == Usage(input_tokens=15200, output_tokens=3100, cached_input_tokens=4096)
    assert (first.project_id, first.api_key_id, first.model, first.requests) == (
        "proj_waybill_east",
        "key_east_prod",
        "gpt-4o-mini-2024-07-18",
        12,
    )
    assert first.where == "u.json, line 1, data[0].results[0]"
    assert len(report.rows) == 2  # the second hour is empty: evidence of nothing billed


def test_openai_costs_are_dollars_read_exactly() -> None:
    report = parse_report([(None, page("openai-costs"))])
    assert [r.cost_usd for r in report.rows] == [D("0.0084"), D("0.00186"), D("0.0035")]
    assert report.rows[0].item == "gpt-4o-mini-2024-07-18, input" and report.rows[0].model is None


def test_anthropic_usage_input_is_uncached_plus_cache_reads_plus_cache_writes() -> None:
    (row,) = parse_report([(None, page("anthropic-usage"))]).rows
    assert row.usage == Usage(
        input_tokens=8200 + 6144 + 2048,
        output_tokens=2300,
        cached_input_tokens=6144,
        cache_write_input_tokens=2048,  # kept by lifetime, to be priced as cache writes
    )
    assert row.workspace_id == "wrkspc_01JwQvzr7rXLA5AGx3HKfFUJ"
    assert row.api_key_id == "apikey_01Rj2N8SVvo6BePZj99NhmiT"


def test_anthropic_cost_amounts_are_cents_as_decimal_strings() -> None:
    rows = parse_report([(None, page("anthropic-costs"))]).rows
    # "2.46" is 2.46 cents: $0.0246, exactly.
    assert [r.cost_usd for r in rows] == [D("0.0246"), D("0.0345")]


def _split(name: str) -> tuple[bytes, bytes]:
    """The page's buckets as two pages of one fetch."""
    whole = body(name)
    first = {**whole, "data": whole["data"][:1], "has_more": True, "next_page": "p2"}
    second = {**whole, "data": whole["data"][1:], "has_more": False, "next_page": None}
    return json.dumps(first).encode(), json.dumps(second).encode()


def test_pages_in_several_files_or_one_per_line_are_one_report() -> None:
    one, two = _split("openai-usage")
    whole = parse_report([("u.json", page("openai-usage"))])
    as_files = parse_report([("1.json", one), ("2.json", two)])
    as_lines = parse_report([("all.jsonl", one + b"\n" + two + b"\n")])
    as_array = parse_report([("all.json", b"[" + one + b"," + two + b"]")])
    for other in (as_files, as_lines, as_array):
        assert [(r.start, r.usage) for r in other.rows] == [(r.start, r.usage) for r in whole.rows]


def test_a_page_saved_twice_counts_once() -> None:
    once = parse_report([("a.json", page("anthropic-usage"))])
    twice = parse_report([("a.json", page("anthropic-usage")), ("b.json", page("anthropic-usage"))])
    assert [r.usage for r in twice.rows] == [r.usage for r in once.rows]
    assert len(twice.rows) == len(once.rows) == 1


def test_a_bucket_saved_twice_with_other_results_is_refused() -> None:
    changed = body("anthropic-usage")
    changed["data"][0]["results"][0]["output_tokens"] = 1
    with pytest.raises(ExportError, match=r"also on a\.json.*with other results") as caught:
        parse_report(
            [("a.json", page("anthropic-usage")), ("b.json", json.dumps(changed).encode())]
        )
    assert caught.value.source == "b.json"


def test_overlapping_buckets_of_two_widths_are_refused() -> None:
    daily = body("anthropic-usage")
    daily["data"] = [
        {
            **daily["data"][0],
            "starting_at": "2026-11-30T00:00:00Z",
            "ending_at": "2026-12-01T00:00:00Z",
        }
    ]
    with pytest.raises(ExportError, match="overlaps bucket"):
        parse_report([("h.json", page("anthropic-usage")), ("d.json", json.dumps(daily).encode())])


def test_two_formats_are_never_one_import() -> None:
    with pytest.raises(ExportError, match="a openai-costs page among openai-usage pages"):
        parse_report([("u.json", page("openai-usage")), ("c.json", page("openai-costs"))])


def test_pages_without_results_need_their_format_named() -> None:
    empty = json.dumps({"object": "page", "data": [], "has_more": False}).encode()
    assert detect_format(empty) is None
    with pytest.raises(ExportError, match="name it with --format"):
        parse_report([("e.json", empty)])
    assert parse_report([("e.json", empty)], "openai-usage").rows == ()


@pytest.mark.parametrize(
    ("edit", "field", "message"),
    [
        (lambda r: r.update(input_tokens=-1), "data[0].results[0].input_tokens", "whole number"),
        (lambda r: r.update(input_tokens="12"), "data[0].results[0].input_tokens", "whole number"),
        (
            lambda r: r.update(input_tokens=10**30),
            "data[0].results[0].input_tokens",
            "whole number",
        ),
        (lambda r: r.update(input_tokens=True), "data[0].results[0].input_tokens", "whole number"),
        (lambda r: r.pop("output_tokens"), "data[0].results[0].output_tokens", "is required"),
        (lambda r: r.update(model=["x"]), "data[0].results[0].model", "must be a string"),
        (lambda r: r.update(model="m\x00"), "data[0].results[0].model", "without NUL"),
        (
            lambda r: r.update(input_cached_tokens=10**6),
            "data[0].results[0].input_cached_tokens",
            "must not exceed input_tokens",
        ),
    ],
)
def test_a_bad_result_is_refused_naming_its_line_and_field(
    edit: Any, field: str, message: str
) -> None:
    bad = body("openai-usage")
    edit(bad["data"][0]["results"][0])
    with pytest.raises(ExportError, match=message) as caught:
        parse_report([("u.json", json.dumps(bad).encode())])
    assert (caught.value.line, caught.value.field, caught.value.source) == (1, field, "u.json")
    assert str(caught.value).startswith(f"u.json, line 1, {field}: ")


def test_hostile_pages_are_refused_never_crash() -> None:
    deep = b'{"data": ' + b"[" * 100_000 + b"]" * 100_000 + b', "has_more": false}'
    huge = b'{"object": "page", "data": [{"start_time": 1' + b"0" * 5000 + b"}]}"
    costly = body("anthropic-costs")
    costly["data"][0]["results"][0]["amount"] = "1e400"
    nan = body("openai-costs")
    nan["data"][0]["results"][0]["amount"]["value"] = "NaN"
    cases = [
        (deep, None),
        (huge, None),
        (json.dumps(costly).encode(), "data[0].results[0].amount"),
        (json.dumps(nan).encode(), "data[0].results[0].amount.value"),
        (b"\xff\xfe", None),
        (b"   ", None),
        (b'{"object": "page", "data": [{"start_time": "x"}], "has_more": false}', None),
    ]
    for data, field in cases:
        with pytest.raises(ExportError) as caught:
            parse_report([("x.json", data)], "openai-usage" if field is None else None)
        if field is not None:
            assert caught.value.field == field
    line_two = page("openai-usage").replace(b"\n", b" ") + b"\n" + b'{"broken": \n'
    with pytest.raises(ExportError, match="not valid JSON") as caught:
        parse_report([("x.jsonl", line_two)])
    assert caught.value.line == 2


def test_a_currency_other_than_usd_is_refused() -> None:
    euros = body("openai-costs")
    euros["data"][0]["results"][1]["amount"]["currency"] = "eur"
    with pytest.raises(ExportError, match="must be usd") as caught:
        parse_report([(None, json.dumps(euros).encode())])
    assert caught.value.field == "data[0].results[1].amount.currency"


# --- Anthropic's Usage and Cost Analytics API (anthropic-analytics) ---------------------------


@pytest.mark.parametrize("name", ["anthropic-analytics-usage", "anthropic-analytics-cost"])
def test_analytics_pages_are_told_by_their_rows(name: str) -> None:
    assert detect_format(page(name)) == "anthropic-analytics"
    report = parse_report([(f"{name}.json", page(name))])
    assert report.format == "anthropic-analytics"
    assert report.usage is name.endswith("usage")
    named = parse_report([(None, page(name))], "anthropic-analytics")
    assert named.rows == tuple(
        dataclasses.replace(r, where=r.where.removeprefix(f"{name}.json, ")) for r in report.rows
    )


def test_analytics_usage_rows_read_as_the_legacy_report_with_writes_by_lifetime() -> None:
    report = parse_report([(None, page("anthropic-analytics-usage"))])
    (bucket,) = report.buckets
    assert (bucket.start, bucket.end) == (
        datetime(2026, 11, 30, tzinfo=UTC),
        datetime(2026, 12, 1, tzinfo=UTC),
    )
    sonnet, haiku = report.rows
    assert sonnet.usage == Usage(
        input_tokens=8200 + 6144 + 2048 + 512,
        output_tokens=2300,
        cached_input_tokens=6144,
        cache_write_input_tokens=2048,
        cache_write_1h_input_tokens=512,
        web_searches=3,
    )
    assert (sonnet.model, sonnet.api_key_id, sonnet.workspace_id, sonnet.requests) == (
        "claude-sonnet-4-5-20250929",
        "apikey_01Rj2N8SVvo6BePZj99NhmiT",
        "wrkspc_01JwQvzr7rXLA5AGx3HKfFUJ",
        41,
    )
    assert haiku.usage is not None and haiku.usage.input_tokens == 100
    assert sonnet.where == "line 1, data[0]"


def test_analytics_cost_amounts_are_cents_per_row() -> None:
    report = parse_report([(None, page("anthropic-analytics-cost"))])
    assert not report.usage
    assert [r.cost_usd for r in report.rows] == [D("0.0246"), D("0.0345")]
    assert {r.model for r in report.rows} == {"claude-sonnet-4-5-20250929"}


def test_analytics_rows_of_one_bucket_on_two_pages_are_one_bucket_and_repeats_count_once() -> None:
    data = body("anthropic-analytics-usage")
    first = {**data, "data": data["data"][:1], "has_more": True, "next_page": "p2"}
    second = {**data, "data": data["data"][1:]}
    pages = [(None, json.dumps(first).encode()), (None, json.dumps(second).encode())]
    (bucket,) = parse_report(pages).buckets
    assert len(bucket.rows) == 2
    again = parse_report([*pages, (None, page("anthropic-analytics-usage"))])
    assert again.rows == parse_report(pages).rows
    other = json.loads(json.dumps(first))
    other["data"][0]["usage"]["output_tokens"] = 1
    with pytest.raises(ExportError, match="other figures"):
        parse_report([*pages, (None, json.dumps(other).encode())])


def test_analytics_usage_and_cost_pages_are_never_one_import() -> None:
    with pytest.raises(ExportError, match="usage and the cost pages apart"):
        parse_report(
            [(None, page("anthropic-analytics-usage")), (None, page("anthropic-analytics-cost"))]
        )
    with pytest.raises(ExportError, match="one report at a time"):
        parse_report([(None, page("anthropic-analytics-usage")), (None, page("anthropic-usage"))])


def test_a_bad_analytics_row_is_refused_naming_its_field() -> None:
    data = body("anthropic-analytics-usage")
    data["data"][1]["usage"]["output_tokens"] = -1
    with pytest.raises(ExportError) as caught:
        parse_report([(None, json.dumps(data).encode())])
    assert caught.value.field == "data[1].usage.output_tokens"
    cost = body("anthropic-analytics-cost")
    cost["data"][0]["cost"]["currency"] = "EUR"
    with pytest.raises(ExportError, match="must be USD"):
        parse_report([(None, json.dumps(cost).encode())])


def _embeddings_page(*buckets: dict[str, Any]) -> bytes:
    return json.dumps({"object": "page", "data": list(buckets), "has_more": False}).encode()


def _embeddings_bucket(start: int, *tokens: int) -> dict[str, Any]:
    results = [
        {
            "object": "organization.usage.embeddings.result",
            "input_tokens": n,
            "num_model_requests": 1,
            "project_id": "proj_waybill_east",
            "api_key_id": "key_east_prod",
            "model": "text-embedding-3-small",
        }
        for n in tokens
    ]
    return {"object": "bucket", "start_time": start, "end_time": start + 3600, "results": results}


def test_embeddings_usage_pages_are_openai_usage_read_as_input_only() -> None:
    start = int(datetime(2026, 11, 30, 14, tzinfo=UTC).timestamp())
    data = _embeddings_page(_embeddings_bucket(start, 700))
    assert detect_format(data) == "openai-usage"
    (row,) = parse_report([("e.json", data)]).rows
    assert row.usage == Usage(input_tokens=700, output_tokens=0)
    assert row.model == "text-embedding-3-small" and row.requests == 1


def test_the_completions_and_embeddings_buckets_of_one_hour_are_one_bucket() -> None:
    # The saved completions page: results at 14:00, an empty 15:00.
    completions = page("openai-usage")
    first = int(datetime(2026, 11, 30, 14, tzinfo=UTC).timestamp())
    embeddings = _embeddings_page(
        _embeddings_bucket(first, 700), _embeddings_bucket(first + 3600, 50)
    )
    whole = parse_report([("c.json", completions), ("e.json", embeddings)])
    assert [(b.start.hour, len(b.rows)) for b in whole.buckets] == [(14, 3), (15, 1)]
    models = [r.model for r in whole.buckets[0].rows]
    assert "text-embedding-3-small" in models and "gpt-4o-mini-2024-07-18" in models
    # In either order, and with an empty embeddings hour beside a full completions one.
    reversed_ = parse_report([("e.json", embeddings), ("c.json", completions)])
    assert [len(b.rows) for b in reversed_.buckets] == [3, 1]
    empty = _embeddings_page(_embeddings_bucket(first))
    assert len(parse_report([("c.json", completions), ("e.json", empty)]).rows) == 2


def test_one_endpoints_bucket_saved_twice_with_other_results_is_still_refused() -> None:
    start = int(datetime(2026, 11, 30, 14, tzinfo=UTC).timestamp())
    one = _embeddings_page(_embeddings_bucket(start, 700))
    other = _embeddings_page(_embeddings_bucket(start, 701))
    with pytest.raises(ExportError, match="with other results"):
        parse_report([("a.json", one), ("b.json", other)])


def test_a_bucket_mixing_both_endpoints_results_is_refused() -> None:
    mixed = body("openai-usage")
    start = mixed["data"][0]["start_time"]
    mixed["data"][0]["results"] += _embeddings_bucket(start, 5)["results"]
    with pytest.raises(ExportError, match="one usage endpoint"):
        parse_report([("m.json", json.dumps(mixed).encode())])
