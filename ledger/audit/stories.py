"""The story of every request, held to what its decisions say (contract §4, "Every decision
is followed by what it says").

A request's stream tells what the gateway did: attempts started and finished, a decision
after each failed one, the request's end. The chain and the books prove those events were
never changed; this module proves they never contradict each other:

- ``decision_not_followed``: after ``retry`` the next attempt runs on the same endpoint,
  after ``failover`` on another (or the request fails for want of a route), after
  ``resume`` it is a resume, after ``stop`` no attempt starts — unless a later decision
  after the same attempt changed the plan and said why (a refused retry or resume);
- ``decision_after_unknown_attempt``: a decision follows an attempt of its own request;
- ``attempt_not_finished``: when a request's end is recorded, each of its attempts has
  finished (by the gateway, or by crash recovery, which records the same events);
- ``completed_without_success``: a request completes only after an attempt that succeeded;
- ``left_pool``: in a composed group (contract §4 "Pools"), a retry, a hedge or a resume
  runs in the pool of the attempt it follows (``AttemptStarted.pool``).

Pure: :class:`Stories` folds events given in ledger order (any other streams' events are
skipped by the caller or here) and holds only the requests still being told. A request
whose first event it never saw (archived, or before the window read) is not judged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

__all__ = ["RULES", "Stories", "StoryBroken"]

RULES: Final = (
    "decision_not_followed",
    "decision_after_unknown_attempt",
    "attempt_not_finished",
    "completed_without_success",
    "left_pool",
)

# Ends a plan cannot be held to: the client left, or the gateway could not go on (its own
# failure, the ledger unavailable); the plan was cut short, not contradicted.
_CUT_SHORT: Final = frozenset(
    {"client_canceled", "ledger_unavailable", "internal_error", "deadline_exceeded"}
)
_REQUEST_PREFIX: Final = "request-"


@dataclass(frozen=True, slots=True)
class StoryBroken:
    """A request whose events contradict each other: where, which rule, and how."""

    request_id: str
    position: int
    rule: str  # one of RULES
    detail: str

    def __str__(self) -> str:
        return f"request {self.request_id} (position {self.position}): {self.rule}: {self.detail}"


@dataclass(slots=True)
class _Plan:
    action: str
    reason: str
    after: str  # the failed attempt it follows
    endpoint: str  # that attempt's endpoint
    position: int


@dataclass(slots=True)
class _Story:
    request_id: str
    endpoints: dict[str, str] = field(default_factory=dict)  # attempt id → endpoint
    pools: dict[str, str | None] = field(default_factory=dict)  # attempt id → its pool
    finished: set[str] = field(default_factory=set)
    succeeded: bool = False
    plan: _Plan | None = None


class Stories:
    """The stories of the requests being told, fed event by event in ledger order."""

    def __init__(self) -> None:
        self._told: dict[str, _Story] = {}
        self.checked = 0  # requests whose end was judged

    def feed(self, position: int, stream_id: str, body: dict[str, Any]) -> list[StoryBroken]:
        """One event of the ledger (its stored JSON); what it shows broken, if anything."""
        if not stream_id.startswith(_REQUEST_PREFIX):
            return []
        request_id = stream_id[len(_REQUEST_PREFIX) :]
        kind = body.get("type")
        story = self._told.get(request_id)
        if story is None:
            if kind != "RequestReceived":
                return []  # its beginning was not seen: not ours to judge
            self._told[request_id] = _Story(request_id)
            return []
        data = body.get("data") or {}
        match kind:
            case "AttemptStarted":
                return _started(story, position, data)
            case "AttemptFinished":
                story.finished.add(str(data.get("attempt_id")))
                if data.get("status") == "succeeded":
                    story.succeeded = True
                return []
            case "FailoverDecided":
                return _decided(story, position, data)
            case "RequestCompleted" | "RequestFailed":
                del self._told[request_id]
                self.checked += 1
                return _ended(story, position, kind, data)
        return []


def _broken(story: _Story, position: int, rule: str, detail: str) -> list[StoryBroken]:
    return [StoryBroken(story.request_id, position, rule, detail)]


def _started(story: _Story, position: int, data: dict[str, Any]) -> list[StoryBroken]:
    attempt_id, endpoint = str(data.get("attempt_id")), str(data.get("endpoint"))
    story.endpoints[attempt_id] = endpoint
    story.pools[attempt_id] = data.get("pool")
    plan = story.plan
    left = _left_pool(story, position, data, plan)
    if left:
        return left
    if plan is None or data.get("cause") == "hedge":
        return []  # a hedge is the walk's own second way, not a step of a plan
    story.plan = None
    kind = data.get("kind", "call")
    followed = {
        "retry": endpoint == plan.endpoint and kind != "resume",
        "failover": endpoint != plan.endpoint and kind != "resume",
        "resume": kind == "resume",
        "stop": False,
    }.get(plan.action, True)
    if followed:
        return []
    return _broken(
        story,
        position,
        "decision_not_followed",
        f"{plan.action} ({plan.reason}) after attempt {plan.after} on {plan.endpoint}, "
        f"then attempt {attempt_id} ({kind}) started on {endpoint}",
    )


def _left_pool(
    story: _Story, position: int, data: dict[str, Any], plan: _Plan | None
) -> list[StoryBroken]:
    """A child's retries, hedges and resumes stay inside its pool's scope."""
    follows = data.get("hedge_of") or data.get("resumed_from")
    if follows is None and data.get("cause") == "retry" and plan is not None:
        follows = plan.after
    if follows is None or str(follows) not in story.pools:
        return []
    theirs, mine = story.pools[str(follows)], data.get("pool")
    if theirs == mine:
        return []
    return _broken(
        story,
        position,
        "left_pool",
        f"attempt {data.get('attempt_id')} ({data.get('cause')}, {data.get('kind', 'call')}) "
        f"runs in pool {mine} after attempt {follows} in pool {theirs}",
    )


def _decided(story: _Story, position: int, data: dict[str, Any]) -> list[StoryBroken]:
    after = str(data.get("after_attempt_id"))
    endpoint = story.endpoints.get(after)
    if endpoint is None:
        return _broken(
            story,
            position,
            "decision_after_unknown_attempt",
            f"a decision after attempt {after}, which this request never started",
        )
    reason = str(data.get("reason"))
    # Another way of a hedged request carries it on: nothing further is promised.
    story.plan = (
        None
        if reason == "other_way_running"
        else _Plan(str(data.get("action")), reason, after, endpoint, position)
    )
    return []


def _ended(story: _Story, position: int, kind: str, data: dict[str, Any]) -> list[StoryBroken]:
    found: list[StoryBroken] = []
    unfinished = sorted(set(story.endpoints) - story.finished)
    if unfinished:
        found += _broken(
            story,
            position,
            "attempt_not_finished",
            f"{kind} with attempt(s) {', '.join(unfinished)} never finished",
        )
    if kind == "RequestCompleted" and not story.succeeded:
        found += _broken(story, position, "completed_without_success", "no attempt of it succeeded")
    plan = story.plan
    if plan is not None and plan.action in ("retry", "resume"):
        if kind == "RequestFailed" and data.get("error_code") in _CUT_SHORT:
            return found
        found += _broken(
            story,
            position,
            "decision_not_followed",
            f"{plan.action} ({plan.reason}) after attempt {plan.after}, then {kind} "
            "with no attempt",
        )
    return found
