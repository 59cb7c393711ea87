"""Accounting rules: what an attempt costs (SPEC §4, §6), in exact decimal arithmetic.

Prices are US dollars per million tokens. Amounts are quantized to 12 decimal places, the
precision of the ledger's money columns, rounding up: a reservation or a charge is never
understated by rounding.
"""

from __future__ import annotations

from decimal import ROUND_CEILING, Decimal
from typing import Final

from ledger.events import Usage

__all__ = ["MONEY_QUANTUM", "quantize", "usage_cost"]

MONEY_QUANTUM: Final = Decimal("0.000000000001")
_PER_MTOK: Final = Decimal(1_000_000)


def quantize(amount: Decimal) -> Decimal:
    return amount.quantize(MONEY_QUANTUM, rounding=ROUND_CEILING)


def usage_cost(
    usage: Usage,
    *,
    input_per_mtok: Decimal,
    output_per_mtok: Decimal,
    cached_input_per_mtok: Decimal,
) -> Decimal:
    """The cost of known usage; cached input tokens are part of the input count."""
    cached = min(usage.cached_input_tokens, usage.input_tokens)
    amount = (
        (usage.input_tokens - cached) * input_per_mtok
        + cached * cached_input_per_mtok
        + usage.output_tokens * output_per_mtok
    ) / _PER_MTOK
    return quantize(amount)
