"""Every request's story held to its decisions (ledger/audit/stories.py): the rules one by
one, on stories written as the gateway records them."""

from __future__ import annotations

from typing import Any

from ledger.audit.stories import Stories, StoryBroken

REQ = "req_1"


class _Story:
    """Writes one request's events, in order, and feeds them to a fold."""

    def __init__(self) -> None:
        self.stories = Stories()
        self.position = 0
        self.broken: list[StoryBroken] = []
        self.event("RequestReceived")

    def event(self, event_type: str, **data: Any) -> _Story:
        self.position += 1
        body = {"type": event_type, "data": {"request_id": REQ, **data}}
        self.broken += self.stories.feed(self.position, f"request-{REQ}", body)
        return self

    def started(self, attempt: str, endpoint: str, cause: str = "first", **kw: Any) -> _Story:
        return self.event(
            "AttemptStarted", attempt_id=attempt, endpoint=endpoint, cause=cause, **kw
        )

    def finished(self, attempt: str, status: str = "failed") -> _Story:
        return self.event("AttemptFinished", attempt_id=attempt, status=status)

    def decided(self, after: str, action: str, reason: str = "r") -> _Story:
        return self.event("FailoverDecided", after_attempt_id=after, action=action, reason=reason)

    def rules(self) -> list[str]:
        return [b.rule for b in self.broken]


def _failed_once() -> _Story:
    return _Story().started("a1", "east").finished("a1")


def test_a_retry_followed_by_an_attempt_on_the_same_endpoint_holds():
    story = (
        _failed_once()
        .decided("a1", "retry")
        .started("a2", "east", "retry")
        .finished("a2", "succeeded")
    )
    story.event("RequestCompleted")
    assert story.rules() == []
    assert story.stories.checked == 1


def test_a_retry_followed_by_an_attempt_elsewhere_is_named():
    story = (
        _failed_once()
        .decided("a1", "retry", "retry_with_backoff")
        .started("a2", "west", "failover")
    )
    assert story.rules() == ["decision_not_followed"]
    broken = story.broken[0]
    assert broken.request_id == REQ and broken.position == 5
    assert "retry (retry_with_backoff) after attempt a1 on east" in broken.detail
    assert "a2 (call) started on west" in str(broken)


def test_a_refused_retry_that_says_so_may_fail_over():
    story = (
        _failed_once()
        .decided("a1", "retry")
        .decided("a1", "failover", "retry_refused_breaker_open")
    )
    story.started("a2", "west", "failover").finished("a2", "succeeded").event("RequestCompleted")
    assert story.rules() == []


def test_a_failover_must_leave_the_endpoint():
    story = _failed_once().decided("a1", "failover").started("a2", "east", "failover")
    assert story.rules() == ["decision_not_followed"]


def test_a_failover_may_end_for_want_of_a_route():
    story = (
        _failed_once()
        .decided("a1", "failover")
        .event("RequestFailed", error_code="no_eligible_route")
    )
    assert story.rules() == []


def test_a_resume_must_be_followed_by_a_resume():
    story = _failed_once().decided("a1", "resume").started("a2", "east", "retry", kind="call")
    assert story.rules() == ["decision_not_followed"]
    story = _failed_once().decided("a1", "resume").started("a2", "north", "failover", kind="resume")
    assert story.rules() == []


def test_a_stop_is_followed_by_no_attempt():
    story = _failed_once().decided("a1", "stop").started("a2", "west", "failover")
    assert story.rules() == ["decision_not_followed"]
    story = _failed_once().decided("a1", "stop").event("RequestFailed", error_code="upstream_error")
    assert story.rules() == []


def test_a_retry_the_request_never_made_is_named_unless_the_client_left():
    story = (
        _failed_once()
        .decided("a1", "retry")
        .event("RequestFailed", error_code="upstream_unavailable")
    )
    assert story.rules() == ["decision_not_followed"]
    story = (
        _failed_once().decided("a1", "retry").event("RequestFailed", error_code="client_canceled")
    )
    assert story.rules() == []


def test_a_decision_after_an_attempt_never_started_is_named():
    story = _Story().decided("a9", "failover")
    assert story.rules() == ["decision_after_unknown_attempt"]


def test_an_ended_request_with_an_attempt_never_finished_is_named():
    story = _Story().started("a1", "east").event("RequestFailed", error_code="upstream_error")
    assert story.rules() == ["attempt_not_finished"]


def test_a_completion_needs_an_attempt_that_succeeded():
    story = _failed_once().event("RequestCompleted")
    assert story.rules() == ["completed_without_success"]


def test_a_hedge_is_the_walks_own_way_and_another_way_carries_a_failed_one():
    story = _Story().started("a1", "east").started("a2", "west", "hedge", kind="hedge")
    story.finished("a1").decided("a1", "failover", "other_way_running")
    story.finished("a2", "succeeded").event("RequestCompleted")
    assert story.rules() == []


def test_a_request_whose_beginning_was_not_seen_is_not_judged():
    stories = Stories()
    body = {"type": "RequestCompleted", "data": {}}
    assert stories.feed(7, "request-old", body) == []
    assert stories.feed(8, "breaker", {"type": "BreakerTransitioned", "data": {}}) == []
    assert stories.checked == 0


def test_a_pooled_retry_hedge_or_resume_stays_in_its_pool():
    # contract §4 "Pools": a child's retries, hedges and resumes stay inside the pool.
    inside = _Story().started("a1", "east", pool="local", dispatch="delegate_pool")
    inside.started("a2", "north", "hedge", kind="hedge", hedge_of="a1", pool="local")
    inside.finished("a2").finished("a1").decided("a1", "retry")
    inside.started("a3", "east", "retry", pool="local")
    assert inside.rules() == []
    hedged = _Story().started("a1", "east", pool="local")
    hedged.started("a2", "west", "hedge", kind="hedge", hedge_of="a1", pool="cloud")
    assert hedged.rules() == ["left_pool"]
    resumed = _Story().started("a1", "east", pool="local").finished("a1")
    resumed.decided("a1", "resume").started(
        "a2", "west", "failover", kind="resume", resumed_from="a1", pool="cloud"
    )
    assert resumed.rules() == ["left_pool"]
    failover = _failed_once().decided("a1", "failover").started("a2", "west", pool="cloud")
    assert failover.rules() == []  # a failover may cross to another pool
