"""``waybill explain`` as a real process, on a ledger the gateway wrote."""

from __future__ import annotations

import json

from router.fake_provider import Behavior
from tests.gateway.harness import Route, running_gateway
from tests.gateway.test_failure_table import BODY
from tests.ledger.test_cli import waybill


async def test_explain_prints_the_same_explanation_as_the_api(sqlite_url: str) -> None:
    async with running_gateway(
        sqlite_url, ["east", "west"], [Route("east"), Route("west", tier=1)]
    ) as gw:
        gw.upstreams["east"].set_plan([Behavior.rate_limited()])
        async with gw.http() as http:
            response = await http.post("/v1/chat/completions", json=BODY)
            request_id = response.headers["x-request-id"]
            api = (await http.get(f"/v1/requests/{request_id}/explain")).json()
            api_text = (
                await http.get(f"/v1/requests/{request_id}/explain", params={"format": "text"})
            ).text

    as_json = waybill("explain", request_id, "--json", database_url=sqlite_url)
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout) == api
    as_text = waybill("explain", request_id, "--database-url", sqlite_url, database_url="")
    assert as_text.returncode == 0, as_text.stderr
    assert as_text.stdout == api_text
    assert "answered 429 rate_limited before starting work (failover: not_started_failover)" in (
        " ".join(as_text.stdout.split())
    )


def test_explain_of_an_unknown_request_exits_1_with_one_line(sqlite_url: str) -> None:
    result = waybill("explain", "req_nope", database_url=sqlite_url)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.strip().splitlines() == ["error: no request 'req_nope' in the ledger"]
