"""The ledger's archived months: files outside the database, and their place in the chain.

``waybill archive`` (``ledger.audit.archive``) moves each whole closed month out of the
database (``ledger.store.partitions``) into one file, ``DIR/ledger-YYYY-MM.jsonl.gz`` (gzip),
and records it in ``ledger_archives``. This module is everything that reads or writes those
files, and the database's record of them: what a replay, the books' audit, ``verify`` and a
request's trail read before the live ledger. A file is the month's chain segment, line by
line:

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

import asyncio
import gzip
import hashlib
import itertools
import os
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import orjson
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from ledger.store.schema import ledger_archives
from ledger.store.stored import GENESIS_HASH, StoredEvent, chain_hash

__all__ = [
    "FORMAT",
    "ArchiveError",
    "HistoryArchived",
    "Segment",
    "SegmentWriter",
    "archived_events",
    "archived_history",
    "archived_pages",
    "archived_segments",
    "archived_stream",
    "check_directory",
    "check_segment",
    "file_name",
    "live_start",
    "read_segment",
    "write_segment",
]

FORMAT: Final = "waybill-archive/v1"


class ArchiveError(Exception):
    """An archive file that is not a month of this ledger's chain, or cannot be read."""


class HistoryArchived(Exception):
    """Work that folds every event since position 1 (a replay, the books' audit) on a
    ledger whose oldest months are archived, and no archive directory to read them from."""


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


class SegmentWriter:
    """Writes one month's file in ``directory``: to a temporary name, synced, then renamed
    by ``close``, so that a file under its name is always whole."""

    def __init__(self, directory: Path, month: str, previous_hash: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.month, self.previous_hash = month, previous_hash
        self.final = directory / file_name(month)
        self.partial = self.final.with_name(self.final.name + ".partial")
        self._raw = self.partial.open("wb")
        self._out = gzip.GzipFile(fileobj=self._raw, mode="wb", mtime=0)
        self.first: int | None = None
        self.last, self.end, self.count = 0, previous_hash, 0

    def write(self, position: int, hash_: str, payload: bytes) -> None:
        if self.first is None:
            self.first = position
            header = {
                "first_position": position,
                "format": FORMAT,
                "month": self.month,
                "previous_hash": self.previous_hash,
            }
            self._out.write(orjson.dumps(header, option=orjson.OPT_SORT_KEYS) + b"\n")
        self._out.write(b"%d %s %s\n" % (position, hash_.encode(), payload))
        self.last, self.end, self.count = position, hash_, self.count + 1

    def close(self) -> Segment:
        if self.first is None:
            self.abandon()
            raise ArchiveError(f"{self.month} has no events to archive")
        trailer = {"end_hash": self.end, "events": self.count, "last_position": self.last}
        self._out.write(orjson.dumps(trailer, option=orjson.OPT_SORT_KEYS) + b"\n")
        self._out.close()
        self._raw.flush()
        os.fsync(self._raw.fileno())
        self._raw.close()
        with self.partial.open("rb") as written:
            digest = hashlib.file_digest(written, "sha256").hexdigest()
        self.partial.rename(self.final)
        return Segment(
            self.month,
            self.first,
            self.last,
            self.previous_hash,
            self.end,
            self.count,
            self.final.name,
            digest,
        )

    def abandon(self) -> None:
        self._out.close()
        self._raw.close()
        self.partial.unlink(missing_ok=True)


def write_segment(
    directory: Path, month: str, previous_hash: str, events: Iterable[StoredEvent]
) -> Segment:
    """Write ``events`` (in position order, chained from ``previous_hash``) as ``month``'s
    file in ``directory``."""
    writer = SegmentWriter(directory, month, previous_hash)
    try:
        for position, hash_, payload in events:
            writer.write(position, hash_, payload)
    except BaseException:
        writer.abandon()
        raise
    return writer.close()


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


def archived_stream(
    directory: Path, segments: list[Segment], stream_id: str
) -> list[tuple[int, str, bytes]]:
    """The events of ``stream_id`` in the archive files, in order (a pass over each file;
    a line is parsed only if its bytes name the stream)."""
    needle = b'"stream_id":' + orjson.dumps(stream_id) + b","
    found = []
    for segment in segments:
        path = directory / segment.file
        if not path.exists():
            raise ArchiveError(f"{path}: missing (the ledger archived {segment.month} there)")
        _, events = read_segment(path)
        found += [event for event in events if needle in event[2]]
    return found


# --- the database side ---


async def archived_segments(engine: AsyncEngine) -> list[Segment]:
    """The months archived, oldest first (``ledger_archives``)."""
    t = ledger_archives.c
    async with engine.connect() as conn:
        rows = (await conn.execute(select(ledger_archives).order_by(t.last_position))).all()
    return [
        Segment(
            r.month,
            int(r.first_position),
            int(r.last_position),
            bytes(r.previous_hash).hex(),
            bytes(r.end_hash).hex(),
            int(r.events),
            r.file,
            r.sha256,
        )
        for r in rows
    ]


async def live_start(engine: AsyncEngine) -> tuple[int, str]:
    """The last archived position and its hash: the live ledger's chain goes on from there
    (0 and the genesis hash when nothing is archived)."""
    segments = await archived_segments(engine)
    if not segments:
        return 0, GENESIS_HASH
    return segments[-1].last_position, segments[-1].end_hash


async def archived_history(engine: AsyncEngine, what: str, archive: Path | None) -> list[Segment]:
    """The archived months that ``what`` (work that folds every event since position 1: a
    replay, the books' audit) reads from ``archive`` before the live ledger, their files
    checked as the chain's start (``check_directory``); none when nothing is archived.
    HistoryArchived without ``archive``; ArchiveError for a file that does not hold."""
    segments = await archived_segments(engine)
    if not segments:
        return []
    if archive is None:
        raise HistoryArchived(
            f"{what} needs every event, and positions 1-{segments[-1].last_position} are "
            "archived: give their directory (--archive or WAYBILL_ARCHIVE_DIR)"
        )
    return await asyncio.to_thread(check_directory, archive, segments)


def archived_events(directory: Path, segments: Iterable[Segment]) -> Iterator[StoredEvent]:
    """Every event of the archived months, in position order, from their files."""
    for segment in segments:
        _, events = read_segment(directory / segment.file)
        yield from events


async def archived_pages(
    directory: Path, segments: Iterable[Segment], size: int
) -> AsyncIterator[list[StoredEvent]]:
    """:func:`archived_events` in pages of ``size``, each read off the event loop."""
    events = archived_events(directory, segments)
    while page := await asyncio.to_thread(list, itertools.islice(events, size)):
        yield page


def check_directory(directory: Path, recorded: list[Segment]) -> list[Segment]:
    """Check every archived month's file in ``directory`` against its record and the chain
    from the genesis on: the files the ledger records, each whole, each following the one
    before. ArchiveError names the first that does not hold."""
    previous, checked = GENESIS_HASH, []
    for segment in recorded:
        path = directory / segment.file
        if not path.exists():
            raise ArchiveError(f"{path}: missing (the ledger archived {segment.month} there)")
        found = check_segment(path, previous_hash=previous)
        if found != segment:
            raise ArchiveError(f"{path}: is not the {segment.month} the ledger archived")
        previous = found.end_hash
        checked.append(found)
    return checked
