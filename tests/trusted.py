"""What a trusted record must be: its validated twin (``ledger.values.Record.trusted``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson

from ledger.events import Event, encode_event
from ledger.values import Record


def assert_same_record(fast: Record, validated: Record) -> None:
    """``fast`` is ``validated``: the same class, fields in the same order holding equal
    values of the same types (a list is not a tuple, a str not an enum), the same fields
    given, and the same JSON, byte for byte, as recorded and hashed."""
    assert type(fast) is type(validated)
    assert list(fast.__dict__) == list(validated.__dict__)
    for name, value in validated.__dict__.items():
        mine = fast.__dict__[name]
        assert type(mine) is type(value), (name, mine, value)
        assert mine == value, (name, mine, value)
    assert fast.model_fields_set == validated.model_fields_set
    assert fast.__pydantic_extra__ is None and validated.__pydantic_extra__ is None
    assert fast.__pydantic_private__ is None and validated.__pydantic_private__ is None
    assert fast == validated
    if isinstance(fast, Event) and isinstance(validated, Event):
        assert orjson.dumps(encode_event(fast)) == orjson.dumps(encode_event(validated))
    assert orjson.dumps(fast.model_dump(mode="json")) == orjson.dumps(
        validated.model_dump(mode="json")
    )


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
