"""Drivers against the fake provider over real HTTP on 127.0.0.1."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from ledger.events import Evidence, FailureClass
from router.config import Endpoint
from router.drivers import (
    AnthropicDriver,
    AttemptBinding,
    AttemptTimeouts,
    ChatRequest,
    Driver,
    OpenAIDriver,
    UpstreamFailure,
)
from router.drivers.anthropic import to_chat_completion
from router.drivers.http import HTTPClient
from router.drivers.openai import openai_usage
from router.fake_provider import PART_TOKENS, Behavior, FakeUpstream
from router.fake_provider.behavior import Kind

SECRET = "sk-test-very-secret-0123456789"
DRIVERS = ("openai", "anthropic")
BODY = {
    "model": "gateway-model",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say hello."},
    ],
}


def _endpoint(up: FakeUpstream, kind: str, **extra: object) -> Endpoint:
    raw = {
        "id": "east",
        "driver": kind,
        "base_url": up.base_url,
        "api_key": "${env:KEY}",
        "region": "eu",
        "data_classes": ["internal"],
        **extra,
    }
    return Endpoint.model_validate(raw, context={"environ": {"KEY": SECRET}})


def _binding(
    up: FakeUpstream,
    kind: str,
    *,
    attempt: float = 5.0,
    first: float | None = 5.0,
    idle: float = 5.0,
    traceparent: str | None = None,
    tracestate: str | None = None,
    **extra: object,
) -> AttemptBinding:
    return AttemptBinding(
        endpoint=_endpoint(up, kind, **extra),
        upstream_model="fake-model",
        attempt_id="att_123",
        timeouts=AttemptTimeouts(attempt, first, idle),
        traceparent=traceparent,
        tracestate=tracestate,
    )


def _request(stream: bool = False) -> ChatRequest:
    return ChatRequest(body=BODY, upstream_model="fake-model", max_tokens=64, stream=stream)


@pytest.fixture(params=DRIVERS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def driver(kind: str) -> AsyncIterator[Driver]:
    d: Driver = AnthropicDriver() if kind == "anthropic" else OpenAIDriver()
    yield d
    await d.aclose()


async def _collect(driver: Driver, binding: AttemptBinding):
    chunks = []
    async with await driver.stream(driver.prepare(_request(stream=True), binding)) as stream:
        async for chunk in stream:
            chunks.append(chunk)
    text = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")
    )
    return stream, chunks, text


async def _stream_failure(driver: Driver, binding: AttemptBinding) -> UpstreamFailure:
    with pytest.raises(UpstreamFailure) as info:
        await _collect(driver, binding)
    return info.value


async def _complete_failure(driver: Driver, binding: AttemptBinding) -> UpstreamFailure:
    with pytest.raises(UpstreamFailure) as info:
        await driver.complete(driver.prepare(_request(), binding))
    assert SECRET not in str(info.value) and SECRET not in repr(info.value)
    return info.value


# --- success ---


async def test_a_call_is_sent_only_the_way_it_was_prepared(driver, kind):
    async with FakeUpstream("east") as up:
        binding = _binding(up, kind)
        with pytest.raises(ValueError, match="stream=True"):
            await driver.stream(driver.prepare(_request(), binding))
        with pytest.raises(ValueError, match="stream=False"):
            await driver.complete(driver.prepare(_request(stream=True), binding))
        assert up.hits == 0  # refused before anything was sent


async def test_buffered_completion_translates_content_usage_and_ids(driver, kind):
    async with FakeUpstream("east") as up:
        tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        ts = "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"
        binding = _binding(up, kind, traceparent=tp, tracestate=ts)
        result = await driver.complete(driver.prepare(_request(), binding))
        sent = up.requests[-1]
    message = result.response["choices"][0]["message"]
    assert isinstance(message["content"], str) and message["content"]
    assert result.response["object"] == "chat.completion"
    assert result.finish_reason == "stop"
    assert result.usage is not None and result.usage.output_tokens > 0
    assert result.upstream_request_id == sent.request_id
    assert result.response_id
    assert sent.headers.get("x-waybill-attempt-id") == "att_123"
    assert sent.headers.get("traceparent") == tp
    assert sent.headers.get("tracestate") == ts


async def test_openai_driver_sends_bearer_auth():
    async with FakeUpstream("east") as up, _openai() as driver:
        await driver.complete(driver.prepare(_request(), _binding(up, "openai")))
        sent = up.requests[-1]
    assert sent.headers.get("authorization") == f"Bearer {SECRET}"
    assert sent.json["model"] == "fake-model" and sent.json["max_tokens"] == 64


async def test_anthropic_driver_maps_the_request_to_the_messages_api():
    async with FakeUpstream("east") as up:
        driver = AnthropicDriver()
        body = {**BODY, "stop": "END", "temperature": 0.2}
        request = ChatRequest(body=body, upstream_model="fake-model", max_tokens=32)
        await driver.complete(driver.prepare(request, _binding(up, "anthropic")))
        await driver.aclose()
        sent = up.requests[-1]
    assert sent.path == "/v1/messages"
    assert sent.headers.get("x-api-key") == SECRET
    assert sent.headers.get("anthropic-version")
    assert sent.json["system"] == "Be brief."
    assert sent.json["messages"] == [{"role": "user", "content": "Say hello."}]
    assert (sent.json["max_tokens"], sent.json["stop_sequences"]) == (32, ["END"])
    assert sent.json["temperature"] == 0.2


async def test_stream_chunks_concatenate_to_the_buffered_reply_with_usage(driver, kind):
    async with FakeUpstream("east") as up:
        buffered = await driver.complete(driver.prepare(_request(), _binding(up, kind)))
        stream, chunks, text = await _collect(driver, _binding(up, kind))
    assert text == buffered.response["choices"][0]["message"]["content"]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert stream.finish_reason == "stop"
    assert stream.usage == buffered.usage
    assert stream.response_id and stream.upstream_request_id
    assert stream.time_to_first_chunk_ms is not None
    assert stream.invalid_events == 0


async def test_usage_counts_reasoning_as_output_and_cache_reads_as_input(driver, kind):
    # The fake reports as its dialect does: OpenAI's reasoning inside completion_tokens and
    # cached input inside prompt_tokens, Anthropic's cache reads beside its input_tokens.
    plan = [Behavior.ok(reasoning_tokens=20, cached_tokens=3)] * 2
    async with FakeUpstream("east") as up:
        up.set_plan(plan)
        buffered = await driver.complete(driver.prepare(_request(), _binding(up, kind)))
        stream, _, _ = await _collect(driver, _binding(up, kind))
    for usage in (buffered.usage, stream.usage):
        assert usage is not None
        assert (usage.input_tokens, usage.cached_input_tokens) == (5, 3)
        assert usage.output_tokens == 20 + 6


async def test_openai_usage_keeps_audio_input_and_output_tokens_apart_buffered_and_streamed():
    # An input_audio part and a spoken answer: OpenAI reports both inside the counts, in
    # prompt_tokens_details / completion_tokens_details.audio_tokens.
    audio = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Say it."}, audio]}],
        "modalities": ["text", "audio"],
        "audio": {"voice": "alloy", "format": "wav"},
    }
    driver = OpenAIDriver()
    try:
        async with FakeUpstream("east") as up:
            up.set_plan([Behavior.ok(reasoning_tokens=5)] * 2)
            usages = []
            for stream in (False, True):
                request = ChatRequest(
                    body=body, upstream_model="fake-model", max_tokens=64, stream=stream
                )
                call = driver.prepare(request, _binding(up, "openai"))
                if stream:
                    async with await driver.stream(call) as upstream:
                        async for _ in upstream:
                            pass
                    usages.append(upstream.usage)
                else:
                    usages.append((await driver.complete(call)).usage)
    finally:
        await driver.aclose()
    for usage in usages:
        assert usage is not None
        assert usage.audio_input_tokens == PART_TOKENS["input_audio"] < usage.input_tokens
        assert (usage.output_tokens, usage.audio_output_tokens) == (5 + 6, 6)  # not reasoning
        assert usage.web_searches == 0  # never in a provider's usage


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        # OpenAI: audio inside the counts.
        (
            {
                "prompt_tokens": 500,
                "completion_tokens": 30,
                "prompt_tokens_details": {"audio_tokens": 400},
                "completion_tokens_details": {"audio_tokens": 20},
            },
            (500, 400, 30, 20),
        ),
        # A compatible server that counts audio beside the counts: added.
        (
            {
                "prompt_tokens": 100,
                "completion_tokens": 10,
                "prompt_tokens_details": {"audio_tokens": 400},
                "completion_tokens_details": {"audio_tokens": 20},
            },
            (500, 400, 30, 20),
        ),
        ({"prompt_tokens": 5, "completion_tokens": 3}, (5, 0, 3, 0)),
    ],
)
def test_openai_usage_reads_audio_tokens_and_never_understates_them(raw, expected):
    usage = openai_usage(raw)
    assert usage is not None
    assert (
        usage.input_tokens,
        usage.audio_input_tokens,
        usage.output_tokens,
        usage.audio_output_tokens,
    ) == expected


@pytest.mark.parametrize(
    ("raw", "output"),
    [
        ({"completion_tokens": 30, "completion_tokens_details": {"reasoning_tokens": 20}}, 30),
        # A compatible server that counts reasoning beside the completion: added.
        ({"completion_tokens": 10, "completion_tokens_details": {"reasoning_tokens": 20}}, 30),
        ({"completion_tokens": 10, "total_tokens": 45}, 40),
        ({"completion_tokens": 10, "total_tokens": 15}, 10),
    ],
)
def test_openai_usage_never_understates_the_output(raw, output):
    usage = openai_usage({"prompt_tokens": 5, **raw})
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens) == (5, output)


def test_openai_usage_with_a_negative_or_missing_count_is_unknown():
    assert openai_usage({"prompt_tokens": -1, "completion_tokens": 3}) is None
    assert openai_usage({"prompt_tokens": 1}) is None


def test_anthropic_usage_counts_cache_reads_and_writes_as_input():
    body = {
        "id": "msg_1",
        "content": [{"type": "text", "text": "hi"}],
        "stop_reason": "end_turn",
        "usage": {
            "input_tokens": 3,
            "cache_read_input_tokens": 100,
            "cache_creation_input_tokens": 7,
            "output_tokens": 4,
        },
    }
    usage = to_chat_completion(body, "claude")["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (110, 4)


async def test_the_driver_reuses_its_pooled_connection(driver, kind):
    async with FakeUpstream("east") as up:
        for _ in range(3):
            await driver.complete(driver.prepare(_request(), _binding(up, kind)))
        assert up.connections == 1


async def test_a_driver_sends_through_the_client_it_is_given(kind):
    driver: Driver = (AnthropicDriver if kind == "anthropic" else OpenAIDriver)(
        HTTPClient(max_idle_per_origin=0)  # keeps nothing: every attempt connects anew
    )
    async with FakeUpstream("east") as up:
        for _ in range(2):
            await driver.complete(driver.prepare(_request(), _binding(up, kind)))
        await driver.aclose()
        assert up.connections == 2


# --- HTTP errors ---


async def test_rate_limited_with_retry_after_carries_retry_after_ms(driver, kind):
    async with FakeUpstream("east", plan=[Behavior.rate_limited(retry_after=2)]) as up:
        failure = await _complete_failure(driver, _binding(up, kind))
    assert failure.classification.failure_class is FailureClass.RATE_LIMITED
    assert failure.classification.retry_after_ms == 2000
    assert failure.upstream_request_id


async def test_insufficient_quota_is_quota_exhausted(driver, kind):
    async with FakeUpstream("east", plan=[Behavior.insufficient_quota()]) as up:
        failure = await _complete_failure(driver, _binding(up, kind))
    assert failure.classification.failure_class is FailureClass.QUOTA_EXHAUSTED
    # Whether it fails over is the group's approved policy (on_quota_exhausted), not the class's.
    assert failure.classification.may_fail_over == "per_on_quota_exhausted"


@pytest.mark.parametrize(
    ("behavior", "expected"),
    [
        (Behavior.unauthorized(), FailureClass.CREDENTIALS),
        (Behavior.forbidden(), FailureClass.CREDENTIALS),
        (Behavior.content_policy(), FailureClass.POLICY_DENIED),
        (Behavior.content_policy(status=403), FailureClass.POLICY_DENIED),
        (Behavior.context_length_exceeded(), FailureClass.CONTEXT_TOO_SMALL),
        (Behavior.model_not_found(), FailureClass.MODEL_UNAVAILABLE),
    ],
    ids=["401", "403", "policy_400", "policy_403", "context", "model_not_found"],
)
async def test_error_responses_map_to_their_failure_class(driver, kind, behavior, expected):
    async with FakeUpstream("east", plan=[behavior]) as up:
        failure = await _complete_failure(driver, _binding(up, kind))
    assert failure.classification.failure_class is expected
    assert failure.classification.evidence is Evidence.NOT_STARTED


async def test_500_is_upstream_unavailable_with_unknown_evidence(driver, kind):
    async with FakeUpstream("east", plan=[Behavior.server_error(500)]) as up:
        failure = await _complete_failure(driver, _binding(up, kind))
    assert failure.classification.failure_class is FailureClass.UPSTREAM_UNAVAILABLE
    assert failure.classification.evidence is Evidence.UNKNOWN


@pytest.mark.parametrize(("trust", "evidence"), [(True, "not_started"), (False, "unknown")])
async def test_not_started_503_is_believed_only_from_a_trusted_endpoint(
    driver, kind, trust, evidence
):
    async with FakeUpstream("east", plan=[Behavior.not_started()]) as up:
        binding = _binding(up, kind, trust_not_started=trust)
        failure = await _complete_failure(driver, binding)
    assert failure.outcome.http_status == 503
    assert failure.classification.evidence == evidence


async def test_streaming_error_status_fails_before_any_event(driver, kind):
    async with FakeUpstream("east", plan=[Behavior.rate_limited(retry_after=1)]) as up:
        failure = await _stream_failure(driver, _binding(up, kind))
    assert failure.classification.failure_class is FailureClass.RATE_LIMITED
    assert failure.events_yielded is False


# --- transport faults ---


async def test_reset_before_bytes_is_network_error(driver, kind):
    async with FakeUpstream("east", plan=[Behavior.reset_before_bytes()]) as up:
        failure = await _complete_failure(driver, _binding(up, kind))
    assert failure.classification.failure_class is FailureClass.NETWORK_ERROR
    assert failure.classification.evidence is Evidence.UNKNOWN


async def test_connection_refused_is_network_error_not_started(driver, kind):
    async with FakeUpstream("east") as up:
        binding = _binding(up, kind)
    failure = await _complete_failure(driver, binding)  # the server is gone
    assert failure.classification.failure_class is FailureClass.NETWORK_ERROR
    assert failure.classification.evidence is Evidence.NOT_STARTED


async def test_stall_before_headers_with_a_tiny_attempt_timeout_is_timeout_unknown(driver, kind):
    async with FakeUpstream("east", plan=[Behavior.stall(stall_s=2)]) as up:
        failure = await _complete_failure(driver, _binding(up, kind, attempt=0.2))
    assert failure.classification.failure_class is FailureClass.TIMEOUT
    assert failure.classification.evidence is Evidence.UNKNOWN


async def test_slow_first_event_is_first_token_timeout_before_anything_yielded(driver, kind):
    behavior = Behavior.ok(first_event_delay_ms=1000)
    async with FakeUpstream("east", plan=[behavior]) as up:
        failure = await _stream_failure(driver, _binding(up, kind, first=0.2))
    assert failure.outcome.transport == "first_token_timeout"
    assert failure.classification.failure_class is FailureClass.TIMEOUT
    assert failure.events_yielded is False


async def test_disconnect_before_first_event_fails_with_nothing_yielded(driver, kind):
    async with FakeUpstream("east", plan=[Behavior.disconnect_before_first_event()]) as up:
        failure = await _stream_failure(driver, _binding(up, kind))
    assert failure.classification.failure_class is FailureClass.NETWORK_ERROR
    assert failure.events_yielded is False


async def test_mid_stream_disconnect_is_a_failure_after_events_were_yielded(driver, kind):
    async with FakeUpstream("east", plan=[Behavior.mid_stream_disconnect(after_events=5)]) as up:
        failure = await _stream_failure(driver, _binding(up, kind))
    assert failure.classification.failure_class is FailureClass.NETWORK_ERROR
    assert failure.events_yielded is True


async def _until_failure(
    driver: Driver, binding: AttemptBinding
) -> tuple[list[dict[str, Any]], UpstreamFailure]:
    chunks: list[dict[str, Any]] = []
    with pytest.raises(UpstreamFailure) as info:
        async with await driver.stream(driver.prepare(_request(stream=True), binding)) as stream:
            async for chunk in stream:
                chunks.append(chunk)
    return chunks, info.value


async def test_an_error_event_after_content_fails_after_what_came_before_it(driver, kind):
    # The whole body arrives in one read, error event included: the content before the
    # error is still handed out, and the failure says so.
    behavior = Behavior.error_event(after_events=4, one_write=True)
    async with FakeUpstream("east", plan=[behavior]) as up:
        chunks, failure = await _until_failure(driver, _binding(up, kind))
    assert any(c["choices"][0]["delta"].get("content") for c in chunks if c.get("choices"))
    assert failure.events_yielded is True
    assert failure.outcome.error_type == {"openai": "server_error"}.get(kind, "overloaded_error")
    assert failure.classification.failure_class is FailureClass.UPSTREAM_UNAVAILABLE


async def test_an_error_event_first_fails_with_nothing_yielded(driver, kind):
    async with FakeUpstream("east", plan=[Behavior.error_event(after_events=0)]) as up:
        chunks, failure = await _until_failure(driver, _binding(up, kind))
    assert chunks == []
    assert failure.events_yielded is False


async def test_idle_stream_after_events_is_a_stalled_stream(driver, kind):
    async with FakeUpstream("east", plan=[Behavior.stall(after_events=5, stall_s=2)]) as up:
        failure = await _stream_failure(driver, _binding(up, kind, first=0.2, idle=0.2))
    assert failure.outcome.transport == "stream_stalled"
    assert failure.classification.failure_class == "timeout"
    assert failure.outcome.error_message == "stream idle"  # not the close after the stall
    assert failure.events_yielded is True


async def test_after_content_the_idle_limit_bounds_every_silence_not_the_first_token_one(
    driver, kind
):
    # A first-token limit far above the idle one must not stretch the silences after content.
    stall = Behavior.stall(after_content=2, stall_s=5)
    async with FakeUpstream("east", plan=[stall]) as up:
        failure = await _stream_failure(driver, _binding(up, kind, first=10.0, idle=0.3))
    assert failure.outcome.transport == "stream_stalled"
    assert failure.events_yielded is True


async def test_without_a_first_token_timeout_the_idle_timeout_bounds_the_first_event(driver, kind):
    behavior = Behavior.ok(first_event_delay_ms=1000)
    async with FakeUpstream("east", plan=[behavior]) as up:
        failure = await _stream_failure(driver, _binding(up, kind, first=None, idle=0.2))
    assert failure.outcome.transport == "first_token_timeout"
    assert failure.outcome.error_message == "stream idle"
    assert failure.events_yielded is False


async def _reads(driver: Driver, binding: AttemptBinding) -> list[tuple[int, bytes | None]]:
    """Each batch's size and the upstream's bytes it came with (DriverStream.raw)."""
    async with await driver.stream(driver.prepare(_request(stream=True), binding)) as stream:
        return [(len(batch), stream.raw) async for batch in stream.batches()]


async def test_an_openai_streams_reads_pass_through_as_the_upstreams_bytes(driver, kind):
    async with FakeUpstream("east", plan=[Behavior.ok(chunk_delay_ms=5)]) as up:
        reads = await _reads(driver, _binding(up, kind))
    if kind == "anthropic":  # translated: its chunks must be written anew
        assert all(raw is None for _, raw in reads)
        return
    for size, raw in reads:  # the first read too: it starts with "data:", so has no BOM
        assert raw is not None and raw.count(b"data: ") == size and b"[DONE]" not in raw


@pytest.mark.parametrize("ends", ["done", "error_event"])
async def test_a_tap_takes_a_streams_plain_reads_and_leaves_its_end_and_errors(driver, kind, ends):
    if ends == "done":
        behavior = Behavior.ok(chunk_delay_ms=5)
    else:
        behavior = Behavior(Kind.ERROR_EVENT, after_events=5, chunk_delay_ms=5)
    tapped: list[tuple[list[dict[str, Any]], bytes]] = []

    def deliver(chunks: list[dict[str, Any]], raw: bytes) -> bool:
        tapped.append((chunks, raw))
        return True

    handed: list[dict[str, Any]] = []
    async with FakeUpstream("east", plan=[behavior]) as up:
        call = driver.prepare(_request(stream=True), _binding(up, kind))
        async with await driver.stream(call) as stream:
            try:
                async for batch in stream.batches():
                    handed += batch
                    stream.tap(deliver)
            except UpstreamFailure:
                assert ends == "error_event"
            else:
                assert ends == "done"
    if kind == "anthropic":  # nothing passes through unchanged: nothing is tapped
        assert tapped == []
        return
    assert tapped, "a paced stream's middle reads are tapped"
    for chunks, raw in tapped:
        assert raw.count(b"data: ") == len(chunks) and b"[DONE]" not in raw
        assert b'"error"' not in raw
    taken = [chunk for chunks, _ in tapped for chunk in chunks]
    assert not {id(c) for c in taken} & {id(c) for c in handed}  # never handed out again
    if ends == "done":  # the end is handed out, and the totals hold
        assert stream.finish_reason == "stop" and stream.usage is not None


async def test_stream_without_done_after_the_final_chunk_is_a_success(driver, kind):
    async with FakeUpstream("east", plan=[Behavior.ok(), Behavior.no_done()]) as up:
        _, _, expected = await _collect(driver, _binding(up, kind))
        stream, _, text = await _collect(driver, _binding(up, kind))
    assert text == expected
    assert stream.finish_reason == "stop"


async def test_malformed_event_is_skipped_and_counted(driver, kind):
    async with FakeUpstream("east", plan=[Behavior.malformed_event()]) as up:
        stream, _, text = await _collect(driver, _binding(up, kind))
    assert stream.invalid_events == 1
    assert stream.finish_reason == "stop" and text


async def test_malformed_buffered_body_is_a_failure(driver, kind):
    async with FakeUpstream("east", plan=[Behavior.malformed_event()]) as up:
        failure = await _complete_failure(driver, _binding(up, kind))
    assert failure.outcome.transport == "invalid_response"


@pytest.mark.parametrize(
    "behavior",
    [Behavior(Kind.SPLIT_UTF8), Behavior(Kind.LINE_ENDINGS, line_ending="cr")],
    ids=["split_utf8", "cr"],
)
async def test_awkward_streams_give_the_exact_text(driver, kind, behavior):
    async with FakeUpstream("east", plan=[Behavior.ok(), behavior]) as up:
        _, _, expected = await _collect(driver, _binding(up, kind))
        stream, _, text = await _collect(driver, _binding(up, kind))
    assert text == expected and stream.finish_reason == "stop"


async def test_split_utf8_buffered_body_is_exact(driver, kind):
    async with FakeUpstream("east", plan=[Behavior.ok(), Behavior(Kind.SPLIT_UTF8)]) as up:
        plain = await driver.complete(driver.prepare(_request(), _binding(up, kind)))
        split = await driver.complete(driver.prepare(_request(), _binding(up, kind)))
    content = split.response["choices"][0]["message"]["content"]
    assert content == plain.response["choices"][0]["message"]["content"]


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "stream"])
async def test_large_body_over_max_response_bytes_is_response_too_large(driver, kind, stream):
    plan = [Behavior(Kind.LARGE_BODY, min_bytes=64 * 1024)]
    async with FakeUpstream("east", plan=plan) as up:
        binding = _binding(up, kind, max_response_bytes=16 * 1024)
        if stream:
            failure = await _stream_failure(driver, binding)
        else:
            failure = await _complete_failure(driver, binding)
    assert failure.classification.failure_class is FailureClass.RESPONSE_TOO_LARGE
    assert failure.classification.evidence is Evidence.STARTED


class _openai:
    async def __aenter__(self) -> OpenAIDriver:
        self.driver = OpenAIDriver()
        return self.driver

    async def __aexit__(self, *exc: object) -> None:
        await self.driver.aclose()
