"""Reading a saved report page: JSON to plain values, and each field checked at its path.

A page is untrusted input. It is parsed with exact decimals (never floats), nesting is
bounded, and every value is checked for its type and range where it is read; the first
bad one raises :class:`ExportError` naming the page's line and the field's JSON path
(``data[3].results[0].input_tokens``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any, Final

from ledger.books.accounting import quantize
from ledger.finance.usage_export import ExportError
from ledger.types import MONEY_LIMIT

__all__ = ["MAX_TOKENS", "Page", "Where", "read_pages"]

# A count beyond any real bucket (and far inside a BIGINT): larger is a broken page.
MAX_TOKENS: Final = 10**15
_MAX_TEXT: Final = 200
_MAX_DEPTH: Final = 32


@dataclass(frozen=True, slots=True)
class Page:
    """One page of a report as saved: its line in the file, and its JSON object."""

    line: int
    body: dict[str, Any]
    path: str = ""  # "[2]" for the third page of a JSON array of pages


@dataclass(frozen=True, slots=True)
class Where:
    """Where a value sits: its file, the line its page starts on, and its JSON path."""

    source: str | None
    line: int
    path: str

    def at(self, key: str | int) -> Where:
        step = f"[{key}]" if isinstance(key, int) else (f".{key}" if self.path else key)
        return Where(self.source, self.line, self.path + step)

    def error(self, message: str) -> ExportError:
        return ExportError(message, line=self.line, field=self.path or None, source=self.source)


def read_pages(data: bytes, source: str | None) -> list[Page]:
    """The pages a file holds: one JSON page, a JSON array of pages, or one page per line."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise ExportError("not UTF-8 text", line=line, source=source) from None
    if not text.strip():
        raise ExportError("the report is empty", source=source)
    try:
        whole = _loads(text)
    except ValueError as error:
        # Not one JSON document: one page per line, or a broken document.
        lines = _json_lines(text, source)
        if lines is None:
            raise ExportError(
                f"not valid JSON: {error}", line=_line_of(error), source=source
            ) from None
        return lines
    if isinstance(whole, list):
        pages = []
        for index, item in enumerate(whole):
            if not isinstance(item, dict):
                raise Where(source, 1, f"[{index}]").error("each page must be a JSON object")
            pages.append(Page(1, item, f"[{index}]"))
        return pages
    if not isinstance(whole, dict):
        raise ExportError("a report page must be a JSON object", line=1, source=source)
    return [Page(1, whole)]


def _json_lines(text: str, source: str | None) -> list[Page] | None:
    """One page per non-blank line, or None if the first line is no JSON object either."""
    pages: list[Page] = []
    for number, raw in enumerate(text.split("\n"), 1):
        if not raw.strip():
            continue
        try:
            page = _loads(raw)
        except ValueError as error:
            if not pages:
                return None
            raise ExportError(f"not valid JSON: {error}", line=number, source=source) from None
        if not isinstance(page, dict):
            if not pages:
                return None
            raise ExportError("each page must be a JSON object", line=number, source=source)
        pages.append(Page(number, page))
    return pages or None


def _loads(text: str) -> Any:
    try:
        value = json.loads(text, parse_float=Decimal, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("nested too deeply for a report page") from None
    if _depth(value) > _MAX_DEPTH:
        raise ValueError("nested too deeply for a report page")
    return value


def _depth(value: Any) -> int:
    deepest, level, stack = 0, 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        deepest = max(deepest, level)
        if deepest > _MAX_DEPTH:
            return deepest
        if isinstance(item, dict):
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, level + 1) for v in item)
    return deepest


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def _line_of(error: ValueError) -> int | None:
    return getattr(error, "lineno", None)


# --- typed fields ---


def items(value: Any, where: Where) -> Iterator[tuple[Any, Where]]:
    """The elements of a JSON array, each with its path."""
    if not isinstance(value, list):
        raise where.error("must be a JSON array")
    for index, item in enumerate(value):
        yield item, where.at(index)


def obj(value: Any, where: Where) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise where.error("must be a JSON object")
    return value


def text(record: dict[str, Any], key: str, where: Where, *, required: bool = False) -> str | None:
    value = record.get(key)
    at = where.at(key)
    if value is None:
        if required:
            raise at.error("is required")
        return None
    if not isinstance(value, str):
        raise at.error("must be a string or null")
    if "\x00" in value or len(value) > _MAX_TEXT:
        raise at.error(f"must be at most {_MAX_TEXT} characters, without NUL")
    return value.strip() or None


def count(record: dict[str, Any], key: str, where: Where, *, required: bool = False) -> int:
    """A token or request count: a whole number, 0 <= n < 10**15 (absent: 0 unless required)."""
    value = record.get(key)
    at = where.at(key)
    if value is None:
        if required:
            raise at.error("is required")
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_TOKENS:
        raise at.error(f"must be a whole number from 0 to {MAX_TOKENS - 1}, not {value!r}")
    return value


def amount(value: Any, where: Where, *, scale: int = 0) -> Decimal:
    """An exact amount of money: a JSON number or a decimal string, ``scale`` powers of
    ten above dollars (Anthropic reports cents: 2). Rounded up to the ledger's precision."""
    parsed: Decimal | None = None
    if isinstance(value, Decimal):
        parsed = value
    elif isinstance(value, int) and not isinstance(value, bool):
        parsed = Decimal(value)
    elif isinstance(value, str) and len(value) <= 60:
        try:
            parsed = Decimal(value.strip())
        except InvalidOperation:
            parsed = None
    if parsed is None or not parsed.is_finite():
        raise where.error(f"not a decimal amount: {str(value)[:60]!r}")
    dollars = parsed.scaleb(-scale)
    # A provider credits a refund as a negative line; the books hold no negative cost.
    if abs(dollars) >= MONEY_LIMIT:
        raise where.error(f"must be below {MONEY_LIMIT} USD")
    return quantize(dollars) if dollars >= 0 else -quantize(-dollars)


def instant(value: Any, where: Where) -> datetime:
    """A bucket boundary: Unix seconds (OpenAI) or an RFC 3339 string (Anthropic)."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return datetime.fromtimestamp(value, UTC)
        except (OverflowError, OSError, ValueError):
            raise where.error(f"not a Unix time: {value}") from None
    if isinstance(value, str) and len(value) <= 40:
        try:
            moment = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
            return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
        except (ValueError, OverflowError):
            pass
    raise where.error(f"not a timestamp: {str(value)[:40]!r}")
