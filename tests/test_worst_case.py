"""The worst case covers every billable dimension a request can trigger (router/worst_case.py,
with router/chat.py reading the request): choices, both output bounds, reasoning, cached and
uncached input, images, audio, files, audio output, predictions, web search — and what a
mapping cannot price is named, never guessed."""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.accounting import usage_cost
from ledger.events import Requirements
from router.chat import DEFAULT_LIMITS, HeaderNarrowing, parse_body
from router.config import Limits, Mapping, Workspace
from router.drivers import ChatRequest, OpenAIDriver
from router.drivers.anthropic import to_messages_request
from router.drivers.openai import openai_usage
from router.errors import GatewayError
from router.fake_upstream import PART_TOKENS, Behavior
from router.fake_upstream._openai import OPENAI
from router.fake_upstream._reply import make_reply
from router.worst_case import input_tokens, unpriced, worst_case_cost

D = Decimal
MTOK = 10**6


def _mapping(max_output: int = 1000, **price: Any) -> Mapping:
    return Mapping.model_validate(
        {
            "endpoint": "east",
            "model": "m",
            "context_window": 10**9,
            "max_output_tokens": max_output,
            "price": {"input_per_mtok": 1, "output_per_mtok": 2, **price},
        }
    )


WORKSPACE = Workspace.model_validate(
    {"id": "w", "models": ["chat"], "regions": ["r"], "data_class": "internal"}
)


def _requirements(body: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> Requirements:
    """What the gateway reads from a request body (``model`` added)."""
    call = parse_body(orjson.dumps({"model": "chat", **body}), limits)
    return call.requirements(WORKSPACE, HeaderNarrowing())


USER = {"role": "user", "content": "hi"}


# --- choices and output bounds -------------------------------------------------------------


def test_every_choice_of_n_is_billed_its_own_output_and_the_input_once():
    one = _requirements({"messages": [USER], "max_tokens": 400})
    hundred = _requirements({"messages": [USER], "max_tokens": 400, "n": 100}, Limits(max_n=128))
    assert hundred.choices == 100
    mapping = _mapping()
    text = one.estimated_input_tokens
    assert worst_case_cost(mapping, one) == D(text * 1 + 400 * 2) / MTOK
    assert worst_case_cost(mapping, hundred) == D(text * 1 + 100 * 400 * 2) / MTOK


def test_without_a_bound_each_choice_may_use_the_mappings_max_output():
    requirements = _requirements({"messages": [USER], "n": 3})
    text = requirements.estimated_input_tokens
    assert worst_case_cost(_mapping(max_output=700), requirements) == D(text + 3 * 700 * 2) / MTOK


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens"])
def test_either_output_bound_is_the_bound(name):
    assert _requirements({"messages": [USER], name: 42}).max_output_tokens == 42


def test_both_output_bounds_at_once_are_refused_naming_max_tokens():
    body = {"model": "chat", "messages": [USER], "max_tokens": 10, "max_completion_tokens": 10}
    with pytest.raises(GatewayError) as refused:
        parse_body(orjson.dumps(body))
    assert (refused.value.status, refused.value.code, refused.value.param) == (
        400,
        "invalid_request",
        "max_tokens",
    )


@pytest.mark.parametrize("n", [0, -1, 1.5, True, "2", 9])
def test_n_must_be_an_integer_from_1_to_limits_max_n(n):
    body = {"model": "chat", "messages": [USER], "n": n}
    with pytest.raises(GatewayError) as refused:
        parse_body(orjson.dumps(body), Limits(max_n=8))
    assert (refused.value.status, refused.value.code, refused.value.param) == (
        400,
        "invalid_request",
        "n",
    )
    assert "limits.max_n" in refused.value.message


def test_n_up_to_max_n_and_integral_numbers_are_accepted():
    assert _requirements({"messages": [USER], "n": 8}).choices == 8
    assert _requirements({"messages": [USER], "n": 2.0}).choices == 2
    assert _requirements({"messages": [USER], "n": None}).choices == 1
    assert Limits().max_n == 8


def test_a_prediction_adds_its_bytes_to_every_choices_output():
    prediction = {"type": "content", "content": "x" * 300}
    requirements = _requirements(
        {"messages": [USER], "max_tokens": 10, "n": 2, "prediction": prediction}
    )
    assert requirements.prediction_tokens == len(orjson.dumps(prediction))
    text = requirements.estimated_input_tokens
    expected = D(text + 2 * (10 + requirements.prediction_tokens) * 2) / MTOK
    assert worst_case_cost(_mapping(), requirements) == expected


# --- input: cached or not, and what text bytes do not bound -------------------------------


def test_input_is_priced_at_the_higher_of_the_cached_and_uncached_prices():
    requirements = Requirements(estimated_input_tokens=1000, max_output_tokens=0)
    dearer_cache = _mapping(input_per_mtok=1, cached_input_per_mtok=3)
    assert worst_case_cost(dearer_cache, requirements) == D("0.003")
    cheaper_cache = _mapping(input_per_mtok=1, cached_input_per_mtok="0.5")
    assert worst_case_cost(cheaper_cache, requirements) == D("0.001")


def _image(data_bytes: int = 10) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * data_bytes}}


def test_an_images_base64_bytes_are_not_text_and_each_image_costs_the_mappings_bound():
    small = _requirements({"messages": [{"role": "user", "content": [_image(10)]}]})
    large = _requirements(
        {"messages": [{"role": "user", "content": [_image(100_000)] * 3}], "max_tokens": 1}
    )
    assert (small.image_inputs, large.image_inputs) == (1, 3)
    assert large.estimated_input_tokens < small.estimated_input_tokens + 100  # not 300 KB
    large = large.model_copy(update={"max_output_tokens": 0})  # input alone
    mapping = _mapping(image_input={"tokens": 1000})
    text = large.estimated_input_tokens
    assert worst_case_cost(mapping, large) == D(text + 3 * 1000) / MTOK
    assert input_tokens(mapping, large) == text + 3000


def test_a_parts_own_price_applies_unless_the_input_price_is_higher():
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    requirements = _requirements({"messages": [{"role": "user", "content": [audio]}]})
    requirements = requirements.model_copy(update={"max_output_tokens": 0})  # input alone
    text = requirements.estimated_input_tokens
    dear = _mapping(audio_input={"tokens": 500, "per_mtok": 40})
    assert worst_case_cost(dear, requirements) == D(text * 1 + 500 * 40) / MTOK
    cheap = _mapping(cached_input_per_mtok=3, audio_input={"tokens": 500, "per_mtok": 2})
    assert worst_case_cost(cheap, requirements) == D(text * 3 + 500 * 3) / MTOK


def test_files_and_an_assistants_earlier_audio_are_inputs_of_their_kind():
    file = {"type": "file", "file": {"file_id": "file-1"}}
    spoken = {"role": "assistant", "content": None, "audio": {"id": "audio_1"}}
    requirements = _requirements({"messages": [{"role": "user", "content": [file]}, spoken]})
    assert (requirements.file_inputs, requirements.audio_inputs) == (1, 1)


def test_audio_output_prices_the_output_bound_at_the_higher_price():
    for body in ({"modalities": ["text", "audio"]}, {"audio": {"voice": "alloy"}}):
        requirements = _requirements({"messages": [USER], "max_tokens": 100, **body})
        assert requirements.audio_output
        mapping = _mapping(audio_output={"per_mtok": 80})
        text = requirements.estimated_input_tokens
        assert worst_case_cost(mapping, requirements) == D(text + 100 * 80) / MTOK


def test_web_search_adds_the_mappings_amount_per_choice():
    requirements = _requirements(
        {"messages": [USER], "max_tokens": 1, "n": 2, "web_search_options": {}}
    )
    mapping = _mapping(web_search={"per_choice_usd": "0.03"})
    text = requirements.estimated_input_tokens
    assert worst_case_cost(mapping, requirements) == D(text + 2 * 1 * 2) / MTOK + D("0.06")


def test_a_schema_and_function_definitions_count_as_text():
    plain = _requirements({"messages": [USER]})
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"a": "b" * 500}}}
    shaped = _requirements({"messages": [USER], "response_format": schema})
    assert shaped.estimated_input_tokens >= plain.estimated_input_tokens + 500


# --- what a mapping cannot price -------------------------------------------------------------


def test_unpriced_names_every_dimension_the_mapping_has_no_price_for():
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    video = {"type": "video_url", "video_url": {"url": "https://v.invalid/v.mp4"}}
    requirements = _requirements(
        {
            "messages": [{"role": "user", "content": [_image(), audio, video]}],
            "modalities": ["audio"],
            "web_search_options": {},
        }
    )
    assert requirements.unknown_inputs == ("video_url",)
    bare = _mapping()
    assert unpriced(bare, requirements) == (
        "image_input,audio_input,audio_output,web_search,content_part:video_url"
    )
    with pytest.raises(ValueError, match="no price for image_input"):
        worst_case_cost(bare, requirements)
    priced = _mapping(
        image_input={"tokens": 1},
        audio_input={"tokens": 1},
        audio_output={"per_mtok": 1},
        web_search={"per_choice_usd": 0},
    )
    assert unpriced(priced, requirements) == "content_part:video_url"  # never priceable


def test_text_only_requests_need_no_price_beyond_tokens():
    assert unpriced(_mapping(), _requirements({"messages": [USER], "n": 3})) is None


def test_the_anthropic_driver_sends_none_of_the_extras_so_none_is_billed_or_needs_a_price():
    body = {
        "model": "chat",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, _image()]}],
        "max_tokens": 100,
        "n": 4,
        "modalities": ["audio"],
        "audio": {"voice": "alloy"},
        "prediction": {"type": "content", "content": "x" * 50},
        "web_search_options": {},
    }
    sent = to_messages_request(
        ChatRequest(body=body, upstream_model="claude", max_tokens=100), stream=False
    )
    assert set(sent) == {"model", "messages", "max_tokens", "stream"}
    assert sent["messages"] == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    requirements = _requirements({k: v for k, v in body.items() if k != "model"})
    mapping = _mapping()
    assert unpriced(mapping, requirements, "anthropic") is None
    text = requirements.estimated_input_tokens
    assert worst_case_cost(mapping, requirements, "anthropic") == D(text + 100 * 2) / MTOK


def test_the_worst_case_is_exact_decimal():
    mapping = _mapping(
        max_output=3, input_per_mtok="0.1", output_per_mtok="0.1", image_input={"tokens": 3}
    )
    requirements = Requirements(estimated_input_tokens=0, image_inputs=1, choices=1)
    cost = worst_case_cost(mapping, requirements)
    assert Fraction(cost) == Fraction(6, 10**7)


# --- the property: never below what the provider then bills -----------------------------------

_TEXT = st.text(max_size=120)
_PART = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, _TEXT),
    st.builds(_image, st.integers(0, 3000)),
    st.builds(
        lambda n: {"type": "input_audio", "input_audio": {"data": "U" * n, "format": "wav"}},
        st.integers(0, 2000),
    ),
    st.builds(lambda n: {"type": "file", "file": {"file_data": "F" * n}}, st.integers(0, 2000)),
)
_MESSAGE = st.builds(
    lambda role, content: {"role": role, "content": content},
    st.sampled_from(["system", "user", "assistant"]),
    st.one_of(_TEXT, st.lists(_PART, min_size=1, max_size=4)),
)
_OPENAI_DRIVER = OpenAIDriver()  # only its request body is built: nothing is sent
_PRICE = st.decimals(min_value=0, max_value=100, places=6, allow_nan=False, allow_infinity=False)


@st.composite
def _bodies(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "chat",
        "messages": draw(st.lists(_MESSAGE, min_size=1, max_size=4)),
    }
    n = draw(st.none() | st.integers(1, 8))
    if n is not None:
        body["n"] = n
    bound = draw(st.sampled_from([None, "max_tokens", "max_completion_tokens"]))
    if bound is not None:
        body[bound] = draw(st.integers(1, 3000))
    return body


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    body=_bodies(),
    n_chunks=st.integers(0, 60),
    reasoning=st.integers(0, 5000),
    cached=st.integers(0, 10**5),
    prices=st.tuples(_PRICE, _PRICE, _PRICE, _PRICE),
    max_output=st.integers(1, 8000),
)
def test_the_reservation_is_never_below_what_the_provider_bills(
    body, n_chunks, reasoning, cached, prices, max_output
):
    input_price, output_price, cached_price, part_price = prices
    mapping = _mapping(
        max_output=max_output,
        input_per_mtok=input_price,
        output_per_mtok=output_price,
        cached_input_per_mtok=cached_price,
        image_input={"tokens": PART_TOKENS["image_url"]},
        audio_input={"tokens": PART_TOKENS["input_audio"], "per_mtok": part_price},
        file_input={"tokens": PART_TOKENS["file"]},
    )
    call = parse_body(orjson.dumps(body))
    requirements = _requirements({k: v for k, v in body.items() if k != "model"})
    reserved = worst_case_cost(mapping, requirements)

    # What the gateway sends (the OpenAI driver), and what the provider then bills for it.
    request = ChatRequest(body=call.body, upstream_model="m", max_tokens=call.max_tokens)
    sent = _OPENAI_DRIVER._payload(request)
    if sent.get("max_tokens") is None and sent.get("max_completion_tokens") is None:
        sent["max_completion_tokens"] = max_output  # the model's own limit
    behavior = Behavior.ok(n_chunks=n_chunks, reasoning_tokens=reasoning, cached_tokens=cached)
    reply = make_reply("east", "req_1", "chatcmpl-1", OPENAI.parse(sent), behavior)
    usage = openai_usage(OPENAI.body(reply)["usage"])
    assert usage is not None
    assert usage.output_tokens == reply.completion_tokens >= reply.reasoning_tokens
    billed = usage_cost(
        usage,
        input_per_mtok=input_price,
        output_per_mtok=output_price,
        cached_input_per_mtok=cached_price,
    )
    assert reserved >= billed, (reserved, billed, usage)
