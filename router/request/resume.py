"""Same-model stream resume (contract §5 "Resume"): the continuation's request and its seam.

When a committed stream breaks, the gateway asks the same upstream model to continue the
text the client already has: :func:`continuation_body` adds that text to the request as a
partial assistant message, the way the mapping's ``resume:`` says its upstream takes one.
What comes back is joined to what the client has by a :class:`Seam`: an upstream that
repeats the delivered text first has it stripped; one that starts to repeat it and then
says something else cannot be joined (the stream ends with its in-band error instead). Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from router.config import ResumeMode
from router.drivers import NativeBody

__all__ = [
    "SEAM_CHECK_CHARS",
    "Seam",
    "continuation_body",
    "native_continuation",
    "prefill_text",
]

SEAM_CHECK_CHARS: Final = 8
"""A continuation that matches the delivered text for this many characters (or all of it,
if shorter) and then differs is a repetition that changed course, not a continuation."""


def prefill_text(delivered: str) -> str:
    """The partial assistant message sent for ``delivered``: without trailing whitespace,
    which Anthropic refuses on a final assistant turn (the seam restores it)."""
    return delivered.rstrip()


def continuation_body(body: Mapping[str, Any], mode: ResumeMode, delivered: str) -> dict[str, Any]:
    """The client's request, asking the upstream to continue ``delivered``."""
    if mode == "none":
        raise ValueError("a mapping without resume cannot continue a stream")
    partial: dict[str, Any] = {"role": "assistant", "content": prefill_text(delivered)}
    if mode == "prefix_flag":
        partial["prefix"] = True
    resumed = dict(body)
    resumed["messages"] = [*body.get("messages", ()), partial]
    if mode == "continue_final_message":
        resumed["continue_final_message"] = True
        resumed["add_generation_prompt"] = False
    return resumed


def native_continuation(native: NativeBody, delivered: str) -> NativeBody:
    """A native Messages body asking to continue ``delivered``: Anthropic takes a final
    assistant turn as the start of its answer (the dialect's own prefill)."""
    body = dict(native.body)
    partial = {"role": "assistant", "content": prefill_text(delivered)}
    body["messages"] = [*native.body.get("messages", ()), partial]
    return NativeBody(native.dialect, body, native.headers)


@dataclass
class Seam:
    """Joins a continuation to the ``delivered`` text: feed it the continuation's text as it
    arrives; each call says what the client should get of it."""

    delivered: str
    state: Literal["undecided", "joined", "broken"] = "undecided"
    _seen: str = ""

    def feed(self, text: str) -> str:
        """The part of ``text`` to pass on ("" while undecided or once broken)."""
        if self.state == "joined":
            return text
        if self.state == "broken":
            return ""
        self._seen += text
        seen, delivered = self._seen, self.delivered
        if seen.startswith(delivered):
            # The upstream repeats what the client has: pass on only what follows.
            return self._join(seen[len(delivered) :])
        if delivered.startswith(seen):
            return ""  # so far a repetition, or a coincidence: wait for more
        common = _common_prefix(seen, delivered)
        if common >= min(SEAM_CHECK_CHARS, len(delivered)):
            self.state = "broken"  # it repeated, then went another way
            return ""
        # A continuation proper: the whitespace the prefill left out may come back first.
        gap = delivered[len(prefill_text(delivered)) :]
        if gap and seen.startswith(gap):
            seen = seen[len(gap) :]
        return self._join(seen)

    def end(self) -> bool:
        """The continuation ended: whether the seam held (an end while still undecided, a
        repetition cut short, cannot be joined)."""
        if self.state == "undecided":
            self.state = "joined" if self._seen == "" else "broken"
        return self.state == "joined"

    def _join(self, text: str) -> str:
        self.state = "joined"
        return text


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
