"""The HTTP surface's promises: auth, controlled errors, x-should-retry, Idempotency-Key."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from ledger import apikeys
from router.fake_provider import Behavior
from tests.gateway.harness import Route, running_gateway

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
BODY = {"model": "chat", "messages": MESSAGES}


def assert_error_shape(response, status: int, code: str) -> Any:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert response.headers["x-request-id"]
    error = response.json()["error"]
    assert error["code"] == code
    assert error["request_id"] == response.headers["x-request-id"]
    assert isinstance(error["message"], str) and "Traceback" not in error["message"]
    assert isinstance(error["attempts"], list)
    return error


async def test_missing_unknown_and_revoked_keys_are_refused(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw, gw.http() as http:
        missing = await http.post("/v1/chat/completions", json=BODY, headers={"Authorization": ""})
        assert_error_shape(missing, 401, "invalid_api_key")
        unknown = await http.post(
            "/v1/chat/completions", json=BODY, headers={"Authorization": "Bearer wb_nope"}
        )
        assert_error_shape(unknown, 401, "invalid_api_key")
        assert (await http.post("/v1/chat/completions", json=BODY)).status_code == 200
        await apikeys.revoke_key(gw.store, gw.key_id)
        revoked = await http.post("/v1/chat/completions", json=BODY)
        assert_error_shape(revoked, 401, "invalid_api_key")
        assert gw.upstreams["east"].hits == 1
        received = [e for e in await gw.store.read_all() if e.type == "RequestReceived"]
        assert len(received) == 1  # a revoked key's request leaves nothing on the ledger


@pytest.mark.parametrize(
    ("content", "headers"),
    [
        (orjson.dumps(BODY), {}),
        (orjson.dumps({**BODY, "stream": True}), {}),
        (b"{not json", {}),
        (orjson.dumps({**BODY, "model": "no-such-model"}), {}),
        (orjson.dumps(BODY), {"Idempotency-Key": "once"}),
    ],
    ids=["buffered", "streamed", "bad-body", "unknown-model", "idempotency-key"],
)
async def test_a_key_revoked_after_it_was_used_hears_only_401(database_url, content, headers):
    # The chat path keeps keys it has read; a revocation by another process must still
    # refuse the very next request, before any upstream call, whatever else is wrong with it.
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw, gw.http() as http:
        assert (await http.post("/v1/chat/completions", json=BODY)).status_code == 200
        await apikeys.revoke_key(gw.store, gw.key_id)
        refused = await http.post("/v1/chat/completions", content=content, headers=headers)
        assert_error_shape(refused, 401, "invalid_api_key")
        assert gw.upstreams["east"].hits == 1
        received = [e for e in await gw.store.read_all() if e.type == "RequestReceived"]
        assert len(received) == 1


@pytest.mark.parametrize(
    ("content", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (b'{"model": 7, "messages": []}', 400, "model"),
        (b'{"model": "chat", "messages": "hello"}', 400, "messages"),
        (b'{"model": "chat", "messages": [{"role": "user"}], "stream": "yes"}', 400, "stream"),
        (b'{"model": "chat", "messages": [{"role": "user"}], "max_tokens": -1}', 400, "max_tokens"),
        (b'{"model": "chat", "messages": [{"content": "x"}]}', 400, "messages[0]"),
    ],
)
async def test_bad_bodies_get_a_400_naming_the_field(database_url, content, status, param):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw, gw.http() as http:
        response = await http.post(
            "/v1/chat/completions", content=content, headers={"content-type": "application/json"}
        )
        error = assert_error_shape(response, status, "invalid_request")
        assert error["param"] == param
        assert response.headers["x-should-retry"] == "false"
        assert gw.upstreams["east"].hits == 0
        recorded = {e.type for e in await gw.store.read_all()}
        assert "RequestReceived" not in recorded  # refused at the edge: nothing was routed


async def test_oversized_body_is_refused_before_reading_it_all(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw, gw.http() as http:
        huge = (
            b'{"model": "chat", "messages": [{"role": "user", "content": "'
            + b"x" * (5 * 1024 * 1024)
            + b'"}]}'
        )
        response = await http.post("/v1/chat/completions", content=huge)
        assert_error_shape(response, 413, "invalid_request")


async def test_bad_header_values_are_a_400(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw, gw.http() as http:
        for name, value in [
            ("X-Waybill-Max-Cost-Usd", "lots"),
            ("X-Waybill-Deadline-Ms", "-5"),
            ("X-Waybill-Allow-Failover", "maybe"),
            ("X-Waybill-Data-Class", "secret"),
            ("X-Waybill-Retention", "forever"),
        ]:
            response = await http.post("/v1/chat/completions", json=BODY, headers={name: value})
            error = assert_error_shape(response, 400, "invalid_request")
            assert error["param"] == name


@pytest.mark.parametrize(
    "name",
    ["Authorization", "Idempotency-Key", "X-Waybill-Max-Cost-Usd", "X-Waybill-Allow-Failover"],
)
async def test_a_single_valued_header_sent_twice_is_a_400_naming_it(database_url, name):
    # Which of two values wins is a guess: a proxy's stricter cost limit would be ignored, a
    # second key silently dropped. Nothing is reserved or sent upstream.
    values = {
        "Authorization": ("Bearer wb_one", "Bearer wb_two"),
        "Idempotency-Key": ("a", "b"),
        "X-Waybill-Max-Cost-Usd": ("1", "0.0001"),
        "X-Waybill-Allow-Failover": ("true", "false"),
    }[name]
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw, gw.http() as http:
        twice = [(name, value) for value in values]
        response = await http.post("/v1/chat/completions", json=BODY, headers=twice)
        error = assert_error_shape(response, 400, "invalid_request")
        assert error["param"] == name and "more than once" in error["message"]
        assert gw.upstreams["east"].hits == 0
        if name == "Authorization":  # every authenticated route, not the chat route alone
            response = await http.get("/v1/models", headers=twice)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == name


async def test_unknown_model_is_404_model_not_found(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw:
        with pytest.raises(openai.NotFoundError) as caught:
            await gw.client().chat.completions.create(model="no-such-group", messages=MESSAGES)
        assert caught.value.code == "model_not_found"


async def test_unknown_path_is_a_controlled_404(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw, gw.http() as http:
        assert_error_shape(await http.get("/v1/nothing-here"), 404, "not_found")


async def test_quota_exhausted_is_terminal_502_with_should_retry_false(database_url):
    async with (
        running_gateway(
            database_url, ["east", "west"], [Route("east", tier=0), Route("west", tier=1)]
        ) as gw,
        gw.http() as http,
    ):
        gw.upstreams["east"].set_plan([Behavior.insufficient_quota()])
        response = await http.post("/v1/chat/completions", json=BODY)
        error = assert_error_shape(response, 502, "upstream_quota_exhausted")
        assert response.headers["x-should-retry"] == "false"
        assert error["attempts"] == [
            {"endpoint": "east", "status": 429, "failure_class": "quota_exhausted"}
        ]
        assert gw.upstreams["west"].hits == 0
        types = await gw.types(response.headers["x-request-id"])
        assert types[-2:] == ["FailoverDecided", "RequestFailed"]


async def test_idempotency_key_replays_the_recorded_answer_without_a_second_call(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw, gw.http() as http:
        headers = {"Idempotency-Key": "order-42"}
        first = await http.post("/v1/chat/completions", json=BODY, headers=headers)
        second = await http.post("/v1/chat/completions", json=BODY, headers=headers)
        assert first.status_code == second.status_code == 200
        assert second.json() == first.json()
        assert second.headers["x-request-id"] == first.headers["x-request-id"]
        assert second.headers["idempotent-replayed"] == "true"
        assert gw.upstreams["east"].hits == 1
        other = await http.post(
            "/v1/chat/completions",
            json={**BODY, "messages": [{"role": "user", "content": "something else"}]},
            headers=headers,
        )
        assert_error_shape(other, 409, "idempotency_conflict")
        assert gw.upstreams["east"].hits == 1


async def test_idempotency_key_binds_the_body_not_its_key_order(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw, gw.http() as http:
        headers = {"Idempotency-Key": "order-43", "Content-Type": "application/json"}
        body = {"model": "chat", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}
        reordered = {
            "messages": [{"content": "hi", "role": "user"}],
            "max_tokens": 20,
            "model": "chat",
        }
        assert orjson.dumps(body) != orjson.dumps(reordered)
        first = await http.post("/v1/chat/completions", content=orjson.dumps(body), headers=headers)
        second = await http.post(
            "/v1/chat/completions", content=orjson.dumps(reordered), headers=headers
        )
        assert first.status_code == second.status_code == 200
        assert second.headers["idempotent-replayed"] == "true"
        assert gw.upstreams["east"].hits == 1
        other = {**body, "max_tokens": 21}
        third = await http.post(
            "/v1/chat/completions", content=orjson.dumps(other), headers=headers
        )
        assert_error_shape(third, 409, "idempotency_conflict")


async def test_idempotency_key_in_flight_is_a_409(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw, gw.http() as http:
        gw.upstreams["east"].set_plan([Behavior.ok(latency_ms=800)])
        headers = {"Idempotency-Key": "slow-one"}
        first = asyncio.create_task(http.post("/v1/chat/completions", json=BODY, headers=headers))
        await gw.upstreams["east"].wait_for_async(lambda up: up.hits == 1)
        second = await http.post("/v1/chat/completions", json=BODY, headers=headers)
        error = assert_error_shape(second, 409, "idempotency_conflict")
        assert "in flight" in error["message"]
        assert (await first).status_code == 200
        assert gw.upstreams["east"].hits == 1


async def test_streamed_answer_is_replayed_for_the_same_idempotency_key(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw:
        client = gw.client()
        headers = {"Idempotency-Key": "stream-1"}
        first = await client.chat.completions.create(
            model="chat", messages=MESSAGES, stream=True, extra_headers=headers
        )
        first_text = "".join([c.choices[0].delta.content or "" async for c in first])

        async def recorded() -> bool:
            second = await client.chat.completions.create(
                model="chat", messages=MESSAGES, stream=True, extra_headers=headers
            )
            return "".join([c.choices[0].delta.content or "" async for c in second]) == first_text

        assert await recorded()
        assert gw.upstreams["east"].hits == 1


def _as(secret: str, idempotency_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}", "Idempotency-Key": idempotency_key}


async def test_another_key_sending_the_same_idempotency_key_makes_an_independent_request(
    database_url,
):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw, gw.http() as http:
        other = await apikeys.create_key(gw.store, "acme", "client")
        first = await http.post("/v1/chat/completions", json=BODY, headers=_as(gw.secret, "k"))
        theirs = await http.post("/v1/chat/completions", json=BODY, headers=_as(other.secret, "k"))
        assert first.status_code == theirs.status_code == 200, theirs.text
        assert "idempotent-replayed" not in theirs.headers
        assert theirs.headers["x-request-id"] != first.headers["x-request-id"]
        assert gw.upstreams["east"].hits == 2
        # Its answer is its own request, which it may read (the explanation reads the ledger).
        explained = await http.get(
            f"/v1/requests/{theirs.headers['x-request-id']}/explain",
            headers={"Authorization": f"Bearer {other.secret}"},
        )
        assert explained.status_code == 200, explained.text
        # Each key's retry still gets its own recorded answer, without another call.
        for secret, answer in ((gw.secret, first), (other.secret, theirs)):
            again = await http.post("/v1/chat/completions", json=BODY, headers=_as(secret, "k"))
            assert again.headers["idempotent-replayed"] == "true"
            assert again.headers["x-request-id"] == answer.headers["x-request-id"]
            assert again.json() == answer.json()
        assert gw.upstreams["east"].hits == 2


async def test_another_key_sending_the_same_idempotency_key_with_another_body_is_no_conflict(
    database_url,
):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw, gw.http() as http:
        other = await apikeys.create_key(gw.store, "acme", "client")
        another_body = {**BODY, "messages": [{"role": "user", "content": "something else"}]}
        first = await http.post("/v1/chat/completions", json=BODY, headers=_as(gw.secret, "k"))
        theirs = await http.post(
            "/v1/chat/completions", json=another_body, headers=_as(other.secret, "k")
        )
        assert first.status_code == theirs.status_code == 200, theirs.text
        assert "idempotent-replayed" not in theirs.headers
        assert gw.upstreams["east"].hits == 2
        # The first key's own reuse with another body is still a conflict.
        mine = await http.post(
            "/v1/chat/completions", json=another_body, headers=_as(gw.secret, "k")
        )
        assert_error_shape(mine, 409, "idempotency_conflict")
        assert gw.upstreams["east"].hits == 2


async def test_another_key_is_not_told_an_idempotency_key_is_in_flight(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw, gw.http() as http:
        other = await apikeys.create_key(gw.store, "acme", "client")
        gw.upstreams["east"].set_plan([Behavior.ok(latency_ms=800)])
        first = asyncio.create_task(
            http.post("/v1/chat/completions", json=BODY, headers=_as(gw.secret, "slow"))
        )
        await gw.upstreams["east"].wait_for_async(lambda up: up.hits == 1)
        theirs = await http.post(
            "/v1/chat/completions", json=BODY, headers=_as(other.secret, "slow")
        )
        assert theirs.status_code == 200, theirs.text
        assert not first.done()  # answered while the first key's request was in flight
        assert (await first).status_code == 200
        assert gw.upstreams["east"].hits == 2


async def test_capacity_error_is_503_and_never_touches_an_upstream(database_url):
    async with (
        running_gateway(database_url, ["east"], [Route("east")], max_in_flight=1) as gw,
        gw.http() as http,
    ):
        gw.upstreams["east"].set_plan([Behavior.ok(latency_ms=800)])
        first = asyncio.create_task(http.post("/v1/chat/completions", json=BODY))
        await gw.upstreams["east"].wait_for_async(lambda up: up.hits == 1)
        second = await http.post("/v1/chat/completions", json=BODY)
        assert_error_shape(second, 503, "capacity_error")
        assert (await first).status_code == 200
        assert gw.upstreams["east"].hits == 1


# --- found by fuzzing the API from its OpenAPI schema (test_fuzz_api.py) ------------------


async def test_an_undeclared_method_is_a_controlled_405_naming_the_allowed_ones(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw, gw.http() as http:
        response = await http.delete("/v1/models")
        error = assert_error_shape(response, 405, "invalid_request")
        assert error["type"] == "invalid_request_error"
        assert response.headers["allow"] == "GET"


async def test_max_tokens_is_any_json_integer_within_i_json_range(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw, gw.http() as http:
        # JSON has numbers, not ints: 16.0 is the integer 16.
        accepted = await http.post("/v1/chat/completions", json={**BODY, "max_tokens": 16.0})
        assert accepted.status_code == 200, accepted.text
        for content in (
            b'{"model": "chat", "messages": [{"role": "user"}], "max_tokens": 9007199254740992}',
            b'{"model": "chat", "messages": [{"role": "user"}], "max_tokens": 1e30}',
            b'{"model": "chat", "messages": [{"role": "user"}], "max_tokens": 16.5}',
        ):
            response = await http.post("/v1/chat/completions", content=content)
            assert assert_error_shape(response, 400, "invalid_request")["param"] == "max_tokens"


async def test_header_numbers_beyond_what_the_ledger_holds_are_a_400_not_a_500(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw, gw.http() as http:
        for name, value in [
            ("X-Waybill-Deadline-Ms", "1" + "0" * 30),  # no event could record it
            ("X-Waybill-Deadline-Ms", "\u00b2"),  # a digit to str.isdigit, no number to int()
            ("X-Waybill-Max-Cost-Usd", "1" + "0" * 26),  # beyond NUMERIC(38, 12)
            ("X-Waybill-Max-Cost-Usd", "1e3"),  # money is plain digits
        ]:
            response = await http.post(
                "/v1/chat/completions", json=BODY, headers={name.encode(): value.encode("latin-1")}
            )
            assert assert_error_shape(response, 400, "invalid_request")["param"] == name
        assert gw.upstreams["east"].hits == 0
        within = {"X-Waybill-Deadline-Ms": "9" * 15, "X-Waybill-Max-Cost-Usd": "9" * 25}
        assert (await http.post("/v1/chat/completions", json=BODY, headers=within)).is_success


async def test_query_values_outside_the_calendar_or_with_nul_are_a_400_not_a_500(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw, gw.http() as http:
        # A cursor this endpoint could have handed out, but for an instant outside the calendar.
        forged = "WyJyZXF1ZXN0cyIsIjAwMDEtMDEtMDFUMDA6MDA6MDArMjM6NTkiLCJ4Il0"
        for params, param in [
            ({"since": "0001-01-01T00:00:00+23:59"}, "since"),
            ({"until": "9999-12-31T23:59:59-23:59"}, "until"),
            ({"limit": "\u00b2"}, "limit"),
            ({"cursor": forged}, "cursor"),
            ({"model": "chat\x00"}, None),  # PostgreSQL text cannot hold NUL
        ]:
            response = await http.get("/v1/requests", params=params)
            assert assert_error_shape(response, 400, "invalid_request")["param"] == param
        for path in (
            "/v1/requests/req%00x",
            "/v1/spend?workspace=%00",
            "/v1/budgets?workspace=%00",
        ):
            assert_error_shape(await http.get(path), 400, "invalid_request")


async def test_usage_export_and_settlement_values_out_of_range_are_a_400(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw:
        admin = await apikeys.create_key(gw.store, "acme", "admin")
        headers = {"Authorization": f"Bearer {admin.secret}"}
        line = {
            "attempt_id": "att_x",
            "model": "m",
            "input_tokens": 1,
            "output_tokens": 1,
            "cost_usd": "0.01",
            "timestamp": "2026-11-30T12:00:00Z",
        }
        async with gw.http() as http:
            for field, value in [
                ("timestamp", "0001-01-01T00:00:00+23:59"),  # outside the calendar in UTC
                ("attempt_id", "att\x00x"),  # PostgreSQL text cannot hold NUL
                ("input_tokens", "\u00b2"),
            ]:
                response = await http.post(
                    "/v1/reconciliations",
                    content=orjson.dumps({**line, field: value}) + b"\n",
                    headers={**headers, "content-type": "application/x-ndjson"},
                )
                assert assert_error_shape(response, 400, "invalid_request")["param"] == field
            response = await http.post(
                "/v1/settlements/unknown/set_x",
                json={"settled_usd": "1" + "0" * 26, "reason": "beyond NUMERIC(38, 12)"},
                headers=headers,
            )
            assert assert_error_shape(response, 400, "invalid_request")["param"] == "settled_usd"
