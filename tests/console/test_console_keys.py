"""The console's Keys page over plain HTTP, on both ledger backends: admins list, create and
revoke keys (CSRF as on every form, the admin key recorded as the actor); other roles are
refused; and key names are shown wherever the console shows key ids."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import httpx

from ledger import apikeys
from tests.console.support import browser, csrf_token, sign_in, traffic
from tests.gateway.test_failure_table import BODY
from tests.helpers import eventually


async def test_an_admin_creates_and_revokes_a_key_on_the_keys_page(database_url: str) -> None:
    async with traffic(database_url) as t, browser(t.gateway) as http:
        admin = await apikeys.find_key(t.gateway.store, t.secrets["admin"])
        assert admin is not None
        assert (await sign_in(http, t.secrets["admin"])).status_code == 303
        page = await http.get("/console/keys")
        assert page.status_code == 200 and 'href="/console/keys"' in page.text
        assert admin.key_id in page.text
        form = {
            "csrf_token": csrf_token(page.text),
            "workspace": "acme",
            "role": "client",
            "name": "nightly batch",
            "budget_usd": "3",
            "budget_window": "month",
            "endpoints": "west",
            "expires_at": "2031-01-31",
            "requests_per_minute": "30",
        }
        assert (
            await http.post("/console/keys", data={**form, "csrf_token": "forged"})
        ).status_code == 403
        refused = await http.post("/console/keys", data={**form, "requests_per_minute": "x"})
        assert refused.status_code == 400 and "limits.requests_per_minute" in refused.text
        created = await http.post("/console/keys", data=form)
        assert created.status_code == 201, created.text
        found = re.search(r"<output class=\"secret\"><code>(wb_[^<]+)</code>", created.text)
        assert found, created.text
        secret = found.group(1)
        key = await apikeys.find_key(t.gateway.store, secret)
        assert key is not None and key.name == "nightly batch" and key.endpoints == ("west",)
        assert key.budget == (Decimal(3), "month") and key.limits is not None
        assert key.limits.requests_per_minute == 30
        listed = await http.get("/console/keys")
        assert secret not in listed.text and apikeys.secret_digest(secret) not in listed.text
        assert "nightly batch" in listed.text and "2031-01-31 00:00" in listed.text

        revoked = await http.post(
            f"/console/keys/{key.key_id}/revoke", data={"csrf_token": csrf_token(listed.text)}
        )
        assert revoked.status_code == 303
        assert revoked.headers["location"] == f"/console/keys?revoked={key.key_id}"
        after = await apikeys.find_key(t.gateway.store, secret)
        assert after is not None and after.revoked
        stream = [
            e.event() for e in await t.gateway.store.read_stream(apikeys.key_stream(key.key_id))
        ]
        assert [
            (e.type, getattr(e, "created_by", None) or getattr(e, "revoked_by", None))
            for e in stream
        ] == [
            ("KeyCreated", admin.key_id),
            ("KeyRevoked", admin.key_id),
        ]
        unknown = await http.post(
            "/console/keys/key_nope/revoke", data={"csrf_token": csrf_token(listed.text)}
        )
        assert unknown.status_code == 404


async def test_the_keys_page_is_for_admins_only(sqlite_url: str) -> None:
    async with traffic(sqlite_url) as t, browser(t.gateway) as http:
        assert (await sign_in(http, t.secrets["finance"])).status_code == 303
        page = await http.get("/console/requests")
        assert 'href="/console/keys"' not in page.text
        refused = await http.get("/console/keys")
        assert refused.status_code == 403 and "admin key" in refused.text
        posted = await http.post(
            "/console/keys",
            data={"csrf_token": csrf_token(page.text), "workspace": "acme"},
        )
        assert posted.status_code == 403
        assert len(await apikeys.list_keys(t.gateway.store)) == 6  # the traffic's, no more


async def test_the_console_shows_key_names_beside_their_ids(sqlite_url: str) -> None:
    async with traffic(sqlite_url) as t, browser(t.gateway) as http:
        named = await apikeys.create_key(
            t.gateway.store, "acme", name="billing batch", budget=(Decimal(5), "day")
        )
        async with httpx.AsyncClient(base_url=t.gateway.url, timeout=30) as api:
            answer = await api.post(
                "/v1/chat/completions",
                json=BODY,
                headers={"Authorization": f"Bearer {named.secret}"},
            )
        assert answer.status_code == 200, answer.text
        request_id = answer.headers["x-request-id"]
        assert (await sign_in(http, t.secrets["admin"])).status_code == 303

        async def listed() -> bool:
            return request_id in (await http.get("/console/requests")).text

        await eventually(listed, within_s=15)
        shown = "billing batch <code>" + named.key_id
        assert shown in (await http.get("/console/requests")).text
        assert shown in (await http.get(f"/console/requests/{request_id}")).text

        budget = f"billing batch <code>key:{named.key_id}:"

        async def budgeted() -> bool:
            return budget in (await http.get("/console/spend")).text

        await eventually(budgeted, within_s=15)


async def test_an_expired_key_cannot_sign_in(sqlite_url: str) -> None:
    async with traffic(sqlite_url) as t, browser(t.gateway) as http:
        past = datetime.now(UTC) - timedelta(minutes=1)
        expired = await apikeys.create_key(t.gateway.store, "acme", "admin", expires_at=past)
        refused = await sign_in(http, expired.secret)
        assert refused.status_code == 401 and "(or expired)" in refused.text
        assert "waybill_console=" not in refused.headers.get("set-cookie", "")
