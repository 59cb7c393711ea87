"""The continuation's request and its seam (router/request/resume.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.request.resume import (
    Seam,
    broken_output_tokens,
    continuation_body,
    prefill_text,
    resumed_usage,
    text_tokens_bound,
)

BODY = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def test_assistant_prefill_adds_a_trailing_assistant_message():
    body = continuation_body(BODY, "assistant_prefill", "Once upon ")
    assert body["messages"][-1] == {"role": "assistant", "content": "Once upon"}
    assert body["messages"][:-1] == BODY["messages"] and "prefix" not in body["messages"][-1]
    assert BODY["messages"] == [{"role": "user", "content": "hi"}], "the client's body is kept"


def test_prefix_flag_marks_the_partial_message():
    body = continuation_body(BODY, "prefix_flag", "Once")
    assert body["messages"][-1] == {"role": "assistant", "content": "Once", "prefix": True}


def test_continue_final_message_says_so_in_the_body():
    body = continuation_body(BODY, "continue_final_message", "Once")
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["messages"][-1]["content"] == "Once"


def test_a_mapping_without_resume_has_no_continuation():
    with pytest.raises(ValueError, match="cannot continue"):
        continuation_body(BODY, "none", "Once")


def test_a_continuation_proper_passes_as_it_comes():
    seam = Seam(" Once upon a")
    assert seam.feed(" time") == " time"
    assert seam.feed(" there") == " there"
    assert seam.end()


def test_a_repetition_of_the_delivered_text_is_stripped_across_pieces():
    seam = Seam(" Once upon a")
    assert seam.feed(" Once") == ""
    assert seam.feed(" upon a time") == " time"
    assert seam.state == "joined"


def test_the_whitespace_the_prefill_left_out_is_not_sent_twice():
    delivered = "Once upon "
    assert prefill_text(delivered) == "Once upon"
    seam = Seam(delivered)
    assert seam.feed(" a time") == "a time"


def test_a_repetition_that_changes_course_cannot_be_joined():
    seam = Seam(" Once upon a time there")
    assert seam.feed(" Once upon a mattress") == ""
    assert seam.state == "broken"
    assert seam.feed(" more") == ""
    assert not seam.end()


def test_a_short_coincidence_is_a_continuation():
    seam = Seam(" Once upon a time")
    assert seam.feed(" On") == ""  # it might be a repetition: wait
    assert seam.feed("ward") == " Onward"


def test_a_continuation_that_ends_while_undecided_cannot_be_joined():
    seam = Seam(" Once upon a time")
    seam.feed(" Once upon")
    assert not seam.end()


def test_an_empty_continuation_that_ends_is_joined():
    assert Seam(" The end.").end()


@given(
    st.text(min_size=1, max_size=40),
    st.text(max_size=40),
    st.lists(st.integers(min_value=0, max_value=80), max_size=6),
)
def test_a_full_repetition_always_yields_exactly_the_rest(delivered, rest, cuts):
    text = delivered + rest
    pieces, last = [], 0
    for cut in sorted(c for c in cuts if c <= len(text)):
        pieces.append(text[last:cut])
        last = cut
    pieces.append(text[last:])
    seam = Seam(delivered)
    out = "".join(seam.feed(piece) for piece in pieces)
    assert seam.end()
    assert out == rest


# --- the final usage of a resumed stream (contract §5 "Resume") ---------------------------


def test_a_broken_attempt_counts_the_bytes_of_the_text_it_delivered():
    assert text_tokens_bound("Once upon") == 9
    assert text_tokens_bound("naïve ☃") == len("naïve ☃".encode()) == 10
    # A partial report (Anthropic's 1 output token at the start) never lowers it ...
    assert broken_output_tokens("Once upon a time", None) == 16
    assert broken_output_tokens("Once upon a time", 1) == 16
    # ... and a larger one raises it.
    assert broken_output_tokens("Once", 40) == 40


def test_the_resumed_usage_adds_the_broken_output_to_the_continuations():
    continuation = {
        "prompt_tokens": 65,
        "completion_tokens": 20,
        "total_tokens": 85,
        "completion_tokens_details": {"reasoning_tokens": 0},
    }
    told = resumed_usage(continuation, 180)
    assert told == {
        "prompt_tokens": 65,  # the request's prompt with the delivered text sent back
        "completion_tokens": 200,
        "total_tokens": 265,
        "completion_tokens_details": {"reasoning_tokens": 0},
    }
    assert continuation["completion_tokens"] == 20, "the continuation's own is kept as it was"
    assert resumed_usage({"total_tokens": 10}, 5) == {"completion_tokens": 5, "total_tokens": 15}
    assert resumed_usage(continuation, 0) == continuation


@given(pieces=st.lists(st.text(max_size=30), min_size=1, max_size=5), reported=st.integers(0, 99))
def test_the_client_is_never_told_fewer_output_tokens_than_the_text_it_received(
    pieces: list[str], reported: int
):
    # Each broken attempt delivered one piece and reported nothing; the last piece came from
    # the continuation, whose reported output is the upstream's word for its part.
    broken = pieces[:-1]
    carried = sum(broken_output_tokens(text, None) for text in broken)
    told = resumed_usage({"prompt_tokens": 7, "completion_tokens": reported}, carried)
    assert told["completion_tokens"] >= sum(text_tokens_bound(t) for t in broken) + reported
    assert told["total_tokens"] == 7 + told["completion_tokens"]
