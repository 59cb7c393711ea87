"""Same-model stream resume (contract §5 "Resume"): the continuation's request and its seam.

When a committed stream breaks, the gateway asks the same upstream model to continue the
text the client already has: :func:`continuation_body` adds that text to the request as a
partial assistant message, the way the mapping's ``resume:`` says its upstream takes one.
What comes back is joined to what the client has by a :class:`Seam`: an upstream that
repeats the delivered text first has it stripped; one that starts to repeat it and then
says something else cannot be joined (the stream ends with its in-band error instead). The
final usage the client is told adds the broken attempts' output to the continuation's
(:func:`resumed_usage`). Pure.
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
    "broken_output_tokens",
    "continuation_body",
    "native_continuation",
    "prefill_text",
    "resumed_usage",
    "text_tokens_bound",
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


_CONTINUED_NATIVELY: Final = frozenset({"anthropic"})


def can_continue(native: NativeBody | None) -> bool:
    """Whether a request can ask for a continuation: the canonical body always can; a native
    body only in a dialect that takes a prefill (Anthropic's). A native Responses body
    (stateful, maybe stored by the provider) has none: its broken stream is not resumed."""
    return native is None or native.dialect in _CONTINUED_NATIVELY


def native_continuation(native: NativeBody, delivered: str) -> NativeBody:
    """A native Messages body asking to continue ``delivered``: Anthropic takes a final
    assistant turn as the start of its answer (the dialect's own prefill)."""
    body = dict(native.body)
    partial = {"role": "assistant", "content": prefill_text(delivered)}
    body["messages"] = [*native.body.get("messages", ()), partial]
    return NativeBody(native.dialect, body, native.headers)


def text_tokens_bound(text: str) -> int:
    """At least as many tokens as ``text`` is made of: its UTF-8 bytes, since no tokenizer's
    token is shorter than one byte (the bound the worst case takes for a prompt)."""
    return len(text.encode("utf-8"))


def broken_output_tokens(delivered: str, reported: int | None) -> int:
    """The output tokens a broken attempt counts for in the client's final usage (contract
    §5 "Resume"): the text it delivered to the client, bounded from above by
    :func:`text_tokens_bound`, or the output tokens it reported if more. A broken stream's
    report is partial at best (an Anthropic stream says 1 output token at its start), so it
    can only raise the count, never lower it below the text the client has."""
    bound = text_tokens_bound(delivered)
    return bound if reported is None else max(bound, reported)


def resumed_usage(continuation: Mapping[str, Any], broken_output: int) -> dict[str, Any]:
    """The usage the client is told for a resumed stream (contract §5 "Resume"), from the
    continuation's own (an OpenAI ``usage`` object) and ``broken_output``, the stream's
    broken attempts' output tokens (:func:`broken_output_tokens`, summed): output is their
    sum with the continuation's, so the client is never told fewer output tokens than the
    text it received; the prompt is the continuation's, which is the request's prompt and
    the delivered text sent back with it; the total adds up. The ledger is not told this:
    the broken attempts' reservations stay held as unknown usage (§6)."""
    usage = dict(continuation)
    completion = usage.get("completion_tokens")
    completion = completion if type(completion) is int else 0
    usage["completion_tokens"] = completion + broken_output
    prompt = usage.get("prompt_tokens")
    total = usage.get("total_tokens")
    if type(prompt) is int:
        usage["total_tokens"] = prompt + usage["completion_tokens"]
    elif type(total) is int:
        usage["total_tokens"] = total + broken_output
    return usage


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
