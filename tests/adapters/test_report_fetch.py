"""Fetching providers' reports from their admin APIs: the fake admin API over real HTTP,
paging, each provider's auth and error shapes, and the bounded waits (the sleep is ours)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
import yaml

from ledger.finance.provider_reports import parse_report
from router.adapters.provider_reports import (
    MAX_RETRIES,
    MAX_WAIT_S,
    FetchError,
    day_window,
    fetch_report,
)
from router.config import Endpoint, parse_config
from router.fake_provider import FakeAdminApi

KEY = "sk-admin-do-not-print"
T0 = datetime(2026, 11, 30, tzinfo=UTC)


def _endpoint(driver: str, admin_url: str, **identity: str) -> Endpoint:
    base = "https://api.invalid/v1" if driver == "openai" else "https://api.invalid"
    document = {
        "endpoints": [
            {
                "id": "e",
                "driver": driver,
                "base_url": base,
                "region": "r",
                "data_classes": ["internal"],
                "admin_api_key": "${env:ADMIN}",
                "admin_base_url": admin_url,
                **identity,
            }
        ],
        "models": [
            {
                "name": "g",
                "mappings": [
                    {
                        "endpoint": "e",
                        "model": "m",
                        "context_window": 1000,
                        "max_output_tokens": 100,
                        "price": {"input_per_mtok": 1, "output_per_mtok": 2},
                    }
                ],
            }
        ],
        "workspaces": [{"id": "w", "models": ["g"], "regions": ["r"], "data_class": "internal"}],
    }
    return parse_config(yaml.safe_dump(document), environ={"ADMIN": KEY}).endpoints[0]


def _analytics_rows(hours: int) -> list[dict[str, Any]]:
    """Rows of Anthropic's analytics usage API: one an hour, alternating workspaces."""
    return [
        {
            "starting_at": (T0 + timedelta(hours=h)).isoformat().replace("+00:00", "Z"),
            "ending_at": (T0 + timedelta(hours=h + 1)).isoformat().replace("+00:00", "Z"),
            "group": {
                "api_key_id": None,
                "model": "claude-sonnet-4-5-20250929",
                "workspace_id": "wrkspc_1" if h % 2 == 0 else "wrkspc_other",
            },
            "usage": {
                "uncached_input_tokens": 10 + h,
                "cache_read_input_tokens": 0,
                "cache_creation": {"ephemeral_5m_input_tokens": h, "ephemeral_1h_input_tokens": 0},
                "output_tokens": 5,
                "requests": 1,
                "server_tool_use": {"web_search_requests": 0},
            },
        }
        for h in range(hours)
    ]


class Sleeps:
    def __init__(self) -> None:
        self.waits: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)


async def test_anthropic_reports_are_fetched_from_the_analytics_api_with_its_headers() -> None:
    async with FakeAdminApi(
        {"anthropic-analytics-usage": _analytics_rows(5)}, admin_key=KEY, page_size=2
    ) as api:
        endpoint = _endpoint("anthropic", api.root_url, provider_workspace_id="wrkspc_1")
        pages: list[int] = []
        fetched = await fetch_report(
            endpoint, "usage", T0, T0 + timedelta(days=1), on_page=pages.append
        )
        requests = api.requests
    # Three rows of wrkspc_1, two a page.
    assert fetched.format == "anthropic-analytics" and len(fetched.pages) == 2 and pages == [1, 2]
    assert [r.path for r in requests] == ["/v1/organizations/analytics/usage"] * 2
    first = requests[0]
    assert first.headers["x-api-key"] == KEY and first.headers["anthropic-version"] == "2023-06-01"
    assert first.headers["anthropic-beta"] == "analytics-usage-cost-2026-08-24"
    assert "authorization" not in first.headers
    params = dict(first.params)
    assert params["starting_at"] == "2026-11-30T00:00:00Z"
    assert params["ending_at"] == "2026-12-01T00:00:00Z"
    assert params["workspace_ids[]"] == "wrkspc_1" and params["bucket_width"] == "1h"
    assert {v for k, v in first.params if k == "group_by[]"} == {"model", "workspace_id"}
    assert dict(requests[1].params)["page"] == "page_2"
    report = parse_report([(f"p{n}", page) for n, page in enumerate(fetched.pages)])
    assert report.format == "anthropic-analytics" and report.usage
    assert [r.workspace_id for r in report.rows] == ["wrkspc_1"] * 3
    assert [r.usage.cache_write_input_tokens for r in report.rows if r.usage] == [0, 2, 4]
    assert len(report.buckets) == 3


async def test_anthropic_costs_come_from_the_analytics_cost_endpoint_by_day() -> None:
    row = {
        "starting_at": "2026-11-30T00:00:00Z",
        "ending_at": "2026-12-01T00:00:00Z",
        "group": {"model": "claude-sonnet-4-5-20250929", "workspace_id": "wrkspc_1"},
        "cost": {"amount": "123.45", "currency": "USD"},
    }
    async with FakeAdminApi({"anthropic-analytics-costs": [row]}, admin_key=KEY) as api:
        endpoint = _endpoint("anthropic", api.root_url, provider_workspace_id="wrkspc_1")
        fetched = await fetch_report(endpoint, "costs", T0, T0 + timedelta(days=1))
        (request,) = api.requests
    assert request.path == "/v1/organizations/analytics/cost"
    assert dict(request.params)["bucket_width"] == "1d"
    report = parse_report([(None, fetched.pages[0])])
    assert not report.usage and [r.cost_usd for r in report.rows] == [Decimal("1.2345")]


async def test_a_429_is_waited_out_as_retry_after_says_and_never_longer_than_the_bound() -> None:
    async with FakeAdminApi({"openai-costs": []}, admin_key=KEY) as api:
        api.fail_next(429, retry_after="7")
        api.fail_next(429, retry_after="86400")
        api.fail_next(429)  # no Retry-After: backoff
        sleeps = Sleeps()
        endpoint = _endpoint("openai", api.base_url, provider_project_id="proj_1")
        fetched = await fetch_report(endpoint, "costs", T0, T0 + timedelta(days=2), sleep=sleeps)
        requests = api.requests
    assert sleeps.waits == [7.0, MAX_WAIT_S, 4.0]
    assert [r.status for r in requests] == [429, 429, 429, 200]
    assert requests[-1].path == "/v1/organization/costs"
    assert dict(requests[-1].params)["bucket_width"] == "1d"
    assert {v for k, v in requests[-1].params if k == "group_by"} == {"line_item", "project_id"}
    assert fetched.format == "openai-costs" and len(fetched.pages) == 1


async def test_server_errors_are_retried_a_bounded_number_of_times() -> None:
    async with FakeAdminApi({"openai-usage": []}, admin_key=KEY) as api:
        api.fail_next(500, times=MAX_RETRIES + 1)
        sleeps = Sleeps()
        endpoint = _endpoint("openai", api.base_url)
        with pytest.raises(FetchError, match="admin API answered 500: server_error"):
            await fetch_report(endpoint, "usage", T0, T0 + timedelta(days=1), sleep=sleeps)
        assert len(api.requests) == MAX_RETRIES + 1
    assert sleeps.waits == [1.0, 2.0, 4.0, 8.0, 16.0]


async def test_a_refused_key_ends_the_fetch_with_the_providers_message_never_the_key() -> None:
    async with FakeAdminApi({"anthropic-costs": []}, admin_key="another") as api:
        endpoint = _endpoint("anthropic", api.root_url)
        with pytest.raises(FetchError) as caught:
            await fetch_report(endpoint, "costs", T0, T0 + timedelta(days=1), sleep=Sleeps())
        assert len(api.requests) == 1  # a 401 is never retried
    message = str(caught.value)
    assert "401: authentication_error: invalid x-api-key" in message and KEY not in message


async def test_an_unreachable_admin_api_fails_after_its_retries() -> None:
    async with FakeAdminApi() as api:
        url = api.base_url
    sleeps = Sleeps()
    with pytest.raises(FetchError, match="admin API unreachable"):
        await fetch_report(
            _endpoint("openai", url), "usage", T0, T0 + timedelta(days=1), sleep=sleeps
        )
    assert len(sleeps.waits) == MAX_RETRIES


def test_since_and_until_are_days_until_inclusive_or_instants() -> None:
    assert day_window("2026-11-01", "2026-11-30") == (
        datetime(2026, 11, 1, tzinfo=UTC),
        datetime(2026, 12, 1, tzinfo=UTC),
    )
    assert day_window("2026-11-01T12:00:00Z", "2026-11-01T13:00:00+00:00")[1] == datetime(
        2026, 11, 1, 13, tzinfo=UTC
    )
    with pytest.raises(FetchError, match="not a date"):
        day_window("november", "2026-11-30")
