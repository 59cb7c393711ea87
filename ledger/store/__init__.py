"""The ledger's event store: append-only, hash-chained, on PostgreSQL or SQLite.

What lives where:

- ``event_store``: ``EventStore``, one per process, what the rest of Waybill calls: appends,
  reads (``head``, ``read_all``, ``read_stream``, ``iterate``), commit listeners.
- ``append``: the append path, how an event gets into the ledger: checked and encoded once,
  queued, committed in batches by one task (group commit), each append decided on its own,
  ordered and hashed onto the chain (``decide``); and the one-method ``Committer`` interface
  that the backends implement.
- ``postgres`` and ``sqlite``: one committer per backend (the ledger's lock, its SQL); the
  workers of ``waybill serve --workers N`` commit through the first worker's appender with
  the forwarding committer of ``shared_appends``.
- ``recorded``: an event as the ledger holds it (``RecordedEvent``), its canonical bytes,
  and the expected versions an append may name.
- ``stored`` and ``_dictionary``: the stored form, one compressed row per append; ``schema``
  the tables; ``db`` URLs, engines, migrations and the classification of database errors;
  ``reads`` the raw asyncpg edge of the hot path; ``partitions`` the months of the ledger on
  PostgreSQL; ``tail`` the wake-ups of readers that follow it.
"""

from ledger.store.db import LedgerUnavailable
from ledger.store.event_store import EventStore
from ledger.store.recorded import (
    ANY_VERSION,
    NO_STREAM,
    RecordedEvent,
    WrongExpectedVersion,
    canonical_payload,
    decode_payload,
    decode_row,
)
from ledger.store.stored import GENESIS_HASH, chain_hash

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
