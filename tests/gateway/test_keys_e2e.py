"""Keys as people manage them, over HTTP on both ledger backends: an expired key is refused
as a revoked one is; the key API (``/v1/admin/keys``) creates, lists and revokes keys, each
change an event on the key's stream with the actor; a key's own rate limits."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from ledger import apikeys
from tests.gateway.harness import Route, running_gateway

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
