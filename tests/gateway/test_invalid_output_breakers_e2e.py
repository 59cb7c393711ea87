"""A tenant's invalid outputs stay its own (contract §5 "Circuit breakers"): an
``invalid_output`` counts toward the mapping's breaker only when the breaker's window holds
invalid outputs from more than one workspace. One workspace's requests that keep demanding a
shape the model does not give are still recorded, settled and failed over, but they never
open the breaker every workspace shares; two workspaces' do. Run with breakers in process and
shared through Redis, on both ledger backends, with the ``openai`` SDK as the client."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai import AsyncOpenAI

from ledger import apikeys
from router.fake_provider import Behavior
from tests.gateway.harness import Gateway, gateway_with_breakers

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
FORMAT: Any = {
    "type": "json_schema",
    "json_schema": {"name": "place", "schema": SCHEMA, "strict": True},
}
VALID = json.dumps({"city": "Paris"})
NOT_JSON = Behavior.ok(text="Paris, I think")  # breaks the schema: invalid_output
BREAKER = "{failure_threshold: 2, base_cooldown_ms: 60000, max_cooldown_ms: 60000}"


async def _ask(gw: Gateway, client: AsyncOpenAI) -> tuple[str, str]:
    """One request demanding the schema: the endpoint that served it, and its request id."""
    raw = await client.chat.completions.with_raw_response.create(
        model="chat",
        messages=[{"role": "user", "content": "where?"}],
        response_format=FORMAT,
    )
    completion = raw.parse()
    assert json.loads(completion.choices[0].message.content or "") == {"city": "Paris"}
    return raw.headers["x-waybill-endpoint"], raw.headers["x-request-id"]


async def _mapping_transitions(gw: Gateway) -> list[dict[str, Any]]:
    events = await gw.store.read_stream("breaker")
    return [e.data for e in events if e.data["scope"] == "mapping"]


@pytest.mark.parametrize("shared", [False, True], ids=["in_process", "redis"])
async def test_one_workspaces_invalid_outputs_do_not_open_the_breaker_two_workspaces_do(
    database_url: str, shared: bool
) -> None:
    async with gateway_with_breakers(
        database_url, shared, "invalid-output", defaults={"breaker": BREAKER}
    ) as gw:
        east, west = gw.upstreams["east"], gw.upstreams["west"]
        west.set_default(Behavior.ok(text=VALID))
        acme = gw.client()
        other = gw.client((await apikeys.create_key(gw.store, "other", "client")).secret)

        # acme's requests get answers that break their schema from east, three times over
        # a breaker threshold of 2: each is failed over to west, and east stays in rotation.
        east.set_default(NOT_JSON)
        for hits in (1, 2, 3):
            served, request_id = await _ask(gw, acme)
            assert (served, east.hits) == ("west", hits)
            finished = [e.data for e in await gw.events(request_id) if e.type == "AttemptFinished"]
            assert [f["failure_class"] for f in finished] == ["invalid_output", None]
            settled = {e.data["attempt_id"] for e in await gw.events(request_id)
                       if e.type == "BudgetSettled"}  # fmt: skip
            assert finished[0]["attempt_id"] in settled, "recorded and settled as ever"
        assert await _mapping_transitions(gw) == []

        # The other workspace is served by east as if nothing happened.
        east.set_default(Behavior.ok(text=VALID))
        assert (await _ask(gw, other))[0] == "east"

        # Now both workspaces get invalid outputs from east: acme's alone is not counted,
        # other's is (acme's is in the window), and acme's next makes two in a row.
        east.set_default(NOT_JSON)
        for client in (acme, other, acme):
            assert (await _ask(gw, client))[0] == "west"
        [opened] = await _mapping_transitions(gw)
        assert (opened["target"], opened["to_state"], opened["reason"]) == (
            "east/fake-model",
            "open",
            "failure_threshold",
        )
        assert (opened["failure_class"], opened["consecutive_failures"]) == ("invalid_output", 2)

        hits = east.hits
        served, request_id = await _ask(gw, other)
        assert (served, east.hits) == ("west", hits), "the mapping's breaker is open for all"
        evaluated = next(e.data for e in await gw.events(request_id) if e.type == "RouteEvaluated")
        east_candidate = next(c for c in evaluated["candidates"] if c["endpoint"] == "east")
        assert (east_candidate["reason_code"], east_candidate["detail"]) == (
            "breaker_open",
            "mapping",
        )
