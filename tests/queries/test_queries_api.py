"""The ledger query API over HTTP: search with cursor pagination, raw events, bad query
values, and the access matrix of contract §3's roles on every query endpoint."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson

from ledger import apikeys
from router.fake_provider import Behavior
from tests.gateway.harness import Gateway, Route, running_gateway
from tests.gateway.test_failure_table import BODY
from tests.helpers import eventually


async def page_through(
    http: httpx.AsyncClient, path: str, headers: dict[str, str] | None = None, **params: Any
) -> list[list[Any]]:
    pages, cursor = [], None
    while True:
        query = {**params, **({"cursor": cursor} if cursor else {})}
        response = await http.get(path, params=query, headers=headers)
        assert response.status_code == 200, response.text
        body = response.json()
        assert set(body) == {"data", "next_cursor"}
        pages.append(body["data"])
        cursor = body["next_cursor"]
        if cursor is None:
            return pages


async def listed(
    http: httpx.AsyncClient, headers: dict[str, str] | None = None, **params: Any
) -> list[str]:
    pages = await page_through(http, "/v1/requests", headers, **params)
    return [v["request_id"] for page in pages for v in page]


async def test_search_pages_newest_first_with_an_opaque_cursor_and_filters(
    database_url: str,
) -> None:
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw, gw.http() as http:
        gw.upstreams["east"].set_plan([Behavior.ok()] * 6 + [Behavior.insufficient_quota()] * 2)
        # Concurrent requests share group commits: several views share one created_at.
        served = await asyncio.gather(
            *(http.post("/v1/chat/completions", json=BODY) for _ in range(6))
        )
        failed = [await http.post("/v1/chat/completions", json=BODY) for _ in range(2)]
        assert [r.status_code for r in served] == [200] * 6
        assert all(r.status_code >= 500 for r in failed)
        ids = {r.headers["x-request-id"] for r in [*served, *failed]}

        async def all_final() -> bool:
            views = (await http.get("/v1/requests")).json()["data"]
            return len(views) == 8 and all(v["status"] != "in_progress" for v in views)

        await eventually(all_final)
        everything = (await http.get("/v1/requests", params={"limit": 500})).json()["data"]
        pages = await page_through(http, "/v1/requests", limit=3)
        assert [len(p) for p in pages] == [3, 3, 2]
        paged = [v for page in pages for v in page]
        assert paged == everything and {v["request_id"] for v in paged} == ids
        keys = [(v["created_at"], v["request_id"]) for v in paged]
        assert keys == sorted(keys, reverse=True)  # newest first, ties by request id

        view = paged[0]
        assert set(view) >= {
            "request_id", "workspace", "key_id", "model", "status", "endpoint", "attempts",
            "reserved_usd", "settled_usd", "held_unknown_usd", "created_at", "completed_at",
        }  # fmt: skip
        assert all(isinstance(view[m], str) for m in ("settled_usd", "held_unknown_usd"))

        assert len(await listed(http, status="failed", limit=1)) == 2
        assert len(await listed(http, status="succeeded", endpoint="east", model="chat")) == 6
        assert await listed(http, model="nope") == []
        assert len(await listed(http, since="2000-01-01")) == 8
        assert await listed(http, until="2000-01-01T00:00:00Z") == []
        middle = paged[3]["created_at"]
        newer = [v["request_id"] for v in paged if v["created_at"] >= middle]
        assert await listed(http, since=middle) == newer
        assert await listed(http, until=middle) == [i for i in (v["request_id"] for v in paged)
                                                    if i not in newer]  # fmt: skip

        request_id = served[0].headers["x-request-id"]
        event_pages = await page_through(http, f"/v1/requests/{request_id}/events", limit=2)
        raw = [e for page in event_pages for e in page]
        recorded = await gw.events(request_id)
        assert raw == orjson.loads(orjson.dumps([e.as_json() for e in recorded]))
        assert [len(p) for p in event_pages][:-1] == [2] * (len(event_pages) - 1)
        assert all(len(e["hash"]) == 64 for e in raw)
        assert set(raw[0]) == {
            "position", "stream_id", "version", "type", "schema_version", "data", "metadata",
            "recorded_at", "hash",
        }  # fmt: skip


async def test_bad_query_values_are_a_400_naming_the_parameter(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url, ["east"], [Route("east")]) as gw, gw.http() as http:
        events_cursor = "WyJldmVudHMiLDJd"  # a cursor of the events endpoint
        cases = [
            ("/v1/requests", {"limit": "0"}, "limit"),
            ("/v1/requests", {"limit": "501"}, "limit"),
            ("/v1/requests", {"limit": "ten"}, "limit"),
            ("/v1/requests", {"limit": "-1"}, "limit"),
            ("/v1/requests", {"status": "done"}, "status"),
            ("/v1/requests", {"since": "yesterday"}, "since"),
            ("/v1/requests", {"until": "2026-13-01"}, "until"),
            ("/v1/requests", {"cursor": "not a cursor"}, "cursor"),
            ("/v1/requests", {"cursor": events_cursor}, "cursor"),
            ("/v1/requests/req_x/events", {"limit": "1000"}, "limit"),
            ("/v1/requests/req_x/events", {"cursor": "e30"}, "cursor"),
            ("/v1/requests/req_x/explain", {"format": "xml"}, "format"),
        ]
        for path, params, param in cases:
            response = await http.get(path, params=params)
            assert response.status_code == 400, (path, params, response.text)
            error = response.json()["error"]
            assert (error["code"], error["param"]) == ("invalid_request", param), (path, params)
            assert "Traceback" not in error["message"]
        unauthenticated = await http.get("/v1/requests", headers={"Authorization": ""})
        assert unauthenticated.status_code == 401


# --- the access matrix ------------------------------------------------------------------

KEYS: dict[str, tuple[str, apikeys.Role]] = {  # name: (workspace, role)
    "client": ("acme", "client"),
    "peer": ("acme", "client"),
    "auditor": ("acme", "auditor"),
    "finance": ("acme", "finance"),
    "admin": ("acme", "admin"),
    "outsider": ("other", "client"),
    "other_auditor": ("other", "auditor"),
}
MADE_BY = ("client", "peer", "outsider")  # each of these keys makes one request
SEES = {
    "client": {"client"},
    "peer": {"peer"},
    "auditor": {"client", "peer"},
    "finance": {"client", "peer"},
    "admin": {"client", "peer", "outsider"},
    "outsider": {"outsider"},
    "other_auditor": {"outsider"},
}
VERIFIES = {"auditor", "admin", "other_auditor"}
PER_REQUEST = ("", "/explain", "/explain?format=text", "/events")


async def make_keys(gw: Gateway) -> dict[str, str]:
    secrets = {"client": gw.secret}
    for name, (workspace, role) in KEYS.items():
        if name not in secrets:
            secrets[name] = (await apikeys.create_key(gw.store, workspace, role)).secret
    return secrets


def as_key(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def test_every_role_sees_exactly_its_scope_on_every_query_endpoint(
    database_url: str,
) -> None:
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw, gw.http() as http:
        secrets = await make_keys(gw)
        request_of = {}
        for maker in MADE_BY:
            response = await http.post(
                "/v1/chat/completions", json=BODY, headers=as_key(secrets[maker])
            )
            assert response.status_code == 200
            request_of[maker] = response.headers["x-request-id"]

        async def views_exist() -> bool:
            response = await http.get("/v1/requests", headers=as_key(secrets["admin"]))
            return len(response.json()["data"]) == len(MADE_BY)

        await eventually(views_exist)
        nowhere = (await http.get("/v1/requests/req_nowhere")).json()["error"]

        for name, secret in secrets.items():
            headers = as_key(secret)
            for maker, request_id in request_of.items():
                for suffix in PER_REQUEST:
                    response = await http.get(f"/v1/requests/{request_id}{suffix}", headers=headers)
                    where = (name, maker, suffix)
                    if maker in SEES[name]:
                        assert response.status_code == 200, where
                        continue
                    # Exactly what a request that does not exist gets: 404, never 403.
                    assert response.status_code == 404, where
                    error = response.json()["error"]
                    assert error["code"] == nowhere["code"] == "request_not_found", where
                    assert error["message"] == nowhere["message"].replace("req_nowhere", request_id)
                    assert request_id not in response.text.replace(f"'{request_id}'", ""), where
            found = await listed(http, headers, limit=1)
            assert set(found) == {request_of[m] for m in SEES[name]}, name
            verify = await http.get("/v1/ledger/verify", headers=headers)
            if name in VERIFIES:
                assert verify.status_code == 200 and verify.json()["ok"] is True, name
            else:
                assert verify.status_code == 403, name
                assert verify.json()["error"]["code"] == "permission_denied"

        # Filters never widen a scope: asking for another workspace or key finds nothing.
        auditor = as_key(secrets["auditor"])
        for params in ({"workspace": "other"}, {"workspace": "acme", "key_id": "key_x"}):
            response = await http.get("/v1/requests", params=params, headers=auditor)
            assert response.json() == {"data": [], "next_cursor": None}
        peer_key = (await http.get(f"/v1/requests/{request_of['peer']}", headers=auditor)).json()
        client = as_key(secrets["client"])
        response = await http.get(
            "/v1/requests", params={"key_id": peer_key["key_id"]}, headers=client
        )
        assert response.json()["data"] == []
        admin = as_key(secrets["admin"])
        response = await http.get("/v1/requests", params={"workspace": "other"}, headers=admin)
        assert [v["request_id"] for v in response.json()["data"]] == [request_of["outsider"]]
