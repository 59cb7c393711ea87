"""The fake provider's continuation rules: which form of partial assistant message it
continues, what it answers (the rest of the answer, echoed or mismatched when told), what it
refuses, and what it records — on both wires, buffered and streamed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.fake_provider import (
    CONTINUATIONS,
    MISMATCHED_SEAM,
    Behavior,
    Continuation,
    FakeUpstream,
    reply_pieces,
)
from router.fake_provider._continuation import continued

PIECES = reply_pieces("east")  # "Hello", " from", " east:", " héllo", " 日本", " 🚀"
WHOLE = "".join(PIECES)
ASK = {"role": "user", "content": "x" * 40}  # 40 chars -> 11 prompt tokens alone
FORMS: tuple[Continuation, ...] = ("assistant_prefill", "prefix_flag", "continue_final_message")


def openai_body(form: str | None, partial: str, **extra: Any) -> dict[str, Any]:
    """A chat completion continuing `partial` in `form` (None: an ordinary request)."""
    messages: list[dict[str, Any]] = [ASK]
    body: dict[str, Any] = {"model": "gpt-test", "messages": messages, **extra}
    if form is None:
        return body
    final: dict[str, Any] = {"role": "assistant", "content": partial}
    if form == "prefix_flag":
        final["prefix"] = True
    if form == "continue_final_message":
        body.update(continue_final_message=True, add_generation_prompt=False)
    messages.append(final)
    return body


def anthropic_body(partial: str | None, **extra: Any) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [ASK]
    if partial is not None:
        messages.append({"role": "assistant", "content": [{"type": "text", "text": partial}]})
    return {"model": "claude-test", "max_tokens": 100, "messages": messages, **extra}


def prompt_tokens(partial: str) -> int:
    return (40 + len(partial)) // 4 + 1


@pytest.fixture
def up() -> Iterator[FakeUpstream]:
    with FakeUpstream("east") as upstream:
        yield upstream


@pytest.fixture
def http(up: FakeUpstream) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=up.root_url) as client:
        yield client


# Reading answers, buffered and streamed


def events_of(response: httpx.Response) -> list[dict[str, Any]]:
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def openai_stream(http: httpx.Client, body: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """The content pieces of a streamed chat completion, and its usage."""
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    response = http.post("/v1/chat/completions", json=stream)
    assert response.status_code == 200
    events = events_of(response)
    pieces = [e["choices"][0]["delta"].get("content") for e in events[1:] if e["choices"]]
    return [p for p in pieces if p is not None], events[-1]["usage"]


def anthropic_stream(http: httpx.Client, body: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """The text deltas of a streamed message, and its usage (start and end merged)."""
    response = http.post("/v1/messages", json={**body, "stream": True})
    assert response.status_code == 200
    events = events_of(response)
    pieces = [e["delta"]["text"] for e in events if e["type"] == "content_block_delta"]
    usage = {**events[0]["message"]["usage"], **events[-2]["usage"]}
    return pieces, usage


def cut_stream(up: FakeUpstream, path: str, body: dict[str, Any]) -> str:
    """The text a stream delivered before the fake cut it (the plan says where)."""
    received = ""
    with (
        httpx.Client(base_url=up.root_url) as http,
        pytest.raises(httpx.RemoteProtocolError),
        http.stream("POST", path, json=body) as response,
    ):
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if path == "/v1/messages":
                received += event.get("delta", {}).get("text", "")
            else:
                received += event["choices"][0]["delta"].get("content") or ""
    return received


# Each rule continues its own form, with the rest of the answer, billed as providers bill


@pytest.mark.parametrize("form", FORMS)
def test_each_rule_continues_its_own_form_with_the_rest_of_the_answer(up, http, form):
    up.set_continuation(form)
    partial = "".join(PIECES[:2])

    response = http.post("/v1/chat/completions", json=openai_body(form, partial))

    body = response.json()
    assert response.status_code == 200
    assert body["choices"][0]["message"]["content"] == "".join(PIECES[2:])
    assert body["choices"][0]["finish_reason"] == "stop"
    # The rest is the output; the partial text was input.
    assert body["usage"]["completion_tokens"] == 4
    assert body["usage"]["prompt_tokens"] == prompt_tokens(partial)
    recorded = up.requests[-1]
    assert (recorded.continuation, recorded.continuation_chars) == (form, len(partial))
    assert not recorded.continuation_refused


@pytest.mark.parametrize("form", FORMS)
def test_a_streamed_continuation_sends_only_the_rest(up, http, form):
    up.set_continuation(form)
    partial = "".join(PIECES[:3])

    pieces, usage = openai_stream(http, openai_body(form, partial))

    assert tuple(pieces) == PIECES[3:]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt_tokens(partial), 3)


@pytest.mark.parametrize("rule", CONTINUATIONS)
def test_anthropic_continues_a_trailing_assistant_message_whatever_the_rule(up, http, rule):
    up.set_continuation(rule)
    partial = "".join(PIECES[:2])

    buffered = http.post("/v1/messages", json=anthropic_body(partial)).json()
    pieces, usage = anthropic_stream(http, anthropic_body(partial))

    assert buffered["content"] == [{"type": "text", "text": "".join(PIECES[2:])}]
    assert buffered["usage"] == {"input_tokens": prompt_tokens(partial), "output_tokens": 4}
    assert tuple(pieces) == PIECES[2:]
    assert usage == {"input_tokens": prompt_tokens(partial), "output_tokens": 4}
    assert [(r.continuation, r.continuation_chars) for r in up.requests] == [
        ("assistant_prefill", len(partial))
    ] * 2


def test_an_anthropic_string_prefill_is_a_continuation_too(up, http):
    body = anthropic_body(None)
    body["messages"].append({"role": "assistant", "content": "Hello"})

    answer = http.post("/v1/messages", json=body).json()

    assert answer["content"][0]["text"] == "".join(PIECES[1:])
    assert up.requests[-1].continuation_chars == 5


def test_the_requests_limit_bounds_the_continuation_not_the_whole_answer(up, http):
    up.set_continuation("assistant_prefill")
    partial = "".join(PIECES[:3])

    body = http.post(
        "/v1/chat/completions", json=openai_body("assistant_prefill", partial, max_tokens=2)
    ).json()

    assert body["choices"][0]["message"]["content"] == "".join(PIECES[3:5])
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 2


def test_n_chunks_is_the_length_of_the_whole_answer(up, http):
    up.set_continuation("prefix_flag")
    up.set_plan([Behavior.ok(n_chunks=9)])
    partial = "".join(reply_pieces("east", 9)[:7])

    body = http.post("/v1/chat/completions", json=openai_body("prefix_flag", partial)).json()

    assert body["choices"][0]["message"]["content"] == "".join(reply_pieces("east", 9)[7:])
    assert body["usage"]["completion_tokens"] == 2


def test_every_choice_of_n_continues_the_same_partial_text(up, http):
    up.set_continuation("assistant_prefill")
    partial = "".join(PIECES[:5])

    body = http.post(
        "/v1/chat/completions", json=openai_body("assistant_prefill", partial, n=2)
    ).json()

    texts = [choice["message"]["content"] for choice in body["choices"]]
    assert texts == [" 🚀", " 🚀 Hello"]
    assert body["usage"]["completion_tokens"] == 1 + 2


# A partial text that is not a prefix of the answer


@pytest.mark.parametrize(
    ("partial", "rest"),
    [
        ("Hello fr", "om east: héllo 日本 🚀"),  # inside a piece: the piece's tail
        ("Hello from west, and", "east: héllo 日本 🚀"),  # from where they part
        ("Bonjour", WHOLE),  # nothing in common: the whole answer
        (WHOLE, ""),  # the whole answer already: nothing more
        (WHOLE + " and more", ""),
    ],
    ids=["inside_a_piece", "diverging", "unrelated", "complete", "beyond"],
)
def test_a_continuation_answers_the_rest_after_the_longest_common_prefix(up, http, partial, rest):
    up.set_continuation("assistant_prefill")

    body = http.post("/v1/chat/completions", json=openai_body("assistant_prefill", partial)).json()
    pieces, _ = anthropic_stream(http, anthropic_body(partial))

    assert body["choices"][0]["message"]["content"] == rest
    assert body["choices"][0]["finish_reason"] == "stop"
    assert "".join(pieces) == rest
    assert all(pieces)  # no empty content event


# Refused: the fake's rule does not take the request's form


@pytest.mark.parametrize(
    ("rule", "form"),
    [(rule, form) for rule in CONTINUATIONS for form in FORMS if rule != form],
)
def test_a_form_the_rule_does_not_take_is_refused_with_invalid_prefill(up, http, rule, form):
    up.set_continuation(rule)
    up.set_plan([Behavior.ok(n_chunks=2)])

    response = http.post("/v1/chat/completions", json=openai_body(form, "Hello"))

    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_prefill")
    assert form in error["message"]
    assert response.headers["x-request-id"] == up.requests[-1].request_id
    recorded = up.requests[-1]
    assert (recorded.continuation, recorded.continuation_chars) == (form, 5)
    assert recorded.continuation_refused
    assert recorded.behavior is None
    assert up.plan == (Behavior.ok(n_chunks=2),)  # the refusal took nothing from the plan


@pytest.mark.parametrize(
    ("extra", "last_is_assistant", "complaint"),
    [
        ({"continue_final_message": True}, True, "add_generation_prompt"),
        (
            {"continue_final_message": True, "add_generation_prompt": True},
            True,
            "add_generation_prompt",
        ),
        (
            {"continue_final_message": True, "add_generation_prompt": False},
            False,
            "final message",
        ),
    ],
    ids=["generation_prompt_by_default", "generation_prompt_asked", "no_assistant_message"],
)
def test_continue_final_message_needs_its_whole_form(up, http, extra, last_is_assistant, complaint):
    up.set_continuation("continue_final_message")
    messages: list[dict[str, Any]] = [ASK]
    if last_is_assistant:
        messages.append({"role": "assistant", "content": "Hello"})

    response = http.post("/v1/chat/completions", json={"model": "m", "messages": messages, **extra})

    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_prefill"
    assert complaint in response.json()["error"]["message"]
    assert up.requests[-1].continuation_refused


def test_by_default_the_fake_continues_nothing_on_the_openai_wire(up, http):
    refused = http.post("/v1/chat/completions", json=openai_body("assistant_prefill", "Hello"))
    ordinary = http.post("/v1/chat/completions", json=openai_body(None, ""))
    tool_turn = openai_body(None, "")
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    tool_turn["messages"].append({"role": "assistant", "content": None, "tool_calls": [call]})
    after_a_tool_call = http.post("/v1/chat/completions", json=tool_turn)

    assert up.continuation == "none"
    assert refused.status_code == 400
    assert "does not continue" in refused.json()["error"]["message"]
    assert ordinary.json()["choices"][0]["message"]["content"] == WHOLE
    assert after_a_tool_call.json()["choices"][0]["message"]["content"] == WHOLE
    assert [r.continuation for r in up.requests] == ["assistant_prefill", None, None]
    assert [r.continuation_chars for r in up.requests] == [5, None, None]


# Echoed and mismatched continuations


def test_repeat_prefix_sends_the_partial_text_again_in_its_pieces_then_the_rest(up, http):
    up.set_continuation("assistant_prefill")
    up.set_plan([Behavior.ok(repeat_prefix=True)] * 3)
    partial = "".join(PIECES[:2])

    buffered = http.post("/v1/chat/completions", json=openai_body("assistant_prefill", partial))
    pieces, usage = openai_stream(http, openai_body("assistant_prefill", partial))
    anthropic_pieces, anthropic_usage = anthropic_stream(http, anthropic_body(partial))

    assert buffered.json()["choices"][0]["message"]["content"] == WHOLE
    assert buffered.json()["usage"]["completion_tokens"] == 6  # the echo is output too
    assert tuple(pieces) == tuple(anthropic_pieces) == PIECES
    assert usage["completion_tokens"] == anthropic_usage["output_tokens"] == 6


def test_mismatched_continuation_starts_with_a_seam_that_fits_nothing(up, http):
    up.set_continuation("prefix_flag")
    up.set_plan([Behavior.ok(mismatched_continuation=True)] * 2)
    partial = "".join(PIECES[:3])

    pieces, usage = openai_stream(http, openai_body("prefix_flag", partial))
    anthropic_pieces, _ = anthropic_stream(http, anthropic_body(partial))

    assert pieces == anthropic_pieces == [MISMATCHED_SEAM, *PIECES[3:]]
    assert not "".join(pieces).startswith(partial)
    assert not "".join(pieces).startswith("".join(PIECES[3:]))
    assert usage["completion_tokens"] == 4


def test_an_echo_followed_by_a_mismatched_seam(up, http):
    up.set_continuation("continue_final_message")
    up.set_plan([Behavior.ok(repeat_prefix=True, mismatched_continuation=True)])
    partial = "".join(PIECES[:2])

    pieces, _ = openai_stream(http, openai_body("continue_final_message", partial))

    assert pieces == [*PIECES[:2], MISMATCHED_SEAM, *PIECES[2:]]


def test_continuation_options_leave_an_ordinary_request_alone(up, http):
    up.set_plan([Behavior.ok(repeat_prefix=True, mismatched_continuation=True)])

    body = http.post("/v1/messages", json=anthropic_body(None)).json()

    assert body["content"][0]["text"] == WHOLE


# The resume a gateway performs: cut, continue and stall, continue to the end


@pytest.mark.parametrize("wire", ["openai", "anthropic"])
def test_a_plan_cuts_the_first_stream_stalls_the_continuation_then_finishes(up, wire):
    up.set_continuation("assistant_prefill")
    up.set_plan(
        [
            Behavior.mid_stream_disconnect(after_content=3),
            Behavior.stall(after_content=2, stall_s=0.01),
            Behavior.ok(),
        ]
    )

    def request(partial: str | None) -> dict[str, Any]:
        if wire == "anthropic":
            return {**anthropic_body(partial), "stream": True}
        form = None if partial is None else "assistant_prefill"
        return {**openai_body(form, partial or ""), "stream": True}

    path = "/v1/messages" if wire == "anthropic" else "/v1/chat/completions"
    first = cut_stream(up, path, request(None))
    second = cut_stream(up, path, request(first))
    with httpx.Client(base_url=up.root_url) as http:
        if wire == "anthropic":
            third, _ = anthropic_stream(http, anthropic_body(first + second))
        else:
            third, _ = openai_stream(http, openai_body("assistant_prefill", first + second))

    assert first == "".join(PIECES[:3])
    assert second == "".join(PIECES[3:5])
    assert tuple(third) == PIECES[5:]
    assert [(r.continuation, r.continuation_chars) for r in up.requests] == [
        (None, None),
        ("assistant_prefill", len(first)),
        ("assistant_prefill", len(first + second)),
    ]


# Programming the rule


def test_the_rule_is_set_over_the_control_api_and_survives_a_reset(up, http):
    set_rule = http.post("/_fake/continuation", json={"continuation": "prefix_flag"})
    bad = http.post("/_fake/continuation", json={"continuation": "guess"})
    not_an_object = http.post("/_fake/continuation", json="prefix_flag")
    http.post("/v1/chat/completions", json=openai_body("prefix_flag", "Hello"))
    logged = http.get("/_fake/requests").json()["data"]
    reset = http.post("/_fake/reset").json()

    assert set_rule.status_code == 200
    assert set_rule.json()["continuation"] == "prefix_flag"
    assert bad.status_code == not_an_object.status_code == 400
    assert "continuation" in bad.json()["error"]
    assert logged[-1]["continuation"] == "prefix_flag"
    assert logged[-1]["continuation_chars"] == 5
    assert logged[-1]["continuation_refused"] is False
    assert reset["continuation"] == "prefix_flag"


def test_the_constructor_takes_a_rule_and_rejects_any_other():
    with FakeUpstream("east", continuation="continue_final_message") as up:
        assert up.stats()["continuation"] == "continue_final_message"
    with pytest.raises(ValueError, match="continuation"):
        FakeUpstream("east", continuation="sometimes")  # type: ignore[arg-type]


def test_continuation_options_round_trip_through_json():
    behavior = Behavior.ok(repeat_prefix=True, mismatched_continuation=True)

    assert behavior.to_json() == {
        "kind": "ok",
        "repeat_prefix": True,
        "mismatched_continuation": True,
    }
    assert Behavior.from_json(behavior.to_json()) == behavior


# The continuation's pieces, for any answer and any partial text

_PIECES = st.lists(st.text(min_size=1, max_size=6), max_size=8)


def _shared(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@given(pieces=_PIECES, cut=st.integers(0, 60), tail=st.text(max_size=6), echo=st.booleans())
def test_a_continuation_is_the_answer_after_what_it_shares_with_the_partial_text(
    pieces, cut, tail, echo
):
    whole = "".join(pieces)
    partial = whole[:cut] + tail
    shared = _shared(partial, whole)

    rest = continued(pieces, partial)
    sent = continued(pieces, partial, repeat_prefix=echo, mismatched=True)

    assert all(rest) and all(sent)
    assert whole[:shared] + "".join(rest) == whole
    assert "".join(sent) == (partial if echo else "") + MISMATCHED_SEAM + "".join(rest)


@given(pieces=_PIECES, data=st.data())
def test_an_echo_of_delivered_pieces_is_those_pieces_again(pieces, data):
    k = data.draw(st.integers(0, len(pieces)))

    sent = continued(pieces, "".join(pieces[:k]), repeat_prefix=True)

    assert sent == pieces
