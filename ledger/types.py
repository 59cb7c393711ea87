"""Column types shared by read models."""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any, Final

from sqlalchemy import Dialect, Numeric, String
from sqlalchemy.types import TypeDecorator, TypeEngine

__all__ = ["MONEY_LIMIT", "MONEY_PATTERN", "MoneyColumn", "money_of", "money_str", "parse_money"]

# NUMERIC(38, 12) holds amounts below 10**26 dollars: no amount the ledger books may reach it.
MONEY_LIMIT: Final = Decimal(10) ** 26
# A money amount a client writes: plain digits, an optional fraction, no sign, no exponent.
MONEY_PATTERN: Final = r"^0*[0-9]{1,26}(\.[0-9]+)?$"
_MONEY: Final = re.compile(MONEY_PATTERN)


class MoneyColumn(TypeDecorator[Decimal]):
    """Exact decimal dollars: NUMERIC on PostgreSQL, a decimal string on SQLite.

    SQLite has no exact decimal type (its NUMERIC affinity rounds through a float), so
    amounts are stored as text there and only ever summed in Python or compared after
    conversion; PostgreSQL does exact arithmetic in the database.
    """

    impl = Numeric(38, 12)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name == "sqlite":
            return dialect.type_descriptor(String(60))
        return dialect.type_descriptor(Numeric(38, 12, asdecimal=True))

    def process_bind_param(self, value: Decimal | None, dialect: Dialect) -> Any:
        if value is None:
            return None
        if dialect.name == "sqlite":
            return money_str(value)
        return value

    def process_result_value(self, value: Any, dialect: Dialect) -> Decimal | None:
        if value is None:
            return None
        return Decimal(value) if not isinstance(value, Decimal) else value


def parse_money(text: str) -> Decimal | None:
    """The amount ``text`` writes (``"0.25"``, surrounding blanks ignored), or None if it
    is not a plain decimal amount below :data:`MONEY_LIMIT`."""
    text = text.strip()
    return Decimal(text) if _MONEY.match(text) else None


def money_of(value: Any) -> Decimal:
    """A money column's value however the driver gave it: a ``Decimal`` (NUMERIC), or its
    exact text (SQLite's column, a raw read of it, the JSON the PostgreSQL appender reads)."""
    return value if isinstance(value, Decimal) else Decimal(str(value))


def money_str(value: Decimal) -> str:
    """A plain decimal string without exponent and without trailing zeros beyond 6 places."""
    text = format(value.normalize(), "f")
    if "." in text:
        whole, fraction = text.split(".")
        fraction = fraction.ljust(6, "0")
        return f"{whole}.{fraction}"
    return f"{text}.000000"
