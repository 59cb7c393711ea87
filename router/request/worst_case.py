"""The worst-case cost of an attempt (contract §4, §6): the most a provider may bill for one
request on one mapping, the billable dimensions a mapping has no price for, and the rates
the attempt's settlement is priced at — one pricing vocabulary before and after the call.

Pure: a mapping, its endpoint's driver and the request's requirements in, exact decimals out.
Every dimension a request can trigger is bounded, none guessed:

- text input: the prompt's bytes bound its tokens (``router/doors/chat.py``), priced at the higher
  of the input and cached input prices (the provider decides what it served from cache) —
  on an Anthropic endpoint, at the cache-write prices too when they are higher (a request
  may write its whole prompt to the cache);
- content parts (images, audio, files): each at most its kind's ``tokens`` in the mapping's
  price, at the higher of that kind's own price and the input prices;
- output, for each of the ``n`` choices (each is billed its own tokens): the request's
  ``max_tokens`` / ``max_completion_tokens``, else the mapping's ``max_output_tokens`` —
  reasoning tokens are output tokens inside that bound — plus a predicted output's tokens
  (rejected prediction tokens are billed as output); an answer that may hold audio at the
  higher of the output and audio output prices;
- web search: the mapping's amount per choice.

A dimension the mapping has no price for makes :func:`unpriced` name it, and routing
excludes the mapping (``unpriced_input``) rather than reserve a guess. A request can incur
cache writes when it carries ``cache_control`` markers (``Requirements.cache_writes``, the
lifetimes they ask for) and its endpoint is Anthropic's, the one dialect that bills them:
such a mapping needs ``cache_write_per_mtok`` for 5-minute writes and
``cache_write_1h_per_mtok`` for hour-long ones.

The settlement (``ledger.books.accounting.usage_cost``) prices what the provider reports at
:func:`settlement_rates`, the rates the worst case used: audio input and output tokens at
their dimension's rate, never below the text price; text, cached or not, at its own price;
images and files at the input price (OpenAI bills them inside the prompt tokens, and no
count of them is reported apart); cache writes at their lifetime's price. Writes an upstream
reports though the mapping has no price for them (a request without markers cannot cause
them) are settled at the next price the mapping has: an hour's at the 5-minute price, a
5-minute one at the input price. Web searches are billed per search and reported nowhere:
:func:`billed_usage` adds the ones the worst case counted, one per choice.
"""

from __future__ import annotations

from collections.abc import Mapping as AnyMapping
from decimal import Decimal
from enum import StrEnum
from typing import Final

from ledger.books.accounting import EXACT, Rates, usage_cost
from ledger.events import Requirements, Usage
from router.config import Driver, Mapping, PartPrice, Price

__all__ = [
    "Dimension",
    "billed_usage",
    "input_tokens",
    "output_tokens",
    "settlement",
    "settlement_rates",
    "unpriced",
    "web_searches",
    "worst_case_cost",
]


class Dimension(StrEnum):
    """A billable dimension beyond text tokens: its name is its key under a mapping's
    ``price:`` and the detail of an ``unpriced_input`` exclusion."""

    IMAGE_INPUT = "image_input"
    AUDIO_INPUT = "audio_input"
    FILE_INPUT = "file_input"
    AUDIO_OUTPUT = "audio_output"
    WEB_SEARCH = "web_search"
    CACHE_WRITE = "cache_write_per_mtok"  # the key itself: prices per token are flat keys
    CACHE_WRITE_1H = "cache_write_1h_per_mtok"


# Whether a driver sends the client's body on as it is. The OpenAI driver does, so every
# dimension of the request reaches the upstream. The Anthropic driver sends text and function
# tools only: `n`, non-text content parts, audio, predictions and web search have no Messages
# API counterpart and are left out (router/drivers/anthropic.py;
# tests/request/test_worst_case.py holds it to that), so they cannot be billed there — unless
# the body arrived in its own dialect (`Requirements.native`, the Anthropic door), which it
# then sends as it came, images and documents included.
_PASSES_BODY_THROUGH: Final[AnyMapping[Driver, bool]] = {"openai": True, "anthropic": False}
# Whether the driver's dialect bills prompt-cache writes: Anthropic's does (at its own
# prices, reported as cache_creation_input_tokens); OpenAI's caches for free.
_BILLS_CACHE_WRITES: Final[AnyMapping[Driver, bool]] = {"openai": False, "anthropic": True}


def _passes_through(driver: Driver, requirements: Requirements) -> bool:
    return _PASSES_BODY_THROUGH[driver] or requirements.native == driver


_PER_MTOK_EXPONENT: Final = -6


def _beyond_text(r: Requirements) -> bool:
    """Whether the request may be billed for anything but text tokens (most are not: this
    keeps their worst case as cheap to compute as the arithmetic it needs)."""
    return bool(
        r.image_inputs
        or r.audio_inputs
        or r.file_inputs
        or r.audio_output
        or r.web_search
        or r.unknown_inputs
    )


def unpriced(mapping: Mapping, requirements: Requirements, driver: Driver = "openai") -> str | None:
    """The billable dimensions of the request that ``mapping`` has no price for,
    comma-joined (e.g. ``"image_input,web_search"``); None if every one is priced.

    A content part of a type the gateway does not know (``content_part:video_url``) can
    have no price: whatever it costs upstream is unknown.
    """
    r, price = requirements, mapping.price
    writes = _unpriced_cache_writes(price, r, driver)
    if not _passes_through(driver, requirements) or not _beyond_text(requirements):
        return ",".join(writes) or None
    needed = (
        (Dimension.IMAGE_INPUT, r.image_inputs > 0, price.image_input),
        (Dimension.AUDIO_INPUT, r.audio_inputs > 0, price.audio_input),
        (Dimension.FILE_INPUT, r.file_inputs > 0, price.file_input),
        (Dimension.AUDIO_OUTPUT, r.audio_output, price.audio_output),
        (Dimension.WEB_SEARCH, r.web_search, price.web_search),
    )
    missing = [str(dimension) for dimension, asked, priced in needed if asked and priced is None]
    missing += [f"content_part:{kind}" for kind in r.unknown_inputs]
    return ",".join(missing + writes) or None


def _unpriced_cache_writes(price: Price, requirements: Requirements, driver: Driver) -> list[str]:
    if not requirements.cache_writes or not _BILLS_CACHE_WRITES[driver]:
        return []
    needed = (
        (Dimension.CACHE_WRITE, "5m", price.cache_write_per_mtok),
        (Dimension.CACHE_WRITE_1H, "1h", price.cache_write_1h_per_mtok),
    )
    asked = requirements.cache_writes
    return [str(key) for key, ttl, priced in needed if ttl in asked and priced is None]


def _parts(mapping: Mapping, requirements: Requirements) -> list[tuple[int, PartPrice]]:
    """(count, price) of each kind of content part the request holds."""
    price, r = mapping.price, requirements
    kinds = (
        (r.image_inputs, price.image_input),
        (r.audio_inputs, price.audio_input),
        (r.file_inputs, price.file_input),
    )
    parts = []
    for count, part_price in kinds:
        if count:
            if part_price is None:
                raise ValueError(f"unpriced content parts: {unpriced(mapping, requirements)}")
            parts.append((count, part_price))
    return parts


def input_tokens(mapping: Mapping, requirements: Requirements, driver: Driver = "openai") -> int:
    """The most input tokens the request may be billed on ``mapping``: its text, and each
    content part the driver sends at its kind's bound. Raises ValueError if unpriced."""
    tokens = requirements.estimated_input_tokens
    if _passes_through(driver, requirements) and _beyond_text(requirements):
        tokens += sum(count * part.tokens for count, part in _parts(mapping, requirements))
    return tokens


def output_tokens(mapping: Mapping, requirements: Requirements) -> int:
    """The most output tokens one choice may be billed (reasoning included): the request's
    own limit, even above the mapping's, else the mapping's ``max_output_tokens``."""
    if requirements.max_output_tokens is not None:
        return requirements.max_output_tokens
    return mapping.max_output_tokens


def worst_case_cost(
    mapping: Mapping, requirements: Requirements, driver: Driver = "openai"
) -> Decimal:
    """The most the provider may bill for the request on ``mapping`` (module docstring).

    ``driver`` is the mapping's endpoint's; the default, ``openai``, sends everything.
    Raises ValueError for a request with a dimension the mapping has no price for
    (:func:`unpriced` says which).
    """
    price, r = mapping.price, requirements
    passes = _passes_through(driver, r)
    extras = passes and _beyond_text(r)
    if extras or r.cache_writes:
        missing = unpriced(mapping, r, driver)
        if missing is not None:
            raise ValueError(f"no price for {missing}")
    input_price = _input_rate(price, driver)
    micro = EXACT.multiply(Decimal(r.estimated_input_tokens), input_price)
    if extras:
        for count, part in _parts(mapping, r):
            part_price = _part_rate(part, input_price)
            micro = EXACT.add(micro, EXACT.multiply(Decimal(count * part.tokens), part_price))
    choices = r.choices if passes else 1
    per_choice = output_tokens(mapping, r) + (r.prediction_tokens if passes else 0)
    output_price = _audio_output_rate(price) if extras and r.audio_output else price.output_per_mtok
    micro = EXACT.add(micro, EXACT.multiply(Decimal(choices * per_choice), output_price))
    cost = micro.scaleb(_PER_MTOK_EXPONENT, EXACT)
    searches = web_searches(r, driver) if extras else 0
    if searches and price.web_search is not None:
        cost = EXACT.add(cost, EXACT.multiply(Decimal(searches), price.web_search.per_choice_usd))
    return cost


# --- the rates: one per dimension, for the worst case and the settlement alike ---


def _input_rate(price: Price, driver: Driver = "openai") -> Decimal:
    """The most a text input token may cost: the provider decides what it serves from its
    cache, so the higher of the input and cached input prices; where the dialect bills
    cache writes, of their prices too (a request may write its whole prompt to the cache)."""
    rate = max(price.input_per_mtok, price.cached_input_per_mtok)
    if _BILLS_CACHE_WRITES[driver]:
        for write in (price.cache_write_per_mtok, price.cache_write_1h_per_mtok):
            if write is not None:
                rate = max(rate, write)
    return rate


def _part_rate(part: PartPrice | None, input_rate: Decimal) -> Decimal:
    """A content part's token: at its kind's own price if it has one, never below a text
    input token's."""
    if part is None or part.per_mtok is None:
        return input_rate
    return max(part.per_mtok, input_rate)


def _audio_output_rate(price: Price) -> Decimal:
    """An audio output token: at the audio output price, never below the text output's."""
    if price.audio_output is None:
        return price.output_per_mtok
    return max(price.output_per_mtok, price.audio_output.per_mtok)


def settlement_rates(mapping: Mapping) -> Rates:
    """The rates an attempt's usage on ``mapping`` is settled at: each dimension at the rate
    its bound was reserved at, text input at its own (cached or not). Audio tokens a
    provider reports although the mapping has no audio price are settled as text would be
    at its dearest (the request that reaches a provider with audio is priced for it)."""
    price = mapping.price
    return Rates(
        input_per_mtok=price.input_per_mtok,
        cached_input_per_mtok=price.cached_input_per_mtok,
        output_per_mtok=price.output_per_mtok,
        audio_input_per_mtok=_part_rate(price.audio_input, _input_rate(price)),
        audio_output_per_mtok=_audio_output_rate(price),
        web_search_usd=None if price.web_search is None else price.web_search.per_choice_usd,
        cache_write_per_mtok=price.cache_write_per_mtok,
        cache_write_1h_per_mtok=price.cache_write_1h_per_mtok,
    )


def web_searches(requirements: Requirements, driver: Driver = "openai") -> int:
    """The web searches an attempt is billed for: one per choice of a request with
    ``web_search_options`` that the driver sends on (``web_search.per_choice_usd`` is the
    most a search adds to a choice)."""
    if not requirements.web_search or not _PASSES_BODY_THROUGH[driver]:
        return 0
    return requirements.choices


def billed_usage(usage: Usage, requirements: Requirements, driver: Driver = "openai") -> Usage:
    """The provider's reported ``usage`` with what it bills but does not report: web
    searches (OpenAI bills them per call; its chat completions usage has no count), settled
    at the configured fee."""
    searches = max(web_searches(requirements, driver), usage.web_searches)
    if searches == usage.web_searches:
        return usage
    return usage.model_copy(update={"web_searches": searches})


def settlement(
    reported: Usage | None, mapping: Mapping, requirements: Requirements, driver: Driver
) -> tuple[Usage | None, Decimal | None]:
    """What an attempt on ``mapping`` is billed for (the usage the upstream ``reported``,
    plus what it bills without reporting) and its cost, dimension by dimension at the
    mapping's rates (contract §6); (None, None) when the upstream did not say."""
    if reported is None:
        return None, None
    usage = billed_usage(reported, requirements, driver)
    return usage, usage_cost(usage, settlement_rates(mapping))
