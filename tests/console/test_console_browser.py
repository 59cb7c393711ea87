"""The console in a real browser (headless Chromium): sign in, read why a request failed over,
look at spend, settle an unknown usage, sign out."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from ledger import apikeys
from tests.console.support import traffic

pytestmark = pytest.mark.browser


async def test_an_operator_signs_in_reads_a_failover_settles_unknown_usage_and_signs_out(
    sqlite_url: str, chromium: Any
) -> None:
    async with traffic(sqlite_url) as t:
        context = await chromium.new_context(java_script_enabled=False)  # reading needs none
        page = await context.new_page()
        url = t.gateway.url

        # A deep link before signing in goes through the sign-in form and comes back.
        await page.goto(f"{url}/console/requests/{t.failed_over}")
        assert page.url.startswith(f"{url}/console/sign-in")
        await page.fill("#api_key", t.secrets["finance"])
        await page.click("button[type=submit]")
        await page.wait_for_url(f"{url}/console/requests/{t.failed_over}")

        # The request's page: the summary on top, then its timeline.
        summary = await page.inner_text("p.summary")
        assert "rate_limited" in summary and "west" in summary
        steps = await page.locator("ol.timeline > li").all_inner_texts()
        assert any("attempt 1: east/fake-model" in s and "rate_limited" in s for s in steps)
        assert any("after attempt 1: failover" in s for s in steps)
        assert any("attempt 2: west/fake-model" in s and "succeeded" in s for s in steps)
        assert await page.locator("figure.timeline-chart svg rect").count() == 2
        facts = await page.inner_text("dl.facts")
        assert "client API" in facts and "openai.chat_completions" in facts
        await page.click("text=Raw events")
        assert "RequestReceived" in await page.inner_text("main")

        # Spend: three charts and the table by day, here by endpoint.
        await page.click("nav >> text=Spend")
        assert await page.locator(".charts svg").count() == 3
        await page.select_option("select[name=group]", "endpoint")
        await page.click("button:text('Show')")
        await page.wait_for_url("**/console/spend?*group=endpoint*")
        table = await page.inner_text("table.data")
        assert "east" in table and "west" in table
        await page.select_option("select[name=group]", "api")
        await page.click("button:text('Show')")
        await page.wait_for_url("**/console/spend?*group=api*")
        assert "openai.chat_completions" in await page.inner_text("table.data")

        # Unknown usage: the attempt's story, then the form.
        await page.click("nav >> text=Unknown usage")
        card = page.locator("section.settlement")
        assert await card.count() == 1
        assert "upstream_unavailable" in await card.inner_text()
        await card.locator("input[name=settled_usd]").fill("0.000042")
        await card.locator("input[name=reason]").fill("provider invoice 2026-11, line 7")
        await card.locator("button[type=submit]").click()
        await page.wait_for_url("**/console/unknown?settled=*")
        assert "No unknown usage is open" in await page.inner_text("main")
        finance = await apikeys.find_key(t.gateway.store, t.secrets["finance"])
        assert finance is not None
        settled = [e.event() for e in await t.gateway.events(t.unknown)]
        assert [
            (e.actor, e.reason)  # type: ignore[attr-defined]
            for e in settled
            if e.type == "UnknownUsageSettled"
        ] == [(finance.key_id, "provider invoice 2026-11, line 7")]

        # Sign out: the session is over, pages send the browser to sign in again.
        await page.click("button:text('Sign out')")
        await page.wait_for_url("**/console/sign-in**")
        await page.goto(f"{url}/console/spend")
        assert page.url.startswith(f"{url}/console/sign-in")
        await context.close()


async def test_a_client_key_is_refused_at_sign_in_and_an_auditor_cannot_settle(
    sqlite_url: str, chromium: Any
) -> None:
    async with traffic(sqlite_url) as t:
        page = await chromium.new_page()
        await page.goto(f"{t.gateway.url}/console/sign-in")
        await page.fill("#api_key", t.secrets["client"])
        await page.click("button[type=submit]")
        assert "a client key cannot sign in" in await page.inner_text("[role=alert]")

        await page.fill("#api_key", t.secrets["auditor"])
        await page.click("button[type=submit]")
        await page.wait_for_url("**/console/requests")
        await page.goto(f"{t.gateway.url}/console/unknown")
        assert await page.locator("section.settlement").count() == 1
        assert await page.locator("form.settle").count() == 0
        async with httpx.AsyncClient(base_url=t.gateway.url) as api:
            still = await api.get(
                "/v1/settlements/unknown",
                params={"state": "open"},
                headers={"Authorization": f"Bearer {t.secrets['admin']}"},
            )
        assert len(still.json()["data"]) == 1


async def test_a_late_settlement_is_a_mark_past_a_break_and_sub_cent_ticks_read(
    sqlite_url: str, chromium: Any
) -> None:
    import dataclasses
    from datetime import timedelta
    from decimal import Decimal

    from ledger.views.explain import explain
    from router.http.console.charts import Bar, bar_chart, timeline_chart
    from router.http.console.timeline import timeline

    async with traffic(sqlite_url) as t:
        async with httpx.AsyncClient(base_url=t.gateway.url) as api:
            listed = await api.get(
                "/v1/settlements/unknown",
                headers={"Authorization": f"Bearer {t.secrets['admin']}"},
            )
            settled = await api.post(
                f"/v1/settlements/unknown/{listed.json()['data'][0]['settlement_id']}",
                json={"settled_usd": "0.000042", "reason": "invoice"},
                headers={"Authorization": f"Bearer {t.secrets['admin']}"},
            )
            assert settled.status_code == 200, settled.text
        trail = await t.gateway.events(t.unknown)
    # The settlement as a reconciliation would record it, 55 s after the request came in.
    received = trail[0].recorded_at
    trail = [
        dataclasses.replace(e, recorded_at=received + timedelta(seconds=55))
        if e.type == "UnknownUsageSettled"
        else e
        for e in trail
    ]
    steps = timeline(explain(trail), trail)
    assert steps.total_ms < 55_000 and [m.label for m in steps.late] == ["unknown usage settled"]
    svg = timeline_chart("the attempts in time", steps.bars, steps.total_ms, steps.late)
    costs = [Bar(f"2026-12-0{d}", Decimal(f"0.00000{d}"), "") for d in range(1, 4)]
    spend = bar_chart("settled cost per day (USD)", costs, usd=True)

    page = await (await chromium.new_context(java_script_enabled=False)).new_page()
    await page.set_content(f"<html><body style='width:1100px'>{svg}{spend}</body></html>")
    charts = page.locator("svg.chart")
    bars = (
        await charts.nth(0)
        .locator("rect")
        .evaluate_all(
            "rs => rs.map(r => { const b = r.getBoundingClientRect(); return [b.left, b.right]; })"
        )
    )
    mark = await charts.nth(0).locator(".late-mark").bounding_box()
    rule = await charts.nth(0).locator(".axis-break").bounding_box()
    assert mark is not None and rule is not None
    # The attempts fill the axis (not squeezed into its left edge); the late settlement is
    # drawn after the break, beyond them.
    first_left = min(left for left, _ in bars)
    last_right = max(right for _, right in bars)
    assert last_right - first_left > 0.5 * (rule["x"] - first_left)
    assert last_right <= rule["x"] < mark["x"]
    assert "+55.0 s" in (await charts.nth(0).text_content() or "")
    ticks = await charts.nth(1).locator("text").all_text_contents()
    dollars = [tick for tick in ticks if tick.startswith("$")]
    assert len(set(dollars)) == 3 and "$0.00" not in dollars, dollars


async def test_an_admin_creates_a_named_key_sees_its_secret_once_and_revokes_it(
    sqlite_url: str, chromium: Any
) -> None:
    async with traffic(sqlite_url) as t:
        context = await chromium.new_context(java_script_enabled=False)
        page = await context.new_page()
        await page.goto(f"{t.gateway.url}/console/sign-in")
        await page.fill("#api_key", t.secrets["admin"])
        await page.click("button[type=submit]")
        await page.wait_for_url("**/console/requests")

        await page.click("nav >> text=Keys")
        form = page.locator("form.create-key")
        await form.locator("input[name=name]").fill("ci runner")
        await form.locator("select[name=role]").select_option("client")
        await form.locator("input[name=requests_per_minute]").fill("20")
        await form.locator("button[type=submit]").click()
        secret = (await page.inner_text("output.secret")).strip()
        assert secret.startswith("wb_")
        key = await apikeys.find_key(t.gateway.store, secret)
        assert key is not None and key.name == "ci runner" and not key.revoked

        await page.goto(f"{t.gateway.url}/console/keys")  # the secret is not shown again
        assert await page.locator("output.secret").count() == 0
        row = page.locator(f"tr#{key.key_id}")
        assert "ci runner" in await row.inner_text() and "active" in await row.inner_text()
        await row.locator("button:text('Revoke')").click()
        await page.wait_for_url(f"**/console/keys?revoked={key.key_id}")
        assert "revoked" in await page.locator(f"tr#{key.key_id}").inner_text()
        revoked = await apikeys.find_key(t.gateway.store, secret)
        assert revoked is not None and revoked.revoked
        await context.close()
