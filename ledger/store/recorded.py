"""An event as the ledger holds it: its canonical bytes, the record read back from them, and
what an append names as the version it expects.

The canonical payload is the exact bytes that are stored and hashed (contract §7): sorted-key,
compact UTF-8 JSON of the stream id, version, type, schema version, data, metadata and
recorded time. Everything a reader sees of an event is parsed from those bytes
(``decode_payload``), so what was hashed is what is read.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

import orjson

from ledger.events import Event, decode_event
from ledger.store.stored import stored_events
from ledger.support.frozen import direct_init

__all__ = [
    "ANY_VERSION",
    "NO_STREAM",
    "EncodedParts",
    "RecordedEvent",
    "WrongExpectedVersion",
    "canonical_payload",
    "decode_payload",
    "decode_row",
    "payloads_from_parts",
    "recorded_time",
]

ANY_VERSION: None = None
"""``expected_version`` that appends at the stream's end, whatever its version."""
NO_STREAM = 0
"""``expected_version`` for a stream that must not exist yet."""


class WrongExpectedVersion(Exception):
    """The stream is not at the version the caller expected; nothing was written."""

    def __init__(self, stream_id: str, expected: int, actual: int) -> None:
        super().__init__(
            f"stream {stream_id!r} is at version {actual}, not the expected {expected}: "
            "another writer appended first; nothing was written"
        )
        self.stream_id = stream_id
        self.expected = expected
        self.actual = actual

    def __reduce__(self) -> tuple[Any, ...]:  # across processes (ledger.store.shared_appends)
        return (WrongExpectedVersion, (self.stream_id, self.expected, self.actual))


@direct_init  # one per event an append writes or a reader reads
@dataclass(frozen=True, slots=True)
class RecordedEvent:
    """An event as it stands in the ledger."""

    position: int
    stream_id: str
    version: int
    type: str
    schema_version: int
    data: dict[str, Any]
    metadata: dict[str, Any]
    recorded_at: datetime
    hash: str
    payload: bytes
    _event: Event | None = field(default=None, compare=False, repr=False)

    def event(self) -> Event:
        """The typed event, upcast to the current schema version (validated once, then
        shared by every reader of this record: the events are immutable)."""
        typed = self._event
        if typed is None:
            typed = decode_event(self.type, self.schema_version, self.data)
            object.__setattr__(self, "_event", typed)
        return typed

    def as_json(self) -> dict[str, Any]:
        """The event in the query API's stable shape (contract §3)."""
        return {
            "position": self.position,
            "stream_id": self.stream_id,
            "version": self.version,
            "type": self.type,
            "schema_version": self.schema_version,
            "data": self.data,
            "metadata": self.metadata,
            "recorded_at": self.recorded_at.isoformat(),
            "hash": self.hash,
        }


def canonical_payload(
    *,
    stream_id: str,
    version: int,
    event_type: str,
    schema_version: int,
    data: Mapping[str, Any],
    metadata: Mapping[str, Any],
    recorded_at: str,
) -> bytes:
    """The exact bytes that are stored and hashed: sorted-key, compact UTF-8 JSON."""
    return orjson.dumps(
        {
            "stream_id": stream_id,
            "version": version,
            "type": event_type,
            "schema_version": schema_version,
            "data": data,
            "metadata": metadata,
            "recorded_at": recorded_at,
        },
        option=orjson.OPT_SORT_KEYS,
    )


class EncodedParts(Protocol):
    """One event of an append, its parts already JSON-encoded (``ledger.store.append``)."""

    @property
    def type_json(self) -> bytes: ...  # the type, quoted
    @property
    def schema_version(self) -> int: ...
    @property
    def data_json(self) -> bytes: ...  # sorted keys


def payloads_from_parts(
    *,
    stream_id: bytes,
    first_version: int,
    events: Sequence[EncodedParts],
    metadata: bytes,
    recorded_at: bytes,
) -> list[bytes]:
    """``canonical_payload``'s bytes of one append's events (versions ``first_version`` on),
    from parts already JSON-encoded (the ``data`` and ``metadata`` objects with sorted keys,
    the strings quoted): the append encodes each event's data once, for these bytes and for
    what its callers read alike. The keys are written in sorted order, as ``OPT_SORT_KEYS``
    writes them; the runs of bytes an append's events share are joined once."""
    after_data = b"".join(
        (b',"metadata":', metadata, b',"recorded_at":', recorded_at, b',"schema_version":')
    )
    after_schema = b"".join((b',"stream_id":', stream_id, b',"type":'))
    return [
        b"".join(
            (
                b'{"data":',
                event.data_json,
                after_data,
                b"%d" % event.schema_version,
                after_schema,
                event.type_json,
                b',"version":',
                b"%d" % version,
                b"}",
            )
        )
        for version, event in enumerate(events, first_version)
    ]


def decode_payload(position: int, hash_: str, payload: bytes) -> RecordedEvent:
    body = orjson.loads(payload)
    return RecordedEvent(
        position=position,
        stream_id=body["stream_id"],
        version=body["version"],
        type=body["type"],
        schema_version=body["schema_version"],
        data=body["data"],
        metadata=body["metadata"],
        recorded_at=recorded_time(body["recorded_at"]),
        hash=hash_,
        payload=payload,
    )


def decode_row(
    position: int, previous: bytes | None, payloads: bytes, *, after: int = 0
) -> list[RecordedEvent]:
    """The events an ``appends`` row holds (those past position ``after``), in order;
    ``previous`` is the previous row's hash (``ledger.store.stored.previous_hash``)."""
    return [
        decode_payload(at, hash_, payload)
        for at, hash_, payload in stored_events(position, previous, bytes(payloads), after=after)
    ]


# The events of one append batch share their recorded time: a page of events holds few
# distinct ones, so each is parsed once (datetimes are immutable).
recorded_time = functools.lru_cache(maxsize=256)(datetime.fromisoformat)
