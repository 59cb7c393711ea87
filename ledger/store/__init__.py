"""The event store (moving: the append path now lives in ``ledger.store.append``)."""

from ledger.store.append import (
    ANY_VERSION,
    GENESIS_HASH,
    NO_STREAM,
    EventStore,
    LedgerUnavailable,
    RecordedEvent,
    WrongExpectedVersion,
    canonical_payload,
    chain_hash,
    decode_payload,
    decode_row,
)

__all__ = [
    "ANY_VERSION",
    "GENESIS_HASH",
    "NO_STREAM",
    "EventStore",
    "LedgerUnavailable",
    "RecordedEvent",
    "WrongExpectedVersion",
    "canonical_payload",
    "chain_hash",
    "decode_payload",
    "decode_row",
]
