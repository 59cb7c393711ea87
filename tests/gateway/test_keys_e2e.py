"""Keys as people manage them, over HTTP on both ledger backends: an expired key is refused
as a revoked one is; the key API (``/v1/admin/keys``) creates, lists and revokes keys, each
change an event on the key's stream with the actor; a key's own rate limits."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from ledger import apikeys
from ledger.events import KeyLimits
from tests.gateway.harness import Route, running_gateway
from tests.gateway.test_rate_limits_e2e import _fresh_window

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


async def test_an_expired_key_is_refused_like_a_revoked_one(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw:
        # The ledger records what it is given; only the CLI and the key API refuse a past
        # expiry. A key that expired an hour ago stands for one that reached its expiry.
        past = datetime.now(UTC) - timedelta(hours=1)
        expired = await apikeys.create_key(gw.store, "acme", expires_at=past)
        revoked = await apikeys.create_key(gw.store, "acme")
        await apikeys.revoke_key(gw.store, revoked.key_id)
        answers = []
        for secret in (expired.secret, revoked.secret):
            with pytest.raises(openai.AuthenticationError) as refused:
                await gw.client(secret).chat.completions.create(model="chat", messages=MESSAGES)
            answers.append(refused.value.response)
        assert [(r.status_code, r.json()["error"]["code"]) for r in answers] == [
            (401, "invalid_api_key")
        ] * 2
        assert answers[0].json()["error"]["message"] == answers[1].json()["error"]["message"]
        async with gw.http() as http:
            http.headers["authorization"] = f"Bearer {expired.secret}"
            assert (await http.get("/v1/requests")).status_code == 401
        assert len(gw.upstreams["east"].requests) == 0
        future = datetime.now(UTC) + timedelta(days=1)
        valid = await apikeys.create_key(gw.store, "acme", expires_at=future)
        await gw.client(valid.secret).chat.completions.create(model="chat", messages=MESSAGES)


async def test_the_key_api_creates_lists_and_revokes_keys_with_the_actor(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw:
        admin = await apikeys.create_key(gw.store, "acme", "admin")
        headers = {"authorization": f"Bearer {admin.secret}"}
        async with gw.http() as http:
            created = await http.post(
                "/v1/admin/keys",
                headers=headers,
                json={
                    "workspace": "acme",
                    "name": "nightly batch",
                    "budget": {"limit_usd": "2.50", "window": "month"},
                    "endpoints": ["east"],
                    "expires_at": "2031-01-31",
                    "limits": {"requests_per_minute": 50},
                },
            )
            assert created.status_code == 201, created.text
            key = created.json()
            secret = key.pop("secret")
            assert secret.startswith("wb_")
            assert key == {
                "key_id": key["key_id"],
                "name": "nightly batch",
                "workspace": "acme",
                "role": "client",
                "state": "active",
                "created_at": key["created_at"],
                "created_by": admin.key_id,
                "revoked_at": None,
                "expires_at": "2031-01-31T00:00:00Z",
                "budget": {"limit_usd": "2.500000", "window": "month"},  # as the books keep it
                "endpoints": ["east"],
                "limits": {"requests_per_minute": 50},
            }
            await gw.client(secret).chat.completions.create(model="chat", messages=MESSAGES)

            listed = await http.get("/v1/admin/keys", headers=headers)
            assert listed.status_code == 200, listed.text
            rows = listed.json()["data"]
            assert [row["key_id"] for row in rows] == [gw.key_id, admin.key_id, key["key_id"]]
            assert rows[-1] == key
            digest = apikeys.secret_digest(secret)
            assert secret not in listed.text and digest not in listed.text
            other = await http.get("/v1/admin/keys?workspace=other", headers=headers)
            assert other.json() == {"data": [], "next_cursor": None}

            revoked = await http.post(f"/v1/admin/keys/{key['key_id']}/revoke", headers=headers)
            assert revoked.status_code == 200, revoked.text
            assert revoked.json()["state"] == "revoked" and revoked.json()["revoked_at"]
            again = await http.post(f"/v1/admin/keys/{key['key_id']}/revoke", headers=headers)
            assert again.status_code == 200 and again.json() == revoked.json()
        with pytest.raises(openai.AuthenticationError):
            await gw.client(secret).chat.completions.create(model="chat", messages=MESSAGES)
        stream = await gw.store.read_stream(apikeys.key_stream(key["key_id"]))
        assert [(e.type, e.schema_version) for e in stream] == [
            ("KeyCreated", 2),
            ("KeyRevoked", 1),
        ]
        assert stream[0].data["created_by"] == admin.key_id
        assert stream[0].data["name"] == "nightly batch"
        assert stream[0].data["limits"] == {"requests_per_minute": 50, "tokens_per_minute": None}
        assert stream[1].data["revoked_by"] == admin.key_id


async def test_the_key_api_refuses_non_admins_unknown_keys_and_bad_fields(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw:
        admin = await apikeys.create_key(gw.store, "acme", "admin")
        finance = await apikeys.create_key(gw.store, "acme", "finance")
        async with gw.http() as http:
            for secret in (gw.secret, finance.secret):
                bearer = {"authorization": f"Bearer {secret}"}
                for method, path in (
                    ("POST", "/v1/admin/keys"),
                    ("GET", "/v1/admin/keys"),
                    ("POST", f"/v1/admin/keys/{gw.key_id}/revoke"),
                ):
                    answer = await http.request(
                        method, path, headers=bearer, json={"workspace": "acme"}
                    )
                    assert answer.status_code == 403, (method, path, answer.text)
                    assert answer.json()["error"]["code"] == "permission_denied"
            headers = {"authorization": f"Bearer {admin.secret}"}
            for nope in ("key_nope", "k" * 201):  # no key has an id the events refuse
                unknown = await http.post(f"/v1/admin/keys/{nope}/revoke", headers=headers)
                assert unknown.status_code == 404
                assert unknown.json()["error"]["code"] == "key_not_found"
            for body, param in (
                ({"workspace": "nowhere"}, "workspace"),
                ({"name": "x"}, "workspace"),
                ({"workspace": "acme", "role": "owner"}, "role"),
                ({"workspace": "acme", "name": ""}, "name"),
                ({"workspace": "acme", "name": "a\nb"}, "name"),
                ({"workspace": "acme", "budget": {"limit_usd": 5}}, "budget.limit_usd"),
                ({"workspace": "acme", "budget": {"limit_usd": "5", "window": "week"}},
                 "budget.window"),
                ({"workspace": "acme", "endpoints": []}, "endpoints"),
                ({"workspace": "acme", "endpoints": ["west"]}, "endpoints"),
                ({"workspace": "acme", "endpoints": ["provider:gemini"]}, "endpoints"),
                ({"workspace": "acme", "expires_at": "2001-01-01"}, "expires_at"),
                ({"workspace": "acme", "expires_at": "soon"}, "expires_at"),
                ({"workspace": "acme", "limits": {}}, "limits"),
                ({"workspace": "acme", "limits": {"requests_per_minute": 0}},
                 "limits.requests_per_minute"),
                ({"workspace": "acme", "limits": {"tokens_per_minute": True}},
                 "limits.tokens_per_minute"),
            ):  # fmt: skip
                refused = await http.post("/v1/admin/keys", headers=headers, json=body)
                assert refused.status_code == 400, (body, refused.text)
                error = refused.json()["error"]
                assert (error["code"], error["param"]) == ("invalid_request", param), body
            not_json = await http.post("/v1/admin/keys", headers=headers, content=b"{")
            assert not_json.status_code == 400
            listed = (await http.get("/v1/admin/keys", headers=headers)).json()["data"]
        assert len(listed) == 3  # nothing refused was created


async def test_a_key_created_or_revoked_through_one_gateway_acts_on_another(database_url):
    async with (
        running_gateway(database_url, ["east"], [Route("east")]) as one,
        running_gateway(database_url, ["east"], [Route("east")]) as other,
    ):
        admin = await apikeys.create_key(one.store, "acme", "admin")
        headers = {"authorization": f"Bearer {admin.secret}"}
        async with one.http() as http:
            created = await http.post("/v1/admin/keys", headers=headers, json={"workspace": "acme"})
            assert created.status_code == 201, created.text
            key = created.json()
            # The other gateway reads the key, and keeps it in its cache of keys.
            client = other.client(key["secret"])
            for _ in range(2):
                await client.chat.completions.create(model="chat", messages=MESSAGES)
            revoked = await http.post(f"/v1/admin/keys/{key['key_id']}/revoke", headers=headers)
            assert revoked.status_code == 200, revoked.text
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model="chat", messages=MESSAGES)
        assert len(other.upstreams["east"].requests) == 2


async def test_a_keys_own_limits_refuse_it_while_another_key_is_not_limited(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw:
        await _fresh_window()
        admin = await apikeys.create_key(gw.store, "acme", "admin")
        async with gw.http() as http:
            created = await http.post(
                "/v1/admin/keys",
                headers={"authorization": f"Bearer {admin.secret}"},
                json={"workspace": "acme", "limits": {"requests_per_minute": 2}},
            )
        limited = created.json()
        client = gw.client(limited["secret"])
        for _ in range(2):
            await client.chat.completions.create(model="chat", messages=MESSAGES)
        with pytest.raises(openai.RateLimitError) as refused:
            await client.chat.completions.create(model="chat", messages=MESSAGES)
        response = refused.value.response
        assert response.json()["error"]["code"] == "rate_limited"
        assert 1 <= int(response.headers["retry-after"]) <= 60
        events = await gw.events(response.headers["x-request-id"])
        (exceeded,) = [e.data for e in events if e.type == "RateLimitExceeded"]
        assert exceeded["subject"] == f"key:{limited['key_id']}"
        assert (exceeded["limit_name"], exceeded["limit"]) == ("requests_per_minute", 2)
        for _ in range(3):  # the workspace's other key has no limit of its own
            await gw.client().chat.completions.create(model="chat", messages=MESSAGES)
        assert len(gw.upstreams["east"].requests) == 5


async def test_a_keys_own_limits_override_key_limits_and_the_workspace_total_applies(
    database_url,
):
    limits = "    key_limits: {requests_per_minute: 1}\n    limits: {requests_per_minute: 4}\n"
    async with running_gateway(
        database_url, ["east"], [Route("east")], workspace_extra=limits
    ) as gw:
        await _fresh_window()
        roomy = await apikeys.create_key(gw.store, "acme", limits=KeyLimits(requests_per_minute=10))
        await gw.client().chat.completions.create(model="chat", messages=MESSAGES)
        with pytest.raises(openai.RateLimitError):  # the workspace's key_limits
            await gw.client().chat.completions.create(model="chat", messages=MESSAGES)
        client = gw.client(roomy.secret)
        for _ in range(3):  # over key_limits: its own limits say 10
            await client.chat.completions.create(model="chat", messages=MESSAGES)
        with pytest.raises(openai.RateLimitError) as refused:  # the workspace's 4 in all
            await client.chat.completions.create(model="chat", messages=MESSAGES)
        events = await gw.events(refused.value.response.headers["x-request-id"])
        (exceeded,) = [e.data for e in events if e.type == "RateLimitExceeded"]
        assert (exceeded["subject"], exceeded["limit"]) == ("workspace:acme", 4)
