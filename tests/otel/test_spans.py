"""The pure fold from a request's ledger events to its spans, and the deterministic ids."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

from opentelemetry.sdk.resources import Resource
from opentelemetry.trace import SpanKind, StatusCode

from ledger import events as ev
from otel import semconv as sc
from otel.export import to_readable_spans
from otel.ids import (
    attempt_span_id,
    request_span_id,
    request_trace_id,
    upstream_traceparent,
)
from otel.spans import SpanData, request_spans
from tests.otel.trails import (
    CALLER_SPAN,
    CALLER_TRACE,
    T0,
    at,
    failover_trail,
    no_route_trail,
    quota_trail,
    received,
    recorded,
)


def _by_name(spans: list[SpanData]) -> dict[str, SpanData]:
    return {s.name: s for s in spans}


def test_a_failover_is_one_request_span_with_a_client_span_per_attempt():
    request, first, second = request_spans(failover_trail("r1"))
    assert (request.name, request.kind) == ("chat chat-default", "server")
    assert (first.name, first.kind) == ("chat gpt-4o-mini", "client")
    assert (second.name, second.kind) == ("chat claude-3-5", "client")
    # The caller's trace, the request span hanging from the caller's span.
    assert {s.trace_id for s in (request, first, second)} == {CALLER_TRACE}
    assert (request.parent_span_id, request.remote_parent) == (CALLER_SPAN, True)
    assert request.span_id == request_span_id("r1")
    assert first.parent_span_id == second.parent_span_id == request.span_id
    assert not first.remote_parent
    assert (first.span_id, second.span_id) == (attempt_span_id("r1-a1"), attempt_span_id("r1-a2"))


def test_attempt_spans_carry_the_genai_and_waybill_attributes():
    _, first, second = request_spans(failover_trail("r1"))
    a = first.attributes
    assert a[sc.GEN_AI_OPERATION_NAME] == "chat"
    assert a[sc.GEN_AI_PROVIDER_NAME] == "openai"
    assert a[sc.GEN_AI_REQUEST_MODEL] == "gpt-4o-mini"
    assert (a[sc.SERVER_ADDRESS], a[sc.SERVER_PORT]) == ("east.example.test", 443)
    assert a[sc.ERROR_TYPE] == a[sc.WAYBILL_FAILURE_CLASS] == "upstream_unavailable"
    assert a[sc.WAYBILL_EVIDENCE] == "unknown"
    assert (a[sc.WAYBILL_TIER], a[sc.WAYBILL_WEIGHT]) == (0, 3)
    assert (a[sc.WAYBILL_REQUEST_ID], a[sc.WAYBILL_ATTEMPT_ID]) == ("r1", "r1-a1")
    assert a[sc.WAYBILL_RESERVED_USD] == "0.0030"
    assert a[sc.WAYBILL_HELD_UNKNOWN_USD] == "0.0030"
    assert a[sc.HTTP_RESPONSE_STATUS_CODE] == 502
    assert (a[sc.WAYBILL_ATTEMPT_KIND], a[sc.WAYBILL_ATTEMPT_ADMITTED_AS]) == ("call", "closed")
    assert a[sc.WAYBILL_ATTEMPT_RESPONSE_BYTES] == 87
    assert sc.WAYBILL_ATTEMPT_TIME_TO_FIRST_CHUNK_MS not in a
    assert first.error == "upstream_unavailable"

    b = second.attributes
    assert b[sc.GEN_AI_PROVIDER_NAME] == "anthropic"
    assert b[sc.GEN_AI_RESPONSE_MODEL] == "claude-3-5-20241022"
    assert b[sc.GEN_AI_RESPONSE_ID] == "msg_1"
    assert b[sc.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)
    assert (b[sc.GEN_AI_USAGE_INPUT_TOKENS], b[sc.GEN_AI_USAGE_OUTPUT_TOKENS]) == (12, 30)
    assert b[sc.WAYBILL_EVIDENCE] == "started"
    assert b[sc.WAYBILL_SETTLED_USD] == "0.000072"  # settled in the terminal's commit
    assert b[sc.WAYBILL_ATTEMPT_CAUSE] == "failover"
    assert b[sc.WAYBILL_ATTEMPT_ADMITTED_AS] == "probe:endpoint"
    assert b[sc.WAYBILL_ATTEMPT_TIME_TO_FIRST_CHUNK_MS] == 95
    assert b[sc.WAYBILL_ATTEMPT_RESPONSE_BYTES] == 1024
    assert sc.ERROR_TYPE not in b and second.error is None


def test_request_span_attributes_and_no_old_or_secret_names():
    request, *_ = request_spans(failover_trail("r1"))
    r = request.attributes
    assert r[sc.GEN_AI_REQUEST_MODEL] == "chat-default"
    assert r[sc.GEN_AI_RESPONSE_MODEL] == "claude-3-5-20241022"
    assert r[sc.GEN_AI_PROVIDER_NAME] == "anthropic"
    assert r[sc.GEN_AI_REQUEST_STREAM] is False
    assert r[sc.GEN_AI_REQUEST_MAX_TOKENS] == 64
    assert sc.GEN_AI_REQUEST_CHOICE_COUNT not in r  # one choice: the attribute is left out
    assert (r[sc.GEN_AI_USAGE_INPUT_TOKENS], r[sc.GEN_AI_USAGE_OUTPUT_TOKENS]) == (12, 30)
    assert r[sc.WAYBILL_STATUS] == "succeeded" and r[sc.WAYBILL_ENDPOINT] == "west"
    assert r[sc.WAYBILL_ATTEMPTS] == 2
    assert r[sc.WAYBILL_COST_USD] == "0.000072"
    # the later reconciliation of attempt 1 is not part of the trace
    assert r[sc.WAYBILL_HELD_UNKNOWN_USD] == "0.0030"
    assert request.error is None
    for span in request_spans(failover_trail("r1")):
        keys = set(span.attributes) | {k for e in span.events for k in e.attributes}
        assert "gen_ai.system" not in keys
        assert not [k for k in keys if "prompt" in k or "secret" in k]


def test_a_request_for_several_choices_names_their_count():
    trail = failover_trail("r1")
    received = trail[0]
    assert received.type == "RequestReceived"
    data = {**received.data, "requirements": {**received.data["requirements"], "choices": 3}}
    trail[0] = dataclasses.replace(received, data=data)
    request, *_ = request_spans(trail)
    assert request.attributes[sc.GEN_AI_REQUEST_CHOICE_COUNT] == 3


def test_an_attempts_cache_writes_are_span_attributes_by_lifetime():
    trail = failover_trail("r1")
    at_ = next(i for i, e in enumerate(trail) if e.type == "AttemptFinished" and e.data["usage"])
    usage = {**trail[at_].data["usage"], "cache_write_input_tokens": 4}
    usage["cache_write_1h_input_tokens"] = 2
    trail[at_] = dataclasses.replace(trail[at_], data={**trail[at_].data, "usage": usage})
    _, first, second = request_spans(trail)
    b = second.attributes
    assert (b[sc.WAYBILL_CACHE_WRITE_INPUT_TOKENS], b[sc.WAYBILL_CACHE_WRITE_1H_INPUT_TOKENS]) == (
        4,
        2,
    )
    assert sc.WAYBILL_CACHE_WRITE_INPUT_TOKENS not in first.attributes


def test_routing_decisions_are_span_events_at_their_own_time():
    request, *_ = request_spans(failover_trail("r1"))
    names = [(e.name, e.time) for e in request.events]
    assert names == [
        (sc.EVENT_ROUTE_EVALUATED, at(0)),
        (sc.EVENT_FAILOVER_DECIDED, at(300)),
        (sc.EVENT_ROUTE_EVALUATED, at(300)),
        (sc.EVENT_CANDIDATE_EXCLUDED, at(300)),
    ]
    first_route, failover, second_route, excluded = (e.attributes for e in request.events)
    assert first_route[sc.WAYBILL_ENDPOINT] == "east" and first_route[sc.WAYBILL_CANDIDATES] == 2
    assert failover[sc.WAYBILL_ACTION] == "failover" and failover[sc.WAYBILL_ALLOWED] is True
    assert failover[sc.WAYBILL_REASON] == "unknown_execution_failover"
    assert failover[sc.WAYBILL_AFTER_ATTEMPT_ID] == "r1-a1"
    assert second_route[sc.WAYBILL_TRIED_ENDPOINTS] == ("east",)
    assert second_route[sc.WAYBILL_SEQUENCE] == 2
    assert excluded[sc.WAYBILL_REASON_CODE] == "already_tried"
    assert excluded[sc.WAYBILL_ENDPOINT] == "east"


def test_span_times_come_from_the_ledger():
    request, first, second = request_spans(failover_trail("r1"))
    # attempt 1: started at its commit, ended after its duration (not at the later commit)
    assert (first.start, first.end) == (at(0), at(120))
    # attempt 2: started at 300 ms, finished 380 ms later, before its commit at 700 ms
    assert (second.start, second.end) == (at(300), at(680))
    # the request: its terminal commit, and the gateway's duration before it
    assert (request.start, request.end) == (T0 - timedelta(milliseconds=20), at(700))
    for child in (first, second):
        assert request.start <= child.start <= child.end <= request.end


def test_a_failed_request_has_error_status_and_error_type():
    request, attempt = request_spans(quota_trail("r2"))
    assert request.error == "upstream_quota_exhausted"
    assert request.attributes[sc.ERROR_TYPE] == "upstream_quota_exhausted"
    assert request.attributes[sc.WAYBILL_STATUS] == "failed"
    assert request.attributes[sc.HTTP_RESPONSE_STATUS_CODE] == 502
    assert attempt.error == "quota_exhausted"
    assert attempt.attributes[sc.WAYBILL_ERROR_CODE] == "insufficient_quota"
    stop = next(e for e in request.events if e.name == sc.EVENT_FAILOVER_DECIDED)
    assert stop.attributes[sc.WAYBILL_ACTION] == "stop"
    assert stop.attributes[sc.WAYBILL_REASON] == "quota_exhausted_never_fails_over"
    # no traceparent from the caller: a root span in a trace derived from the request id
    assert request.parent_span_id is None and not request.remote_parent
    assert request.trace_id == attempt.trace_id == request_trace_id("r2")


def test_no_eligible_route_gives_a_lone_request_span_with_the_exclusions():
    (request,) = request_spans(no_route_trail("r3"))
    assert request.error == "no_eligible_route"
    excluded = [e.attributes for e in request.events if e.name == sc.EVENT_CANDIDATE_EXCLUDED]
    assert [(e[sc.WAYBILL_ENDPOINT], e[sc.WAYBILL_REASON_CODE]) for e in excluded] == [
        ("east", "missing_capability"),
        ("west", "region_not_allowed"),
    ]
    assert excluded[0][sc.WAYBILL_DETAIL] == "tools"
    assert sc.GEN_AI_PROVIDER_NAME not in request.attributes


def test_a_broken_stream_is_a_partial_failure():
    events = recorded(
        [
            (0, [received("r4", stream=True)]),
            (
                10,
                [
                    ev.RequestFailed(
                        request_id="r4",
                        http_status=502,
                        error_code="upstream_error",
                        error_type="upstream_error",
                        message="the upstream stream broke",
                        attempts=1,
                        endpoint="east",
                        stream_started=True,
                        duration_ms=10,
                    )
                ],
            ),
        ]
    )
    (request,) = request_spans(events)
    assert request.attributes[sc.WAYBILL_STATUS] == "partial_failure"
    assert request.attributes[sc.GEN_AI_REQUEST_STREAM] is True


def test_a_request_without_its_terminal_event_has_no_spans_yet():
    trail = failover_trail("r5")
    terminal = next(i for i, e in enumerate(trail) if e.type == "RequestCompleted")
    assert request_spans(trail[:terminal]) == []
    assert len(request_spans(trail[: terminal + 1])) == 3


def test_spans_are_the_same_whenever_they_are_folded():
    # Re-folding (a re-export, a restart) gives identical spans; later events change nothing.
    trail = failover_trail("r6")
    until_terminal = [e for e in trail if e.recorded_at <= at(700)]
    assert request_spans(trail) == request_spans(until_terminal) == request_spans(list(trail))


def test_ids_are_deterministic_and_valid():
    assert request_trace_id("req_1") == request_trace_id("req_1") != request_trace_id("req_2")
    assert len(request_trace_id("req_1")) == 32 and len(request_span_id("req_1")) == 16
    assert request_span_id("x") != attempt_span_id("x")
    assert request_trace_id("req_1", CALLER_TRACE.upper()) == CALLER_TRACE
    for invalid in ("0" * 32, "zz" * 16, "abc", ""):
        assert request_trace_id("req_1", invalid) == request_trace_id("req_1")
    assert upstream_traceparent(CALLER_TRACE, "00f067aa0ba902b7") == (
        f"00-{CALLER_TRACE}-00f067aa0ba902b7-01"
    )


def test_readable_spans_keep_ids_timestamps_parents_and_status():
    spans = request_spans(failover_trail("r7"))
    request, first, _ = to_readable_spans(spans, Resource({"service.name": "waybill"}))
    assert request.context is not None and first.context is not None
    assert format(request.context.trace_id, "032x") == CALLER_TRACE
    assert format(request.context.span_id, "016x") == request_span_id("r7")
    assert request.parent is not None and request.parent.is_remote
    assert format(request.parent.span_id, "016x") == CALLER_SPAN
    assert first.parent is not None and not first.parent.is_remote
    assert first.parent.span_id == request.context.span_id
    assert request.kind is SpanKind.SERVER and first.kind is SpanKind.CLIENT
    assert first.start_time == int(T0.timestamp()) * 10**9
    assert first.end_time == int(T0.timestamp()) * 10**9 + 120 * 10**6
    assert first.status.status_code is StatusCode.ERROR
    assert first.status.description == "upstream_unavailable"
    assert request.status.status_code is StatusCode.UNSET
    assert request.events[0].name == sc.EVENT_ROUTE_EVALUATED
    assert request.events[0].timestamp == int(T0.timestamp()) * 10**9
    assert request.instrumentation_scope is not None
    assert request.instrumentation_scope.schema_url == sc.SCHEMA_URL


def test_an_embeddings_request_is_the_embeddings_operation_on_every_span():
    trail = failover_trail("r1")
    data = {
        **trail[0].data,
        "api": "openai.embeddings",
        "requirements": {**trail[0].data["requirements"], "kind": "embeddings"},
    }
    trail[0] = dataclasses.replace(trail[0], data=data)
    spans = request_spans(trail)
    assert [s.name for s in spans] == [
        "embeddings chat-default",
        "embeddings gpt-4o-mini",
        "embeddings claude-3-5",
    ]
    assert {s.attributes[sc.GEN_AI_OPERATION_NAME] for s in spans} == {"embeddings"}


def test_with_a_tenant_key_the_request_span_names_a_pseudonym_not_the_workspace():
    from otel.ids import pseudonymous_tenant

    plain = request_spans(failover_trail("r1"))[0].attributes
    assert plain[sc.WAYBILL_WORKSPACE] == "acme" and sc.WAYBILL_TENANT not in plain
    key = b"a-secret-of-sixteen-bytes-or-more"
    named = request_spans(failover_trail("r1"), tenant_key=key)[0].attributes
    assert sc.WAYBILL_WORKSPACE not in named
    tenant = named[sc.WAYBILL_TENANT]
    assert tenant == pseudonymous_tenant("acme", key)
    # stable, hex SHA-256 wide, and another secret (or another workspace) names another
    assert pseudonymous_tenant("acme", key) == tenant
    assert isinstance(tenant, str) and len(tenant) == 64 and "acme" not in tenant
    assert pseudonymous_tenant("acme", b"another-secret-of-16-bytes") != tenant
    assert pseudonymous_tenant("other", key) != tenant
