"""A request's explanation as a timeline: what happened, in ledger order, with its offsets.

Pure: the explanation (``ledger.views.explain``) and the request's recorded events in, plain
values out. The explanation says what each candidate, attempt and decision was; the events
say when, and in which order, so each evaluation's candidates, each attempt, each failover
decision and the request's end become one entry at its offset from the request's receipt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ledger import events as ev
from ledger.store import RecordedEvent
from router.http.console.charts import LateMark, TimelineBar

__all__ = ["LATE_AFTER_MS", "Entry", "Timeline", "timeline"]

LATE_AFTER_MS = 1000
"""An event this long after the request's end, and as long again as the request took, is
late (a reconciliation or a hand settlement, seconds or days on): the axis keeps the
request's own span and the event is a mark past a break."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One step of the timeline. ``kind``: ``evaluation`` (``candidates``), ``attempt``
    (``attempt``: the explanation's attempt), ``decision`` (``attempt``: the attempt it
    followed, its ``failover`` the decision), ``committed`` or ``end`` (``text``)."""

    kind: str
    at_ms: int
    title: str
    text: str = ""
    candidates: Sequence[Mapping[str, Any]] = ()
    attempt: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Timeline:
    entries: list[Entry] = field(default_factory=list)
    bars: list[TimelineBar] = field(default_factory=list)
    total_ms: int = 0
    late: list[LateMark] = field(default_factory=list)  # after total_ms, past a break


def timeline(explanation: Mapping[str, Any], trail: Sequence[RecordedEvent]) -> Timeline:
    if not trail:
        return Timeline()
    received = trail[0].recorded_at

    def offset(recorded: RecordedEvent) -> int:
        return max(0, round((recorded.recorded_at - received).total_seconds() * 1000))

    attempts = {a["attempt_id"]: a for a in explanation["attempts"]}
    candidates: dict[int, list[Mapping[str, Any]]] = {}
    for candidate in explanation["candidates"]:
        candidates.setdefault(candidate["evaluation"], []).append(candidate)
    entries: list[Entry] = []
    bars: list[TimelineBar] = []
    for recorded in trail:
        event = recorded.event()
        at = offset(recorded)
        if isinstance(event, ev.RouteEvaluated):
            chosen = event.chosen
            entries.append(
                Entry(
                    "evaluation",
                    at,
                    f"route evaluation {event.sequence}{_level(event.group_path)}",
                    "nothing eligible was left"
                    if chosen is None
                    else f"chose {chosen.endpoint}/{chosen.model} on tier {chosen.tier}",
                    candidates=candidates.get(event.sequence, []),
                )
            )
        elif isinstance(event, ev.AttemptStarted):
            attempt = attempts.get(event.attempt_id)
            if attempt is None:
                continue
            entries.append(Entry("attempt", at, _attempt_title(attempt), attempt=attempt))
            bars.append(_bar(attempt, at))
        elif isinstance(event, ev.FailoverDecided):
            attempt = attempts.get(event.after_attempt_id)
            entries.append(
                Entry(
                    "decision",
                    at,
                    f"after attempt {attempt['attempt_number'] if attempt else '?'}: "
                    f"{event.action}{'' if event.allowed else ' (not allowed)'}",
                    f"{event.failure_class.value} ({event.evidence.value}): {event.reason}",
                    attempt=attempt,
                )
            )
        elif isinstance(event, ev.StreamCommitted):
            entries.append(
                Entry(
                    "committed",
                    at,
                    "stream committed",
                    f"the client's stream is {event.endpoint}'s",
                )
            )
        elif isinstance(event, ev.RequestCompleted):
            entries.append(
                Entry("end", at, "completed", f"HTTP {event.http_status} from {event.endpoint}")
            )
        elif isinstance(event, ev.RequestFailed):
            entries.append(
                Entry("end", at, "failed", f"HTTP {event.http_status} {event.error_code}")
            )
    span = max([0, *(e.at_ms for e in entries), *(b.start_ms + (b.duration_ms or 0) for b in bars)])
    late: list[LateMark] = []
    for recorded in trail:
        at = offset(recorded)
        if at > span + max(LATE_AFTER_MS, span):
            late.append(LateMark(_late_label(recorded.type), at))
        else:
            span = max(span, at)
    return Timeline(entries, bars, span, late)


def _late_label(event_type: str) -> str:
    """`UnknownUsageSettled` → `unknown usage settled`."""
    return "".join(f" {c.lower()}" if c.isupper() else c for c in event_type).strip()


def _level(path: Sequence[str]) -> str:
    """A composed group's level (contract §4 "Pools"): the composer's, or a pool's."""
    if not path:
        return ""
    if len(path) == 1:
        return f": pools of {path[0]}"
    return f": inside pool {' > '.join(path)}"


def _attempt_title(attempt: Mapping[str, Any]) -> str:
    kind = "" if attempt["kind"] == "call" else f" ({attempt['kind']})"
    via = ""
    if attempt.get("dispatch"):
        via = f", {attempt['dispatch']} via {' > '.join(attempt['group_path'])}"
    return (
        f"attempt {attempt['attempt_number']}{kind}: {attempt['endpoint']}/{attempt['model']}, "
        f"{attempt['cause']}, tier {attempt['tier']}{via}"
    )


def _bar(attempt: Mapping[str, Any], started_ms: int) -> TimelineBar:
    status = attempt["status"]
    if status == "failed":
        note = f"{attempt['failure_class'] or 'failed'} ({attempt['evidence']})"
    elif status == "succeeded":
        note = "succeeded"
    else:
        note = "in progress"
    duration = attempt["duration_ms"]
    return TimelineBar(
        f"#{attempt['attempt_number']} {attempt['endpoint']}/{attempt['model']}",
        started_ms,
        None if duration is None else int(duration),
        status,
        note,
    )
