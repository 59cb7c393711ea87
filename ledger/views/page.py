"""A page of the ledger as the read models read it: each event's position, type, recorded
data and recorded time, decoded from its row's payloads without its chain hash.

A read model folds what the events recorded (``fields_of``), not the typed events: turning
each event into its pydantic model was about half of the read-model follower's CPU, and the
hash chain (a SHA-256 per event, and a look-up of the previous row's hash per row) a tenth
more, where no read model reads either (bench/README.md, "Issue 44's levers": the read
models' page). What the ledger holds was validated when it was appended, and ``waybill
verify`` checks the chain. The typed event is still one call away (``event()``) for the
folds of rare events.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

import orjson
from pydantic import BaseModel
from pydantic_core import PydanticUndefined, to_jsonable_python

from ledger.events import CATALOGUE, Event, UnknownEventType, decode_event
from ledger.store.recorded import recorded_time
from ledger.store.stored import payloads_of

__all__ = ["DecodedEvent", "PageEvent", "decode", "decode_row", "fields_of", "with_defaults"]


class PageEvent(Protocol):
    """What a read model reads of an event: a ``DecodedEvent`` from a page, or a
    ``ledger.store.RecordedEvent``."""

    @property
    def position(self) -> int: ...
    @property
    def type(self) -> str: ...
    @property
    def schema_version(self) -> int: ...
    @property
    def data(self) -> dict[str, Any]: ...
    @property
    def recorded_at(self) -> datetime: ...
    def event(self) -> Event: ...


@dataclass(slots=True)
class DecodedEvent:
    """An event of a page. Never changed, yet not frozen: a frozen dataclass sets each field
    through ``object.__setattr__``, several times the cost, and a page makes one per event."""

    position: int
    type: str
    schema_version: int
    data: dict[str, Any]
    recorded_at: datetime
    _event: Event | None = field(default=None, repr=False, compare=False)

    def event(self) -> Event:
        """The typed event, upcast and validated on first use."""
        if self._event is None:
            self._event = decode_event(self.type, self.schema_version, self.data)
        return self._event


def decode(position: int, payload: bytes) -> DecodedEvent:
    """The event at ``position`` from its canonical payload."""
    body = orjson.loads(payload)
    return DecodedEvent(
        position,
        body["type"],
        body["schema_version"],
        body["data"],
        recorded_time(body["recorded_at"]),
    )


def decode_row(position: int, payloads: bytes, wanted: Sequence[int] | range) -> list[DecodedEvent]:
    """The events of one ``appends`` row (its first event at ``position``) at the offsets
    ``wanted`` into the row, in order."""
    inside = payloads_of(payloads)
    return [decode(position + offset, inside[offset]) for offset in wanted]


def fields_of(event: PageEvent) -> Mapping[str, Any]:
    """The event's recorded data as its type's current schema has it, with the model's
    default for each field it leaves out (``with_defaults``): the JSON values as recorded
    (amounts as decimal strings), not validated again. An event recorded at an older schema
    version is upcast and validated, as ``event()`` does: rare, and done once per page."""
    model = _model(event.type)
    if event.schema_version != model.schema_version:
        return event.event().model_dump(mode="json")
    return with_defaults(model, event.data)


def with_defaults(model: type[BaseModel], data: Mapping[str, Any]) -> Mapping[str, Any]:
    """``data``, recorded from a ``model`` (an event or a record inside one), with the
    model's default for each field it leaves out: those left out of the recorded form, and
    those added to the model after it was recorded."""
    if len(data) < _field_count(model):
        return {**_defaults(model), **data}
    return data


def _model(event_type: str) -> type[Event]:
    cls = CATALOGUE.get(event_type)
    if cls is None:
        raise UnknownEventType(event_type)
    return cls


@functools.cache
def _field_count(model: type[BaseModel]) -> int:
    return len(model.model_fields)


@functools.cache
def _defaults(model: type[BaseModel]) -> dict[str, Any]:
    # In their JSON form, as a recorded field would be (an amount as a decimal string).
    found = {}
    for name, info in model.model_fields.items():
        if info.default is not PydanticUndefined or info.default_factory is not None:
            found[name] = to_jsonable_python(info.get_default(call_default_factory=True))
    return found
