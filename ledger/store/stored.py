"""The stored form of the ledger: one row per append, its events' canonical bytes compressed.

An append is one stream's consecutive events, recorded together: consecutive positions and
versions, one recorded time, one metadata (``ledger.store``). The ledger keeps it as one row
of ``appends`` (``ledger.store.schema``):

- ``position`` and ``version``: its first event's; the others follow, one each;
- ``stream_id`` and ``recorded_at``, which all its events share;
- ``types``: one character per event, in order (``TYPE_CHARS``), so that SQL can count a row's
  events (``length(types)``) and find the rows holding a type (``types LIKE '%C%'``);
- ``hash``: its last event's chain hash (32 bytes); the others are derived from the previous
  row's, as the chain defines them (``stored_events``);
- ``payloads``: each event's canonical payload — the exact bytes that were hashed — joined by
  newlines (compact JSON holds none), compressed (a format byte first, ``compress``).

Everything else a reader sees of an event (its data, metadata, type, schema version) is read
from those bytes; ``waybill verify`` checks the row's columns against them. Why this form: the
queryable copies of each event's data (``data`` and ``metadata`` as JSON beside the bytes) and
one row and index entry per event were most of a request's size on disk; the bytes of an
append's events share most of their text with each other and with other requests' events,
which a deflate with a preset dictionary of typical events (``ledger.store._dictionary``)
removes (see bench/README.md, Ledger size).
"""

from __future__ import annotations

import hashlib
import struct
import threading
import zlib
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Final

import zstandard
from sqlalchemy import ColumnElement, Label, func, literal_column, or_, select
from sqlalchemy.ext.asyncio import AsyncConnection

from ledger.store._dictionary import DICTIONARY_1
from ledger.store.schema import appends, ledger_archives

__all__ = [
    "FROM_POSITION_SQL",
    "GENESIS_HASH",
    "HASH_SIZE",
    "PREVIOUS_SQL",
    "TYPE_CHARACTERS",
    "TYPE_CHARS",
    "StoredEvent",
    "chain_digest",
    "chain_hash",
    "compress",
    "count_types",
    "from_position",
    "holding",
    "payloads_of",
    "previous_hash",
    "read_range",
    "row_of",
    "stored_events",
    "type_char",
    "types_of",
]

HASH_SIZE: Final = 32
GENESIS_HASH: Final = "0" * 64

# One character per event type, for ever: rows are written with them. A type added to the
# catalogue takes the next character of TYPE_CHARACTERS; none is ever reused or moved. Upper-case
# letters and digits only: SQLite's LIKE ignores case, and neither `%` nor `_` may appear.
TYPE_CHARS: Final[Mapping[str, str]] = {
    "RequestReceived": "A",
    "RouteEvaluated": "B",
    "BudgetReserved": "C",
    "BudgetReservationDenied": "D",
    "AttemptStarted": "E",
    "StreamCommitted": "F",
    "AttemptFinished": "G",
    "FailoverDecided": "H",
    "BudgetSettled": "I",
    "BudgetReleased": "J",
    "BudgetOverrun": "K",
    "UnknownUsageOpened": "L",
    "UnknownUsageSettled": "M",
    "RequestCompleted": "N",
    "RequestFailed": "O",
    "BreakerTransitioned": "P",
    "ReconciliationImported": "Q",
    "KeyCreated": "R",
    "KeyRevoked": "S",
    "ConfigActivated": "T",
    "PeriodClosed": "U",
    "PeriodAdjusted": "V",
    "CheckpointTaken": "W",
    "EndpointDisabled": "X",
    "EndpointEnabled": "Y",
    "RateLimitExceeded": "Z",
}
TYPE_CHARACTERS: Final = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
_TYPE_OF: Final = {char: name for name, char in TYPE_CHARS.items()}

# A row's payloads: format 0, the joined bytes as they are; format 1, raw deflate (RFC 1951)
# against DICTIONARY_1 in a 16 KB window, written until 2026-12-07 and still read; format 2,
# written since, one Zstandard frame (RFC 8878) against DICTIONARY_1 as raw content, without
# the frame's magic number (the format byte says what follows), checksum or dictionary id,
# with its content size. Level 5 takes fewer instructions than deflate at level 3 did, for
# smaller rows; levels 3 and 4 take fewer still, but level 3's rows are larger than deflate's
# and level 4's barely smaller, and the ledger's size per request has no room to give (see
# bench/README.md, Decisions: "Issue 44's levers for short requests"). The level is the
# writer's alone: any level's rows decompress the same way.
_RAW, _DEFLATE_1, _ZSTD_2 = 0, 1, 2
_FORMAT_2: Final = bytes((_ZSTD_2,))
_WINDOW_BITS: Final = -14
_ZSTD_LEVEL: Final = 5
_ZSTD_DICTIONARY: Final = zstandard.ZstdCompressionDict(
    DICTIONARY_1, dict_type=zstandard.DICT_TYPE_RAWCONTENT
)
_ZSTD_DICTIONARY.precompute_compress(level=_ZSTD_LEVEL)  # primed once, shared by every row
_ZSTD_PARAMETERS: Final = zstandard.ZstdCompressionParameters(
    # The other parameters are left to zstd, chosen by each row's size.
    compression_level=_ZSTD_LEVEL,
    format=zstandard.FORMAT_ZSTD1_MAGICLESS,
    write_content_size=1,
    write_checksum=0,
    write_dict_id=0,
)
# A Zstandard context serves one call at a time: one per thread (the SQLite backend decides
# and reads on threads of its own).
_contexts = threading.local()


def _zstd_compress() -> Callable[[bytes | memoryview], bytes]:
    try:
        return _contexts.compress  # type: ignore[no-any-return]
    except AttributeError:
        compressor = zstandard.ZstdCompressor(
            dict_data=_ZSTD_DICTIONARY, compression_params=_ZSTD_PARAMETERS
        )
        _contexts.compress = compressor.compress
        return compressor.compress


def _zstd_decompress() -> Callable[[bytes | memoryview], bytes]:
    try:
        return _contexts.decompress  # type: ignore[no-any-return]
    except AttributeError:
        decompressor = zstandard.ZstdDecompressor(
            dict_data=_ZSTD_DICTIONARY, format=zstandard.FORMAT_ZSTD1_MAGICLESS
        )
        _contexts.decompress = decompressor.decompress
        return decompressor.decompress


StoredEvent = tuple[int, str, bytes]
"""An event as its row holds it: position, chain hash (hex) and canonical payload."""


def chain_hash(previous_hash: str, position: int, payload: bytes) -> str:
    """The chain's hash of the event at ``position`` (contract §7), in hex."""
    return chain_digest(bytes.fromhex(previous_hash), position, payload).hex()


def chain_digest(previous: bytes, position: int, payload: bytes) -> bytes:
    """``chain_hash`` as its 32 bytes, from the previous event's: an append chains its events
    without a hex round trip per event (the ``appends`` row keeps the last one's bytes)."""
    digest = _sha256(previous)
    digest.update(_POSITION(position))
    digest.update(payload)
    return digest.digest()


_sha256: Final = hashlib.sha256
_POSITION: Final = struct.Struct(">Q").pack  # 8 bytes, big-endian


def type_char(event_type: str) -> str:
    try:
        return TYPE_CHARS[event_type]
    except KeyError:
        raise ValueError(f"event type {event_type!r} has no stored character") from None


def compress(payloads: Sequence[bytes]) -> bytes:
    """The ``payloads`` column of a row holding these canonical payloads (format 2)."""
    return _FORMAT_2 + _zstd_compress()(b"\n".join(payloads))


def payloads_of(column: bytes) -> list[bytes]:
    """The canonical payloads a row's ``payloads`` column holds, in order (any format)."""
    body = memoryview(column)[1:]
    if column[0] == _ZSTD_2:
        try:
            joined = _zstd_decompress()(body)
        except zstandard.ZstdError as error:  # as a damaged deflate stream's zlib.error
            raise ValueError(f"stored payloads cannot be decompressed: {error}") from None
    elif column[0] == _DEFLATE_1:
        inflater = zlib.decompressobj(_WINDOW_BITS, zdict=DICTIONARY_1)
        joined = inflater.decompress(body) + inflater.flush()
    elif column[0] == _RAW:
        joined = bytes(body)
    else:
        raise ValueError(f"stored payloads in an unknown format ({column[0]})")
    return joined.split(b"\n")


def row_of(
    position: int,
    stream_id: str,
    version: int,
    types: Sequence[str],
    recorded_at: Any,
    last_hash: bytes,
    payloads: Sequence[bytes],
) -> dict[str, Any]:
    """The ``appends`` row of one append's events (``last_hash``: the last one's chain hash,
    its 32 bytes)."""
    try:
        chars = "".join([TYPE_CHARS[t] for t in types])
    except KeyError as error:
        raise ValueError(f"event type {error.args[0]!r} has no stored character") from None
    return {
        "position": position,
        "recorded_at": recorded_at,
        "version": version,
        "stream_id": stream_id,
        "types": chars,
        "hash": last_hash,
        "payloads": compress(payloads),
    }


def stored_events(
    position: int, previous: bytes | None, payloads: bytes, *, after: int = 0
) -> list[StoredEvent]:
    """The events of one row with positions past ``after``, their hashes chained from
    ``previous``, the previous row's ``hash`` (None: the row is the ledger's first). Not a
    check: ``waybill verify`` compares the last with the row's own."""
    chained = GENESIS_HASH if previous is None else bytes(previous).hex()
    found = []
    for offset, payload in enumerate(payloads_of(payloads)):
        chained = chain_hash(chained, position + offset, payload)
        if position + offset > after:
            found.append((position + offset, chained, payload))
    return found


def types_of(types: str) -> list[str]:
    """A row's ``types`` column as the events' type names."""
    try:
        return [_TYPE_OF[char] for char in types]
    except KeyError as error:
        raise ValueError(f"unknown stored event type {error.args[0]!r}") from None


def holding(event_type: str) -> ColumnElement[bool]:
    """Rows that hold an event of ``event_type`` (a literal, so that PostgreSQL and SQLite
    match it to a partial index written the same way)."""
    return appends.c.types.like(literal_column(f"'%{type_char(event_type)}%'"))


def previous_hash() -> Label[bytes | None]:
    """The previous row's ``hash``, as the column ``previous`` of a query of ``appends``
    (one probe of the primary key); for the first row, the end hash of the last month
    archived (``ledger.audit.archive``), or None: the genesis."""
    before = appends.alias("before")
    row = (
        select(before.c.hash)
        .where(before.c.position < appends.c.position)
        .order_by(before.c.position.desc())
        .limit(1)
        .scalar_subquery()
    )
    archived = (
        select(ledger_archives.c.end_hash)
        .order_by(ledger_archives.c.last_position.desc())
        .limit(1)
        .scalar_subquery()
    )
    return func.coalesce(row, archived).label("previous")


PREVIOUS_SQL: Final = (
    "coalesce((SELECT before.hash FROM appends before WHERE before.position < appends.position "
    "ORDER BY before.position DESC LIMIT 1), (SELECT end_hash FROM ledger_archives "
    "ORDER BY last_position DESC LIMIT 1)) AS previous"
)
"""``previous_hash`` as SQL text, for a query of ``appends`` (not aliased)."""


def from_position(after: int) -> ColumnElement[bool]:
    """Rows holding events past ``after``: the one that holds ``after + 1``, and every later
    one (two probes of the primary key; positions have no gaps)."""
    first = (
        select(func.coalesce(func.max(appends.c.position), 0))
        .where(appends.c.position <= after + 1)
        .scalar_subquery()
    )
    return appends.c.position >= first


async def read_range(conn: AsyncConnection, after: int, last: int, rows: int) -> list[StoredEvent]:
    """The events at positions ``after`` + 1 .. ``last`` held by at most ``rows`` rows from
    the one holding ``after`` + 1 on (fewer than asked only where the ledger ends)."""
    a = appends.c
    result = await conn.execute(
        select(a.position, previous_hash(), a.payloads)
        .where(from_position(after), a.position <= last)
        .order_by(a.position)
        .limit(rows)
    )
    found: list[StoredEvent] = []
    for position, previous, payloads in result:
        found += stored_events(position, previous, bytes(payloads), after=after)
    return [event for event in found if event[0] <= last]


async def count_types(conn: AsyncConnection, event_types: Collection[str]) -> dict[str, int]:
    """How many events of each of ``event_types`` the ledger holds (a pass over the rows
    holding any: for tools and checks, not the request path)."""
    chars = {type_char(t): t for t in event_types}
    counts = dict.fromkeys(event_types, 0)
    query = select(appends.c.types).where(or_(*(holding(t) for t in event_types)))
    for (types,) in await conn.execute(query):
        for char in types:
            if char in chars:
                counts[chars[char]] += 1
    return counts


FROM_POSITION_SQL: Final = (
    "position >= (SELECT coalesce(max(position), 0) FROM appends WHERE position <= {after} + 1)"
)
"""``from_position`` as SQL text, ``{after}`` being the parameter's placeholder."""
