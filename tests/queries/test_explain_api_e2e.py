"""Explain names the door a request came through (`RequestReceived.api`): the query API's
JSON and text, `waybill explain`, the console's request page; and the console's spend page
groups by it."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from ledger import apikeys
from tests.console.support import browser, sign_in
from tests.gateway.door_traffic import served_through
from tests.gateway.harness import Route, running_gateway
from tests.helpers import eventually
from tests.ledger.test_cli import waybill

BODY: dict[str, Any] = {
    "model": "chat",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 100,
}


async def test_explain_and_the_console_name_the_door(database_url: str) -> None:
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw:
        admin = await apikeys.create_key(gw.store, "acme", "admin")
        async with gw.http() as http:
            chat = (await http.post("/v1/chat/completions", json=BODY)).headers["x-request-id"]
        messages = await served_through(gw, "anthropic.messages", BODY)
        async with gw.http() as http:
            for request_id, api in (
                (chat, "openai.chat_completions"),
                (messages, "anthropic.messages"),
            ):
                x = (await http.get(f"/v1/requests/{request_id}/explain")).json()
                assert x["api"] == api
                assert x["decision_path"][0]["text"].startswith(f"received through {api} ")
                text = await http.get(
                    f"/v1/requests/{request_id}/explain", params={"format": "text"}
                )
                assert f"· api {api} ·" in text.text
        async with browser(gw) as page:
            await sign_in(page, admin.secret)
            shown = await page.get(f"/console/requests/{messages}")
            assert shown.status_code == 200
            assert re.search(
                r"<dt>client API</dt><dd><code>anthropic\.messages</code></dd>", shown.text
            )

            async def grouped() -> bool:
                spend = await page.get("/console/spend", params={"group": "api"})
                assert spend.status_code == 200
                return "<td>anthropic.messages</td>" in spend.text

            await eventually(grouped)
            spend = await page.get("/console/spend", params={"group": "api"})
            assert "<td>openai.chat_completions</td>" in spend.text
            assert '<option value="api" selected>client API</option>' in spend.text


def test_waybill_explain_names_the_door(sqlite_url: str) -> None:
    async def traffic() -> str:
        async with running_gateway(sqlite_url, ["east"], [Route("east")]) as gw:
            return await served_through(gw, "anthropic.messages", BODY)

    request_id = asyncio.run(traffic())
    shown = waybill("explain", request_id, database_url=sqlite_url)
    assert shown.returncode == 0, shown.stderr
    assert "· api anthropic.messages ·" in shown.stdout
    as_json = waybill("explain", request_id, "--json", database_url=sqlite_url)
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["api"] == "anthropic.messages"
