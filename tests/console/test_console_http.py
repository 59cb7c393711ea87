"""The console over plain HTTP, without a browser: signing in and out, CSRF, sessions that
end with their key, and every page narrowed to what the key may read over the API."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import orjson

from ledger import apikeys
from router.fake_provider import Behavior
from router.http.console.sessions import secret_from
from tests.console.support import browser, csrf_token, sign_in, traffic
from tests.gateway.harness import Route, running_gateway
from tests.ledger.test_cli import waybill

REPORTS = Path(__file__).parents[1] / "ledger" / "reports"


def _api(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def test_sign_in_takes_admin_auditor_and_finance_keys_and_refuses_a_client_key(
    sqlite_url: str,
) -> None:
    async with traffic(sqlite_url) as t, browser(t.gateway) as http:
        refused = await sign_in(http, t.secrets["client"])
        assert refused.status_code == 403
        assert "a client key cannot sign in" in refused.text
        assert "waybill_console=" not in refused.headers.get("set-cookie", "")
        unknown = await sign_in(http, "wb_not_a_key")
        assert unknown.status_code == 401 and "unknown or revoked" in unknown.text

        for role in ("admin", "auditor", "finance"):
            http.cookies.clear()
            signed = await sign_in(http, t.secrets[role])
            assert signed.status_code == 303, (role, signed.text)
            assert signed.headers["location"] == "/console/requests"
            cookie = next(
                c for c in signed.headers.get_list("set-cookie") if c.startswith("waybill_console=")
            )
            attributes = cookie.lower()
            assert "httponly" in attributes and "samesite=lax" in attributes
            assert "path=/console" in attributes
            assert t.secrets[role] not in cookie  # the key itself is never in the cookie
            page = await http.get("/console/requests")
            assert page.status_code == 200 and "Sign out" in page.text


async def test_a_page_without_a_session_sends_the_browser_to_sign_in_and_back(
    sqlite_url: str,
) -> None:
    async with traffic(sqlite_url) as t, browser(t.gateway) as http:
        wanted = f"/console/requests/{t.failed_over}"
        answer = await http.get(wanted)
        assert answer.status_code == 303
        assert answer.headers["location"].startswith("/console/sign-in?next=")
        form = await http.get(answer.headers["location"])
        assert f'name="next" value="{wanted}"' in form.text
        signed = await http.post(
            "/console/sign-in",
            data={
                "api_key": t.secrets["admin"],
                "csrf_token": csrf_token(form.text),
                "next": wanted,
            },
        )
        assert signed.headers["location"] == wanted
        # A next page elsewhere than the console is not followed.
        http.cookies.clear()
        form = await http.get("/console/sign-in")
        elsewhere = await http.post(
            "/console/sign-in",
            data={
                "api_key": t.secrets["admin"],
                "csrf_token": csrf_token(form.text),
                "next": "https://example.com/",
            },
        )
        assert elsewhere.headers["location"] == "/console/requests"


async def test_forms_without_their_csrf_token_are_refused_and_change_nothing(
    sqlite_url: str,
) -> None:
    async with traffic(sqlite_url) as t, browser(t.gateway) as http:
        page = await http.get("/console/sign-in")
        assert (
            await http.post("/console/sign-in", data={"api_key": t.secrets["admin"]})
        ).status_code == 403
        forged = await http.post(
            "/console/sign-in",
            data={"api_key": t.secrets["admin"], "csrf_token": "x" + csrf_token(page.text)},
        )
        assert forged.status_code == 403 and "waybill_console=" not in forged.headers.get(
            "set-cookie", ""
        )

        assert (await sign_in(http, t.secrets["finance"])).status_code == 303
        settlement = await _open_settlement(t.gateway.url, t.secrets["finance"])
        for data in ({}, {"csrf_token": "forged"}):
            refused = await http.post(
                f"/console/unknown/{settlement}/settle",
                data={**data, "settled_usd": "0.01", "reason": "invoice"},
            )
            assert refused.status_code == 403 and "CSRF" in refused.text
        assert await _open_settlement(t.gateway.url, t.secrets["finance"]) == settlement
        assert (await http.post("/console/sign-out")).status_code == 403
        assert (await http.get("/console/requests")).status_code == 200  # still signed in


async def test_an_auditor_of_one_workspace_never_sees_anothers_requests(database_url: str) -> None:
    async with traffic(database_url) as t, browser(t.gateway) as http:
        await sign_in(http, t.secrets["other_auditor"])
        listed = (await http.get("/console/requests")).text
        assert t.other in listed
        assert t.failed_over not in listed and t.unknown not in listed
        absent = await http.get("/console/requests/req_nowhere")
        hidden = await http.get(f"/console/requests/{t.failed_over}")
        assert absent.status_code == hidden.status_code == 404
        assert "request_not_found" in hidden.text
        for suffix in ("/events", "/proof"):
            assert (await http.get(f"/console/requests/{t.failed_over}{suffix}")).status_code == 404
        # Asking for the other workspace by name finds nothing either.
        asked = (await http.get("/console/requests", params={"workspace": "acme"})).text
        assert t.failed_over not in asked and t.other not in asked
        spend = (await http.get("/console/spend")).text
        assert "acme" not in spend.split("<main>")[1]
        unknown = (await http.get("/console/unknown")).text
        assert t.unknown not in unknown and "No unknown usage is open" in unknown
        # An attempt of acme's, named in a reconciliation, reads as one that does not exist.
        acme_attempt = await _unknown_attempt(t.gateway.url, t.secrets["admin"])
        assert (await http.get(f"/console/attempts/{acme_attempt}")).status_code == 404

        http.cookies.clear()
        await sign_in(http, t.secrets["auditor"])
        listed = (await http.get("/console/requests")).text
        assert t.failed_over in listed and t.unknown in listed and t.other not in listed
        assert (await http.get(f"/console/requests/{t.other}")).status_code == 404


async def test_a_revoked_keys_session_ends_on_its_next_request(sqlite_url: str) -> None:
    async with traffic(sqlite_url) as t, browser(t.gateway) as http:
        await sign_in(http, t.secrets["auditor"])
        assert (await http.get("/console/health")).status_code == 200
        key = await apikeys.find_key(t.gateway.store, t.secrets["auditor"])
        assert key is not None
        await apikeys.revoke_key(t.gateway.store, key.key_id)
        ended = await http.get("/console/health")
        assert ended.status_code == 303
        assert "revoked" in ended.headers["location"]
        assert (await http.get("/console/requests")).status_code == 303


async def test_sign_out_ends_the_session_even_for_a_copy_of_its_cookie(sqlite_url: str) -> None:
    async with traffic(sqlite_url) as t, browser(t.gateway) as http:
        await sign_in(http, t.secrets["admin"])
        cookie = http.cookies.get("waybill_console")
        page = await http.get("/console/requests")
        out = await http.post("/console/sign-out", data={"csrf_token": csrf_token(page.text)})
        assert out.status_code == 303 and out.headers["location"].startswith("/console/sign-in")
        async with browser(t.gateway) as thief:
            thief.cookies.set("waybill_console", cookie or "", path="/console")
            assert (await thief.get("/console/requests")).status_code == 303


async def test_sign_out_through_one_gateway_ends_the_session_in_every_other(
    database_url: str,
) -> None:
    shared = secret_from("a console secret that replicas share")  # WAYBILL_CONSOLE_SECRET
    async with (
        running_gateway(database_url, ["east"], [Route("east")], console_secret=shared) as one,
        running_gateway(database_url, ["east"], [Route("east")], console_secret=shared) as two,
    ):
        admin = (await apikeys.create_key(one.store, "acme", "admin")).secret
        async with browser(one) as http, browser(two) as other:
            assert (await sign_in(http, admin)).status_code == 303
            other.cookies.set("waybill_console", http.cookies["waybill_console"], path="/console")
            assert (await other.get("/console/requests")).status_code == 200  # one session
            page = await http.get("/console/requests")
            out = await http.post("/console/sign-out", data={"csrf_token": csrf_token(page.text)})
            assert out.status_code == 303
            ended = await other.get("/console/requests")
            assert ended.status_code == 303
            assert ended.headers["location"].startswith("/console/sign-in")


async def test_finance_settles_unknown_usage_recorded_with_its_key_as_actor(
    database_url: str,
) -> None:
    async with traffic(database_url) as t, browser(t.gateway) as http:
        settlement = await _open_settlement(t.gateway.url, t.secrets["admin"])
        await sign_in(http, t.secrets["auditor"])
        page = await http.get("/console/unknown")
        assert settlement in page.text and "/settle" not in page.text  # auditors only read
        refused = await http.post(
            f"/console/unknown/{settlement}/settle",
            data={"csrf_token": csrf_token(page.text), "settled_usd": "0.01", "reason": "x"},
        )
        assert refused.status_code == 403

        http.cookies.clear()
        await sign_in(http, t.secrets["finance"])
        page = await http.get("/console/unknown")
        assert "upstream_unavailable" in page.text  # the attempt's story: its failure class
        token = csrf_token(page.text)
        bad = await http.post(
            f"/console/unknown/{settlement}/settle",
            data={"csrf_token": token, "settled_usd": "lots", "reason": "invoice"},
        )
        assert bad.status_code == 400 and "decimal" in bad.text
        done = await http.post(
            f"/console/unknown/{settlement}/settle",
            data={"csrf_token": token, "settled_usd": "0.000123", "reason": "invoice 11, line 4"},
        )
        assert done.status_code == 303
        again = await http.post(
            f"/console/unknown/{settlement}/settle",
            data={"csrf_token": token, "settled_usd": "0.000123", "reason": "twice"},
        )
        assert again.status_code == 409  # settlement_conflict, as over the API
        events = await t.gateway.events(t.unknown)
        settled = [e.event() for e in events if e.type == "UnknownUsageSettled"]
        finance = await apikeys.find_key(t.gateway.store, t.secrets["finance"])
        assert finance is not None
        assert [(s.actor, s.reason, str(s.settled_usd)) for s in settled] == [  # type: ignore[attr-defined]
            (finance.key_id, "invoice 11, line 4", "0.000123")
        ]


async def test_spend_charts_csv_health_and_a_reconciliation_upload(database_url: str) -> None:
    async with traffic(database_url) as t, browser(t.gateway) as http:
        await sign_in(http, t.secrets["finance"])
        spend = await http.get("/console/spend", params={"group": "endpoint"})
        assert spend.status_code == 200
        assert spend.text.count("<svg") == 3 and "<script" not in spend.text
        assert re.search(r"<td>west</td>", spend.text)
        csv = await http.get("/console/spend.csv", params={"group": "endpoint"})
        assert csv.status_code == 200 and csv.headers["content-type"].startswith("text/csv")
        assert csv.text.splitlines()[0].startswith("day,endpoint,settled_usd")
        assert (await http.get("/console/spend", params={"group": "key"})).status_code == 400

        health = await http.get("/console/health")
        assert health.status_code == 200 and "east" in health.text
        assert "rate_limited" in health.text and "Ledger" not in health.text  # finance
        # Finance imports its workspace's export: the unknown attempt's line settles it.
        attempt = await _unknown_attempt(t.gateway.url, t.secrets["admin"])
        page = await http.get("/console/reconciliations")
        export = (
            "attempt_id,provider_request_id,model,input_tokens,output_tokens,cost_usd,timestamp\n"
            f"{attempt},,fake-model,10,5,0.000050,2026-11-30T12:00:00Z\n"
        )
        uploaded = await http.post(
            "/console/reconciliations",
            data={"csrf_token": csrf_token(page.text), "provider": "east"},
            files={"export": ("usage.csv", export.encode(), "text/csv")},
        )
        assert uploaded.status_code == 303, uploaded.text
        report = await http.get(uploaded.headers["location"])
        assert report.status_code == 200 and attempt in report.text
        assert "Unknown usage settled" in report.text
        listed = await http.get("/console/reconciliations")
        assert uploaded.headers["location"].rsplit("/", 1)[1] in listed.text
        drill = await http.get(f"/console/attempts/{attempt}")
        assert drill.headers["location"] == f"/console/requests/{t.unknown}"

        http.cookies.clear()
        await sign_in(http, t.secrets["admin"])
        board = (await http.get("/console/health")).text
        assert "Ledger" in board and "never recorded" in board
        async with httpx.AsyncClient(base_url=t.gateway.url) as api:
            verified = await api.get("/v1/ledger/verify", headers=_api(t.secrets["admin"]))
        assert verified.json()["ok"] is True
        assert "OK</span>" in (await http.get("/console/health")).text


async def test_console_routes_stay_out_of_the_api_schema(sqlite_url: str) -> None:
    async with traffic(sqlite_url) as t, browser(t.gateway) as http:
        schema = orjson.loads((await http.get("/openapi.json")).content)
        assert not [path for path in schema["paths"] if path.startswith("/console")]


async def _open_settlement(url: str, secret: str) -> str:
    async with httpx.AsyncClient(base_url=url) as api:
        listed = await api.get(
            "/v1/settlements/unknown", params={"state": "open"}, headers=_api(secret)
        )
    data = listed.json()["data"]
    assert len(data) == 1
    return str(data[0]["settlement_id"])


async def _unknown_attempt(url: str, secret: str) -> str:
    async with httpx.AsyncClient(base_url=url) as api:
        listed = await api.get("/v1/settlements/unknown", headers=_api(secret))
    return str(listed.json()["data"][0]["attempt_id"])


async def test_health_shows_an_endpoint_a_refused_key_disabled(sqlite_url: str) -> None:
    async with traffic(sqlite_url) as t, browser(t.gateway) as http:
        t.gateway.upstreams["east"].set_default(Behavior.server_error())
        t.gateway.upstreams["west"].set_default(Behavior.unauthorized())
        async with httpx.AsyncClient(base_url=t.gateway.url) as api:
            answer = await api.post(
                "/v1/chat/completions",
                json={"model": "chat", "messages": [{"role": "user", "content": "hi"}]},
                headers=_api(t.gateway.secret),
            )
        assert answer.status_code == 502, answer.text  # west's key was refused
        await sign_in(http, t.secrets["admin"])
        board = (await http.get("/console/health")).text
        assert "key refused (401" in board and "waybill endpoints enable west" in board


async def test_a_finance_key_reads_its_workspaces_reconciliations_imported_by_the_cli(
    database_url: str, tmp_path: Path
) -> None:
    async with traffic(database_url) as t, browser(t.gateway) as http:
        attempt = await _unknown_attempt(t.gateway.url, t.secrets["admin"])
        export = tmp_path / "usage.csv"
        export.write_text(
            "attempt_id,provider_request_id,model,input_tokens,output_tokens,cost_usd,timestamp\n"
            f"{attempt},,fake-model,10,5,0.000050,2026-11-30T12:00:00Z\n"
        )

        def imported(*scope: str) -> str:
            ran = waybill("reconcile", str(export), *scope, "--json", database_url=database_url)
            assert ran.returncode == 0, ran.stderr
            return str(json.loads(ran.stdout)["id"])

        everyone = imported()  # every workspace's: an admin's to read
        acme = imported("--workspace", "acme")  # what acme's finance key would import
        other = imported("--workspace", "other")

        await sign_in(http, t.secrets["finance"])
        listed = (await http.get("/console/reconciliations")).text
        assert acme in listed and everyone not in listed and other not in listed
        assert "--workspace acme" in listed  # the page says how the CLI imports for it
        report = await http.get(f"/console/reconciliations/{acme}")
        assert report.status_code == 200 and attempt in report.text
        assert (await http.get(f"/console/reconciliations/{everyone}")).status_code == 404

    refused = waybill(
        "reconcile",
        str(REPORTS / "openai-usage.json"),
        "--workspace",
        "acme",
        database_url=database_url,
    )
    assert refused.returncode == 1 and "spans every one" in refused.stderr
