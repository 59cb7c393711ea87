"""The explanation, unit by unit: pure, from recorded events (no database, no gateway)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import orjson
import pytest

from ledger import events as ev
from ledger.events import encode_event
from ledger.store import RecordedEvent
from ledger.views.explain import NotARequestTrail, explain, render_text
from tests.ledger.factories import received, succeeded_trail, unknown_then_failed_trail

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def recorded(events: Sequence[ev.Event], request_id: str = "r1") -> list[RecordedEvent]:
    """The events as the store would hand them back (positions from 10, one ms apart)."""
    return [
        RecordedEvent(
            position=10 + i,
            stream_id=f"request-{request_id}",
            version=i + 1,
            type=type(e).type,
            schema_version=type(e).schema_version,
            data=encode_event(e),
            metadata={},
            recorded_at=T0 + timedelta(milliseconds=i),
            hash=f"{i:064x}",
            payload=b"",
        )
        for i, e in enumerate(events)
    ]


def candidate(endpoint: str, tier: int = 0, weight: int = 1, **kw: object) -> ev.Candidate:
    fields: dict[str, object] = {
        "endpoint": endpoint,
        "model": "m",
        "mapping_index": kw.pop("index", 0),
        "tier": tier,
        "weight": weight,
        "eligible": True,
    }
    fields.update(kw)
    return ev.Candidate.model_validate(fields)


def choice(c: ev.Candidate, position: int = 0) -> ev.RouteChoice:
    return ev.RouteChoice(
        endpoint=c.endpoint,
        model=c.model,
        mapping_index=c.mapping_index,
        tier=c.tier,
        weight=c.weight,
        selection_position=position,
    )


def started(attempt: str, endpoint: str, number: int = 1, **kw: object) -> ev.AttemptStarted:
    fields: dict[str, object] = {
        "request_id": "r1",
        "attempt_id": attempt,
        "attempt_number": number,
        "cause": "first" if number == 1 else "failover",
        "endpoint": endpoint,
        "driver": "openai",
        "model": "m",
        "tier": 0,
        "weight": 1,
    }
    fields.update(kw)
    return ev.AttemptStarted.model_validate(fields)


def test_a_served_request_names_its_route_the_excluded_mapping_and_the_money() -> None:
    x = explain(recorded(succeeded_trail("r1", cost="0.0012")))
    assert x["status"] == "succeeded" and x["endpoint"] == "east"
    assert x["summary"] == (
        "Request r1 (model group chat-default) was served by east/gpt-4o-mini on tier 0; "
        "eu/claude was never eligible: missing_capability tools; "
        "cost $0.001200 settled, $0.001800 released; config generation g1."
    )
    chosen = [c for c in x["candidates"] if c["chosen"]]
    assert [(c["endpoint"], c["selection_position"]) for c in chosen] == [("east", 0)]
    excluded = next(c for c in x["candidates"] if c["endpoint"] == "eu")
    assert (excluded["eligible"], excluded["reason_code"], excluded["detail"]) == (
        False,
        "missing_capability",
        "tools",
    )
    assert excluded["selection_position"] is None
    [attempt] = x["attempts"]
    assert attempt["status"] == "succeeded" and attempt["evidence"] == "started"
    assert (attempt["reserved_usd"], attempt["settled_usd"], attempt["released_usd"]) == (
        "0.003000",
        "0.001200",
        "0.001800",
    )
    assert attempt["reservation"] == "settled" and attempt["failover"] is None
    assert [b["check"] for b in x["budget_checks"]] == ["reserved", "settled"]
    assert x["config_generation"] == "g1"
    assert [s["event"] for s in x["decision_path"]] == [type(e).type for e in succeeded_trail("r1")]


def test_an_unknown_attempt_that_stopped_names_class_evidence_decision_and_the_hold() -> None:
    x = explain(recorded(unknown_then_failed_trail("r1")))
    assert x["status"] == "failed" and x["error_code"] == "upstream_unavailable"
    assert x["summary"].startswith(
        "Request r1 (model group chat-default) failed with 503 upstream_unavailable after "
        "tier 0's east/gpt-4o-mini answered 502 upstream_unavailable with execution unknown "
        "(stop: on_unknown_execution_stop, strict, as on_unknown_execution: stop says: a "
        "request whose attempt may have run is never run again)"
    )
    assert "$0.005000 held as unknown usage" in x["summary"]
    [attempt] = x["attempts"]
    assert attempt["failover"] == {
        "allowed": False,
        "action": "stop",
        "reason": "on_unknown_execution_stop",
        "backoff_ms": None,
        "policy": None,
    }
    assert (attempt["held_unknown_usd"], attempt["reservation"]) == ("0.005000", "held_unknown")
    assert x["held_unknown_usd"] == "0.005000"


def _strict_trail(
    reason: str, policy: str, action: str = "stop", **requirements: bool
) -> list[ev.Event]:
    """The unknown-then-failed trail of a request with ``requirements``, its decision
    ``action`` for ``reason``."""
    trail = unknown_then_failed_trail("r1")
    first = trail[0]
    assert isinstance(first, ev.RequestReceived)
    trail[0] = first.model_copy(
        update={"requirements": first.requirements.model_copy(update=requirements)}
    )
    index, decided = next((i, e) for i, e in enumerate(trail) if isinstance(e, ev.FailoverDecided))
    trail[index] = decided.model_copy(
        update={"reason": reason, "policy": policy, "action": action, "allowed": action != "stop"}
    )
    return trail


def test_a_request_strict_for_its_server_side_effects_names_that_rule_in_plain_words() -> None:
    x = explain(
        recorded(
            _strict_trail(
                "server_side_effects_strict", "server_side_effects=strict", server_side_effects=True
            )
        )
    )
    words = (
        "strict, as every request asking the provider for server-side effects (server-side "
        "tools, web search) is: it is never run again once an attempt may have run"
    )
    assert f"(stop: server_side_effects_strict, {words})" in x["summary"]
    received_step, decided_step = (
        next(s["text"] for s in x["decision_path"] if s["event"] == name)
        for name in ("RequestReceived", "FailoverDecided")
    )
    assert "asks the provider for server-side effects, so it is strict" in received_step
    assert decided_step.endswith(f"stop, not allowed: server_side_effects_strict, {words}")
    assert x["attempts"][0]["failover"]["policy"] == "server_side_effects=strict"
    assert x["requirements"]["server_side_effects"] is True
    text = " ".join(render_text(x).split())
    assert (
        "then stop (not allowed): server_side_effects_strict (policy server_side_effects=strict)"
        in text
    )


def test_a_caller_allowing_a_second_execution_is_named_in_the_explanation() -> None:
    trail = _strict_trail(
        "unknown_execution_allowed_by_header",
        "X-Waybill-Allow-Failover=unknown",
        "failover",
        allow_unknown_execution=True,
    )
    x = explain(recorded(trail))
    assert (
        "unknown_execution_allowed_by_header, the caller's X-Waybill-Allow-Failover: unknown "
        "allowed running it again although the attempt may have run" in x["summary"]
    )
    received_step = x["decision_path"][0]["text"]
    assert "the caller allows running it again after an attempt that may have run" in received_step


def test_an_operator_settlement_of_unknown_usage_is_part_of_the_story() -> None:
    trail = unknown_then_failed_trail("r1")
    trail.append(
        ev.UnknownUsageSettled(
            settlement_id="r1-a1-s",
            request_id="r1",
            attempt_id="r1-a1",
            reservation_id="r1-a1-r",
            held_usd=Decimal("0.0050"),
            settled_usd=Decimal("0.0010"),
            released_usd=Decimal("0.0040"),
            source="operator",
            actor="key_admin",
            reason="provider invoice",
        )
    )
    x = explain(recorded(trail))
    attempt = x["attempts"][0]
    assert (attempt["reservation"], attempt["held_unknown_usd"], attempt["settled_usd"]) == (
        "unknown_settled",
        "0.000000",
        "0.001000",
    )
    assert "held as unknown usage" not in x["summary"]
    assert "by operator key_admin" in x["decision_path"][-1]["text"]


def test_a_budget_that_covers_nothing_is_explained_before_any_attempt() -> None:
    over = candidate("east", eligible=False, reason_code="over_budget", detail="workspace:acme")
    trail = [
        received("r1"),
        ev.RouteEvaluated(request_id="r1", sequence=1, candidates=(over,)),
        ev.BudgetReservationDenied(
            request_id="r1",
            endpoint="east",
            model="m",
            amount_usd=Decimal("0.02"),
            account_id="workspace:acme:2026-11",
            account_kind="workspace",
            limit_usd=Decimal(1),
            available_usd=Decimal("0.01"),
        ),
        ev.RequestFailed(
            request_id="r1",
            http_status=402,
            error_code="budget_exceeded",
            error_type="budget_error",
            message="no eligible route fits the remaining budget",
            attempts=0,
            duration_ms=3,
        ),
    ]
    x = explain(recorded(trail))
    assert x["summary"] == (
        "Request r1 (model group chat-default) failed with 402 budget_exceeded before any "
        "attempt: the budget could not cover a reservation; east/m was never eligible: "
        "over_budget workspace:acme; no cost recorded; a reservation of $0.020000 on east/m "
        "was denied: "
        "workspace account workspace:acme:2026-11 had $0.010000 of $1.000000 left; "
        "config generation g1."
    )
    assert x["attempts"] == [] and x["budget_checks"][0]["check"] == "denied"


def test_what_the_worst_case_is_made_of_and_an_unpriced_mapping_are_explained() -> None:
    requirements = ev.Requirements(
        capabilities=("text", "vision"),
        estimated_input_tokens=40,
        max_output_tokens=50,
        choices=3,
        image_inputs=2,
        web_search=True,
    )
    unpriced = candidate("east", eligible=False, reason_code="unpriced_input", detail="image_input")
    priced = candidate("west", index=1, worst_case_usd=Decimal("0.0123"))
    trail = [
        received("r1").model_copy(update={"requirements": requirements}),
        ev.RouteEvaluated(
            request_id="r1", sequence=1, candidates=(unpriced, priced), chosen=choice(priced)
        ),
    ]
    x = explain(recorded(trail))
    assert x["requirements"]["choices"] == 3 and x["requirements"]["image_inputs"] == 2
    assert x["decision_path"][0]["text"].endswith(
        "billable: up to 40 input tokens of text, 2 image parts, 3 choices of up to 50 "
        "output tokens each, web search; config generation g1"
    )
    assert "east/m: unpriced_input image_input" in x["decision_path"][1]["text"]
    text = render_text(x)
    assert "worst case" in text and "$0.0123" in text
    assert "unpriced_input (image_input)" in text


def test_the_weighted_round_robin_loser_and_a_standby_tier_are_named() -> None:
    a = candidate("east", weight=3, index=0)
    b = candidate("north", weight=1, index=1)
    c = candidate("west", tier=1, index=2)
    trail = [
        received("r1"),
        ev.RouteEvaluated(request_id="r1", sequence=1, candidates=(a, b, c), chosen=choice(a, 7)),
        started("a1", "east"),
    ]
    x = explain(recorded(trail))
    assert x["status"] == "in_progress"
    assert x["summary"] == (
        "Request r1 (model group chat-default) is in progress; attempt 1 on east/m is in "
        "flight; north/m was eligible on tier 0 (weight 1) but the weighted round-robin chose "
        "east/m (weight 3); west/m on tier 1 was eligible but never needed; no cost recorded; "
        "config generation g1."
    )
    assert x["candidates"][0]["selection_position"] == 7
    assert x["attempts"][0]["status"] == "in_progress"


def test_a_stream_that_broke_after_it_started_is_a_partial_failure() -> None:
    east = candidate("east")
    trail = [
        received("r1"),
        ev.RouteEvaluated(request_id="r1", sequence=1, candidates=(east,), chosen=choice(east)),
        started("a1", "east", stream=True),
        ev.AttemptFinished(
            request_id="r1",
            attempt_id="a1",
            status="failed",
            failure_class=ev.FailureClass.NETWORK_ERROR,
            evidence=ev.Evidence.STARTED,
            duration_ms=50,
            stream_committed=True,
        ),
        ev.FailoverDecided(
            request_id="r1",
            after_attempt_id="a1",
            failure_class=ev.FailureClass.NETWORK_ERROR,
            evidence=ev.Evidence.STARTED,
            action="stop",
            allowed=False,
            reason="stream_committed",
        ),
        ev.RequestFailed(
            request_id="r1",
            http_status=502,
            error_code="upstream_error",
            error_type="upstream_error",
            message="the upstream stream broke",
            attempts=1,
            endpoint="east",
            stream_started=True,
            duration_ms=60,
        ),
    ]
    x = explain(recorded(trail))
    assert x["status"] == "partial_failure" and x["endpoint"] == "east"
    assert x["summary"].startswith(
        "Request r1 (model group chat-default) committed its stream to east/m on tier 0, and "
        "the stream broke after it started: network_error after starting work; recorded as a "
        "partial failure (502 upstream_error)"
    )
    assert "usage unknown for the attempt on east/m" in x["summary"]
    assert x["attempts"][0]["failover"]["reason"] == "stream_committed"


def test_a_partial_failure_says_why_the_fallback_could_not_take_over() -> None:
    east, west = candidate("east", index=0), candidate("west", tier=1, index=1)
    trail = [
        received("r1"),
        ev.RouteEvaluated(
            request_id="r1", sequence=1, candidates=(east, west), chosen=choice(east)
        ),
        started("a1", "east", stream=True),
        ev.AttemptFinished(
            request_id="r1",
            attempt_id="a1",
            status="failed",
            failure_class=ev.FailureClass.NETWORK_ERROR,
            evidence=ev.Evidence.STARTED,
            duration_ms=50,
            stream_committed=True,
        ),
        ev.FailoverDecided(
            request_id="r1",
            after_attempt_id="a1",
            failure_class=ev.FailureClass.NETWORK_ERROR,
            evidence=ev.Evidence.STARTED,
            action="stop",
            allowed=False,
            reason="stream_committed",
        ),
        ev.RequestFailed(
            request_id="r1",
            http_status=502,
            error_code="upstream_error",
            error_type="upstream_error",
            message="the upstream stream broke",
            attempts=1,
            endpoint="east",
            stream_started=True,
            duration_ms=60,
        ),
    ]
    x = explain(recorded(trail))
    assert x["status"] == "partial_failure"
    assert "never needed" not in x["summary"]
    assert (
        "west/m on tier 1 was eligible but could not take over: the stream was committed to "
        "east/m, and a committed stream is only resumed on its own model or ended"
    ) in x["summary"]
    assert "never needed" not in render_text(x)


def test_the_explanation_depends_on_the_events_alone() -> None:
    events = recorded(unknown_then_failed_trail("r1"))
    x = explain(events)
    assert explain(list(reversed(events))) == x  # ordered by position, not by argument order
    assert orjson.loads(orjson.dumps(x)) == x  # plain JSON values only
    foreign = recorded([received("r2")], request_id="r2")[0]
    assert explain([*events, foreign]) == x  # another request's event is not this one's


def test_events_that_do_not_begin_with_request_received_are_refused() -> None:
    with pytest.raises(NotARequestTrail):
        explain([])
    with pytest.raises(NotARequestTrail):
        explain(recorded(succeeded_trail("r1"))[1:])


def test_text_holds_the_summary_and_every_section() -> None:
    x = explain(recorded(succeeded_trail("r1")))
    text = render_text(x)
    assert " ".join(x["summary"].split()) in " ".join(text.split())
    for heading in ("candidates:", "attempts:", "decision path:", "budget checks:"):
        assert f"\n{heading}\n" in text
    assert "missing_capability (tools)" in text
    assert all(len(line) <= 100 for line in text.splitlines() if "decision path" in line)
    assert text.startswith("request r1: succeeded\n")


def test_an_adjustment_of_a_closed_period_is_explained() -> None:
    trail = unknown_then_failed_trail("r1")
    opened = next(e for e in trail if isinstance(e, ev.UnknownUsageOpened))
    adjusted = ev.PeriodAdjusted(
        period="2026-11",
        in_period="2026-12",
        request_id="r1",
        attempt_id=opened.attempt_id,
        reservation_id=opened.reservation_id,
        workspace="acme",
        cause="operator_settlement",
        settled_usd=Decimal("0.0040"),
        held_unknown_usd=-opened.held_usd,
        overrun_usd=Decimal(0),
    )
    step = explain(recorded([*trail, adjusted]))["decision_path"][-1]
    assert step["text"].startswith("2026-11 was closed: the change to attempt 1 is an adjustment")
    assert "recorded in 2026-12" in step["text"]
