"""A mapping's price with history (contract §2): dated entries, the one in force at an
attempt's start prices it, and the whole history is in the config's recorded summary."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
import yaml

from router.config import ConfigError, parse_config
from router.request.worst_case import settlement_rates
from tests.config.test_config import ENV, _base, _mapping

TODAY = datetime.now(UTC).date()


def _with_history(*entries: dict[str, Any]) -> dict[str, Any]:
    data = _base()
    _mapping(data)["price"] = list(entries)
    return data


def _entry(day: date, input_price: str) -> dict[str, Any]:
    return {"from": day, "input_per_mtok": input_price, "output_per_mtok": "0.60"}


def _at(day: date) -> datetime:
    return datetime.combine(day, datetime.min.time(), tzinfo=UTC) + timedelta(hours=1)


def test_a_single_price_block_is_still_one_price_without_history() -> None:
    mapping = parse_config(yaml.safe_dump(_base()), environ=ENV).models[0].mappings[0]
    assert mapping.price_history == ()
    assert mapping.priced_at(_at(TODAY)) is mapping


def test_the_entry_in_force_at_an_attempts_start_prices_it() -> None:
    before, change = TODAY - timedelta(days=40), TODAY + timedelta(days=5)
    data = _with_history(_entry(before, "0.10"), _entry(change, "0.20"))
    mapping = parse_config(yaml.safe_dump(data), environ=ENV).models[0].mappings[0]
    assert mapping.price.input_per_mtok == Decimal("0.10")  # in force at load
    assert mapping.price.cached_input_per_mtok == Decimal("0.10")  # defaults per entry
    assert mapping.priced_at(_at(change)).price.input_per_mtok == Decimal("0.20")
    assert mapping.priced_at(_at(change) - timedelta(hours=2)).price.input_per_mtok == Decimal(
        "0.10"
    )
    # Before the first entry, the first applies.
    assert mapping.priced_at(_at(before - timedelta(days=9))).price.input_per_mtok == Decimal(
        "0.10"
    )
    rates = settlement_rates(mapping.priced_at(_at(change)))
    assert settlement_rates(mapping) != rates


def test_a_group_is_priced_mapping_by_mapping() -> None:
    data = _with_history(_entry(TODAY - timedelta(days=1), "0.10"), _entry(TODAY, "0.30"))
    group = parse_config(yaml.safe_dump(data), environ=ENV).models[0]
    priced = group.priced_at(_at(TODAY - timedelta(days=1)))
    assert priced.mappings[0].price.input_per_mtok == Decimal("0.10")
    assert group.priced_at(_at(TODAY)).mappings[0].price.input_per_mtok == Decimal("0.30")


def test_the_recorded_summary_carries_the_whole_history() -> None:
    data = _with_history(_entry(date(2026, 1, 1), "0.10"), _entry(date(2026, 6, 1), "0.20"))
    summary = parse_config(yaml.safe_dump(data), environ=ENV).redacted_summary()
    price = summary["models"][0]["mappings"][0]["price"]
    assert [(p["from"], p["input_per_mtok"]) for p in price] == [
        ("2026-01-01", "0.10"),
        ("2026-06-01", "0.20"),
    ]


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        (
            [_entry(date(2026, 6, 1), "0.2"), _entry(date(2026, 1, 1), "0.1")],
            "must be in order of their from days",
        ),
        (
            [_entry(date(2026, 1, 1), "0.1"), {"input_per_mtok": "0.2", "output_per_mtok": "1"}],
            "models[0].mappings[0].price[1].from: required",
        ),
        (
            [_entry(date(2026, 1, 1), "0.1"), {**_entry(date(2026, 2, 1), "0.2"), "x": 1}],
            "models[0].mappings[0].price[1].x: unknown key",
        ),
    ],
)
def test_a_bad_history_is_refused_naming_the_entry(
    entries: list[dict[str, Any]], expected: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(yaml.safe_dump(_with_history(*entries)), environ=ENV)
    assert expected in str(caught.value)
