"""`waybill reconcile fetch` for an Anthropic endpoint reads Anthropic's Usage and Cost
Analytics API (the fake admin API serves it over real HTTP): real traffic on an Anthropic
upstream that writes to its prompt cache, a call whose usage the gateway never learned, and
the provider's hourly rows that settle it, cache writes priced at their own price."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx

from ledger import apikeys
from ledger.events import Usage
from router.fake_provider import Behavior, FakeAdminApi
from tests.gateway.harness import Route, running_gateway
from tests.ledger.test_cli import waybill

D = Decimal
BODY: dict[str, Any] = {
    "model": "chat",
    "messages": [{"role": "user", "content": "Tell me about the weather in Paris today."}],
    "max_tokens": 100,
}
PRICE = (
    "{input_per_mtok: 1.0, output_per_mtok: 2.0, cached_input_per_mtok: 0.1, "
    "cache_write_per_mtok: 1.25, cache_write_1h_per_mtok: 2.0}"
)
GROUP = {
    "api_key_id": "apikey_east",
    "model": "fake-model",
    "service_tier": None,
    "workspace_id": "wrkspc_east",
}
# What Anthropic says the call the gateway lost really used: 5 uncached input tokens, 4
# written to the cache for 5 minutes, 4 output: $0.000018 at $1, $1.25 and $2.
LOST = {"uncached": 5, "written": 4, "output": 4}
LOST_COST = D("0.000018")


def _hour(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def _row(hour: datetime, usage: dict[str, int]) -> dict[str, Any]:
    """One analytics usage row of east's group for one hour, as Anthropic writes it."""
    return {
        "starting_at": hour.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "ending_at": (hour + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "group": GROUP,
        "usage": {
            "uncached_input_tokens": usage["uncached"],
            "cache_read_input_tokens": usage["read"],
            "cache_creation": {
                "ephemeral_5m_input_tokens": usage["written"],
                "ephemeral_1h_input_tokens": 0,
            },
            "output_tokens": usage["output"],
            "requests": usage["requests"],
            "server_tool_use": {"web_search_requests": 0},
        },
    }


def test_reconcile_fetch_reads_the_analytics_api_for_an_anthropic_endpoint(
    tmp_path: Path, sqlite_url: str
) -> None:
    config_file = tmp_path / "waybill.yaml"
    extra = (
        "    provider_workspace_id: wrkspc_east\n    provider_api_key_id: apikey_east\n"
        "    admin_api_key: ${env:ANTHROPIC_ADMIN_KEY}\n    admin_base_url: ${env:ADMIN_URL}\n"
    )

    async def traffic() -> tuple[list[tuple[datetime, Usage]], datetime, str]:
        """Two answers from east that write to its cache, then a 500 (usage unknown)
        served by west: each settled attempt on east with its hour, the lost one's hour."""
        async with running_gateway(
            sqlite_url,
            ["east", "west"],
            [Route("east", price=PRICE), Route("west", tier=1)],
            drivers={"east": "anthropic"},
            endpoint_extra={"east": extra},
            environ={"ANTHROPIC_ADMIN_KEY": "sk-ant-admin-never-shown", "ADMIN_URL": "http://x"},
            config_file=config_file,
        ) as gw:
            east = gw.upstreams["east"]
            east.set_default(Behavior.ok(cached_tokens=2, cache_write_tokens=3))
            settled: list[tuple[datetime, Usage]] = []
            async with gw.http() as http:
                for _ in range(2):
                    response = await http.post("/v1/chat/completions", json=BODY)
                    assert response.status_code == 200, response.text
                east.set_plan([Behavior.server_error()])
                lost = await http.post("/v1/chat/completions", json=BODY)
                assert lost.headers["x-waybill-endpoint"] == "west"
                lost_id = lost.headers["x-request-id"]
            endpoint_of: dict[str, str] = {}
            for event in await gw.store.read_all(limit=10_000):
                if event.type == "BudgetReserved":
                    endpoint_of[event.data["reservation_id"]] = event.data["endpoint"]
                reservation = str(event.data.get("reservation_id"))
                if event.type == "BudgetSettled" and endpoint_of[reservation] == "east":
                    usage = Usage.model_validate(event.data["usage"])
                    settled.append((_hour(event.recorded_at), usage))
            events = await gw.events(lost_id)
            opened = next(e for e in events if e.type == "UnknownUsageOpened")
            assert opened.data["endpoint"] == "east"
            return settled, _hour(opened.recorded_at), opened.data["settlement_id"]

    settled, lost_hour, settlement_id = asyncio.run(traffic())
    assert [u.cache_write_input_tokens for _, u in settled] == [3, 3]
    sums: dict[datetime, dict[str, int]] = defaultdict(
        lambda: {"uncached": 0, "read": 0, "written": 0, "output": 0, "requests": 0}
    )
    for hour, usage in settled:
        total = sums[hour]
        total["read"] += usage.cached_input_tokens
        total["written"] += usage.cache_write_input_tokens
        total["uncached"] += (
            usage.input_tokens - usage.cached_input_tokens - usage.cache_write_input_tokens
        )
        total["output"] += usage.output_tokens
        total["requests"] += 1
    lost = sums[lost_hour]
    for key, value in LOST.items():
        lost[key] += value
    lost["requests"] += 1
    rows = [_row(hour, usage) for hour, usage in sorted(sums.items())]
    other = {**rows[0], "group": {**GROUP, "workspace_id": "wrkspc_other"}}

    with FakeAdminApi(
        {"anthropic-analytics-usage": [*rows, other]},
        admin_key="sk-ant-admin-never-shown",
        page_size=1,
    ) as api:
        env = {
            "ANTHROPIC_ADMIN_KEY": "sk-ant-admin-never-shown",
            "ADMIN_URL": api.root_url,
            "FAKE_KEY": "sk-fake",
            "WAYBILL_CONFIG": str(config_file),
        }
        day = lost_hour.date()
        args = ("--since", str(day - timedelta(days=1)), "--until", str(day + timedelta(days=1)))
        fetched = waybill(
            "reconcile", "fetch", "--endpoint", "east", *args, "--json", "--save",
            str(tmp_path / "pages"), database_url=sqlite_url, env=env,
        )  # fmt: skip
        requests = api.requests
    assert fetched.returncode == 0, fetched.stderr
    report = json.loads(fetched.stdout)
    assert report["provider"] == "east" and report["format"] == "anthropic-analytics"
    assert {r.path for r in requests} == {"/v1/organizations/analytics/usage"}
    assert all(r.headers["anthropic-beta"] == "analytics-usage-cost-2026-08-24" for r in requests)
    first = dict(requests[0].params)
    assert (first["workspace_ids[]"], first["api_key_ids[]"]) == ("wrkspc_east", "apikey_east")
    assert len(requests) == len(rows)  # the other workspace's row is never sent
    assert "sk-ant-admin" not in fetched.stdout + fetched.stderr

    # The lost call is settled at what Anthropic counted, its cache writes at their price.
    (settled_bucket,) = [c for c in report["buckets"] if c["status"] == "settled_unknown"]
    assert D(settled_bucket["settled_unknown_usd"]) == LOST_COST
    assert all(c["status"] in ("matched", "settled_unknown") for c in report["buckets"])

    # The saved pages are the same report, read as anthropic-analytics by name or content.
    saved = sorted(map(str, (tmp_path / "pages").iterdir()))
    for named in ((), ("--format", "anthropic-analytics")):
        again = waybill(
            "reconcile", *saved, *named, "--provider", "east", "--json",
            database_url=sqlite_url, env=env,
        )  # fmt: skip
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout)["id"] == report["id"]
    assert settlement_id


async def test_analytics_pages_import_over_http_told_by_content_or_named(sqlite_url: str) -> None:
    # Traffic on east's workspace and key that the gateway never saw: unattributed usage.
    extra = "    provider_workspace_id: wrkspc_east\n    provider_api_key_id: apikey_east\n"
    hour = datetime(2026, 11, 30, 14, tzinfo=UTC)
    usage = {"uncached": 300, "read": 0, "written": 100, "output": 200, "requests": 2}
    body = json.dumps({"data": [_row(hour, usage)], "has_more": False, "next_page": None})
    async with running_gateway(
        sqlite_url,
        ["east"],
        [Route("east", price=PRICE)],
        drivers={"east": "anthropic"},
        endpoint_extra={"east": extra},
    ) as gw:
        admin = await apikeys.create_key(gw.store, "acme", "admin")
        finance = await apikeys.create_key(gw.store, "acme", "finance")
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            reports = []
            for query in ("?provider=east", "?provider=east&format=anthropic-analytics"):
                posted = await http.post(
                    f"/v1/reconciliations{query}",
                    content=body,
                    headers={"Authorization": f"Bearer {admin.secret}"},
                )
                assert posted.status_code == 200, posted.text
                reports.append(posted.json())
            refused = await http.post(
                "/v1/reconciliations?provider=east",
                content=body,
                headers={"Authorization": f"Bearer {finance.secret}"},
            )
    assert reports[0]["id"] == reports[1]["id"] and reports[0]["format"] == "anthropic-analytics"
    (unattributed,) = reports[0]["unattributed_provider_usage"]
    # 300 plain input at $1, 100 written for 5 minutes at $1.25, 200 output at $2.
    assert D(unattributed["usd"]) == D("0.000825")
    assert (unattributed["input_tokens"], unattributed["requests"]) == (400, 2)
    assert refused.status_code == 403
