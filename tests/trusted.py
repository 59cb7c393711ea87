"""What a trusted record must be: its validated twin (``ledger.values.Record.trusted``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson

from ledger.events import Event, encode_event
from ledger.values import Record, trusted_difference


def assert_same_record(fast: Record, validated: Record) -> None:
    """``fast`` is ``validated`` (``ledger.values.trusted_difference``), and an event's data
    encodes to the same bytes as recorded and hashed."""
    difference = trusted_difference(fast, validated)
    assert difference is None, difference
    if isinstance(fast, Event) and isinstance(validated, Event):
        assert orjson.dumps(encode_event(fast)) == orjson.dumps(encode_event(validated))


@contextmanager
def checked_trusted() -> Iterator[None]:
    """While open, ``Record.trusted`` builds each record validated too and asserts the two
    are the same (a value of the wrong type or out of bounds fails validation here)."""
    trusted = Record.__dict__["trusted"]
    build = trusted.__func__

    def checked(cls: type[Record], /, **values: Any) -> Record:
        fast: Record = build(cls, **values)
        assert_same_record(fast, cls(**values))
        return fast

    Record.trusted = classmethod(checked)  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        Record.trusted = trusted  # type: ignore[method-assign]
