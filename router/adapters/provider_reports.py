"""Provider reports from the gateway's side (contract §3): what the config says an endpoint
is to its provider, the prices its usage is settled at, and fetching the reports from the
provider's admin API (``waybill reconcile fetch``).

The fetch pages with ``has_more`` / ``next_page`` and authenticates as each provider asks
(OpenAI: ``Authorization: Bearer`` with the admin key; Anthropic: ``x-api-key`` and
``anthropic-version``). An Anthropic endpoint's reports come from the Usage and Cost
Analytics API (``/v1/organizations/analytics/usage`` and ``/analytics/cost``, in beta: the
``anthropic-beta`` header names it), which Anthropic recommends over its legacy
``usage_report`` / ``cost_report``; pages of those saved earlier are still read
(``ledger.finance.provider_reports``).

A 429 is waited out as its ``Retry-After`` says, a 5xx or a broken connection retried with
backoff, each at most :data:`MAX_RETRIES` times a page and never longer than
:data:`MAX_WAIT_S` a wait; any other answer ends the fetch with the provider's own message
(both providers' error shapes are read). The admin key is sent, never shown.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final, Literal
from urllib.parse import quote

import httpx

from ledger.books.accounting import Rates
from ledger.finance.buckets import EndpointIdentity, RateBook, model_key
from ledger.finance.provider_reports import ReportFormat
from router.config import Config, Endpoint, Mapping
from router.request.worst_case import settlement_rates

__all__ = [
    "MAX_RETRIES",
    "MAX_WAIT_S",
    "FetchError",
    "FetchedReport",
    "fetch_report",
    "identities_of",
    "rates_of",
]

ReportKind = Literal["usage", "costs"]
MAX_RETRIES: Final = 5
MAX_WAIT_S: Final = 60.0
MAX_PAGES: Final = 10_000
ANTHROPIC_VERSION: Final = "2023-06-01"
ANTHROPIC_ANALYTICS_BETA: Final = "analytics-usage-cost-2026-08-24"
_TIMEOUT: Final = httpx.Timeout(30.0, connect=10.0)


def identities_of(config: Config) -> list[EndpointIdentity]:
    """Every endpoint with the provider-side ids the config gives it."""
    return [
        EndpointIdentity(
            endpoint=e.id,
            family=e.driver,
            project_id=e.provider_project_id,
            api_key_id=e.provider_api_key_id,
            workspace_id=e.provider_workspace_id,
        )
        for e in config.endpoints
    ]


class _ConfigRates:
    """The config's settlement rates of each (endpoint, model without its snapshot date): the
    first mapping of a pair gives them (the first route of a model group is tried first),
    priced with the entry of its price history in force at the instant asked about."""

    def __init__(self, config: Config) -> None:
        self._first: dict[tuple[str, str], Mapping] = {}
        for group in config.models:
            for mapping in group.mappings:
                self._first.setdefault((mapping.endpoint, model_key(mapping.model)), mapping)

    def __call__(self, endpoint: str, model: str, at: datetime) -> Rates | None:
        mapping = self._first.get((endpoint, model))
        return None if mapping is None else settlement_rates(mapping.priced_at(at))

    def fingerprint(self) -> str:
        return repr(
            sorted((key, repr(m.price), repr(m.price_history)) for key, m in self._first.items())
        )


def rates_of(config: Config) -> RateBook:
    """How a provider report's usage is priced: as the ledger priced it (``_ConfigRates``)."""
    return _ConfigRates(config)


class FetchError(Exception):
    """The provider's admin API did not give the report; the message says why."""


@dataclass(frozen=True, slots=True)
class FetchedReport:
    format: ReportFormat
    pages: list[bytes]  # each page's body as the provider sent it


def _window(since: datetime, until: datetime) -> tuple[datetime, datetime]:
    if until <= since:
        raise FetchError("--until must be after --since")
    return since.astimezone(UTC), until.astimezone(UTC)


# OpenAI's usage is reported by endpoint: chat completions and embeddings each page their
# own buckets of the same spans, and the usage report is both.
_OPENAI_USAGE_PATHS: Final = ("/organization/usage/completions", "/organization/usage/embeddings")


def _params(
    endpoint: Endpoint, kind: ReportKind, start: datetime, end: datetime
) -> tuple[tuple[str, ...], list[tuple[str, str]], ReportFormat]:
    """The report's paths (each paged on its own), query and format for this endpoint's
    provider."""
    if endpoint.driver == "openai":
        query = [
            ("start_time", str(int(start.timestamp()))),
            ("end_time", str(int(end.timestamp()))),
        ]
        paths: tuple[str, ...]
        if kind == "usage":
            paths, groups, width, limit = _OPENAI_USAGE_PATHS, ["model"], "1h", 168
            if endpoint.provider_api_key_id:
                groups.append("api_key_id")
                query.append(("api_key_ids", endpoint.provider_api_key_id))
        else:
            paths, groups, width, limit = ("/organization/costs",), ["line_item"], "1d", 31
        if endpoint.provider_project_id:
            groups.append("project_id")
            query.append(("project_ids", endpoint.provider_project_id))
        query += [("bucket_width", width), ("limit", str(limit))]
        query += [("group_by", g) for g in groups]
        return paths, query, "openai-usage" if kind == "usage" else "openai-costs"
    # The analytics API pages by row (its default page size), each row one group's figures
    # in one time bucket: hourly tokens, daily costs, grouped by model as the legacy
    # reports were (costs by model rather than by description: the analytics rows name it).
    query = [
        ("starting_at", start.strftime("%Y-%m-%dT%H:%M:%SZ")),
        ("ending_at", end.strftime("%Y-%m-%dT%H:%M:%SZ")),
    ]
    groups = ["model"]
    if kind == "usage":
        path, width = "/v1/organizations/analytics/usage", "1h"
        for key, value in (
            ("workspace_ids[]", endpoint.provider_workspace_id),
            ("api_key_ids[]", endpoint.provider_api_key_id),
        ):
            if value:
                query.append((key, value))
        if endpoint.provider_api_key_id:
            groups.append("api_key_id")
    else:
        path, width = "/v1/organizations/analytics/cost", "1d"
    if endpoint.provider_workspace_id:
        groups.append("workspace_id")
    query.append(("bucket_width", width))
    query += [("group_by[]", g) for g in groups]
    return (path,), query, "anthropic-analytics"


def _headers(endpoint: Endpoint) -> dict[str, str]:
    assert endpoint.admin_api_key is not None
    secret = endpoint.admin_api_key.get_secret_value()
    if endpoint.driver == "openai":
        return {"Authorization": f"Bearer {secret}", "Accept": "application/json"}
    return {
        "x-api-key": secret,
        "anthropic-version": ANTHROPIC_VERSION,
        "anthropic-beta": ANTHROPIC_ANALYTICS_BETA,
        "Accept": "application/json",
    }


def _proxy_url(endpoint: Endpoint) -> str | None:
    proxy = endpoint.proxy
    if proxy is None:
        return None
    userinfo = ""
    if proxy.username is not None:
        userinfo = quote(proxy.username.get_secret_value(), safe="")
        if proxy.password is not None:
            userinfo += ":" + quote(proxy.password.get_secret_value(), safe="")
        userinfo += "@"
    return f"http://{userinfo}{proxy.address}"


async def fetch_report(
    endpoint: Endpoint,
    kind: ReportKind,
    since: datetime,
    until: datetime,
    *,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    on_page: Callable[[int], None] | None = None,
) -> FetchedReport:
    """Every page of the endpoint's ``kind`` report for [since, until)."""
    if endpoint.admin_api_key is None:
        raise FetchError(
            f"endpoint {endpoint.id} has no admin_api_key: add admin_api_key: ${{env:NAME}} "
            "to it in the config"
        )
    start, end = _window(since, until)
    paths, query, report_format = _params(endpoint, kind, start, end)
    pages: list[bytes] = []
    async with httpx.AsyncClient(
        timeout=_TIMEOUT, trust_env=False, proxy=_proxy_url(endpoint), follow_redirects=False
    ) as client:
        for path in paths:
            url = endpoint.admin_url + path
            seen: set[str] = set()
            page_token: str | None = None
            while True:
                params = query + ([("page", page_token)] if page_token else [])
                body = await _get(client, url, params, _headers(endpoint), endpoint.id, sleep)
                pages.append(body)
                if on_page is not None:
                    on_page(len(pages))
                page_token = _next_page(body, len(pages))
                if page_token is None:
                    break
                if page_token in seen or len(pages) >= MAX_PAGES:
                    raise FetchError(
                        f"{endpoint.id}: the provider's pages do not end (page {len(pages)})"
                    )
                seen.add(page_token)
    return FetchedReport(report_format, pages)


def _next_page(body: bytes, number: int) -> str | None:
    try:
        page = json.loads(body)
    except ValueError:
        raise FetchError(f"page {number} is not JSON") from None
    if not isinstance(page, dict) or not isinstance(page.get("data"), list):
        raise FetchError(f"page {number} is not a report page")
    token = page.get("next_page")
    if page.get("has_more") is True:
        if not isinstance(token, str) or not token:
            raise FetchError(f"page {number} says has_more but gives no next_page")
        return token
    return None


async def _get(
    client: httpx.AsyncClient,
    url: str,
    params: list[tuple[str, str]],
    headers: dict[str, str],
    endpoint: str,
    sleep: Callable[[float], Awaitable[None]],
) -> bytes:
    for attempt in range(MAX_RETRIES + 1):
        last = attempt == MAX_RETRIES
        try:
            response = await client.get(url, params=tuple(params), headers=headers)
        except httpx.HTTPError as error:
            if last:
                raise FetchError(
                    f"{endpoint}: admin API unreachable: {type(error).__name__}"
                ) from None
            await sleep(_backoff(attempt))
            continue
        if response.status_code == 200:
            return response.content
        message = _provider_message(response)
        if response.status_code == 429 and not last:
            await sleep(_retry_after(response, attempt))
            continue
        if response.status_code >= 500 and not last:
            await sleep(_backoff(attempt))
            continue
        hint = ""
        if response.status_code in (401, 403):
            hint = " (is admin_api_key an admin key of this organization?)"
        raise FetchError(f"{endpoint}: admin API answered {response.status_code}: {message}{hint}")
    raise AssertionError("unreachable")  # pragma: no cover


def _backoff(attempt: int) -> float:
    return float(min(MAX_WAIT_S, 2**attempt))


def _retry_after(response: httpx.Response, attempt: int) -> float:
    value = (response.headers.get("retry-after") or "").strip()
    wait: float | None = None
    if value.replace(".", "", 1).isdigit():
        wait = float(value)
    elif value:
        when = email.utils.parsedate_to_datetime(value) if "," in value else None
        if when is not None:
            wait = (when - datetime.now(UTC)).total_seconds()
    if wait is None:
        wait = _backoff(attempt)
    return max(0.0, min(MAX_WAIT_S, wait))


def _provider_message(response: httpx.Response) -> str:
    """The message of OpenAI's ``{"error": {"message", "type"}}`` or Anthropic's
    ``{"type": "error", "error": {"type", "message"}}``; else the status alone."""
    try:
        body: Any = response.json()
    except ValueError:
        return response.reason_phrase or "no message"
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        kind = error.get("type") or error.get("code")
        text = str(error.get("message") or "")[:300]
        return f"{kind}: {text}" if kind else text or "no message"
    return response.reason_phrase or "no message"


def day_window(since: str, until: str) -> tuple[datetime, datetime]:
    """``--since`` / ``--until``: dates (until inclusive) or ISO 8601 instants (exclusive)."""
    return _instant(since, end=False), _instant(until, end=True)


def _instant(value: str, *, end: bool) -> datetime:
    text = value.strip()
    try:
        if len(text) == 10:
            day = datetime.fromisoformat(text).replace(tzinfo=UTC)
            return day + timedelta(days=1) if end else day
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise FetchError(f"not a date (YYYY-MM-DD) or ISO 8601 instant: {value!r}") from None
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
