"""What the console's tests share: a gateway with two tiers, keys of every role, traffic that
fails over and leaves unknown usage behind, and signing in over plain HTTP."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx

from ledger import apikeys
from router.fake_provider import Behavior
from tests.gateway.harness import Gateway, Route, running_gateway
from tests.gateway.test_failure_table import BODY
from tests.helpers import eventually

ROLES: dict[str, tuple[str, apikeys.Role]] = {  # name: (workspace, role)
    "admin": ("acme", "admin"),
    "auditor": ("acme", "auditor"),
    "finance": ("acme", "finance"),
    "other_auditor": ("other", "auditor"),
    "other_client": ("other", "client"),
}

_TOKEN = re.compile(r'name="csrf_token" value="([^"]+)"')


@dataclass
class Traffic:
    gateway: Gateway
    secrets: dict[str, str]  # role name -> secret; "client" is the harness's acme client
    failed_over: str  # a request of acme's client that failed over from east to west
    unknown: str  # a request of acme's client whose first attempt's usage is unknown
    other: str  # a request of workspace other


@asynccontextmanager
async def traffic(database_url: str) -> AsyncIterator[Traffic]:
    """A gateway (east on tier 0, west on tier 1) that served three requests: one failed
    over after east's 500 (its usage unknown), one after east's 429 (which opens east's
    breaker), one of workspace ``other`` (served by west, east's breaker being open)."""
    async with running_gateway(
        database_url, ["east", "west"], [Route("east"), Route("west", tier=1)]
    ) as gw:
        secrets = {"client": gw.secret}
        for name, (workspace, role) in ROLES.items():
            secrets[name] = (await apikeys.create_key(gw.store, workspace, role)).secret
        gw.upstreams["east"].set_plan(
            [Behavior.server_error(), Behavior.rate_limited(), Behavior.ok()]
        )
        async with gw.http() as http:
            ids = []
            for secret in (gw.secret, gw.secret, secrets["other_client"]):
                answer = await http.post(
                    "/v1/chat/completions",
                    json=BODY,
                    headers={"Authorization": f"Bearer {secret}"},
                )
                assert answer.status_code == 200, answer.text
                ids.append(answer.headers["x-request-id"])

            async def projected() -> bool:
                listed = await http.get(
                    "/v1/settlements/unknown",
                    params={"state": "open"},
                    headers={"Authorization": f"Bearer {secrets['admin']}"},
                )
                views = await http.get(
                    "/v1/requests", headers={"Authorization": f"Bearer {secrets['admin']}"}
                )
                done = [v for v in views.json()["data"] if v["status"] != "in_progress"]
                return len(listed.json()["data"]) == 1 and len(done) == 3

            await eventually(projected, within_s=15)
        yield Traffic(gw, secrets, failed_over=ids[1], unknown=ids[0], other=ids[2])


def csrf_token(html: str) -> str:
    found = _TOKEN.search(html)
    assert found, "no CSRF token on the page"
    return found.group(1)


async def sign_in(http: httpx.AsyncClient, secret: str) -> httpx.Response:
    """Sign in as a browser does: the form's page (its token and cookie), then the form."""
    page = await http.get("/console/sign-in")
    assert page.status_code == 200
    return await http.post(
        "/console/sign-in", data={"api_key": secret, "csrf_token": csrf_token(page.text)}
    )


def browser(gateway: Gateway) -> httpx.AsyncClient:
    """A client with a cookie jar and no API key, as a browser would be."""
    return httpx.AsyncClient(base_url=gateway.url, timeout=30, follow_redirects=False)
