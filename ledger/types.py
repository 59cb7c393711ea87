"""Column types shared by read models."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from sqlalchemy import Dialect, Numeric, String
from sqlalchemy.types import TypeDecorator, TypeEngine

__all__ = ["MoneyColumn", "money_str"]


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


def money_str(value: Decimal) -> str:
    """A plain decimal string without exponent and without trailing zeros beyond 6 places."""
    text = format(value.normalize(), "f")
    if "." in text:
        whole, fraction = text.split(".")
        fraction = fraction.ljust(6, "0")
        return f"{whole}.{fraction}"
    return f"{text}.000000"
