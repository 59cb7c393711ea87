"""Provider usage exports (contract §3 "reconciliation line"): CSV with a header row, or JSONL.

One line per upstream call the provider billed: ``attempt_id`` (the id Waybill sent as
``X-Waybill-Attempt-Id``) and/or ``provider_request_id``, then ``model``, ``input_tokens``,
``output_tokens``, ``cached_input_tokens`` (optional, 0), ``cost_usd`` and ``timestamp``
(ISO 8601; without a zone it is UTC). Other columns are ignored: real exports carry many.

Parsing is all or nothing: the first bad line raises :class:`ExportError` naming its line
number and field, so a reconciliation never runs on half a file. Money is exact: a CSV cell
or a JSON string is read as a decimal, and a JSON number is parsed straight to ``Decimal``
(never through a float, which would already have lost digits).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any, Final, Literal

from ledger.books.accounting import quantize
from ledger.events import Usage
from ledger.types import MONEY_LIMIT

__all__ = ["ExportError", "ExportFormat", "ProviderLine", "parse_export", "sniff_format"]

ExportFormat = Literal["csv", "jsonl"]

_ID_FIELDS: Final = ("attempt_id", "provider_request_id")
_REQUIRED: Final = ("model", "input_tokens", "output_tokens", "cost_usd", "timestamp")
_MAX_ID: Final = 200


class ExportError(ValueError):
    """A usage export that cannot be read; the whole import is refused."""

    def __init__(
        self,
        message: str,
        *,
        line: int | None = None,
        field: str | None = None,
        source: str | None = None,  # the file, where an import reads several
    ):
        where = ", ".join(
            part for part in (source, f"line {line}" if line else None, field) if part is not None
        )
        super().__init__(f"{where}: {message}" if where else message)
        self.line = line
        self.field = field
        self.source = source


@dataclass(frozen=True, slots=True)
class ProviderLine:
    """One billed call, as the provider reports it."""

    line: int  # 1-based line of the file where the record starts
    attempt_id: str | None
    provider_request_id: str | None
    model: str
    usage: Usage
    cost_usd: Decimal
    timestamp: datetime  # UTC


def sniff_format(data: bytes) -> ExportFormat:
    """JSONL if the first non-blank character opens an object, CSV otherwise."""
    start = data.lstrip(b"\xef\xbb\xbf \t\r\n")[:1]
    return "jsonl" if start == b"{" else "csv"


def parse_export(data: bytes, export_format: ExportFormat | None = None) -> list[ProviderLine]:
    """Every line of the export, in file order; :class:`ExportError` at the first bad one."""
    text = _decode(data)
    chosen = export_format or sniff_format(data)
    records = _csv_records(text) if chosen == "csv" else _jsonl_records(text)
    lines = [_line(number, record) for number, record in records]
    if not lines:
        raise ExportError("the export has no usage lines")
    return lines


def _decode(data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise ExportError("not UTF-8 text", line=line) from None


# --- the two formats, as (line number, raw record) ---


def _csv_records(text: str) -> Iterator[tuple[int, Mapping[str, Any]]]:
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    try:
        header = next((row for row in reader if any(cell.strip() for cell in row)), None)
        if header is None:
            raise ExportError("the export is empty: a CSV export starts with a header row")
        columns = [name.strip() for name in header]
        _check_header(columns)
        start = reader.line_num + 1
        for row in reader:
            number, start = start, reader.line_num + 1
            if not row or all(not cell.strip() for cell in row):
                continue  # a blank line
            if len(row) > len(columns):
                raise ExportError(
                    f"{len(row)} cells for {len(columns)} header columns", line=number
                )
            yield number, dict(zip(columns, row, strict=False))
    except csv.Error as error:
        raise ExportError(f"malformed CSV: {error}", line=reader.line_num) from None


def _check_header(columns: list[str]) -> None:
    missing = [name for name in _REQUIRED if name not in columns]
    if missing:
        raise ExportError(
            f"the header row lacks the column(s) {', '.join(missing)}", line=1, field=missing[0]
        )
    if not any(name in columns for name in _ID_FIELDS):
        raise ExportError(
            "the header row needs an attempt_id or a provider_request_id column",
            line=1,
            field="attempt_id",
        )
    duplicates = sorted({name for name in columns if name and columns.count(name) > 1})
    if duplicates:
        raise ExportError(f"duplicate column {duplicates[0]!r}", line=1, field=duplicates[0])


def _jsonl_records(text: str) -> Iterator[tuple[int, Mapping[str, Any]]]:
    for number, raw in enumerate(text.split("\n"), 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw, parse_float=Decimal, parse_constant=_no_constant)
        except ValueError as error:
            raise ExportError(f"not valid JSON: {error}", line=number) from None
        except RecursionError:
            raise ExportError("JSON nested too deeply for a usage line", line=number) from None
        if not isinstance(record, dict):
            raise ExportError("each line must be a JSON object", line=number)
        yield number, record


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


# --- one record's fields ---


def _line(number: int, record: Mapping[str, Any]) -> ProviderLine:
    attempt_id = _optional_id(record, "attempt_id", number)
    provider_request_id = _optional_id(record, "provider_request_id", number)
    if attempt_id is None and provider_request_id is None:
        raise ExportError(
            "attempt_id or provider_request_id is required", line=number, field="attempt_id"
        )
    model = _text(record, "model", number)
    return ProviderLine(
        line=number,
        attempt_id=attempt_id,
        provider_request_id=provider_request_id,
        model=model,
        usage=Usage(
            input_tokens=_tokens(record, "input_tokens", number),
            output_tokens=_tokens(record, "output_tokens", number),
            cached_input_tokens=_tokens(record, "cached_input_tokens", number, optional=True),
        ),
        cost_usd=_money(record, "cost_usd", number),
        timestamp=_timestamp(record, "timestamp", number),
    )


def _present(value: Any) -> bool:
    return value is not None and not (isinstance(value, str) and not value.strip())


def _optional_id(record: Mapping[str, Any], field: str, line: int) -> str | None:
    value = record.get(field)
    if not _present(value):
        return None
    value = _string(value, field, line)
    if len(value) > _MAX_ID:
        raise ExportError(f"longer than {_MAX_ID} characters", line=line, field=field)
    return value


def _text(record: Mapping[str, Any], field: str, line: int) -> str:
    value = record.get(field)
    if not _present(value):
        raise ExportError("is required", line=line, field=field)
    return _string(value, field, line)


def _string(value: Any, field: str, line: int) -> str:
    if not isinstance(value, str):
        raise ExportError("must be a string", line=line, field=field)
    if "\x00" in value:  # PostgreSQL text cannot hold NUL: no attempt or model is named so
        raise ExportError("must not contain NUL characters", line=line, field=field)
    return value.strip()


def _tokens(record: Mapping[str, Any], field: str, line: int, *, optional: bool = False) -> int:
    value = record.get(field)
    if not _present(value):
        if optional:
            return 0
        raise ExportError("is required", line=line, field=field)
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        return int(value.strip())
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ExportError(f"must be a whole number >= 0, not {value!r}", line=line, field=field)


def _money(record: Mapping[str, Any], field: str, line: int) -> Decimal:
    value = record.get(field)
    if not _present(value):
        raise ExportError("is required", line=line, field=field)
    amount: Decimal | None = None
    if isinstance(value, Decimal):
        amount = value
    elif isinstance(value, int) and not isinstance(value, bool):
        amount = Decimal(value)
    elif isinstance(value, str):
        try:
            amount = Decimal(value.strip().removeprefix("$"))
        except InvalidOperation:
            amount = None
    if amount is None or not amount.is_finite():
        raise ExportError(f"not a decimal amount: {value!r}", line=line, field=field)
    if amount < 0:
        raise ExportError(f"must be >= 0, not {value}", line=line, field=field)
    if amount >= MONEY_LIMIT:
        raise ExportError(f"must be below {MONEY_LIMIT} USD, not {value}", line=line, field=field)
    # Beyond the ledger's precision a cost is rounded up, as every cost is: never understated.
    rounded = quantize(amount)
    return amount if rounded == amount else rounded


def _timestamp(record: Mapping[str, Any], field: str, line: int) -> datetime:
    value = record.get(field)
    if not _present(value):
        raise ExportError("is required", line=line, field=field)
    if not isinstance(value, str):
        raise ExportError("must be an ISO 8601 string", line=line, field=field)
    try:
        moment = datetime.fromisoformat(value.strip())
        # An offset can push the UTC time out of the calendar: as malformed as any other.
        return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    except (ValueError, OverflowError):
        raise ExportError(f"not an ISO 8601 timestamp: {value!r}", line=line, field=field) from None
