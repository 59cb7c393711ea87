"""A composed model group over HTTP (contract §4 "Pools"): ``chat`` lists a local pool (tier
0) and a cloud pool (tier 1), each a model group of its own. The composer admits a request to
a pool and delegates (``delegate_pool``); a pre-planned fallback is an exact dispatch
(``execute_endpoint``); each level's evaluation is recorded, and every request's story holds
to `waybill verify`'s rules. Run on SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from openai.types.chat import ChatCompletionMessageParam

from ledger import apikeys
from ledger.audit.stories import Stories
from router.fake_provider import Behavior
from tests.console.support import browser, sign_in
from tests.gateway.harness import (
    ANTHROPIC_ENV,
    Route,
    config_text,
    mappings_yaml,
    running_gateway,
)

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
COMPOSED = """    pools:
      - {group: local, tier: 0}
      - {group: cloud, tier: 1}
"""
GROUPS = {
    "chat": COMPOSED,
    "local": f"    mappings:\n{mappings_yaml([Route('local-a'), Route('local-b', tier=1)])}",
    "cloud": f"    mappings:\n{mappings_yaml([Route('cloud')])}",
}
UPSTREAMS = ["local-a", "local-b", "cloud"]
BREAKER = "{failure_threshold: 1, base_cooldown_ms: 60000, max_cooldown_ms: 60000}"


def _pooled(**options: Any) -> Any:
    return {"groups": GROUPS, **options}


async def _served_by(gw: Any) -> tuple[str, str]:
    raw = await gw.client().chat.completions.with_raw_response.create(
        model="chat", messages=MESSAGES
    )
    return raw.headers["x-waybill-endpoint"], raw.headers["x-request-id"]


async def _story(gw: Any, request_id: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The request's evaluations and attempt starts; its story broken nowhere."""
    events = await gw.events(request_id)
    stories = Stories()
    broken = [b for i, e in enumerate(events) for b in stories.feed(i, e.stream_id, _body(e))]
    assert broken == []
    evaluated = [e.data for e in events if e.type == "RouteEvaluated"]
    started = [e.data for e in events if e.type == "AttemptStarted"]
    return evaluated, started


def _body(event: Any) -> dict[str, Any]:
    return {"type": event.type, "data": event.data}


async def test_the_first_attempt_is_a_delegation_and_each_level_is_evaluated(database_url):
    async with running_gateway(database_url, UPSTREAMS, [Route("cloud")], **_pooled()) as gw:
        endpoint, request_id = await _served_by(gw)
        assert endpoint == "local-a"
        evaluated, started = await _story(gw, request_id)
        composer, pool = evaluated
        assert composer["group_path"] == ["chat"]
        assert [(c["pool"], c["eligible"]) for c in composer["candidates"]] == [
            ("local", True),
            ("cloud", True),
        ]
        assert composer["chosen"]["endpoint"] == "local-a"
        assert pool["group_path"] == ["chat", "local"]
        assert [c["endpoint"] for c in pool["candidates"]] == ["local-a", "local-b"]
        (attempt,) = started
        assert attempt["dispatch"] == "delegate_pool"
        assert attempt["pool"] == "local"
        assert attempt["group_path"] == ["chat", "local"]
        assert attempt["preferred_endpoint"] == "local-a"


async def test_a_saturated_local_pool_leaves_the_request_to_the_cloud_pool(database_url):
    limited = {"local-a": "    max_in_flight: 1\n", "local-b": "    max_in_flight: 1\n"}
    async with running_gateway(
        database_url, UPSTREAMS, [Route("cloud")], endpoint_extra=limited, **_pooled()
    ) as gw:
        local_a, local_b = gw.upstreams["local-a"], gw.upstreams["local-b"]
        local_a.set_default(Behavior.ok(latency_ms=1500))
        local_b.set_default(Behavior.ok(latency_ms=1500))
        first = asyncio.ensure_future(_served_by(gw))
        second = asyncio.ensure_future(_served_by(gw))
        await local_a.wait_for_async(lambda up: up.hits >= 1)
        await local_b.wait_for_async(lambda up: up.hits >= 1)  # both local slots taken
        endpoint, request_id = await _served_by(gw)
        assert endpoint == "cloud"
        evaluated, started = await _story(gw, request_id)
        local = next(c for c in evaluated[0]["candidates"] if c["pool"] == "local")
        assert local["reason_code"] == "pool_unavailable"
        assert "endpoint_saturated" in local["detail"]
        (attempt,) = started
        assert (attempt["dispatch"], attempt["pool"]) == ("delegate_pool", "cloud")
        assert {(await first)[0], (await second)[0]} == {"local-a", "local-b"}


async def test_a_pools_breaker_opens_and_the_planned_fallback_is_an_exact_dispatch(
    database_url,
):
    async with running_gateway(
        database_url,
        UPSTREAMS,
        [Route("cloud")],
        defaults={"breaker": BREAKER},
        **_pooled(),
    ) as gw:
        gw.upstreams["local-a"].set_default(Behavior.server_error(503))
        endpoint, request_id = await _served_by(gw)
        # local-a failed and its breaker opened; the plan's next binding is local-b (the
        # local pool's tier 1), executed exactly, never reordered by the pool.
        assert endpoint == "local-b"
        evaluated, started = await _story(gw, request_id)
        assert [(a["endpoint"], a["dispatch"], a["cause"]) for a in started] == [
            ("local-a", "delegate_pool", "first"),
            ("local-b", "execute_endpoint", "failover"),
        ]
        assert started[1]["preferred_endpoint"] is None
        assert [e["group_path"] for e in evaluated] == [
            ["chat"],
            ["chat", "local"],
            ["chat"],
            ["chat", "local"],
        ]
        again, request_id = await _served_by(gw)
        assert again == "local-b"  # the pool's own router: local-a is behind its breaker
        evaluated, _ = await _story(gw, request_id)
        inner = {c["endpoint"]: c["reason_code"] for c in evaluated[1]["candidates"]}
        assert inner["local-a"] == "breaker_open"


async def test_the_fallback_crosses_to_the_cloud_pool_by_exact_dispatch(database_url):
    async with running_gateway(database_url, UPSTREAMS, [Route("cloud")], **_pooled()) as gw:
        gw.upstreams["local-a"].set_default(Behavior.server_error(503))
        gw.upstreams["local-b"].set_default(Behavior.server_error(503))
        endpoint, request_id = await _served_by(gw)
        assert endpoint == "cloud"
        _, started = await _story(gw, request_id)
        assert [(a["endpoint"], a["dispatch"], a["pool"]) for a in started] == [
            ("local-a", "delegate_pool", "local"),
            ("local-b", "execute_endpoint", "local"),
            ("cloud", "execute_endpoint", "cloud"),
        ]


async def test_a_pool_the_workspace_may_not_use_is_excluded(database_url):
    async with running_gateway(
        database_url,
        UPSTREAMS,
        [Route("cloud")],
        workspace_models={"acme": ["chat", "cloud"]},
        **_pooled(),
    ) as gw:
        endpoint, request_id = await _served_by(gw)
        assert endpoint == "cloud"
        evaluated, _ = await _story(gw, request_id)
        local = next(c for c in evaluated[0]["candidates"] if c["pool"] == "local")
        assert local["reason_code"] == "pool_not_permitted"


async def test_explain_shows_the_nesting_of_a_pooled_request(database_url):
    async with running_gateway(database_url, UPSTREAMS, [Route("cloud")], **_pooled()) as gw:
        gw.upstreams["local-a"].set_default(Behavior.server_error(503))
        gw.upstreams["local-b"].set_default(Behavior.server_error(503))
        _, request_id = await _served_by(gw)
        async with gw.http() as http:
            explained = (await http.get(f"/v1/requests/{request_id}/explain")).json()
            text = (await http.get(f"/v1/requests/{request_id}/explain?format=text")).text
        levels = {(tuple(c["group_path"]), c["pool"]) for c in explained["candidates"]}
        assert (("chat",), "local") in levels and (("chat",), "cloud") in levels
        assert (("chat", "local"), None) in levels
        assert [(a["dispatch"], a["group_path"]) for a in explained["attempts"]] == [
            ("delegate_pool", ["chat", "local"]),
            ("execute_endpoint", ["chat", "local"]),
            ("execute_endpoint", ["chat", "cloud"]),
        ]
        steps = [s["text"] for s in explained["decision_path"]]
        assert any("of the members of composed group chat" in s for s in steps)
        assert any("inside pool local (chat > local)" in s for s in steps)
        assert any("delegated to pool local (chat > local)" in s for s in steps)
        assert any("executed exactly in pool cloud (chat > cloud)" in s for s in steps)
        assert "pool local (prefers local-a/fake-model)" in text
        assert "execute_endpoint via chat > cloud" in text


async def test_a_pooled_stream_is_delegated_and_served(database_url):
    async with running_gateway(database_url, UPSTREAMS, [Route("cloud")], **_pooled()) as gw:
        gw.upstreams["local-a"].set_default(Behavior.server_error(503))
        raw = await gw.client().chat.completions.with_raw_response.create(
            model="chat", messages=MESSAGES, stream=True
        )
        stream = raw.parse()
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text
        request_id = raw.headers["x-request-id"]
        await gw.wait_for_types(request_id, "RequestCompleted")
        _, started = await _story(gw, request_id)
        assert [(a["endpoint"], a["dispatch"], a["stream"]) for a in started] == [
            ("local-a", "delegate_pool", True),
            ("local-b", "execute_endpoint", True),
        ]


async def test_the_console_shows_each_level_and_each_directive(database_url):
    async with running_gateway(database_url, UPSTREAMS, [Route("cloud")], **_pooled()) as gw:
        gw.upstreams["local-a"].set_default(Behavior.server_error(503))
        _, request_id = await _served_by(gw)
        admin = (await apikeys.create_key(gw.store, "acme", "admin")).secret
        async with browser(gw) as http:
            assert (await sign_in(http, admin)).status_code == 303
            page = (await http.get(f"/console/requests/{request_id}")).text
        assert "route evaluation 1: pools of chat" in page
        assert "route evaluation 2: inside pool chat &gt; local" in page
        assert "pool <strong>local</strong> (prefers local-a/fake-model)" in page
        assert "delegate_pool via chat &gt; local" in page
        assert "execute_endpoint via chat &gt; local" in page


async def test_a_reload_never_redirects_a_pooled_request_in_flight(
    database_url, tmp_path, monkeypatch
):
    for name, value in ANTHROPIC_ENV.items():
        monkeypatch.setenv(name, value)  # a reload reads the file as `waybill serve` does
    config_file = tmp_path / "waybill.yaml"
    async with running_gateway(
        database_url, UPSTREAMS, [Route("cloud")], config_file=config_file, **_pooled()
    ) as gw:
        admin = (await apikeys.create_key(gw.store, "acme", "admin")).secret
        local_a, local_b = gw.upstreams["local-a"], gw.upstreams["local-b"]
        local_a.set_plan([dataclasses.replace(Behavior.server_error(503), latency_ms=1500)])
        in_flight = asyncio.ensure_future(_served_by(gw))
        await local_a.wait_for_async(lambda up: up.hits == 1)
        # The new generation serves chat from the cloud pool alone.
        groups = {**GROUPS, "chat": "    pools:\n      - {group: cloud}\n"}
        text = config_text(gw.upstreams, [Route("cloud")], groups=groups)
        config_file.write_text(text.replace("generation: test-1", "generation: test-2"))
        async with gw.http() as http:
            http.headers["Authorization"] = f"Bearer {admin}"
            reloaded = await http.post("/v1/admin/config/reload")
        assert reloaded.status_code == 200, reloaded.text
        assert (await _served_by(gw))[0] == "cloud"
        # The request in flight keeps its generation's plan: local-a's failure falls back
        # to the binding it planned, local-b, by exact dispatch.
        endpoint, request_id = await in_flight
        assert endpoint == "local-b"
        _, started = await _story(gw, request_id)
        assert [(a["endpoint"], a["dispatch"]) for a in started] == [
            ("local-a", "delegate_pool"),
            ("local-b", "execute_endpoint"),
        ]
        assert local_b.hits == 1


async def test_a_hedge_stays_in_the_running_attempts_pool(database_url):
    # contract §4 "Pools": a pool keeps its own hedging, and a child's hedges stay inside
    # its pool's scope. The local pool hedges, but has one endpoint, busy with the first
    # way: no hedge, though the cloud pool is free.
    groups = {**GROUPS, "local": f"    mappings:\n{mappings_yaml([Route('local-a')])}"}
    async with running_gateway(
        database_url,
        UPSTREAMS,
        [Route("cloud")],
        policies={"local": "{hedge: {enabled: true, after_ms: 100}}"},
        groups=groups,
    ) as gw:
        gw.upstreams["local-a"].set_default(Behavior.ok(latency_ms=1000))
        endpoint, request_id = await _served_by(gw)
        assert endpoint == "local-a"
        evaluated, started = await _story(gw, request_id)
        assert [(a["kind"], a["pool"]) for a in started] == [("call", "local")]
        hedge = evaluated[-1]  # the hedge's evaluation: the pool's alone, nothing left
        assert (hedge["group_path"], hedge["chosen"]) == (["chat", "local"], None)
        assert gw.upstreams["cloud"].hits == 0


async def test_a_composition_error_is_a_500_in_the_documented_shape_before_any_io(database_url):
    # Within one config generation the composer only hands its pools directives they can
    # carry out; to see the seam guarded end to end, the served plan's composer is put out
    # of step with its local pool (it reads the pool's mappings from the wrong place).
    async with running_gateway(database_url, UPSTREAMS, [Route("cloud")], **_pooled()) as gw:
        plans = gw.app_state.gateway._plans
        composition = plans["chat"].composition
        local, cloud = composition.pools
        broken = dataclasses.replace(local, offset=local.offset + 1)
        plans["chat"] = dataclasses.replace(
            plans["chat"], composition=dataclasses.replace(composition, pools=(broken, cloud))
        )
        async with gw.http() as http:
            answer = await http.post(
                "/v1/chat/completions", json={"model": "chat", "messages": MESSAGES}
            )
        assert answer.status_code == 500
        assert answer.headers["x-should-retry"] == "false"
        error = answer.json()["error"]
        assert (error["type"], error["code"]) == ("api_error", "composition_error")
        assert error["message"].startswith("composition error (binding_outside_scope): ")
        assert error["attempts"] == []
        assert all(up.hits == 0 for up in gw.upstreams.values())  # no upstream I/O
        request_id = answer.headers["x-request-id"]
        types = await gw.types(request_id)
        assert "AttemptStarted" not in types and "FailoverDecided" not in types
        (failed,) = [e.data for e in await gw.events(request_id) if e.type == "RequestFailed"]
        assert (failed["error_code"], failed["http_status"]) == ("composition_error", 500)
        assert await gw.store.read_stream("breaker") == []  # no breaker counted it


async def test_a_groups_own_mappings_beside_its_pools_are_leaves_run_exactly(database_url):
    groups = {
        **GROUPS,
        "chat": f"    mappings:\n{mappings_yaml([Route('cloud', tier=1)])}"
        "    pools:\n      - {group: local, tier: 0}\n",
    }
    async with running_gateway(database_url, UPSTREAMS, [Route("cloud")], groups=groups) as gw:
        gw.upstreams["local-a"].set_default(Behavior.server_error(503))
        gw.upstreams["local-b"].set_default(Behavior.server_error(503))
        endpoint, request_id = await _served_by(gw)
        assert endpoint == "cloud"
        evaluated, started = await _story(gw, request_id)
        assert [(c["endpoint"], c["pool"]) for c in evaluated[0]["candidates"]] == [
            ("cloud", None),
            ("local-a", "local"),
        ]
        assert [(a["endpoint"], a["dispatch"], a["pool"], a["group_path"]) for a in started] == [
            ("local-a", "delegate_pool", "local", ["chat", "local"]),
            ("local-b", "execute_endpoint", "local", ["chat", "local"]),
            ("cloud", "execute_endpoint", None, ["chat"]),
        ]


async def test_a_pool_hedges_by_its_own_policy_not_the_composed_groups(database_url):
    local_pool = f"    mappings:\n{mappings_yaml([Route('local-a'), Route('local-b')])}"
    async with running_gateway(
        database_url,
        UPSTREAMS,
        [Route("cloud")],
        # The composed group would hedge; its local pool does not.
        policies={"chat": "{hedge: {enabled: true, after_ms: 100}}"},
        groups={**GROUPS, "local": local_pool},
    ) as gw:
        gw.upstreams["local-a"].set_default(Behavior.ok(latency_ms=600))
        endpoint, request_id = await _served_by(gw)
        assert endpoint == "local-a"
        _, started = await _story(gw, request_id)
        assert [a["kind"] for a in started] == ["call"]
        assert gw.upstreams["local-b"].hits == 0


async def test_the_callers_preferred_endpoint_is_honoured_across_and_inside_pools(database_url):
    async with running_gateway(database_url, UPSTREAMS, [Route("cloud")], **_pooled()) as gw:
        client = gw.client()
        for prefer in ("cloud", "local-b", "nowhere"):
            raw = await client.chat.completions.with_raw_response.create(
                model="chat",
                messages=MESSAGES,
                extra_headers={"X-Waybill-Prefer-Endpoint": prefer},
            )
            served = raw.headers["x-waybill-endpoint"]
            evaluated, started = await _story(gw, raw.headers["x-request-id"])
            composer, pool = evaluated
            if prefer == "nowhere":  # overruled: the composer's own choice stands
                assert served == "local-a"
                assert not composer["chosen"].get("preferred")
                continue
            assert served == prefer
            assert composer["chosen"]["preferred"] is True
            assert pool["chosen"]["endpoint"] == prefer
            assert pool["chosen"]["preferred"] is True
            assert started[0]["dispatch"] == "delegate_pool"
