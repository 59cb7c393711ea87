"""A key to create, as the key API's body and the console's form ask for it
(``router.http.keys.key_request``): checked against the serving config, refused naming the
field."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest

from ledger.events import KeyLimits
from router.config import parse_config
from router.errors import GatewayError
from router.http.keys import KeyRequest, key_request
from tests.config.test_checkpoint_config import BASE

CONFIG = parse_config(BASE)
NOW = datetime(2030, 6, 1, tzinfo=UTC)


def test_a_full_body_is_the_key_it_asks_for() -> None:
    asked = key_request(
        {
            "workspace": "acme",
            "role": "finance",
            "name": "  month end ",
            "budget": {"limit_usd": "12.5"},
            "endpoints": ["east", "provider:anthropic", "east"],
            "expires_at": "2031-01-31T12:00:00+01:00",
            "limits": {"tokens_per_minute": 9000},
            "colour": "green",  # not a field of the contract's: ignored
        },
        CONFIG,
        NOW,
    )
    assert asked == KeyRequest(
        "acme",
        "finance",
        "month end",
        (Decimal("12.5"), "day"),
        ("east", "provider:anthropic"),
        datetime(2031, 1, 31, 11, tzinfo=UTC),
        KeyLimits(tokens_per_minute=9000),
    )
    assert key_request({"workspace": "acme"}, CONFIG, NOW) == KeyRequest("acme")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ([], None),
        ({"workspace": 1}, "workspace"),
        ({"workspace": "acme", "name": "x" * 201}, "name"),
        ({"workspace": "acme", "name": 7}, "name"),
        ({"workspace": "acme", "budget": {"limit_usd": "-1"}}, "budget.limit_usd"),
        ({"workspace": "acme", "budget": "5"}, "budget.limit_usd"),
        ({"workspace": "acme", "endpoints": "east"}, "endpoints"),
        ({"workspace": "acme", "endpoints": [" "]}, "endpoints"),
        ({"workspace": "acme", "expires_at": 2031}, "expires_at"),
        ({"workspace": "acme", "expires_at": "2030-06-01T00:00:00Z"}, "expires_at"),
        ({"workspace": "acme", "limits": [60]}, "limits"),
        (
            {"workspace": "acme", "limits": {"requests_per_minute": 1.5}},
            "limits.requests_per_minute",
        ),
    ],
)
def test_a_field_out_of_bounds_is_refused_by_name(body: object, param: str | None) -> None:
    with pytest.raises(GatewayError) as refused:
        key_request(body, CONFIG, NOW)
    assert (refused.value.status, refused.value.code, refused.value.param) == (
        400,
        "invalid_request",
        param,
    )
