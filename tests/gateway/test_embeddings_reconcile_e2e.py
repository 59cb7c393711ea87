"""Embeddings on the books against OpenAI's usage report (contract §3 "Reconciliation"): the
report's embeddings endpoint pages beside its completions pages, one ``openai-usage``
report, settle the unknown usage of an embeddings attempt; and spend groups it by its
door (``group_by=api``)."""

from __future__ import annotations

import json
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import httpx
import sqlalchemy as sa

from ledger import apikeys
from ledger.store.schema import spend_attempts
from ledger.views import all_projections
from ledger.views.projection import ProjectionRunner
from router.fake_provider import Behavior
from tests.gateway.harness import Gateway, Route, running_gateway
from tests.helpers import eventually

D = Decimal
EMBED = {"model": "embed", "input": ["hello", "world"], "encoding_format": "float"}
CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
IDENTITY = "    provider_project_id: proj_east\n"
UNKNOWN_TOKENS = 9  # what the provider says the embeddings call it failed really used


def hour_of(moment: datetime) -> datetime:
    moment = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    return moment.replace(minute=0, second=0, microsecond=0)


def report_page(buckets: list[dict[str, Any]]) -> bytes:
    page = {"object": "page", "data": buckets, "has_more": False, "next_page": None}
    return json.dumps(page).encode()


def bucket(hour: datetime, results: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "object": "bucket",
        "start_time": int(hour.timestamp()),
        "end_time": int((hour + timedelta(hours=1)).timestamp()),
        "results": results,
    }


async def spend_rows(gw: Gateway) -> list[Any]:
    runner = ProjectionRunner(gw.store, all_projections())
    await runner.catch_up(runner.get("spend"))
    async with gw.store.engine.connect() as conn:
        query = sa.select(spend_attempts).order_by(spend_attempts.c.reserved_at)
        return list((await conn.execute(query)).all())


async def test_an_embeddings_unknown_is_settled_from_the_usage_reports_embeddings_pages(
    database_url: str,
) -> None:
    embed = Route(
        "east",
        model="fake-embed",
        capabilities=("embeddings",),
        context_window=8191,
        max_output_tokens=1,
        price="{input_per_mtok: 1.0, output_per_mtok: 0}",
    )
    async with running_gateway(
        database_url,
        ["east"],
        [Route("east")],
        embedding_routes=[embed],
        endpoint_extra={"east": IDENTITY},
    ) as gw:
        admin = await apikeys.create_key(gw.store, "acme", "admin")
        async with gw.http() as http:
            ok = await http.post("/v1/embeddings", json=EMBED)
            assert ok.status_code == 200, ok.text
            chatted = await http.post("/v1/chat/completions", json=CHAT)
            assert chatted.status_code == 200, chatted.text
            gw.upstreams["east"].set_plan([Behavior.server_error()])
            failed = await http.post("/v1/embeddings", json=EMBED)
            assert failed.status_code == 503, failed.text
            unknown_request = failed.headers["x-request-id"]
            await gw.wait_for_types(unknown_request, "RequestFailed")
            await gw.wait_for_types(chatted.headers["x-request-id"], "RequestCompleted")

            async def both_doors() -> bool:  # the spend read model follows the ledger
                by_api = await http.get("/v1/spend?group_by=api")
                assert by_api.status_code == 200, by_api.text
                apis = {row["api"] for row in by_api.json()["data"]}
                return apis == {"openai.embeddings", "openai.chat_completions"}

            await eventually(both_doors)

        rows = await spend_rows(gw)
        (unknown,) = [r for r in rows if r.state == "unknown"]
        # The provider's usage, by endpoint: the chat on the completions pages, the
        # embeddings (the unknown at what it really used) on the embeddings pages.
        sums: dict[tuple[datetime, str], list[int]] = defaultdict(lambda: [0, 0, 0])
        for row in rows:
            kind = "chat" if row.model == "fake-model" else "embeddings"
            tokens = UNKNOWN_TOKENS if row.attempt_id == unknown.attempt_id else row.input_tokens
            total = sums[(hour_of(row.reserved_at), kind)]
            total[0] += tokens
            total[1] += row.output_tokens or 0
            total[2] += 1
        hours = sorted({hour for hour, _ in sums})
        completions = [
            bucket(
                hour,
                [
                    {
                        "object": "organization.usage.completions.result",
                        "input_tokens": i,
                        "output_tokens": o,
                        "num_model_requests": n,
                        "project_id": "proj_east",
                        "model": "fake-model",
                    }
                    for (h, kind), (i, o, n) in sums.items()
                    if h == hour and kind == "chat"
                ],
            )
            for hour in hours
        ]
        embeddings = [
            bucket(
                hour,
                [
                    {
                        "object": "organization.usage.embeddings.result",
                        "input_tokens": i,
                        "num_model_requests": n,
                        "project_id": "proj_east",
                        "model": "fake-embed",
                    }
                    for (h, kind), (i, _, n) in sums.items()
                    if h == hour and kind == "embeddings"
                ],
            )
            for hour in hours
        ]
        # The two endpoints' pages, saved one after the other (JSON lines).
        pages = report_page(completions) + b"\n" + report_page(embeddings) + b"\n"
        async with httpx.AsyncClient(
            base_url=gw.url, headers={"Authorization": f"Bearer {admin.secret}"}, timeout=30
        ) as http:
            posted = await http.post("/v1/reconciliations?provider=east", content=pages)
            assert posted.status_code == 200, posted.text
            report = posted.json()
        assert report["format"] == "openai-usage"
        assert report["unattributed_provider_usage"] == []
        by_model = {c["model"]: c for c in report["buckets"]}
        assert by_model["fake-model"]["status"] == "matched"
        settled = by_model["fake-embed"]
        assert settled["status"] == "settled_unknown"
        assert D(settled["settled_unknown_usd"]) == D(UNKNOWN_TOKENS) / 1_000_000
        (entry,) = report["settled_unknown"]
        assert entry["attempt_id"] == unknown.attempt_id
        (event,) = [e for e in await gw.events(unknown_request) if e.type == "UnknownUsageSettled"]
        assert D(event.data["settled_usd"]) == D(UNKNOWN_TOKENS) / 1_000_000
