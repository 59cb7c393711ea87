"""The worst case covers every billable dimension a request can trigger
(router/request/worst_case.py,
with router/doors/chat.py reading the request): choices, both output bounds, reasoning, cached and
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

from ledger.books.accounting import usage_cost
from ledger.events import Requirements, Usage
from router.config import Limits, Mapping, Workspace
from router.doors import embeddings
from router.doors.chat import DEFAULT_LIMITS, HeaderNarrowing, parse_body
from router.drivers import ChatRequest, OpenAIDriver
from router.drivers.anthropic import to_messages_request
from router.drivers.openai import openai_usage
from router.errors import GatewayError
from router.fake_provider import PART_TOKENS, Behavior
from router.fake_provider._openai import OPENAI
from router.fake_provider._reply import make_reply
from router.request.worst_case import (
    billed_usage,
    input_tokens,
    output_tokens,
    settlement_rates,
    unpriced,
    worst_case_cost,
)

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


# --- the settlement: each dimension at the rate it was reserved at ---------------------------


def _settled(mapping: Mapping, requirements: Requirements, usage: Usage) -> Decimal:
    """What the gateway settles for ``usage`` reported on ``mapping`` (``_Run._settlement``)."""
    return usage_cost(billed_usage(usage, requirements), settlement_rates(mapping))


def test_audio_settles_at_the_rate_it_was_reserved_at_never_below_text():
    requirements = Requirements(audio_inputs=1, audio_output=True)
    usage = Usage(
        input_tokens=1000, output_tokens=100, audio_input_tokens=400, audio_output_tokens=60
    )
    dear = _mapping(audio_input={"tokens": 500, "per_mtok": 40}, audio_output={"per_mtok": 80})
    assert _settled(dear, requirements, usage) == D(600 * 1 + 400 * 40 + 40 * 2 + 60 * 80) / MTOK
    # Audio prices below the text prices: the text prices, as the worst case took them.
    cheap = _mapping(
        cached_input_per_mtok=3,
        audio_input={"tokens": 500, "per_mtok": "0.5"},
        audio_output={"per_mtok": 1},
    )
    assert _settled(cheap, requirements, usage) == D(600 * 1 + 400 * 3 + 100 * 2) / MTOK
    # No audio price at all (the request did not ask for audio, the provider reported some
    # anyway): still never below the text prices.
    assert (
        _settled(_mapping(cached_input_per_mtok=3), Requirements(), usage)
        == D(600 * 1 + 400 * 3 + 100 * 2) / MTOK
    )


def test_a_web_search_settles_its_fee_for_every_choice_on_a_driver_that_sends_it():
    requirements = Requirements(web_search=True, choices=3)
    usage = Usage(input_tokens=10, output_tokens=20)
    mapping = _mapping(web_search={"per_choice_usd": "0.025"})
    assert billed_usage(usage, requirements).web_searches == 3
    assert _settled(mapping, requirements, usage) == D(10 + 40) / MTOK + D("0.075")
    # Anthropic is sent no web search, so is billed none; a request without one neither.
    assert billed_usage(usage, requirements, "anthropic") is usage
    assert billed_usage(usage, Requirements(choices=3)) is usage


def test_images_and_files_settle_as_the_input_tokens_openai_bills_them_as():
    # OpenAI counts an image inside prompt_tokens at the input price and reports no count
    # of its own; the part's bound and price are a reservation's, not a settlement's.
    requirements = Requirements(image_inputs=1, file_inputs=1)
    mapping = _mapping(image_input={"tokens": 765, "per_mtok": 5}, file_input={"tokens": 9})
    usage = Usage(input_tokens=800, output_tokens=0)
    assert _settled(mapping, requirements, usage) == D(800) / MTOK


# --- the property: never below what the provider then bills, settled as its prices say -------


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


_SPOKEN: st.SearchStrategy[dict[str, Any]] = st.sampled_from(
    [{}, {"modalities": ["text", "audio"]}, {"audio": {"voice": "alloy", "format": "wav"}}]
)


@st.composite
def _bodies(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "chat",
        "messages": draw(st.lists(_MESSAGE, min_size=1, max_size=4)),
        **draw(_SPOKEN),
    }
    n = draw(st.none() | st.integers(1, 8))
    if n is not None:
        body["n"] = n
    bound = draw(st.sampled_from([None, "max_tokens", "max_completion_tokens"]))
    if bound is not None:
        body[bound] = draw(st.integers(1, 3000))
    if draw(st.booleans()):
        body["web_search_options"] = {}
    return body


def _priced(fraction: Fraction, quantum: Fraction = Fraction(1, 10**12)) -> Fraction:
    """An exact amount rounded up to the ledger's precision, as a settlement is."""
    return -((-fraction) // quantum) * quantum


def _as_the_prices_say(mapping: Mapping, usage: Usage, searches: int) -> Fraction:
    """The bill for ``usage``, dimension by dimension, straight from the mapping's price
    keys (docs/contract.md §6), in exact fractions."""
    price = mapping.price
    assert price.audio_input is not None and price.audio_input.per_mtok is not None
    assert price.audio_output is not None and price.web_search is not None
    f = Fraction
    input_, cached_price = f(price.input_per_mtok), f(price.cached_input_per_mtok)
    audio_in = min(usage.audio_input_tokens, usage.input_tokens)
    text = usage.input_tokens - audio_in
    cached = min(max(0, usage.cached_input_tokens - audio_in), text)  # cached audio is audio
    audio_out = min(usage.audio_output_tokens, usage.output_tokens)
    micro = (
        (text - cached) * input_
        + cached * cached_price
        + audio_in * max(f(price.audio_input.per_mtok), input_, cached_price)
        + (usage.output_tokens - audio_out) * f(price.output_per_mtok)
        + audio_out * max(f(price.audio_output.per_mtok), f(price.output_per_mtok))
    )
    return _priced(micro / MTOK + searches * f(price.web_search.per_choice_usd))


def _priced_mapping(max_output: int, prices: tuple[Decimal, ...]) -> Mapping:
    input_price, output_price, cached_price, audio_in, audio_out, search = prices
    return _mapping(
        max_output=max_output,
        input_per_mtok=input_price,
        output_per_mtok=output_price,
        cached_input_per_mtok=cached_price,
        image_input={"tokens": PART_TOKENS["image_url"]},
        audio_input={"tokens": PART_TOKENS["input_audio"], "per_mtok": audio_in},
        file_input={"tokens": PART_TOKENS["file"]},
        audio_output={"per_mtok": audio_out},
        web_search={"per_choice_usd": search},
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    body=_bodies(),
    n_chunks=st.integers(0, 60),
    reasoning=st.integers(0, 5000),
    cached=st.integers(0, 10**5),
    prices=st.tuples(*[_PRICE] * 6),
    max_output=st.integers(1, 8000),
)
def test_the_reservation_is_never_below_what_the_provider_bills(
    body, n_chunks, reasoning, cached, prices, max_output
):
    mapping = _priced_mapping(max_output, prices)
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
    assert (usage.audio_input_tokens, usage.audio_output_tokens) == (
        reply.audio_tokens,
        reply.audio_output_tokens,
    )
    assert (reply.audio_output_tokens > 0) <= requirements.audio_output

    # What the gateway settles: every dimension at the mapping's price, within the hold.
    settled = _settled(mapping, requirements, usage)
    searches = len(reply.choices) if "web_search_options" in body else 0
    assert Fraction(settled) == _as_the_prices_say(mapping, usage, searches)
    assert reserved >= settled, (reserved, settled, usage)


@st.composite
def _within_bounds(draw: st.DrawFn, mapping: Mapping) -> tuple[Requirements, Usage]:
    """A request shape, and any usage a provider may bill for it within its bounds."""
    r = Requirements(
        estimated_input_tokens=draw(st.integers(0, 10**6)),
        max_output_tokens=draw(st.none() | st.integers(0, 10**5)),
        choices=draw(st.integers(1, 128)),
        prediction_tokens=draw(st.integers(0, 10**4)),
        image_inputs=draw(st.integers(0, 5)),
        audio_inputs=draw(st.integers(0, 5)),
        file_inputs=draw(st.integers(0, 5)),
        audio_output=draw(st.booleans()),
        web_search=draw(st.booleans()),
    )
    price = mapping.price
    assert price.audio_input is not None
    parts = input_tokens(mapping, r) - r.estimated_input_tokens
    audio_bound = r.audio_inputs * price.audio_input.tokens
    audio_in = draw(st.integers(0, audio_bound))
    prompt = draw(st.integers(0, r.estimated_input_tokens)) + audio_in
    prompt += draw(st.integers(0, parts - audio_bound))  # images and files, as input tokens
    per_choice = output_tokens(mapping, r) + r.prediction_tokens  # a limit of 0 is a limit
    output = draw(st.integers(0, r.choices * per_choice))
    usage = Usage(
        input_tokens=prompt,
        output_tokens=output,
        cached_input_tokens=draw(st.integers(0, prompt)),
        audio_input_tokens=audio_in,
        audio_output_tokens=draw(st.integers(0, output)) if r.audio_output else 0,
    )
    return r, usage


@settings(max_examples=300, deadline=None)
@given(data=st.data(), prices=st.tuples(*[_PRICE] * 6), max_output=st.integers(1, 10**5))
def test_any_usage_within_the_bounds_settles_as_priced_and_within_the_reservation(
    data, prices, max_output
):
    mapping = _priced_mapping(max_output, prices)
    requirements, usage = data.draw(_within_bounds(mapping))
    reserved = worst_case_cost(mapping, requirements)
    settled = _settled(mapping, requirements, usage)
    searches = requirements.choices if requirements.web_search else 0
    assert Fraction(settled) == _as_the_prices_say(mapping, usage, searches)
    assert settled <= reserved, (reserved, settled, requirements, usage)


# --- prompt-cache writes (Anthropic's): asked for by cache_control markers ------------------


def test_cache_writes_asked_for_need_their_price_on_an_anthropic_endpoint_only():
    both = Requirements(estimated_input_tokens=10, cache_writes=("5m", "1h"))
    bare = _mapping()
    assert unpriced(bare, both, "anthropic") == "cache_write_per_mtok,cache_write_1h_per_mtok"
    assert unpriced(_mapping(cache_write_per_mtok="3.75"), both, "anthropic") == (
        "cache_write_1h_per_mtok"
    )
    five = Requirements(estimated_input_tokens=10, cache_writes=("5m",))
    assert unpriced(_mapping(cache_write_per_mtok="3.75"), five, "anthropic") is None
    with pytest.raises(ValueError, match="cache_write_per_mtok"):
        worst_case_cost(bare, five, "anthropic")
    # OpenAI's dialect bills no cache write: nothing to price there.
    assert unpriced(bare, both, "openai") is None
    # Without a marker a request asks for no write.
    assert unpriced(bare, Requirements(estimated_input_tokens=10), "anthropic") is None


def test_an_anthropic_prompt_is_reserved_at_the_dearest_of_its_input_and_cache_write_prices():
    requirements = Requirements(estimated_input_tokens=1000, max_output_tokens=10)
    mapping = _mapping(cache_write_per_mtok="1.25", cache_write_1h_per_mtok="2")
    # The whole prompt may be written to the cache for an hour, markers or not.
    assert worst_case_cost(mapping, requirements, "anthropic") == D(1000 * 2 + 10 * 2) / MTOK
    cheap = _mapping(input_per_mtok=3, cache_write_per_mtok="1.25")
    assert worst_case_cost(cheap, requirements, "anthropic") == D(1000 * 3 + 10 * 2) / MTOK


def test_cache_writes_settle_at_the_rates_of_their_lifetimes():
    usage = Usage(
        input_tokens=100,
        output_tokens=10,
        cached_input_tokens=20,
        cache_write_input_tokens=30,
        cache_write_1h_input_tokens=40,
    )
    mapping = _mapping(
        cached_input_per_mtok="0.1", cache_write_per_mtok="1.25", cache_write_1h_per_mtok="2"
    )
    expected = 10 * 1 + 20 * D("0.1") + 30 * D("1.25") + 40 * 2 + 10 * 2
    assert _settled(mapping, Requirements(), usage) == expected / MTOK
    # Never above the reservation: every input token was reserved at the dearest rate.
    requirements = Requirements(estimated_input_tokens=100, max_output_tokens=10)
    assert _settled(mapping, requirements, usage) <= worst_case_cost(
        mapping, requirements, "anthropic"
    )


@settings(max_examples=300, deadline=None)
@given(
    estimated=st.integers(0, 10**6),
    max_output=st.integers(1, 10**5),
    split=st.tuples(*[st.integers(0, 10**6)] * 4),
    output=st.integers(0, 10**5),
    prices=st.tuples(*[_PRICE] * 3, st.none() | _PRICE, st.none() | _PRICE),
    asked=st.sampled_from([(), ("5m",), ("1h",), ("5m", "1h")]),
)
def test_an_anthropic_reservation_covers_any_cache_reads_and_writes_within_the_prompt(
    estimated, max_output, split, output, prices, asked
):
    input_price, output_price, cached_price, write_5m, write_1h = prices
    mapping = _mapping(
        max_output=max_output,
        input_per_mtok=input_price,
        output_per_mtok=output_price,
        cached_input_per_mtok=cached_price,
        **({} if write_5m is None else {"cache_write_per_mtok": write_5m}),
        **({} if write_1h is None else {"cache_write_1h_per_mtok": write_1h}),
    )
    requirements = Requirements(estimated_input_tokens=estimated, cache_writes=asked)
    missing = unpriced(mapping, requirements, "anthropic")
    needs = {"5m": write_5m, "1h": write_1h}
    assert (missing is None) == all(needs[ttl] is not None for ttl in asked)
    if missing is not None:
        return
    # Any split of the prompt the provider may report: read, written for either lifetime,
    # the rest plain; the answer within the mapping's output bound.
    read, five, hour, _ = split
    hour = min(hour, estimated)
    five = min(five, estimated - hour)
    read = min(read, estimated - hour - five)
    usage = Usage(
        input_tokens=estimated,
        output_tokens=min(output, max_output),
        cached_input_tokens=read,
        cache_write_input_tokens=five,
        cache_write_1h_input_tokens=hour,
    )
    settled = _settled(mapping, requirements, usage)
    assert worst_case_cost(mapping, requirements, "anthropic") >= settled
    f = Fraction
    write_5m_rate = f(input_price if write_5m is None else write_5m)
    write_1h_rate = write_5m_rate if write_1h is None else f(write_1h)
    micro = (
        (estimated - read - five - hour) * f(input_price)
        + read * f(cached_price)
        + five * write_5m_rate
        + hour * write_1h_rate
        + usage.output_tokens * f(output_price)
    )
    assert Fraction(settled) == _priced(micro / MTOK)


# --- embeddings -----------------------------------------------------------------------------


@given(
    texts=st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=8),
    billed_per_token=st.integers(min_value=1, max_value=4),
)
def test_an_embeddings_reservation_is_its_input_alone_and_bounds_what_is_billed(
    texts: list[str], billed_per_token: int
) -> None:
    call = embeddings.parse_body(orjson.dumps({"model": "embed", "input": texts}))
    requirements = call.requirements(WORKSPACE, HeaderNarrowing())
    mapping = _mapping(max_output=4096)
    assert output_tokens(mapping, requirements) == 0
    reserved = worst_case_cost(mapping, requirements)
    assert reserved == D(sum(len(t.encode()) for t in texts)) / MTOK  # at input_per_mtok: 1
    # A tokenizer never makes more tokens of a text than it has bytes.
    billed = sum(max(1, len(t.encode()) // billed_per_token) for t in texts)
    used = Usage(input_tokens=billed, output_tokens=0)
    assert usage_cost(used, settlement_rates(mapping)) <= reserved


def test_an_embeddings_token_array_is_reserved_exactly():
    call = embeddings.parse_body(orjson.dumps({"model": "embed", "input": [[1, 2, 3], [4]]}))
    requirements = call.requirements(WORKSPACE, HeaderNarrowing())
    assert worst_case_cost(_mapping(input_per_mtok=3), requirements) == D(4 * 3) / MTOK
