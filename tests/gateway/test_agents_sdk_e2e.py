"""The OpenAI Agents SDK (``openai-agents``, which speaks the Responses API by default) running
an agent with one function tool through the gateway (contract §3 "The Responses door"), on
both backends: the model asks for the tool, the SDK runs it and sends its output back, the
model answers; every turn is a request in the ledger."""

from __future__ import annotations

from typing import Any

import pytest
from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

from ledger import events as ev
from router.fake_provider import Behavior
from tests.gateway.harness import Route, running_gateway

asked: list[str] = []


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    asked.append(city)
    return f"sunny in {city}"


@pytest.fixture(autouse=True)
def _no_tracing_upload() -> Any:
    # The SDK would send its traces to OpenAI's platform: the gateway's are its own.
    set_tracing_disabled(True)
    asked.clear()
    yield


@pytest.mark.parametrize("stream", [False, True])
async def test_an_agent_with_a_function_tool_runs_through_the_gateway(database_url, stream):
    async with running_gateway(database_url, ["up"], [Route("up")]) as gw:
        gw.upstreams["up"].set_plan([Behavior.tool_call("get_weather"), Behavior.ok()])
        agent = Agent(
            name="weather",
            instructions="Answer with the weather.",
            tools=[get_weather],
            model=OpenAIResponsesModel(model="chat", openai_client=gw.client()),
        )
        if stream:
            result: Any = Runner.run_streamed(agent, "Weather in Paris?")
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(agent, "Weather in Paris?")
        assert asked == ["Paris"], "the SDK ran the tool the model asked for"
        assert str(result.final_output).startswith("Hello from up")
        first, second = gw.upstreams["up"].requests[-2:]
        assert first.json["messages"][0] == {
            "role": "system",
            "content": "Answer with the weather.",
        }
        tool_turn = second.json["messages"][-1]
        assert tool_turn["role"] == "tool" and tool_turn["content"] == "sunny in Paris"
        # Both turns are in the ledger, through the Responses door, settled.
        ids = [raw.response_id for raw in result.raw_responses]
        assert len(ids) == 2
        for response_id in ids:
            request_id = "req_" + str(response_id).removeprefix("resp_")
            types = await gw.wait_for_types(request_id, "RequestCompleted")
            assert "BudgetSettled" in types
            received = (await gw.events(request_id))[0].event()
            assert isinstance(received, ev.RequestReceived)
            assert received.api == "openai.responses"
