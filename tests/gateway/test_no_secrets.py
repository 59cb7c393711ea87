"""No secret ever leaves: not in an event, a log line, a span or /metrics — after a run that
goes through successes, upstream auth failures, 5xx, streams and a client key."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import orjson
import pytest

from otel.spans import request_spans
from router.fake_provider import Behavior
from router.fake_provider.behavior import Kind
from tests.gateway.harness import ANTHROPIC_ENV, Route, running_gateway

UPSTREAM_KEY = ANTHROPIC_ENV["FAKE_KEY"]
PROMPT = "a prompt that must stay out of the books"
BODY: dict[str, Any] = {"model": "chat", "messages": [{"role": "user", "content": PROMPT}]}


async def test_no_secret_in_events_logs_spans_or_metrics(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with (
        running_gateway(
            sqlite_url,
            ["east", "west", "claude"],
            [Route("east", tier=0), Route("west", tier=1), Route("claude", tier=2)],
            drivers={"claude": "anthropic"},
            defaults={"on_credentials_error": "failover"},
        ) as gw,
        gw.http() as http,
    ):
        gw.upstreams["east"].set_plan(
            [
                Behavior.unauthorized(),
                # An upstream that echoes the key it was sent in its error message.
                Behavior(Kind.SERVER_ERROR, message=f"bad key {UPSTREAM_KEY}"),
            ]
        )
        gw.upstreams["west"].set_plan([Behavior.forbidden(), Behavior.rate_limited()])
        for body in (BODY, BODY, {**BODY, "stream": True}, BODY):
            response = await http.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            assert UPSTREAM_KEY not in response.text
        # Every endpoint fails, echoing the key: the final error names the cause, redacted.
        echo = Behavior(Kind.SERVER_ERROR, message=f"bad key {UPSTREAM_KEY}")
        for name in ("east", "west", "claude"):
            gw.upstreams[name].set_plan([echo])
        failed = await http.post(
            "/v1/chat/completions", json=BODY, headers={"X-Waybill-Allow-Failover": "false"}
        )
        assert failed.status_code == 503
        assert "[redacted]" in failed.json()["error"]["message"]
        assert UPSTREAM_KEY not in failed.text
        metrics = (await http.get("/metrics")).text
        bad_key = await http.post(
            "/v1/chat/completions", json=BODY, headers={"Authorization": "Bearer wb_wrong"}
        )
        assert bad_key.status_code == 401
        events = await gw.store.read_all(limit=100_000)
    secrets = [UPSTREAM_KEY, gw.secret, "wb_wrong", PROMPT]
    spans = []
    for request_id in {e.data["request_id"] for e in events if e.type == "RequestReceived"}:
        trail = [e for e in events if e.stream_id == f"request-{request_id}"]
        spans += [orjson.dumps(dataclasses.asdict(s), default=str) for s in request_spans(trail)]
    assert spans
    logs = caplog.text + "".join(str(r.__dict__) for r in caplog.records)
    assert any(b"[redacted]" in e.payload for e in events)  # the echo was recorded, redacted
    for secret in secrets:
        assert all(secret.encode() not in e.payload for e in events), secret
        assert secret not in logs, secret
        assert all(secret.encode() not in span for span in spans), secret
        assert secret not in metrics, secret
