"""Every billable dimension of a request is reserved before the call and settled at its
price after it, end to end: `n` beyond `limits.max_n` is refused, `n` within it is reserved
at its true worst case (and refused 402 when no budget covers it), a request the mapping
cannot price is routed elsewhere or refused, never guessed at, and audio tokens and web
searches settle at their own prices."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from ledger import apikeys
from ledger.events import Usage
from router.config import Limits
from router.doors.chat import HeaderNarrowing, parse_body
from router.fake_provider import PART_TOKENS
from router.request.worst_case import worst_case_cost
from tests.gateway.harness import ANTHROPIC_ENV, Gateway, Route, config_text, running_gateway

D = Decimal
KEY_BUDGET = "    key_budget: {limit_usd: 0.05, window: day}"
ATTACK: dict[str, Any] = {
    "model": "chat",
    "messages": [{"role": "user", "content": "hi"}],
    "n": 100,
    "max_tokens": 400,
}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "iVBOR" * 2000}}


def worst_case(gw: Gateway, body: dict[str, Any], index: int = 0) -> Decimal:
    """What the gateway reserves for ``body`` on mapping ``index`` of the group."""
    call = parse_body(orjson.dumps(body), Limits(max_n=128))
    workspace, group = gw.config.workspace("acme"), gw.config.model_group("chat")
    assert workspace is not None and group is not None
    requirements = call.requirements(workspace, HeaderNarrowing())
    mapping = group.mappings[index]
    endpoint = gw.config.endpoint(mapping.endpoint)
    assert endpoint is not None
    return worst_case_cost(mapping, requirements, endpoint.driver)


async def test_n_above_limits_max_n_is_refused_400_naming_n_before_anything_is_recorded(
    sqlite_url: str,
) -> None:
    async with (
        running_gateway(sqlite_url, ["east"], [Route("east")], workspace_extra=KEY_BUDGET) as gw,
        gw.http() as http,
    ):
        response = await http.post(
            "/v1/chat/completions", json=ATTACK, headers={"X-Waybill-Max-Cost-Usd": "0.005"}
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("invalid_request", "n")
        assert "limits.max_n" in error["message"]
        assert gw.upstreams["east"].hits == 0
        assert await gw.events(response.headers["x-request-id"]) == []


async def test_n_within_max_n_is_reserved_at_its_true_worst_case_and_refused_402(
    sqlite_url: str,
) -> None:
    # The attack, with the bound raised so that it reaches the books: 100 choices of
    # 400 tokens are 0.08 USD of output, above the request's cap and the key's daily budget.
    async with (
        running_gateway(
            sqlite_url,
            ["east"],
            [Route("east")],
            workspace_extra=KEY_BUDGET,
            limits="{max_n: 128}",
        ) as gw,
        gw.http() as http,
    ):
        expected = worst_case(gw, ATTACK)
        assert expected > D("0.08")
        for headers in ({"X-Waybill-Max-Cost-Usd": "0.005"}, {}):
            response = await http.post("/v1/chat/completions", json=ATTACK, headers=headers)
            assert response.status_code == 402, response.text
            assert response.json()["error"]["code"] == "budget_exceeded"
            events = await gw.events(response.headers["x-request-id"])
            received = next(e.data for e in events if e.type == "RequestReceived")
            assert received["requirements"]["choices"] == 100
            (candidate,) = next(e.data for e in events if e.type == "RouteEvaluated")["candidates"]
            assert (candidate["reason_code"], D(candidate["worst_case_usd"])) == (
                "over_budget",
                expected,
            )
            assert "BudgetReserved" not in [e.type for e in events]
        assert "key:" in response.json()["error"]["message"]  # the key's budget, without a cap
        assert gw.upstreams["east"].hits == 0


async def test_every_choice_is_reserved_and_settled_at_what_the_provider_bills(
    sqlite_url: str,
) -> None:
    async with running_gateway(
        sqlite_url, ["east"], [Route("east")], workspace_extra=KEY_BUDGET
    ) as gw:
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "n": 3}
        raw = await gw.client().chat.completions.with_raw_response.create(
            model="chat",
            messages=[{"role": "user", "content": "hi"}],
            n=3,
            max_completion_tokens=50,
        )
        completion = raw.parse()
        assert [c.index for c in completion.choices] == [0, 1, 2]
        assert completion.usage is not None
        assert completion.usage.completion_tokens == 6 + 7 + 8  # every choice billed

        events = await gw.events(raw.headers["x-request-id"])
        reserved = next(e.data for e in events if e.type == "BudgetReserved")
        settled = next(e.data for e in events if e.type == "BudgetSettled")
        assert D(reserved["amount_usd"]) == worst_case(gw, {**body, "max_completion_tokens": 50})
        assert settled["usage"]["output_tokens"] == 21
        usage = settled["usage"]
        cost = D(usage["input_tokens"] * 1 + usage["output_tokens"] * 2) / 10**6
        assert D(settled["settled_usd"]) == cost <= D(reserved["amount_usd"])
        assert D(raw.headers["x-waybill-cost-usd"]) == cost

        async with gw.http() as http:
            explained = await http.get(f"/v1/requests/{raw.headers['x-request-id']}/explain")
            explanation = explained.json()
        assert explanation["requirements"]["choices"] == 3
        assert explanation["requirements"]["max_output_tokens"] == 50
        assert D(explanation["candidates"][0]["worst_case_usd"]) == D(reserved["amount_usd"])


async def test_a_stream_of_several_choices_is_settled_for_all_of_them(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url, ["east"], [Route("east")]) as gw:
        stream = await gw.client().chat.completions.create(
            model="chat",
            messages=[{"role": "user", "content": "hi"}],
            n=2,
            max_tokens=30,
            stream=True,
        )
        texts = {0: "", 1: ""}
        async for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
        assert texts[0] and texts[1] != texts[0]
        request_id = stream.response.headers["x-request-id"]
        await gw.wait_for_types(request_id, "RequestCompleted")
        events = await gw.events(request_id)
        reserved = next(e.data for e in events if e.type == "BudgetReserved")
        settled = next(e.data for e in events if e.type == "BudgetSettled")
        assert settled["usage"]["output_tokens"] == 6 + 7
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "n": 2}
        assert D(reserved["amount_usd"]) == worst_case(gw, {**body, "max_tokens": 30})


async def test_an_image_is_never_sent_where_its_price_is_unknown(sqlite_url: str) -> None:
    # East has no image price: excluded unpriced_input. West prices one image at the fake
    # provider's token count and serves the request; audio, priced nowhere, is refused.
    west_price = "{input_per_mtok: 1.0, output_per_mtok: 2.0, image_input: {tokens: 765}}"
    routes = [Route("east"), Route("west", tier=1, price=west_price)]
    async with (
        running_gateway(sqlite_url, ["east", "west"], routes) as gw,
        gw.http() as http,
    ):
        message = {"role": "user", "content": [{"type": "text", "text": "what is it?"}, IMAGE]}
        body = {"model": "chat", "messages": [message], "max_tokens": 20}
        response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.headers["x-waybill-endpoint"] == "west"
        assert (gw.upstreams["east"].hits, gw.upstreams["west"].hits) == (0, 1)
        events = await gw.events(response.headers["x-request-id"])
        east, west = next(e.data for e in events if e.type == "RouteEvaluated")["candidates"]
        assert (east["reason_code"], east["detail"], east["worst_case_usd"]) == (
            "unpriced_input",
            "image_input",
            None,
        )
        assert D(west["worst_case_usd"]) == worst_case(gw, body, index=1)
        settled = next(e.data for e in events if e.type == "BudgetSettled")
        assert settled["usage"]["input_tokens"] > PART_TOKENS["image_url"]  # billed as such
        assert D(settled["settled_usd"]) <= D(west["worst_case_usd"])

        audio = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
        body = {"model": "chat", "messages": [{"role": "user", "content": [audio]}]}
        response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["code"] == "no_eligible_route"
        assert "east/fake-model: unpriced_input (audio_input)" in error["message"]
        assert "west/fake-model: unpriced_input (audio_input)" in error["message"]
        assert (gw.upstreams["east"].hits, gw.upstreams["west"].hits) == (0, 1)
        types = await gw.types(response.headers["x-request-id"])
        assert "BudgetReserved" not in types


AUDIO_PRICE = (
    "{input_per_mtok: 1.0, output_per_mtok: 2.0,"
    " audio_input: {tokens: 400, per_mtok: 40}, audio_output: {per_mtok: 80}}"
)
SPOKEN: dict[str, Any] = {
    "model": "chat",
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "say it back"},
                {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
            ],
        }
    ],
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"},
    "max_tokens": 50,
}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_spoken_answer_settles_its_audio_tokens_at_the_audio_prices(
    sqlite_url: str, stream: bool
) -> None:
    async with (
        running_gateway(sqlite_url, ["east"], [Route("east", price=AUDIO_PRICE)]) as gw,
        gw.http() as http,
    ):
        body = {**SPOKEN, "stream": stream}
        response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        request_id = response.headers["x-request-id"]
        await gw.wait_for_types(request_id, "RequestCompleted")
        events = await gw.events(request_id)
        reserved = next(e.data for e in events if e.type == "BudgetReserved")
        settled = next(e.data for e in events if e.type == "BudgetSettled")
        usage = Usage.model_validate(settled["usage"])
        # The fake bills the clip and the answer (6 tokens) as audio, as OpenAI reports it.
        assert (usage.audio_input_tokens, usage.audio_output_tokens) == (
            PART_TOKENS["input_audio"],
            6,
        )
        text_input = usage.input_tokens - usage.audio_input_tokens
        expected = D(text_input * 1 + 400 * 40 + 6 * 80) / 10**6
        assert usage.output_tokens == 6
        assert D(settled["settled_usd"]) == expected <= D(reserved["amount_usd"])
        assert "BudgetOverrun" not in [e.type for e in events]
        completed = next(e.data for e in events if e.type == "RequestCompleted")
        assert D(completed["cost_usd"]) == expected
        assert completed["usage"] == settled["usage"]
        if not stream:
            assert D(response.headers["x-waybill-cost-usd"]) == expected


async def test_a_web_search_settles_its_fee_for_every_choice(sqlite_url: str) -> None:
    price = "{input_per_mtok: 1.0, output_per_mtok: 2.0, web_search: {per_choice_usd: 0.03}}"
    async with (
        running_gateway(sqlite_url, ["east"], [Route("east", price=price)]) as gw,
        gw.http() as http,
    ):
        body = {
            "model": "chat",
            "messages": [{"role": "user", "content": "news?"}],
            "web_search_options": {},
            "n": 2,
            "max_tokens": 20,
        }
        response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert gw.upstreams["east"].requests[-1].json["web_search_options"] == {}
        events = await gw.events(response.headers["x-request-id"])
        reserved = next(e.data for e in events if e.type == "BudgetReserved")
        settled = next(e.data for e in events if e.type == "BudgetSettled")
        usage = settled["usage"]
        # Billed per call and not in the provider's usage: settled at the configured fee.
        assert "web_searches" not in (response.json()["usage"] or {})
        assert usage["web_searches"] == 2
        tokens = D(usage["input_tokens"] * 1 + usage["output_tokens"] * 2) / 10**6
        assert D(settled["settled_usd"]) == tokens + D("0.06") <= D(reserved["amount_usd"])
        assert D(response.headers["x-waybill-cost-usd"]) == tokens + D("0.06")


async def test_an_anthropic_upstream_is_sent_the_output_bound_that_was_reserved(
    sqlite_url: str,
) -> None:
    # Anthropic needs max_tokens; without the client's, it gets the mapping's, which the
    # worst case reserved (not a driver default the reservation knew nothing of). Its
    # driver sends no `n`, so one choice is reserved.
    async with (
        running_gateway(
            sqlite_url,
            ["west"],
            [Route("west", max_output_tokens=1000)],
            drivers={"west": "anthropic"},
        ) as gw,
        gw.http() as http,
    ):
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "n": 4}
        response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert gw.upstreams["west"].requests[-1].json["max_tokens"] == 1000
        events = await gw.events(response.headers["x-request-id"])
        reserved = next(e.data for e in events if e.type == "BudgetReserved")
        assert D(reserved["amount_usd"]) == worst_case(gw, body)
        assert D(reserved["amount_usd"]) < D(1000 * 2 * 2) / 10**6  # one choice, not four


async def test_a_reload_moves_limits_max_n_for_new_requests_and_the_served_schema(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in ANTHROPIC_ENV.items():  # a reload reads ${env:...} as serve does
        monkeypatch.setenv(name, value)
    config_file = tmp_path / "waybill.yaml"
    routes = [Route("east")]
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "n": 10}
    async with (
        running_gateway(sqlite_url, ["east"], routes, config_file=config_file) as gw,
        gw.http() as http,
    ):

        async def n_maximum() -> int:
            schema = (await http.get("/openapi.json")).json()
            n: dict[str, Any] = schema["components"]["schemas"]["ChatCompletionRequest"][
                "properties"
            ]["n"]
            return int(next(s["maximum"] for s in n["anyOf"] if "maximum" in s))

        assert (await http.post("/v1/chat/completions", json=body)).status_code == 400
        assert await n_maximum() == 8
        new = config_text(gw.upstreams, routes, limits="{max_n: 16}", generation="test-2")
        config_file.write_text(new)
        admin = await apikeys.create_key(gw.store, "acme", "admin")
        async with httpx.AsyncClient(
            base_url=gw.url, headers={"Authorization": f"Bearer {admin.secret}"}
        ) as admin_http:
            assert (await admin_http.post("/v1/admin/config/reload")).status_code == 200
        served = await http.post("/v1/chat/completions", json=body)
        assert served.status_code == 200, served.text
        assert len(served.json()["choices"]) == 10
        assert await n_maximum() == 16
