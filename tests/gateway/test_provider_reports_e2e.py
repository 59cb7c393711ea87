"""Provider reports end to end: real gateway traffic, the usage page the provider would
report for it (with traffic the gateway never saw), imported over HTTP, fetched by the CLI
from the fake admin API, and explained."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from ledger import apikeys
from ledger.store.schema import spend_attempts
from ledger.views import all_projections
from ledger.views.projection import ProjectionRunner
from router.fake_provider import Behavior, FakeAdminApi
from tests.gateway.harness import Gateway, Route, running_gateway
from tests.ledger.test_cli import waybill

D = Decimal
BODY: dict[str, Any] = {
    "model": "chat",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 100,
}
IDENTITIES = {
    "east": "    provider_project_id: proj_east\n    provider_api_key_id: key_east\n",
    "west": "    provider_project_id: proj_west\n",
}
# What the provider says the call it could not answer really used: $0.000017 at $1/$2.
UNKNOWN_TOKENS = (9, 4)
UNKNOWN_COST = D("0.000017")
# Traffic on east's key the gateway never saw, an hour before: $0.0007.
BYPASS_TOKENS = (300, 200)


@dataclass
class Traffic:
    rows: list[Any]  # spend_attempts rows, oldest first
    unknown: Any  # the attempt whose usage is unknown
    unknown_request: str


def _hour(moment: datetime) -> datetime:
    moment = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    return moment.replace(minute=0, second=0, microsecond=0)


async def _traffic(gw: Gateway, http: httpx.AsyncClient) -> Traffic:
    """Three successes on east, then a 500 on east (unknown usage) served by west."""
    request_ids = []
    for _ in range(3):
        response = await http.post("/v1/chat/completions", json=BODY)
        assert response.status_code == 200, response.text
        request_ids.append(response.headers["x-request-id"])
    gw.upstreams["east"].set_plan([Behavior.server_error()])
    response = await http.post("/v1/chat/completions", json=BODY)
    assert response.status_code == 200 and response.headers["x-waybill-endpoint"] == "west"
    request_ids.append(response.headers["x-request-id"])
    for request_id in request_ids:
        await gw.wait_for_types(request_id, "RequestCompleted")
    runner = ProjectionRunner(gw.store, all_projections())
    await runner.catch_up(runner.get("spend"))
    async with gw.store.engine.connect() as conn:
        rows = (
            await conn.execute(sa.select(spend_attempts).order_by(spend_attempts.c.reserved_at))
        ).all()
    (unknown,) = [r for r in rows if r.state == "unknown"]
    return Traffic(list(rows), unknown, request_ids[3])


def usage_buckets(traffic: Traffic) -> list[dict[str, Any]]:
    """The OpenAI usage report of the traffic, hour by hour, grouped by project, key and
    model: each attempt at the tokens the provider billed, and the bypass an hour before."""
    sums: dict[tuple[datetime, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    for row in traffic.rows:
        tokens = (
            UNKNOWN_TOKENS
            if row.attempt_id == traffic.unknown.attempt_id
            else (row.input_tokens, row.output_tokens)
        )
        total = sums[(_hour(row.reserved_at), row.endpoint)]
        total[0] += tokens[0]
        total[1] += tokens[1]
        total[2] += 1
    first = min(hour for hour, _ in sums)
    sums[(first - timedelta(hours=1), "east")] = [*BYPASS_TOKENS, 2]
    hours = sorted({hour for hour, _ in sums})
    buckets = []
    for hour in [*hours, hours[-1] + timedelta(hours=1)]:  # and an empty hour after
        results = [
            {
                "object": "organization.usage.completions.result",
                "input_tokens": i,
                "output_tokens": o,
                "input_cached_tokens": 0,
                "input_audio_tokens": 0,
                "output_audio_tokens": 0,
                "num_model_requests": n,
                "project_id": f"proj_{endpoint}",
                "user_id": None,
                "api_key_id": "key_east" if endpoint == "east" else None,
                "model": "fake-model-2026-01-15",
                "batch": False,
            }
            for (h, endpoint), (i, o, n) in sorted(sums.items())
            if h == hour
        ]
        buckets.append(
            {
                "object": "bucket",
                "start_time": int(hour.timestamp()),
                "end_time": int((hour + timedelta(hours=1)).timestamp()),
                "results": results,
            }
        )
    return buckets


def page(buckets: list[dict[str, Any]]) -> bytes:
    return json.dumps(
        {"object": "page", "data": buckets, "has_more": False, "next_page": None}
    ).encode()


def _client(gw: Gateway, secret: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=gw.url, headers={"Authorization": f"Bearer {secret}"}, timeout=30
    )


async def test_a_usage_page_settles_the_unknown_from_its_bucket_and_finds_the_bypass(
    database_url: str,
) -> None:
    async with running_gateway(
        database_url,
        ["east", "west"],
        [Route("east", tier=0), Route("west", tier=1)],
        endpoint_extra=IDENTITIES,
    ) as gw:
        admin = await apikeys.create_key(gw.store, "acme", "admin")
        finance = await apikeys.create_key(gw.store, "acme", "finance")
        async with gw.http() as http:
            traffic = await _traffic(gw, http)
        report_page = page(usage_buckets(traffic))
        async with _client(gw, finance.secret) as http:
            refused = await http.post("/v1/reconciliations", content=report_page)
            assert refused.status_code == 403
            assert "admin key" in refused.json()["error"]["message"]
        async with _client(gw, admin.secret) as http:
            posted = await http.post(
                "/v1/reconciliations",
                content=report_page,
                headers={"content-type": "application/json"},
            )
            assert posted.status_code == 200, posted.text
            report = posted.json()
            assert report["format"] == "openai-usage"
            statuses = {(c["bucket"], tuple(c["endpoints"])): c for c in report["buckets"]}
            unknown_hour = _hour(traffic.unknown.reserved_at).strftime("%Y-%m-%dT%H:%MZ")
            settled = statuses[(unknown_hour, ("east",))]
            assert settled["status"] == "settled_unknown" and settled["model"] == "fake-model"
            assert D(settled["settled_unknown_usd"]) == UNKNOWN_COST
            assert settled["within_tolerance"] and D(settled["difference_usd"]) == 0
            assert settled["api_key_id"] == "key_east" and settled["project_id"] == "proj_east"
            west = [c for c in report["buckets"] if c["endpoints"] == ["west"]]
            assert west and all(c["status"] == "matched" for c in west)
            (bypass,) = report["unattributed_provider_usage"]
            assert (bypass["input_tokens"], bypass["output_tokens"]) == BYPASS_TOKENS
            assert D(bypass["usd"]) == D("0.0007") and bypass["requests"] == 2
            assert bypass["endpoints"] == ["east"] and bypass["project_id"] == "proj_east"
            (entry,) = report["settled_unknown"]
            assert entry["attempt_id"] == traffic.unknown.attempt_id
            assert entry["detail"].startswith(f"settled from OpenAI usage bucket {unknown_hour}")

            # The settlement names the reconciliation and the bucket; explain says so.
            (event,) = [
                e
                for e in await gw.events(traffic.unknown_request)
                if e.type == "UnknownUsageSettled"
            ]
            assert event.data["reconciliation_id"] == report["id"]
            assert event.data["bucket"] == unknown_hour
            assert D(event.data["settled_usd"]) == UNKNOWN_COST
            explained = await http.get(
                f"/v1/requests/{traffic.unknown_request}/explain?format=text"
            )
            assert f"settled from OpenAI usage bucket {unknown_hour}" in explained.text

            # Drill down: the attempts of east in that bucket.
            drill = await http.get(
                f"/v1/reconciliations/{report['id']}/buckets/{unknown_hour}?endpoint=east"
            )
            assert drill.status_code == 200, drill.text
            (comparison,) = drill.json()["comparisons"]
            ids = {a["attempt_id"] for a in comparison["attempts"]}
            assert traffic.unknown.attempt_id in ids
            assert {a["endpoint"] for a in comparison["attempts"]} == {"east"}
            missing = await http.get(
                f"/v1/reconciliations/{report['id']}/buckets/1999-01-01T00:00Z"
            )
            assert missing.status_code == 404

            # Idempotent: the same page again returns the recorded report, appends nothing.
            head = await gw.store.head()
            again = await http.post("/v1/reconciliations", content=report_page)
            assert again.status_code == 200 and again.json() == report
            assert await gw.store.head() == head
            read = await http.get(f"/v1/reconciliations/{report['id']}")
            assert read.json() == report
        async with _client(gw, finance.secret) as http:
            hidden = await http.get(f"/v1/reconciliations/{report['id']}/buckets/{unknown_hour}")
            assert hidden.status_code == 404


async def test_an_hour_the_provider_billed_nothing_releases_the_unknown(sqlite_url: str) -> None:
    async with running_gateway(
        sqlite_url,
        ["east", "west"],
        [Route("east", tier=0), Route("west", tier=1)],
        endpoint_extra=IDENTITIES,
    ) as gw:
        admin = await apikeys.create_key(gw.store, "acme", "admin")
        async with gw.http() as http:
            traffic = await _traffic(gw, http)
        buckets = usage_buckets(traffic)
        unknown_hour = int(_hour(traffic.unknown.reserved_at).timestamp())
        (bucket,) = [b for b in buckets if b["start_time"] == unknown_hour]
        (east,) = [r for r in bucket["results"] if r["project_id"] == "proj_east"]
        # The provider never billed the failed call.
        east["input_tokens"] -= UNKNOWN_TOKENS[0]
        east["output_tokens"] -= UNKNOWN_TOKENS[1]
        async with _client(gw, admin.secret) as http:
            posted = await http.post("/v1/reconciliations?provider=east", content=page(buckets))
            assert posted.status_code == 200, posted.text
            report = posted.json()
        assert report["provider"] == "east"
        assert {c["endpoints"][0] for c in report["buckets"]} == {"east"}
        (released,) = [c for c in report["buckets"] if c["status"] == "released_unknown"]
        assert D(released["settled_unknown_usd"]) == 0
        (event,) = [
            e for e in await gw.events(traffic.unknown_request) if e.type == "UnknownUsageSettled"
        ]
        assert D(event.data["settled_usd"]) == 0
        assert D(event.data["released_usd"]) == traffic.unknown.reserved_usd
        assert event.data["reason"].startswith("released: OpenAI usage bucket")


def test_reconcile_fetch_pages_through_the_admin_api_then_reconciles(
    tmp_path: Path, sqlite_url: str
) -> None:
    config_file = tmp_path / "waybill.yaml"

    async def traffic() -> Traffic:
        async with (
            running_gateway(
                sqlite_url,
                ["east", "west"],
                [Route("east", tier=0), Route("west", tier=1)],
                endpoint_extra={
                    "east": IDENTITIES["east"]
                    + "    admin_api_key: ${env:OPENAI_ADMIN_KEY}\n"
                    + "    admin_base_url: ${env:ADMIN_URL}\n",
                    "west": IDENTITIES["west"],
                },
                environ={
                    "OPENAI_ADMIN_KEY": "sk-admin-secret-never-shown",
                    "ADMIN_URL": "http://x",
                },
                config_file=config_file,
            ) as gw,
            gw.http() as http,
        ):
            return await _traffic(gw, http)

    seen = asyncio.run(traffic())
    buckets = usage_buckets(seen)
    with FakeAdminApi(
        {"openai-usage": buckets}, admin_key="sk-admin-secret-never-shown", page_size=1
    ) as api:
        api.fail_next(429, retry_after="0")
        env = {
            "OPENAI_ADMIN_KEY": "sk-admin-secret-never-shown",
            "ADMIN_URL": api.base_url,
            "FAKE_KEY": "sk-fake",
            "WAYBILL_CONFIG": str(config_file),
        }
        day = _hour(seen.rows[0].reserved_at).date()
        args = ("--since", str(day - timedelta(days=1)), "--until", str(day + timedelta(days=1)))
        fetched = waybill(
            "reconcile", "fetch", "--endpoint", "east", *args, "--json", "--save",
            str(tmp_path / "pages"), database_url=sqlite_url, env=env,
        )  # fmt: skip
        assert fetched.returncode == 0, fetched.stderr
        report = json.loads(fetched.stdout)
        requests = api.requests
    assert report["provider"] == "east" and report["format"] == "openai-usage"
    assert len(report["unattributed_provider_usage"]) == 1
    assert [c["status"] for c in report["buckets"]].count("settled_unknown") == 1
    # One page a bucket, the first answered 429 once and asked again, then the embeddings
    # usage (one empty page); the key sent as OpenAI wants it, the report grouped and
    # filtered by east's identity.
    assert [r.status for r in requests] == [429] + [200] * (len(buckets) + 1)
    assert {r.path for r in requests[:-1]} == {"/v1/organization/usage/completions"}
    assert requests[-1].path == "/v1/organization/usage/embeddings"
    assert requests[-1].params == requests[1].params
    assert all(r.headers["authorization"] == "Bearer sk-admin-secret-never-shown" for r in requests)
    first = dict(requests[1].params)
    assert first["bucket_width"] == "1h" and first["project_ids"] == "proj_east"
    assert {v for k, v in requests[1].params if k == "group_by"} == {
        "model",
        "api_key_id",
        "project_id",
    }
    assert [dict(r.params).get("page") for r in requests[1:3]] == [None, "page_1"]
    assert "sk-admin-secret" not in fetched.stdout + fetched.stderr
    saved = sorted((tmp_path / "pages").iterdir())
    assert len(saved) == len(buckets) + 1

    # The saved pages are the same report: importing them gives the recorded one back.
    again = waybill(
        "reconcile", *map(str, saved), "--provider", "east", "--json",
        database_url=sqlite_url, env={"WAYBILL_CONFIG": str(config_file), **env},
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["id"] == report["id"]

    table = waybill("reconcile", "show", report["id"], database_url=sqlite_url)
    assert table.returncode == 0, table.stderr
    assert "settled_unknown" in table.stdout and "unattributed_provider_usage" in table.stdout
    as_csv = waybill("reconcile", "show", report["id"], "--output", "csv", database_url=sqlite_url)
    lines = as_csv.stdout.strip().splitlines()
    assert lines[0].startswith("bucket,bucket_end,model,endpoints,project_id")
    assert len(lines) == 1 + len(report["buckets"])
    bucket = next(c["bucket"] for c in report["buckets"] if c["status"] == "settled_unknown")
    drill = waybill(
        "reconcile", "show", report["id"], "--bucket", bucket, "--json", database_url=sqlite_url
    )
    assert drill.returncode == 0, drill.stderr
    attempts = json.loads(drill.stdout)["comparisons"][0]["attempts"]
    assert seen.unknown.attempt_id in {a["attempt_id"] for a in attempts}

    with FakeAdminApi({"openai-usage": buckets}, admin_key="another-key") as api:
        env["ADMIN_URL"] = api.base_url
        refused = waybill(
            "reconcile", "fetch", "--endpoint", "east", *args, database_url=sqlite_url, env=env
        )
    assert refused.returncode == 1
    assert "admin API answered 401: invalid_request_error: Incorrect API key" in refused.stderr
    assert "sk-admin-secret" not in refused.stdout + refused.stderr
    no_key = waybill(
        "reconcile", "fetch", "--endpoint", "west", *args, database_url=sqlite_url, env=env
    )
    assert no_key.returncode == 1 and "west has no admin_api_key" in no_key.stderr


async def test_a_hostile_report_page_is_refused_whole_naming_its_field(sqlite_url: str) -> None:
    async with running_gateway(
        sqlite_url, ["east"], [Route("east")], endpoint_extra={"east": IDENTITIES["east"]}
    ) as gw:
        admin = await apikeys.create_key(gw.store, "acme", "admin")
        head = await gw.store.head()
        bad = {
            "object": "page",
            "data": [
                {
                    "object": "bucket",
                    "start_time": 1796047200,
                    "end_time": 1796050800,
                    "results": [
                        {
                            "object": "organization.usage.completions.result",
                            "input_tokens": 10**30,
                            "output_tokens": 1,
                            "project_id": "proj_east",
                        }
                    ],
                }
            ],
            "has_more": False,
        }
        deep = b'{"object": "page", "data": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
        async with _client(gw, admin.secret) as http:
            refused = await http.post(
                "/v1/reconciliations?format=openai-usage",
                content=json.dumps(bad).encode(),
            )
            assert refused.status_code == 400
            error = refused.json()["error"]
            assert error["param"] == "data[0].results[0].input_tokens"
            assert error["message"].startswith("line 1, data[0].results[0].input_tokens: must be")
            nested = await http.post("/v1/reconciliations?format=openai-usage", content=deep)
            assert nested.status_code == 400 and "nested too deeply" in nested.text
            unknown = await http.post("/v1/reconciliations?format=xls", content=b"{}")
            assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "format"
        assert await gw.store.head() == head
