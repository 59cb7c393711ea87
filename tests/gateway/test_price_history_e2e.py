"""A mapping's price history through the gateway: an attempt is reserved and settled at the
entry in force when it started, never at a past or a future one."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal as D

from ledger.events import Usage
from tests.gateway.harness import Route, running_gateway


async def test_an_attempt_is_settled_at_the_price_in_force_when_it_started(
    sqlite_url: str,
) -> None:
    today = datetime.now(UTC).date()
    past, future = today - timedelta(days=30), today + timedelta(days=30)
    price = (
        f"[{{from: {past}, input_per_mtok: 1.0, output_per_mtok: 2.0}}, "
        f"{{from: {today}, input_per_mtok: 3.0, output_per_mtok: 5.0}}, "
        f"{{from: {future}, input_per_mtok: 7.0, output_per_mtok: 11.0}}]"
    )
    async with (
        running_gateway(sqlite_url, ["east"], [Route("east", price=price)]) as gw,
        gw.http() as http,
    ):
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
        response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        request_id = response.headers["x-request-id"]
        await gw.wait_for_types(request_id, "RequestCompleted")
        events = await gw.events(request_id)
        settled = next(e.data for e in events if e.type == "BudgetSettled")
        usage = Usage.model_validate(settled["usage"])
        expected = D(usage.input_tokens * 3 + usage.output_tokens * 5) / 10**6
        assert D(settled["settled_usd"]) == expected
