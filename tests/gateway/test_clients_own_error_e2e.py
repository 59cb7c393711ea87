"""An upstream's 400 for the client's own error (contract §3 "Errors", §5): a request the
provider refuses as invalid, naming a field the client wrote ("Invalid schema for function
'f'"), with nothing started, is answered 400 ``invalid_request`` carrying the provider's
message, not 502; the attempt and its failure stay recorded, and ``RequestFailed`` records
what the client was told. An upstream 400 the gateway may have caused (its key, its account)
is still the gateway's 502. Through the ``openai`` SDK, on both ledger backends."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from ledger.store import RecordedEvent
from router.fake_provider import Behavior
from tests.gateway.harness import ANTHROPIC_ENV, Gateway, Route, running_gateway

ROUTES = [Route("east"), Route("west", tier=1)]
TOOLS: Any = [
    {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
    }
]


def _of(events: list[RecordedEvent], kind: str) -> list[dict[str, Any]]:
    return [e.data for e in events if e.type == kind]


async def _refused(gw: Gateway, *, stream: bool = False) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as refused:
        await gw.client().chat.completions.create(
            model="chat",
            messages=[{"role": "user", "content": "weather?"}],
            tools=TOOLS,
            stream=stream,
        )
    return refused.value


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "stream"])
@pytest.mark.parametrize("driver", ["openai", "anthropic"])
async def test_an_upstream_400_for_the_clients_own_error_is_its_400_with_the_providers_message(
    database_url: str, driver: str, stream: bool
) -> None:
    async with running_gateway(
        database_url, ["east", "west"], ROUTES, drivers={"east": driver}
    ) as gw:
        gw.upstreams["east"].set_default(Behavior.invalid_request())
        error = await _refused(gw, stream=stream)
        assert isinstance(error, openai.BadRequestError), error
        body = error.response.json()["error"]
        assert (body["code"], body["type"]) == ("invalid_request", "invalid_request_error")
        said = {
            "openai": "Invalid schema for function 'f': In context=(), 'additionalProperties'",
            "anthropic": "tools.0.custom.input_schema: JSON schema is invalid",
        }[driver]
        assert said in body["message"]
        assert body["param"] == ("tools[0].function.parameters" if driver == "openai" else None)
        assert body["attempts"] == [
            {"endpoint": "east", "status": 400, "failure_class": "non_retryable"}
        ]
        assert error.response.headers["x-should-retry"] == "false"
        assert gw.upstreams["west"].hits == 0, "the same request fails anywhere: no failover"

        events = await gw.events(error.response.headers["x-request-id"])
        [finished] = _of(events, "AttemptFinished")
        assert (finished["status"], finished["failure_class"], finished["evidence"]) == (
            "failed",
            "non_retryable",
            "not_started",
        )
        [failed] = _of(events, "RequestFailed")
        assert (failed["http_status"], failed["error_code"], failed["error_type"]) == (
            400,
            "invalid_request",
            "invalid_request_error",
        )
        assert failed["message"] == body["message"], "the ledger says what the client was told"


async def test_an_upstream_400_about_the_gateways_own_key_is_still_a_502(database_url: str):
    async with running_gateway(database_url, ["east", "west"], ROUTES) as gw:
        # Some providers answer a bad key with a 400: the gateway's doing, not the client's.
        refused = Behavior.invalid_request("API key not valid. Please pass a valid API key.")
        gw.upstreams["east"].set_default(refused)
        error = await _refused(gw)
        assert error.status_code == 502
        assert error.response.json()["error"]["code"] == "upstream_error"
        events = await gw.events(error.response.headers["x-request-id"])
        [failed] = _of(events, "RequestFailed")
        assert (failed["http_status"], failed["error_code"]) == (502, "upstream_error")


async def test_the_providers_message_reaches_the_client_without_the_endpoints_key(
    database_url: str,
) -> None:
    async with running_gateway(database_url, ["east", "west"], ROUTES) as gw:
        key = ANTHROPIC_ENV["FAKE_KEY"]  # the endpoint's key, as the config reads it
        echo = f"Invalid schema for function 'f' (request by {key}): 'type' is required"
        gw.upstreams["east"].set_default(Behavior.invalid_request(echo))
        error = await _refused(gw)
        assert error.status_code == 400
        assert "Invalid schema for function 'f' (request by [redacted])" in error.message
        assert key not in error.response.text
        events = await gw.events(error.response.headers["x-request-id"])
        assert all(key.encode() not in e.payload for e in events)
