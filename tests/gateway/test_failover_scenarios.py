"""Failover Bench's sixteen scenarios, end to end, with our fake provider in place of its wall.

Failover Bench (github.com/failoverbench/failoverbench) sends one streamed request per
scenario through a gateway to a provider that misbehaves on purpose, then scores what the
caller got and what the provider saw. Each test here plays one scenario as the bench's client
does (a stream with usage, over HTTP): the model group's tier 0 is the misbehaving
``primary``, tier 1 the healthy ``fallback`` on an endpoint of its own, and the defaults are
docs/examples/failoverbench.yaml's with seconds scaled to hundreds of milliseconds. Each
asserts what the bench needs to score the scenario a pass: the caller's answer, the attempts
each upstream saw and the recorded decisions. Time is asserted only where the scenario bounds
it (a call that must not wait out a silence ends long before the silence would), never as
speed: a busy machine only makes calls slower.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from ledger.store import RecordedEvent
from router.fake_provider import Behavior, FakeUpstream, RecordedRequest
from tests.gateway.harness import Gateway, Route, running_gateway
from tests.helpers import eventually

PROMPT = (
    "Explain in exactly sixty words why a gateway earns trust only when the provider behind it"
    " misbehaves."
)
BODY: dict[str, Any] = {
    "model": "chat",
    "messages": [{"role": "user", "content": PROMPT}],
    "stream": True,
    "stream_options": {"include_usage": True},
}
ROUTES = (
    Route(
        "primary",
        tier=0,
        model="primary-model",
        context_window=8192,
        max_output_tokens=1024,
        resume="assistant_prefill",
    ),
    Route(
        "fallback", tier=1, model="fallback-model", context_window=128000, max_output_tokens=1024
    ),
)
# docs/examples/failoverbench.yaml's defaults, seconds scaled to hundreds of milliseconds.
SCALED: dict[str, str] = {
    "max_attempts": "3",
    "deadline_ms": "20000",
    "attempt_timeout_ms": "800",
    "first_token_timeout_ms": "800",
    "stream_idle_timeout_ms": "800",
    "retry_same_endpoint": (
        "{rate_limited: {max: 1, max_retry_after_ms: 5000},"
        " upstream_unavailable: {max: 1, backoff_ms: [10, 50]}, timeout: {max: 0}}"
    ),
    "breaker": "{failure_threshold: 3, base_cooldown_ms: 200, max_cooldown_ms: 500}",
}
# A silence or a delay that no timeout above comes near: a call that waited it out would
# take at least this long.
LONG_S = 20.0


@dataclass(frozen=True)
class Streamed:
    """One call as the bench's client reads it: every ``data:`` event, JSON or not."""

    status: int
    request_id: str
    endpoint: str | None  # X-Waybill-Endpoint: who served it
    chunks: list[dict[str, Any]]  # JSON data events without a top-level "error"
    errors: list[dict[str, Any]]  # data events with one: the stream's error
    done: bool  # data: [DONE]
    body: bytes
    elapsed_s: float

    @property
    def deltas(self) -> list[dict[str, Any]]:
        return [c["delta"] for chunk in self.chunks for c in chunk.get("choices") or []]

    @property
    def text(self) -> str:
        return "".join(str(d.get("content") or "") for d in self.deltas)

    @property
    def finishes(self) -> list[str]:
        return [
            str(c["finish_reason"])
            for chunk in self.chunks
            for c in chunk.get("choices") or []
            if c.get("finish_reason")
        ]

    @property
    def usage(self) -> dict[str, Any] | None:
        found = [chunk["usage"] for chunk in self.chunks if chunk.get("usage")]
        return found[-1] if found else None

    @property
    def answered(self) -> bool:
        """One clean 200 stream: a single role preamble, no error, a single finish."""
        roles = [d for d in self.deltas if "role" in d]
        return (
            self.status == 200
            and not self.errors
            and len(roles) == 1
            and self.finishes == ["stop"]
            and self.done
        )


@dataclass(frozen=True)
class Bench:
    gw: Gateway
    http: httpx.AsyncClient
    pieces: dict[str, tuple[str, ...]]  # the upstream's complete answer, piece by piece

    @property
    def primary(self) -> FakeUpstream:
        return self.gw.upstreams["primary"]

    @property
    def fallback(self) -> FakeUpstream:
        return self.gw.upstreams["fallback"]

    def answer(self, upstream: str) -> str:
        return "".join(self.pieces[upstream])

    def hits(self) -> tuple[int, int]:
        return self.primary.hits, self.fallback.hits

    async def call(self, body: dict[str, Any] = BODY) -> Streamed:
        started = time.monotonic()
        async with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
            raw = await response.aread()
        chunks: list[dict[str, Any]] = []
        errors: list[dict[str, Any]] = []
        done = False
        for line in raw.decode().splitlines():
            if not line.startswith("data:"):
                continue
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                done = True
                continue
            try:
                event = json.loads(data)
            except ValueError:
                continue  # as the bench's client does
            if isinstance(event, dict):
                (errors if "error" in event else chunks).append(event)
        return Streamed(
            response.status_code,
            response.headers["x-request-id"],
            response.headers.get("x-waybill-endpoint"),
            chunks,
            errors,
            done,
            raw,
            time.monotonic() - started,
        )

    async def events(self, got: Streamed) -> list[RecordedEvent]:
        """The request's events once it has ended."""

        async def ended() -> bool:
            types = await self.gw.types(got.request_id)
            return bool(types) and types[-1] in ("RequestCompleted", "RequestFailed")

        await eventually(ended)
        return await self.gw.events(got.request_id)

    async def of_type(self, got: Streamed, event_type: str) -> list[dict[str, Any]]:
        return [e.data for e in await self.events(got) if e.type == event_type]

    async def decisions(self, got: Streamed) -> list[tuple[str, str]]:
        return [(d["action"], d["reason"]) for d in await self.of_type(got, "FailoverDecided")]

    async def primary_breaker(self) -> list[tuple[str, str]]:
        return [
            (e.data["from_state"], e.data["to_state"])
            for e in await self.gw.store.read_stream("breaker")
            if (e.data["scope"], e.data["target"]) == ("endpoint", "primary")
        ]

    async def alive(self) -> None:
        """The bench's probe after a scenario: a plain buffered call is answered in full."""
        response = await self.http.post("/v1/chat/completions", json={**BODY, "stream": False})
        assert response.status_code == 200, response.text
        served_by = response.headers["x-waybill-endpoint"]
        assert response.json()["choices"][0]["message"]["content"] == self.answer(served_by)


async def _pieces(upstream: FakeUpstream, model: str) -> tuple[str, ...]:
    """What the upstream streams when nothing goes wrong; then its counters start afresh."""
    async with (
        httpx.AsyncClient(base_url=upstream.base_url, timeout=10) as http,
        http.stream("POST", "/chat/completions", json={**BODY, "model": model}) as response,
    ):
        assert response.status_code == 200
        pieces = []
        async for line in response.aiter_lines():
            data = line.removeprefix("data:").strip()
            if line.startswith("data:") and data != "[DONE]":
                for choice in json.loads(data).get("choices") or []:
                    if choice["delta"].get("content"):
                        pieces.append(str(choice["delta"]["content"]))
    upstream.reset()
    return tuple(pieces)


@asynccontextmanager
async def _bench(database_url: str, **defaults: str) -> AsyncIterator[Bench]:
    async with (
        running_gateway(
            database_url, ["primary", "fallback"], ROUTES, defaults={**SCALED, **defaults}
        ) as gw,
        gw.http() as http,
    ):
        # The primary continues a partial assistant message; the fallback refuses one.
        gw.upstreams["primary"].set_continuation("assistant_prefill")
        pieces = {r.upstream: await _pieces(gw.upstreams[r.upstream], r.model) for r in ROUTES}
        yield Bench(gw, http, pieces)


def _last_message(request: RecordedRequest) -> dict[str, Any]:
    return dict(request.json["messages"][-1])


async def test_s01_429_with_retry_after_is_waited_out_and_retried_in_place(
    sqlite_url: str,
) -> None:
    async with _bench(sqlite_url) as bench:
        bench.primary.set_plan([Behavior.rate_limited(retry_after=0.3)])
        got = await bench.call()
        assert got.answered and got.text == bench.answer("primary")
        assert bench.hits() == (2, 0)
        assert await bench.decisions(got) == [("retry", "retry_after_honoured")]
        started = [e.recorded_at for e in await bench.events(got) if e.type == "AttemptStarted"]
        assert (started[1] - started[0]).total_seconds() >= 0.3  # not one moment sooner
        # The 429 opened the endpoint's breaker at once; the retry was its probe, and closed it.
        admitted = [s["admitted_as"] for s in await bench.of_type(got, "AttemptStarted")]
        assert admitted == ["closed", "probe:endpoint"]
        assert await bench.primary_breaker() == [
            ("closed", "open"),
            ("open", "half_open"),
            ("half_open", "closed"),
        ]


async def test_s02_429_without_retry_after_fails_over_at_once(sqlite_url: str) -> None:
    async with _bench(sqlite_url) as bench:
        bench.primary.set_default(Behavior.rate_limited())
        got = await bench.call()
        assert got.answered and got.text == bench.answer("fallback")
        assert bench.hits() == (1, 1)  # the bench allows at most 4 in the first 3 s, 6 in all
        assert await bench.decisions(got) == [("failover", "not_started_failover")]


async def test_s03_500_once_is_retried_on_the_same_endpoint(sqlite_url: str) -> None:
    async with _bench(sqlite_url) as bench:
        bench.primary.set_plan([Behavior.server_error(status=500)])
        got = await bench.call()
        assert got.answered and got.text == bench.answer("primary")
        assert bench.hits() == (2, 0)
        assert await bench.decisions(got) == [("retry", "retry_with_backoff")]


async def test_s04_503_always_fails_over_within_the_retry_budget(sqlite_url: str) -> None:
    async with _bench(sqlite_url) as bench:
        bench.primary.set_default(Behavior.server_error(status=503))
        got = await bench.call()
        assert got.answered and got.text == bench.answer("fallback")
        assert await bench.decisions(got) == [
            ("retry", "retry_with_backoff"),
            ("failover", "unknown_execution_policy_failover"),
        ]
        assert bench.hits() == (2, 1)  # the bench allows 6 primary attempts


async def test_s05_a_reset_before_any_byte_is_answered_all_the_same(sqlite_url: str) -> None:
    async with _bench(sqlite_url) as bench:
        bench.primary.set_plan([Behavior.reset_before_bytes()])
        got = await bench.call()
        assert got.answered and got.endpoint is not None
        assert got.text == bench.answer(got.endpoint)  # by a retry or a failover: both pass
        assert bench.primary.hits >= 1 and sum(bench.hits()) <= 3
        first = (await bench.of_type(got, "AttemptFinished"))[0]
        assert (first["failure_class"], first["evidence"]) == ("network_error", "unknown")


async def test_s06_a_silent_upstream_times_out_once_and_is_not_retried(sqlite_url: str) -> None:
    async with _bench(sqlite_url) as bench:
        bench.primary.set_default(Behavior.stall(after_events=None, stall_s=LONG_S))
        got = await bench.call()
        assert got.answered and got.text == bench.answer("fallback")
        assert bench.hits() == (1, 1)  # the silent route had one attempt only
        assert got.elapsed_s < LONG_S / 2  # the silence was not waited out
        first = (await bench.of_type(got, "AttemptFinished"))[0]
        assert first["failure_class"] == "timeout" and first["http_status"] is None
        assert await bench.decisions(got) == [("failover", "unknown_execution_policy_failover")]
        # The gateway hung up on the silent upstream rather than leaving the call open.
        await bench.primary.wait_for_async(lambda up: up.client_gone >= 1)


async def test_s07_a_slow_first_token_fails_over_before_anything_is_sent(
    sqlite_url: str,
) -> None:
    async with _bench(sqlite_url) as bench:
        bench.primary.set_default(Behavior.ok(first_event_delay_ms=LONG_S * 1000))
        got = await bench.call()
        # The whole answer is the fallback's: nothing of the slow stream reached the client.
        assert got.answered and got.text == bench.answer("fallback")
        assert {chunk["model"] for chunk in got.chunks} == {"fallback-model"}
        assert bench.hits() == (1, 1)
        assert got.elapsed_s < LONG_S / 2  # the first token was not waited for
        first = (await bench.of_type(got, "AttemptFinished"))[0]
        assert (first["failure_class"], first["stream_committed"]) == ("timeout", False)


async def test_s08_a_stream_cut_mid_answer_is_resumed_and_delivered_whole_once(
    sqlite_url: str,
) -> None:
    async with _bench(sqlite_url) as bench:
        # role, three pieces of the answer, then the connection drops without a finish
        bench.primary.set_plan([Behavior.mid_stream_disconnect(after_events=4)])
        got = await bench.call()
        assert got.answered  # one uninterrupted stream, no error event
        assert got.text == bench.answer("primary")  # whole, and nothing twice
        assert bench.hits() == (2, 0)  # resumed on the same model
        # The primary was asked to go on from exactly what the client already had.
        resumed = _last_message(bench.primary.requests[1])
        assert resumed["role"] == "assistant"
        assert resumed["content"] == "".join(bench.pieces["primary"][:3])
        # The final usage covers the whole text the client got (the fake counts a token a
        # piece): the continuation's output, and the broken attempt's delivered text at its
        # UTF-8 bytes (an upper bound of its tokens), while the ledger holds that attempt's
        # usage unknown as before.
        broken, continued = await bench.of_type(got, "AttemptFinished")
        assert broken["usage"] is None and continued["usage"] is not None
        delivered = len(resumed["content"].encode())
        assert got.usage is not None
        assert got.usage["completion_tokens"] == delivered + continued["usage"]["output_tokens"]
        assert got.usage["completion_tokens"] >= len(bench.pieces["primary"])
        assert got.usage["prompt_tokens"] == continued["usage"]["input_tokens"]
        usage = got.usage
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_s09_a_stalled_stream_is_resumed_within_bounds_and_delivered_whole_once(
    sqlite_url: str,
) -> None:
    async with _bench(sqlite_url) as bench:
        # As on the bench's wall, the continuation stalls too: two resumes are needed.
        stall = Behavior.stall(after_events=3, stall_s=LONG_S)
        bench.primary.set_plan([stall, stall])
        got = await bench.call()
        assert got.answered and got.text == bench.answer("primary")
        assert bench.hits() == (3, 0)
        assert got.elapsed_s < LONG_S / 2  # each stall was detected, not waited out
        await bench.alive()


async def test_s10_a_malformed_event_is_skipped_and_the_answer_completes(
    sqlite_url: str,
) -> None:
    async with _bench(sqlite_url) as bench:
        bench.primary.set_plan([Behavior.malformed_event(after_events=3)])
        got = await bench.call()
        assert got.answered and got.text == bench.answer("primary")
        assert bench.hits() == (1, 0)
        finished = (await bench.of_type(got, "AttemptFinished"))[0]
        assert (finished["status"], finished["invalid_events"]) == ("succeeded", 1)
        await bench.alive()


async def test_s11_a_stream_without_done_is_finished_at_the_end_of_its_body(
    sqlite_url: str,
) -> None:
    # A long idle timeout: a gateway that waited for [DONE] would sit on it.
    async with _bench(sqlite_url, stream_idle_timeout_ms=str(int(LONG_S * 1000))) as bench:
        bench.primary.set_plan([Behavior.no_done()])
        got = await bench.call()
        assert got.answered and got.text == bench.answer("primary")
        assert got.usage is not None and got.usage["completion_tokens"] > 0
        assert got.elapsed_s < LONG_S / 2
        assert bench.hits() == (1, 0)


async def test_s12_context_length_exceeded_goes_once_to_the_larger_window(
    sqlite_url: str,
) -> None:
    async with _bench(sqlite_url) as bench:
        bench.primary.set_default(Behavior.context_length_exceeded())
        got = await bench.call()
        assert got.answered and got.text == bench.answer("fallback")
        assert bench.hits() == (1, 1)  # never resent unchanged to the model that refused it
        assert await bench.decisions(got) == [("failover", "larger_context_failover")]


async def test_s13_a_content_filter_rejection_is_returned_not_retried_or_routed_around(
    sqlite_url: str,
) -> None:
    async with _bench(sqlite_url) as bench:
        bench.primary.set_default(Behavior.content_policy())
        got = await bench.call()
        assert got.status == 502, got.body
        assert json.loads(got.body)["error"]["code"] == "upstream_policy_denied"
        assert bench.hits() == (1, 0)
        assert await bench.decisions(got) == [("stop", "policy_denied_never_routed_around")]


async def test_s14_a_cut_stream_is_resumed_without_ever_prefilling_the_fallback(
    sqlite_url: str,
) -> None:
    async with _bench(sqlite_url) as bench:
        bench.primary.set_plan([Behavior.mid_stream_disconnect(after_events=4)])
        got = await bench.call()
        # The prefill went to the primary, which takes it, never to the fallback, which
        # would refuse it: the answer is whole, once, and no prefill error masks anything.
        assert got.answered and got.text == bench.answer("primary")
        prefilled = [
            r for r in bench.fallback.requests if _last_message(r).get("role") == "assistant"
        ]
        assert prefilled == []


async def test_s15_a_flapping_primary_is_served_around_probed_and_returned_to(
    sqlite_url: str,
) -> None:
    async with _bench(sqlite_url) as bench:
        bench.primary.set_default(Behavior.server_error(status=503))
        outage: list[Streamed] = []

        async def failed_probes(n: int) -> bool:
            outage.append(await bench.call())
            return (await bench.primary_breaker()).count(("half_open", "open")) >= n

        # Down long enough for the breaker to open and two probes to fail.
        await eventually(lambda: failed_probes(2), within_s=30, interval=0.05)
        # Every request of the outage is answered in full, by the fallback.
        assert all(got.answered and got.text == bench.answer("fallback") for got in outage)
        # A breaker, not stateless retrying: once open, a request tries the primary at most
        # once (a probe, which does not retry), however long the outage lasts.
        tried = [
            sum(a["endpoint"] == "primary" for a in await bench.of_type(got, "AttemptStarted"))
            for got in outage
        ]
        assert tried[0] == 2 and all(n <= 1 for n in tried[1:]), tried

        bench.primary.set_default(Behavior.ok())  # it recovers

        async def back_on_primary() -> bool:
            return (await bench.call()).endpoint == "primary"

        # Within max_cooldown_ms (0.5 s) of recovering, and slack for a busy machine.
        await eventually(back_on_primary, within_s=10, interval=0.05)
        for _ in range(3):  # and the traffic stays there
            got = await bench.call()
            assert got.endpoint == "primary" and got.text == bench.answer("primary")
        assert (await bench.primary_breaker())[-1] == ("half_open", "closed")


async def test_s16_after_a_failover_the_fallback_model_and_its_usage_are_reported(
    sqlite_url: str,
) -> None:
    async with _bench(sqlite_url) as bench:
        bench.primary.set_default(Behavior.server_error(status=503))
        got = await bench.call()
        assert got.answered and got.text == bench.answer("fallback")
        assert {chunk["model"] for chunk in got.chunks} == {"fallback-model"}
        assert got.usage is not None and got.usage["completion_tokens"] > 0
        assert bench.hits() == (2, 1)
        completed = (await bench.of_type(got, "RequestCompleted"))[0]
        assert (completed["model"], completed["endpoint"]) == ("fallback-model", "fallback")
        # Only the answer is billed as a completion; the failed attempts are not.
        finished = await bench.of_type(got, "AttemptFinished")
        settled = await bench.of_type(got, "BudgetSettled")
        assert [s["attempt_id"] for s in settled] == [finished[-1]["attempt_id"]]
        assert [f["usage"] for f in finished[:-1]] == [None, None]
