"""Archived months of the ledger: files outside the database, and their place in the chain.

``waybill archive --before DATE --to DIR`` (PostgreSQL) writes each whole closed month
before DATE as one file, ``DIR/ledger-YYYY-MM.jsonl.gz`` (gzip), then detaches and drops
the month's table (``ledger.partitions``) and records it in ``ledger_archives``. A file is
the month's chain segment, line by line:

- a header, ``{"first_position", "format": "waybill-archive/v1", "month", "previous_hash"}``;
- each event as ``<position> <hash> <canonical payload>`` (the stored bytes, byte for byte:
  compact JSON holds no newline);
- a trailer, ``{"end_hash", "events", "last_position"}`` (a file cut short has none).

The months archived must be the ledger's oldest, in order, each one's positions following
the previous one's: the live ledger then starts at the last one's end, and its first row's
chain starts from that end hash. ``check_segment`` re-derives a file's chain from its
header's hash to its trailer's.
"""

from __future__ import annotations

import gzip
import hashlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import orjson

from ledger.stored import GENESIS_HASH, StoredEvent, chain_hash

__all__ = [
    "FORMAT",
    "ArchiveError",
    "Segment",
    "check_segment",
    "file_name",
    "read_segment",
    "write_segment",
]

FORMAT: Final = "waybill-archive/v1"


class ArchiveError(Exception):
    """An archive file that is not a month of this ledger's chain, or cannot be read."""


@dataclass(frozen=True, slots=True)
class Segment:
    """One archived month, as ``ledger_archives`` records it."""

    month: str
    first_position: int
    last_position: int
    previous_hash: str
    end_hash: str
    events: int
    file: str
    sha256: str


def file_name(month: str) -> str:
    return f"ledger-{month}.jsonl.gz"


def write_segment(
    directory: Path, month: str, previous_hash: str, events: Iterable[StoredEvent]
) -> Segment:
    """Write ``events`` (in position order, chained from ``previous_hash``) as ``month``'s
    file in ``directory``: to a temporary name, synced, then renamed, so that a file under
    its name is always whole."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / file_name(month)
    partial = final.with_suffix(".partial")
    first = last = None
    end, count = previous_hash, 0
    with partial.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as out:
        for position, hash_, payload in events:
            if first is None:
                first = position
                header = {
                    "first_position": position,
                    "format": FORMAT,
                    "month": month,
                    "previous_hash": previous_hash,
                }
                out.write(orjson.dumps(header, option=orjson.OPT_SORT_KEYS) + b"\n")
            out.write(b"%d %s %s\n" % (position, hash_.encode(), payload))
            last, end, count = position, hash_, count + 1
        if first is None or last is None:
            raise ArchiveError(f"{month} has no events to archive")
        trailer = {"end_hash": end, "events": count, "last_position": last}
        out.write(orjson.dumps(trailer, option=orjson.OPT_SORT_KEYS) + b"\n")
    with partial.open("rb") as written:
        os.fsync(written.fileno())
        digest = hashlib.file_digest(written, "sha256").hexdigest()
    partial.rename(final)
    return Segment(month, first, last, previous_hash, end, count, final.name, digest)


def read_segment(path: Path) -> tuple[dict[str, object], Iterator[StoredEvent]]:
    """A file's header and its events (the trailer is checked when they run out)."""
    stream = gzip.open(path, "rb")  # noqa: SIM115 - closed by the generator
    try:
        header = orjson.loads(stream.readline())
    except (OSError, orjson.JSONDecodeError, EOFError) as error:
        stream.close()
        raise ArchiveError(f"{path}: not an archive file ({error})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        stream.close()
        raise ArchiveError(f"{path}: not a {FORMAT} file")

    def events() -> Iterator[StoredEvent]:
        with stream:
            for line in stream:
                if line.startswith(b"{"):
                    trailer = orjson.loads(line)
                    header["trailer"] = trailer
                    return
                position, hash_, payload = line.rstrip(b"\n").split(b" ", 2)
                yield int(position), hash_.decode(), payload
            raise ArchiveError(f"{path}: cut short (no trailer)")

    return header, events()


def check_segment(path: Path, *, previous_hash: str | None = None) -> Segment:
    """Re-derive ``path``'s chain: from its header's hash (or ``previous_hash``, the end of
    the month before) through every event to its trailer. ArchiveError names the first
    position that does not hold."""
    header, events = read_segment(path)
    start = str(header["previous_hash"])
    if previous_hash is not None and start != previous_hash:
        raise ArchiveError(f"{path}: does not follow the month before it (hash {start})")
    expected = int(str(header["first_position"]))
    chained, count = start or GENESIS_HASH, 0
    try:
        for position, hash_, payload in events:
            if position != expected:
                raise ArchiveError(f"{path}: position {expected} is missing")
            chained = chain_hash(chained, position, payload)
            if chained != hash_:
                raise ArchiveError(f"{path}: position {position}: hash does not match")
            expected, count = expected + 1, count + 1
    except (OSError, EOFError, ValueError) as error:
        raise ArchiveError(f"{path}: unreadable at position {expected} ({error})") from None
    trailer = header.get("trailer")
    if not isinstance(trailer, dict) or trailer.get("end_hash") != chained:
        raise ArchiveError(f"{path}: its end hash is not its chain's")
    with path.open("rb") as file:
        digest = hashlib.file_digest(file, "sha256").hexdigest()
    return Segment(
        str(header["month"]),
        int(str(header["first_position"])),
        expected - 1,
        start,
        chained,
        count,
        path.name,
        digest,
    )
