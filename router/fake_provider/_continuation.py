"""How the fake continues a partial assistant message: the forms a request gives one in, the
rule that says which form the fake takes, and the pieces a continuation sends.

A request continues when its conversation ends with the assistant's own partial answer. It
takes one of three forms: `assistant_prefill` (a trailing assistant message; native to
Anthropic's Messages API, and what many OpenAI-compatible servers do), `prefix_flag` (the
trailing assistant message carries `"prefix": true`, as DeepSeek and Mistral take it) or
`continue_final_message` (the body carries `"continue_final_message": true` and
`"add_generation_prompt": false`, as vLLM takes it). The fake is strict: on the OpenAI wire it
continues the one form its rule names and refuses any other with a 400, as a provider that
rejects assistant prefill does; rule `none` refuses them all. The Anthropic wire continues a
trailing assistant message whatever the rule.

Pure values and functions; the dialects read the form, the server refuses, make_reply shapes
the answer with `continued`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

__all__ = [
    "CONTINUATIONS",
    "MISMATCHED_SEAM",
    "Continuation",
    "Form",
    "Partial",
    "continued",
    "message_text",
    "parse_continuation",
    "refusal",
]

Form = Literal["assistant_prefill", "prefix_flag", "continue_final_message"]
Continuation = Literal["assistant_prefill", "prefix_flag", "continue_final_message", "none"]
CONTINUATIONS: tuple[Continuation, ...] = get_args(Continuation)
# What a mismatched continuation sends first: text that neither repeats the partial answer
# nor continues it, so that a seam check has something to catch.
MISMATCHED_SEAM = " Anyway,"


@dataclass(frozen=True)
class Partial:
    """A request's partial assistant message: the form it takes and its text. `problem` is
    the server's complaint when the form is incomplete (vLLM's, for continue_final_message
    without `add_generation_prompt: false` or without a final assistant message)."""

    form: Form
    text: str
    problem: str | None = None


def parse_continuation(value: Any) -> Continuation:
    """A rule from config or JSON. Raises ValueError."""
    for rule in CONTINUATIONS:
        if value == rule:
            return rule
    raise ValueError(f"continuation: must be one of {', '.join(CONTINUATIONS)}")


def message_text(content: Any) -> str:
    """The text of a message's content: a string, or its text parts (OpenAI) or text blocks
    (Anthropic) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "".join(
        part["text"]
        for part in content
        if isinstance(part, dict)
        and part.get("type") == "text"
        and isinstance(part.get("text"), str)
    )


def refusal(partial: Partial, rule: Continuation, *, native: bool) -> str | None:
    """Why the fake refuses to continue `partial` under `rule`, or None when it continues.
    `native`: the wire continues a trailing assistant message whatever the rule."""
    if native and partial.form == "assistant_prefill":
        return None
    if rule == "none":
        return (
            f"This model does not continue a partial assistant message ({partial.form}); "
            "the conversation must end with a user or tool message."
        )
    if partial.form != rule:
        return (
            f"This model continues a partial assistant message given as {rule}, "
            f"not as {partial.form}."
        )
    return partial.problem


def continued(
    pieces: Sequence[str], partial: str, *, repeat_prefix: bool = False, mismatched: bool = False
) -> list[str]:
    """The pieces a continuation of `partial` sends, from the pieces of the whole answer.

    The continuation is the answer after its longest common prefix with `partial`: the
    remainder when `partial` is a prefix of the answer (at a piece boundary or inside a
    piece), the answer from where they part when it is not, nothing when `partial` already
    holds the whole answer. `repeat_prefix` sends `partial` first, cut where the answer's
    pieces are cut, as an upstream that echoes the prefill does; `mismatched` then sends
    MISMATCHED_SEAM, which fits neither.
    """
    common = _common_prefix(partial, "".join(pieces))
    echo = _cut_like(partial, pieces) if repeat_prefix else []
    seam = [MISMATCHED_SEAM] if mismatched else []
    return echo + seam + _drop(pieces, common)


def _common_prefix(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _drop(pieces: Sequence[str], chars: int) -> list[str]:
    """`pieces` without their first `chars` characters; a piece cut inside keeps its tail."""
    out: list[str] = []
    for piece in pieces:
        if chars >= len(piece):
            chars -= len(piece)
            continue
        out.append(piece[chars:])
        chars = 0
    return out


def _cut_like(text: str, pieces: Sequence[str]) -> list[str]:
    """`text` cut at the offsets where `pieces` are cut (its tail beyond them in one piece)."""
    out: list[str] = []
    start = 0
    for piece in pieces:
        if start >= len(text):
            break
        out.append(text[start : start + len(piece)])
        start += len(piece)
    if start < len(text):
        out.append(text[start:])
    return [piece for piece in out if piece]
