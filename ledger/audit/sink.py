"""The checkpoint sink: a directory outside the database (contract §7).

    DIR/checkpoints-YYYY-MM-DD.jsonl   the signed checkpoints, one canonical JSON line each,
                                       in the file of their UTC day; lines are only appended
    DIR/tree/NN.hashes                 the tree's nodes of level NN (00, 08, 16, ...): node j
                                       (leaves [j·2^NN, (j+1)·2^NN)) at byte 32·j
    DIR/.lock                          held by the one process writing the sink

The checkpoint lines are what a customer, an auditor or a WORM bucket keeps: small, signed,
enough to catch any rewrite. The tree files hold the same hashes the C2SP tlog tiles hold
(every leaf hash, and every node of levels that are multiples of 8), so that an inclusion
proof is a few hundred reads rather than a pass over the ledger, and so that ``verify
--checkpoints`` can name the first position whose leaf differs. They prove nothing by
themselves: whoever reads them checks what they lead to against a signed root. Tree data
beyond the last checkpoint was never signed, and the writer drops it when it opens.

Plain, synchronous file I/O: the gateway calls it from a worker thread. Only one process
writes a sink at a time: the writer holds an exclusive ``flock`` on ``.lock`` for as long as
it is open, so a second gateway (a replica configured with the same directory on shared
storage), or ``waybill checkpoint`` while a gateway writes there, is told the sink is busy
and writes nothing. Storage without working ``flock`` needs one directory per writer.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from ledger.audit.checkpoints import Checkpoint, CheckpointFormatError, checkpoint_from_line
from ledger.audit.merkle import HASH_SIZE, perfect_root

__all__ = [
    "LEVELS",
    "SinkBusy",
    "SinkEntry",
    "SinkError",
    "SinkWriter",
    "TreeFiles",
    "checkpoint_file",
    "find_checkpoint",
    "read_sink",
]

LEVELS: Final = tuple(range(0, 64, 8))
"""The tree levels the sink keeps in full."""
_LOCK: Final = ".lock"
_TREE: Final = "tree"


class SinkError(Exception):
    """A sink directory that cannot be used as it stands."""


class SinkBusy(SinkError):
    """Another process holds the sink's lock."""


@dataclass(frozen=True, slots=True)
class SinkEntry:
    """One line of a checkpoint file: the checkpoint, or why the line is not one."""

    where: str  # "checkpoints-2026-05-01.jsonl:3"
    checkpoint: Checkpoint | None
    problem: str | None = None


def checkpoint_file(directory: Path, checkpoint: Checkpoint) -> Path:
    """The file a checkpoint's line goes to: the one of its UTC day."""
    return directory / f"checkpoints-{checkpoint.time[:10]}.jsonl"


def read_sink(directory: Path, *, strict: bool = True) -> list[SinkEntry]:
    """Every line of every ``*.jsonl`` file in ``directory``, in file-name and line order
    (several sinks' files may sit side by side). ``strict``: a last line without its
    newline is a problem (a reader racing the writer sees one; so does a damaged file);
    otherwise it is left out."""
    if not directory.is_dir():
        raise SinkError(f"{directory} is not a directory")
    entries = []
    for path in sorted(directory.glob("*.jsonl")):
        data = path.read_bytes()
        lines = data.split(b"\n")
        unterminated = lines.pop()  # b"" when the file ends with its newline
        for number, line in enumerate(lines, start=1):
            entries.append(_entry(f"{path.name}:{number}", line))
        if unterminated and strict:
            where = f"{path.name}:{len(lines) + 1}"
            entries.append(SinkEntry(where, None, "the line does not end (an incomplete write)"))
    return entries


def find_checkpoint(directory: Path, size: int | None = None) -> Checkpoint | None:
    """One sink's latest checkpoint, or its checkpoint of ``size``, reading its day files
    from the newest back only as far as needed (a sink's sizes grow with its lines; its
    lines that are not checkpoints are passed over)."""
    if not directory.is_dir():
        raise SinkError(f"{directory} is not a directory")
    for path in sorted(directory.glob("checkpoints-*.jsonl"), reverse=True):
        lines = path.read_bytes().split(b"\n")
        lines.pop()  # the part after the last newline: b"", or a line still being written
        found = [e.checkpoint for e in (_entry(path.name, line) for line in lines)]
        checkpoints = [c for c in found if c is not None]
        if size is None and checkpoints:
            return checkpoints[-1]
        for checkpoint in checkpoints:
            if checkpoint.size == size:
                return checkpoint
        if checkpoints and size is not None and checkpoints[0].size < size:
            return None  # earlier files hold only smaller trees
    return None


def _entry(where: str, line: bytes) -> SinkEntry:
    try:
        return SinkEntry(where, checkpoint_from_line(line))
    except CheckpointFormatError as error:
        return SinkEntry(where, None, f"not a checkpoint: {error}")


class TreeFiles:
    """The sink's tree files, read with ``pread`` (files grow while they are read)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory / _TREE
        self._fds: dict[int, int] = {}

    def path(self, level: int) -> Path:
        return self.directory / f"{level:02d}.hashes"

    def count(self, level: int) -> int:
        """How many whole nodes the level's file holds."""
        try:
            return self.path(level).stat().st_size // HASH_SIZE
        except FileNotFoundError:
            return 0

    @property
    def leaves(self) -> int:
        return self.count(0)

    def nodes(self, level: int, first: int, count: int) -> list[bytes] | None:
        """Nodes ``first`` .. ``first + count - 1`` of ``level``; None if the file ends
        before them."""
        fd = self._fds.get(level)
        if fd is None:
            try:
                fd = self._fds[level] = os.open(self.path(level), os.O_RDONLY)
            except FileNotFoundError:
                return None
        data = os.pread(fd, count * HASH_SIZE, first * HASH_SIZE)
        if len(data) < count * HASH_SIZE:
            return None
        return [data[i : i + HASH_SIZE] for i in range(0, len(data), HASH_SIZE)]

    def perfect(self, start: int, height: int) -> bytes | None:
        """The perfect subtree of ``2^height`` leaves from ``start``, from the nearest kept
        level at or below it (at most 128 nodes to combine); None beyond the files."""
        level = height - height % 8
        found = self.nodes(level, start >> level, 1 << (height - level))
        if found is None:
            return None
        return found[0] if len(found) == 1 else perfect_root(found)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class SinkWriter:
    """The one writer of a sink: holds its lock from :meth:`open` to :meth:`close`."""

    def __init__(self, directory: Path, lock_fd: int) -> None:
        self.directory = directory
        self._lock_fd = lock_fd
        self.tree = TreeFiles(directory)
        self.last: Checkpoint | None = None

    @classmethod
    def open(cls, directory: Path) -> SinkWriter:
        """Lock the sink (creating the directory and its parents, as `checkpoint keygen
        --out` does) and read where it stands; SinkBusy if another process holds it,
        SinkError if it is not usable."""
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(directory / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise SinkError(f"cannot use {directory}: {error.strerror or error}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise SinkBusy(f"{directory} is being written by {holder}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
        writer = cls(directory, fd)
        try:
            writer.last = writer._last_checkpoint()
            (directory / _TREE).mkdir(exist_ok=True)
        except BaseException:
            writer.close()
            raise
        return writer

    def _last_checkpoint(self) -> Checkpoint | None:
        files = sorted(self.directory.glob("checkpoints-*.jsonl"))
        if not files:
            return None
        path = files[-1]
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            # A line cut short by a crash was never a checkpoint: drop the fragment, or the
            # next line would be glued to it.
            data = data[: data.rfind(b"\n") + 1]
            os.truncate(path, len(data))
        lines = data.splitlines()
        if not lines:
            return None
        try:
            return checkpoint_from_line(lines[-1])
        except CheckpointFormatError as error:
            raise SinkError(f"the last line of {path} is not a checkpoint: {error}") from None

    def keep_tree(self, size: int) -> None:
        """Cut the tree files back to ``size`` leaves: what the last checkpoint signed."""
        for level in LEVELS:
            path = self.tree.path(level)
            if path.exists() and path.stat().st_size > (size >> level) * HASH_SIZE:
                os.truncate(path, (size >> level) * HASH_SIZE)

    def append_tree(self, kept: Mapping[int, Sequence[bytes]]) -> None:
        """Append each level's new nodes and make them durable (before the checkpoint
        that covers them is written)."""
        for level, nodes in kept.items():
            if not nodes:
                continue
            fd = os.open(self.tree.path(level), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, b"".join(nodes))
                os.fsync(fd)
            finally:
                os.close(fd)

    def append(self, checkpoint: Checkpoint) -> Path:
        """Append the checkpoint's line to its day's file, durably; returns the file."""
        path = checkpoint_file(self.directory, checkpoint)
        created = not path.exists()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, checkpoint.line())  # one write: readers never see half a line
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:
            _fsync_directory(self.directory)
        self.last = checkpoint
        return path

    def close(self) -> None:
        self.tree.close()
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = -1


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
