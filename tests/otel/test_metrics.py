"""Metrics recorded from ledger events, read back through OpenTelemetry and Prometheus."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource

from ledger import events as ev
from otel import semconv as sc
from otel.metrics import MetricsPipeline
from tests.otel.trails import failover_trail, no_route_trail, quota_trail, recorded


def _pipeline() -> tuple[MetricsPipeline, InMemoryMetricReader]:
    reader = InMemoryMetricReader()
    pipeline = MetricsPipeline(Resource({"service.name": "t"}), readers=[reader], otlp=False)
    return pipeline, reader


def _points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    data = reader.get_metrics_data()
    assert data is not None
    points: dict[str, list[Any]] = {}
    for resource_metrics in data.resource_metrics:
        for scope in resource_metrics.scope_metrics:
            for metric in scope.metrics:
                points.setdefault(metric.name, []).extend(metric.data.data_points)
    return points


def _breaker_opened() -> ev.BreakerTransitioned:
    return ev.BreakerTransitioned(
        scope="endpoint",
        target="east",
        from_state="closed",
        to_state="open",
        failure_class=ev.FailureClass.UPSTREAM_UNAVAILABLE,
        consecutive_failures=2,
        cooldown_ms=5000,
        config_generation="g1",
    )


def test_attempts_feed_the_genai_client_metrics():
    pipeline, reader = _pipeline()
    for event in [*failover_trail("r1"), *quota_trail("r2")]:
        pipeline.metrics.record(event)
    points = _points(reader)

    tokens = {p.attributes[sc.GEN_AI_TOKEN_TYPE]: p for p in points[sc.GEN_AI_CLIENT_TOKEN_USAGE]}
    assert (tokens["input"].sum, tokens["output"].sum) == (12, 30)
    assert tokens["input"].attributes[sc.GEN_AI_PROVIDER_NAME] == "anthropic"
    assert tokens["input"].attributes[sc.GEN_AI_REQUEST_MODEL] == "claude-3-5"
    assert tokens["input"].attributes[sc.GEN_AI_RESPONSE_MODEL] == "claude-3-5-20241022"
    assert tokens["input"].attributes[sc.SERVER_ADDRESS] == "west.example.test"

    durations = {
        (p.attributes[sc.GEN_AI_REQUEST_MODEL], p.attributes.get(sc.ERROR_TYPE)): p
        for p in points[sc.GEN_AI_CLIENT_OPERATION_DURATION]
    }
    assert durations[("gpt-4o-mini", "upstream_unavailable")].sum == 0.12
    assert durations[("gpt-4o-mini", "quota_exhausted")].count == 1
    assert durations[("claude-3-5", None)].sum == 0.38
    assert list(durations[("claude-3-5", None)].explicit_bounds) == list(sc.DURATION_BUCKETS)

    failovers = points[sc.WAYBILL_FAILOVERS]
    assert [(p.attributes[sc.WAYBILL_FAILURE_CLASS], p.value) for p in failovers] == [
        ("upstream_unavailable", 1)  # the quota stop is not a failover
    ]
    assert [p.value for p in points[sc.WAYBILL_UNKNOWN_USAGE_OPENED]] == [1]
    requests = {p.attributes[sc.WAYBILL_STATUS]: p.value for p in points[sc.WAYBILL_REQUESTS]}
    assert requests == {"succeeded": 1, "failed": 1}


def test_breakers_budget_denials_time_to_first_chunk_and_lag():
    pipeline, reader = _pipeline()
    stream = recorded(
        [
            (
                0,
                [
                    _breaker_opened(),
                    ev.BudgetReservationDenied(
                        request_id="r1",
                        endpoint="east",
                        model="gpt-4o-mini",
                        amount_usd="0.01",
                        account_id="workspace:acme",
                        account_kind="workspace",
                        limit_usd="1",
                        available_usd="0.001",
                    ),
                    ev.AttemptFinished(
                        request_id="r1",
                        attempt_id="a-unseen",  # started before this process followed
                        status="succeeded",
                        evidence=ev.Evidence.STARTED,
                        duration_ms=900,
                        time_to_first_chunk_ms=250,
                    ),
                ],
            )
        ]
    )
    for event in stream:
        pipeline.metrics.record(event)
    pipeline.metrics.set_lag({"otel_traces": 7, "requests": 0})
    points = _points(reader)
    (opened,) = points[sc.WAYBILL_BREAKER_TRANSITIONS]
    assert opened.attributes == {
        sc.WAYBILL_BREAKER_SCOPE: "endpoint",
        sc.WAYBILL_ENDPOINT: "east",
        sc.WAYBILL_BREAKER_STATE: "open",
    }
    (denied,) = points[sc.WAYBILL_BUDGET_REJECTIONS]
    assert denied.attributes == {sc.WAYBILL_ACCOUNT_KIND: "workspace"} and denied.value == 1
    (first_chunk,) = points[sc.GEN_AI_CLIENT_OPERATION_TIME_TO_FIRST_CHUNK]
    assert first_chunk.sum == 0.25
    lag = {p.attributes[sc.WAYBILL_FOLLOWER]: p.value for p in points[sc.WAYBILL_LEDGER_LAG]}
    assert lag == {"otel_traces": 7, "requests": 0}


def test_prometheus_text_names_the_metrics_by_the_conventions():
    pipeline, _ = _pipeline()
    for event in failover_trail("r1"):
        pipeline.metrics.record(event)
    pipeline.metrics.record(recorded([(0, [_breaker_opened()])])[0])
    text = pipeline.prometheus_text().decode()
    assert "gen_ai_client_token_usage_bucket{" in text
    assert 'gen_ai_token_type="input"' in text and 'gen_ai_provider_name="anthropic"' in text
    assert "gen_ai_client_operation_duration_seconds_count{" in text
    assert "waybill_failovers_total{" in text
    assert (
        "waybill_breaker_transitions_total{" in text and 'waybill_breaker_to_state="open"' in text
    )
    assert "gen_ai_system" not in text
    pipeline.shutdown()


def test_unattributed_provider_usage_of_a_reconciliation_is_counted_by_token_type():
    pipeline, reader = _pipeline()
    usage = ev.UnattributedUsage(
        bucket="2026-11-30T13:00Z",
        bucket_end="2026-11-30T14:00Z",
        model="gpt-4o-mini",
        endpoints=("east",),
        project_id="proj_east",
        input_tokens=300,
        output_tokens=200,
    )
    imported = ev.ReconciliationImported(
        reconciliation_id="rec_0123456789abcdef",
        file_sha256="0" * 64,
        lines=3,
        imported_by="cli",
        report_format="openai-usage",
        unattributed_provider_usage=(usage, usage.model_copy(update={"output_tokens": 0})),
    )
    pipeline.metrics.record(recorded([(0, [imported])])[0])
    (points,) = [_points(reader)[sc.WAYBILL_UNATTRIBUTED_TOKENS]]
    by_type = {p.attributes[sc.GEN_AI_TOKEN_TYPE]: p.value for p in points}
    assert by_type == {"input": 600, "output": 200}
    assert {p.attributes[sc.WAYBILL_ENDPOINT] for p in points} == {"east"}
    text = pipeline.prometheus_text().decode()
    assert "waybill_reconciliation_unattributed_tokens_total{" in text
    pipeline.shutdown()


def test_the_events_the_metrics_skip_unread_are_those_no_case_reads() -> None:
    # LedgerMetrics.record returns before reading an event whose type is not in _MEASURED:
    # every class its match names must be there, and nothing else.
    import ast
    import inspect
    import textwrap

    from otel import metrics

    source = textwrap.dedent(inspect.getsource(metrics.LedgerMetrics.record))
    named = {
        node.cls.attr
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.MatchClass) and isinstance(node.cls, ast.Attribute)
    }
    assert {getattr(ev, name).type for name in named} == metrics._MEASURED


def test_an_embeddings_requests_attempts_are_the_embeddings_operation():
    import dataclasses

    pipeline, reader = _pipeline()
    embedded = failover_trail("r1")
    embedded[0] = dataclasses.replace(
        embedded[0], data={**embedded[0].data, "api": "openai.embeddings"}
    )
    for event in [*embedded, *quota_trail("r2")]:
        pipeline.metrics.record(event)
    operations = {
        (p.attributes[sc.GEN_AI_REQUEST_MODEL], p.attributes.get(sc.ERROR_TYPE)): p.attributes[
            sc.GEN_AI_OPERATION_NAME
        ]
        for p in _points(reader)[sc.GEN_AI_CLIENT_OPERATION_DURATION]
    }
    # r1's attempts embed; r2's, a chat on the same model, stay chat.
    assert operations == {
        ("gpt-4o-mini", "upstream_unavailable"): "embeddings",
        ("claude-3-5", None): "embeddings",
        ("gpt-4o-mini", "quota_exhausted"): "chat",
    }
    tokens = _points(reader)[sc.GEN_AI_CLIENT_TOKEN_USAGE]
    assert {p.attributes[sc.GEN_AI_OPERATION_NAME] for p in tokens} == {"embeddings"}
    pipeline.shutdown()


def _transition(target: str, from_state: str, to_state: str) -> ev.BreakerTransitioned:
    scope = "mapping" if "/" in target else "endpoint"
    return ev.BreakerTransitioned(
        scope=scope,
        target=target,
        from_state=from_state,
        to_state=to_state,
        config_generation="g1",
    )


def test_seconds_a_breaker_spent_open_are_counted_when_it_leaves_open():
    pipeline, reader = _pipeline()
    stream = recorded(
        [
            (0, [_transition("east", "closed", "open")]),
            (0, [_transition("east/gpt-4o-mini", "closed", "open")]),
            (5_000, [_transition("east", "open", "half_open")]),  # 5 s open
            (5_200, [_transition("east", "half_open", "open")]),  # a failed probe reopens
            (8_200, [_transition("east", "open", "half_open")]),  # 3 s more
            (8_300, [_transition("east", "half_open", "closed")]),  # half-open is not open
            (9_500, [_transition("east/gpt-4o-mini", "open", "half_open")]),
            (9_600, [_transition("west", "open", "half_open")]),  # opened before we followed
        ]
    )
    for event in stream:
        pipeline.metrics.record(event)
    seconds = {
        (p.attributes[sc.WAYBILL_ENDPOINT], p.attributes.get(sc.WAYBILL_MODEL)): p.value
        for p in _points(reader)[sc.WAYBILL_BREAKER_OPEN_TIME]
    }
    assert seconds == {("east", None): 8.0, ("east", "gpt-4o-mini"): 9.5}
    text = pipeline.prometheus_text().decode()
    assert "waybill_breaker_open_time_seconds_total{" in text
    pipeline.shutdown()


def test_cost_per_successful_request_and_candidates_excluded_by_reason_code():
    pipeline, reader = _pipeline()
    for event in [*failover_trail("r1"), *quota_trail("r2"), *no_route_trail("r3")]:
        pipeline.metrics.record(event)
    points = _points(reader)
    (cost,) = points[sc.WAYBILL_REQUEST_COST]
    assert (cost.count, cost.sum) == (1, 0.000072)  # the failed requests cost nothing here
    assert list(cost.explicit_bounds) == list(sc.COST_BUCKETS)
    excluded = {
        p.attributes[sc.WAYBILL_REASON_CODE]: p.value
        for p in points[sc.WAYBILL_EXCLUDED_CANDIDATES]
    }
    assert excluded == {"already_tried": 1, "missing_capability": 1, "region_not_allowed": 1}
    text = pipeline.prometheus_text().decode()
    assert "waybill_request_cost_USD_bucket{" in text
    assert "waybill_route_excluded_candidates_total{" in text and '"already_tried"} 1.0' in text
    pipeline.shutdown()


def _finished(attempt_id: str, **fields: Any) -> ev.AttemptFinished:
    return ev.AttemptFinished(
        request_id="r1",
        attempt_id=attempt_id,
        status="failed",
        evidence=ev.Evidence.STARTED,
        duration_ms=100,
        **fields,
    )


def _settled(attempt_id: str, usd: str, usage: ev.Usage) -> ev.BudgetSettled:
    return ev.BudgetSettled(
        request_id="r1",
        attempt_id=attempt_id,
        reservation_id=f"{attempt_id}-r",
        reserved_usd="0.01",
        settled_usd=usd,
        released_usd="0",
        usage=usage,
    )


def test_usage_after_a_cancel_and_hedge_losers_tokens_are_counted_from_their_settlement():
    pipeline, reader = _pipeline()
    canceled = ev.FailureClass.CLIENT_CANCELED
    stream = recorded(
        [
            (
                0,
                [
                    _finished("lost", error_code=ev.HEDGE_LOST),
                    _settled("lost", "0.002", ev.Usage(input_tokens=10, output_tokens=40)),
                    _finished("gone", failure_class=canceled),
                    _settled("gone", "0.001", ev.Usage(input_tokens=7, output_tokens=3)),
                    _finished("gone-early", failure_class=canceled),
                    ev.UnknownUsageOpened(
                        settlement_id="s1",
                        request_id="r1",
                        attempt_id="gone-early",
                        reservation_id="gone-early-r",
                        workspace="acme",
                        key_id="k_1",
                        endpoint="east",
                        model="gpt-4o-mini",
                        held_usd="0.004",
                        cause="client_canceled",
                    ),
                    _finished("failed", failure_class=ev.FailureClass.UPSTREAM_UNAVAILABLE),
                    _settled("failed", "0.5", ev.Usage(input_tokens=99, output_tokens=99)),
                ],
            )
        ]
    )
    for event in stream:
        pipeline.metrics.record(event)
    points = _points(reader)

    def by(name: str, attribute: str) -> dict[str, float]:
        return {p.attributes[attribute]: p.value for p in points[name]}

    assert by(sc.WAYBILL_HEDGE_LOSER_TOKENS, sc.GEN_AI_TOKEN_TYPE) == {"input": 10, "output": 40}
    assert by(sc.WAYBILL_HEDGE_LOSER_COST, sc.WAYBILL_SETTLEMENT) == {"settled": 0.002}
    assert by(sc.WAYBILL_CANCELED_TOKENS, sc.GEN_AI_TOKEN_TYPE) == {"input": 7, "output": 3}
    assert by(sc.WAYBILL_CANCELED_COST, sc.WAYBILL_SETTLEMENT) == {
        "settled": 0.001,
        "held_unknown": 0.004,
    }
    text = pipeline.prometheus_text().decode()
    assert "waybill_canceled_tokens_total{" in text and "waybill_hedge_loser_tokens_total{" in text
    pipeline.shutdown()
