"""Rate limits at admission (issue 43 item 2; config ``limits`` and ``key_limits`` on a
workspace, a key's own ``limits`` from the key API or ``keys create``): what a request counts
against, its worst-case tokens, and how a refusal and a settlement's correction are written.
The counting itself is the adapters' (``router.adapters.rate_counters``, over the window
arithmetic of ``rate_limits``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from ledger import events as ev
from router.adapters.rate_limits import RateLimit, Refusal, Window
from router.config import Config, ModelGroup, RateLimits
from router.errors import GatewayError, rate_limited
from router.request.call import Caller
from router.request.ports import RateCounting
from router.request.worst_case import input_tokens, output_tokens

__all__ = [
    "RateAdmission",
    "limits_of",
    "rate_limit_exceeded",
    "refused",
    "worst_case_tokens",
]


def limits_of(caller: Caller) -> tuple[RateLimit, ...]:
    """The limits a request of ``caller`` counts against: its key's (its own if it has them,
    else its workspace's ``key_limits``), then its workspace's, which still apply."""
    workspace = caller.workspace
    limits = []
    per_key = caller.key_limits if caller.key_limits is not None else workspace.key_limits
    if per_key is not None:
        limits.append(_limit(f"key:{caller.key_id}", per_key))
    if workspace.limits is not None:
        limits.append(_limit(f"workspace:{workspace.id}", workspace.limits))
    return tuple(limits)


def _limit(subject: str, limits: RateLimits) -> RateLimit:
    return RateLimit(subject, limits.requests_per_minute, limits.tokens_per_minute)


def worst_case_tokens(config: Config, group: ModelGroup, requirements: ev.Requirements) -> int:
    """The most tokens the request may be billed on any mapping of its group (input, and
    every choice's output): what a reservation's worst case counts, before a route is
    chosen."""
    drivers = {e.id: e.driver for e in config.endpoints}
    most = 0
    for mapping in group.mappings:
        try:
            given = input_tokens(mapping, requirements, drivers[mapping.endpoint])
        except ValueError:  # unpriced there: routing will exclude the mapping
            continue
        most = max(most, given + output_tokens(mapping, requirements) * requirements.choices)
    return most


def rate_limit_exceeded(request_id: str, refusal: Refusal, tokens: int) -> ev.RateLimitExceeded:
    start = datetime.fromtimestamp(refusal.window.start, UTC)
    return ev.RateLimitExceeded(
        request_id=request_id,
        subject=refusal.subject,
        limit_name=refusal.limit_name,
        limit=refusal.limit,
        window_start=start.isoformat().replace("+00:00", "Z"),
        window_s=refusal.window.end - refusal.window.start,
        tokens=tokens,
        retry_after_s=refusal.retry_after_s,
    )


def refused(refusal: Refusal) -> GatewayError:
    per = refusal.limit_name.replace("_per_minute", "")
    message = (
        f"{refusal.subject} has reached its limit of {refusal.limit} {per} per minute; "
        f"retry after {refusal.retry_after_s} s"
    )
    return rate_limited(message, refusal.retry_after_s)


@dataclass(frozen=True, slots=True)
class RateAdmission:
    """A request counted in its window: its worst-case tokens, corrected once it settles."""

    counters: RateCounting
    subjects: Sequence[str]
    window: Window
    tokens: int

    async def settled(self, used_tokens: int) -> None:
        await self.counters.correct(self.subjects, self.window, used_tokens - self.tokens)
