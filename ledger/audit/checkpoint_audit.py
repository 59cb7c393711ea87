"""``waybill verify --checkpoints``: the ledger's events against signed checkpoints.

Nothing in the database is trusted here: the tree is recomputed from the events' stored
bytes, in the same pass that walks the hash chain (``verify_chain``'s ``observe``), and
compared with what the checkpoints signed. For each checkpoint, in size order:

1. its line is a canonical checkpoint and its Ed25519 signature verifies with one of the
   public keys given (an unknown key fails: keys are trusted by being given, never by
   being found in the directory);
2. two checkpoints of one size agree;
3. the ledger's tree at its size has its root, and the event at that position its head
   hash: a rewrite anywhere before it, a reordering or a cut tail fails, even with the hash
   chain and the head recomputed;
4. it extends the checkpoint before it: an RFC 9162 §2.1.4 consistency proof verifies
   against the two signed roots. Its nodes come from the ledger's tree; where the ledger
   no longer matches, from the sink's tree files once they lead to the later root. A proof
   that verifies shows the two are one history whatever its nodes' source; only one made
   from tree files that lead to the later root shows they are not (a signer that forked).

The first checkpoint that fails is named, with the first position whose leaf differs from
what it signed. That position is found by descending the tree, not by a second pass: from
the root, each step compares the ledger's subtree with the one the sink's tree files hold
and goes into the leftmost half that differs. The tree files are trusted only as far as
they lead to the signed root: their root is checked against the signature first, and every
step checks that the two halves hash to the node above them. The ledger's side of each step
comes from what the pass kept (every node of level 8, and the tree's border at the failing
size); the last 256 leaves or fewer are read again. Without the tree files (a copy of the
checkpoint lines alone) the position can only be narrowed to the positions after the last
checkpoint that held, and the report says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from ledger.audit.checkpoints import Checkpoint, PublicKeys
from ledger.audit.merkle import (
    Frontier,
    blocks,
    consistency_ranges,
    event_leaf_hash,
    hash_node,
    mth,
    perfect_root,
    range_hash,
    verify_consistency,
)
from ledger.audit.sink import SinkEntry, TreeFiles
from ledger.store.db import READ_ONLY
from ledger.store.stored import read_range

__all__ = ["CheckpointAudit", "CheckpointFailure", "CheckpointReport"]

_KEPT_LEVEL = 8
_MISSING = b""  # a subtree reaching past the ledger's end: differs from any signed one


@dataclass(frozen=True, slots=True)
class CheckpointFailure:
    where: str  # "checkpoints-2026-05-01.jsonl:3"
    problem: str
    size: int | None = None
    key_id: str | None = None
    first_position: int | None = None  # the first position whose leaf differs
    # Without usable tree files: the first differing position lies in [lowest, highest],
    # if the checkpoint extends the one before it (``assumed``: that could not be shown).
    between: tuple[int, int] | None = None
    assumed: bool = False

    def as_json(self) -> dict[str, Any]:
        return {
            "where": self.where,
            "size": self.size,
            "key_id": self.key_id,
            "problem": self.problem,
            "first_differing_position": self.first_position,
            "between": list(self.between) if self.between else None,
            "between_assumes_consistency": self.assumed,
        }

    def describe(self) -> str:
        head = f"{self.where}"
        if self.size is not None:
            head += f" (size {self.size}, key {self.key_id})"
        line = f"{head}: {self.problem}"
        if self.first_position is not None:
            line += f"; first differing position: {self.first_position}"
        elif self.between is not None:
            line += (
                f"; the first differing position is between {self.between[0]} and {self.between[1]}"
            )
            if self.assumed:
                line += ", if it extends the checkpoint before it"
            line += " (no tree files in the directory to name it)"
        return line


@dataclass(frozen=True, slots=True)
class CheckpointReport:
    checkpoints: int  # lines read
    verified: int  # checkpoints that held
    largest_size: int
    key_ids: tuple[str, ...]
    failure: CheckpointFailure | None = None
    unchecked: int = 0  # beyond a break of the hash chain: not compared

    @property
    def ok(self) -> bool:
        return self.failure is None and self.unchecked == 0 and self.checkpoints > 0

    def as_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "checkpoints": self.checkpoints,
            "verified": self.verified,
            "largest_size": self.largest_size,
            "key_ids": list(self.key_ids),
            "unchecked": self.unchecked,
            "failure": self.failure.as_json() if self.failure else None,
        }


@dataclass(slots=True)
class _Planned:
    where: str
    checkpoint: Checkpoint


@dataclass(slots=True)
class _Mismatch:
    planned: _Planned
    problem: str
    border: dict[tuple[int, int], bytes] = field(default_factory=dict)
    # Extends the checkpoint before it (True), does not (False), not known (None).
    consistent: bool | None = True


class CheckpointAudit:
    """One audit: built from the sink's lines and the keys, fed every event in position
    order (:meth:`feed`), then :meth:`finish`\\ ed."""

    def __init__(
        self, entries: Sequence[SinkEntry], keys: PublicKeys, tree: TreeFiles | None
    ) -> None:
        self._lines = len(entries)
        self._tree = tree
        self._early: list[tuple[int, CheckpointFailure]] = []  # (size or 0, failure)
        by_size: dict[int, _Planned] = {}
        for entry in entries:
            checkpoint = entry.checkpoint
            if checkpoint is None:
                self._early.append((0, CheckpointFailure(entry.where, entry.problem or "")))
                continue
            problem = keys.problem(checkpoint)
            if problem is not None:
                self._early.append((checkpoint.size, _failure(entry.where, checkpoint, problem)))
                continue
            seen = by_size.get(checkpoint.size)
            if seen is None:
                by_size[checkpoint.size] = _Planned(entry.where, checkpoint)
            elif (seen.checkpoint.root, seen.checkpoint.head_hash) != (
                checkpoint.root,
                checkpoint.head_hash,
            ):
                problem = f"it and {seen.where} sign different trees of the same size"
                self._early.append((checkpoint.size, _failure(entry.where, checkpoint, problem)))
        self._plan = [by_size[size] for size in sorted(by_size)]
        self._key_ids = tuple(sorted({p.checkpoint.key_id for p in self._plan}))
        watch: set[tuple[int, int]] = set()
        for before, after in zip(self._plan, self._plan[1:], strict=False):
            for start, end in consistency_ranges(before.checkpoint.size, after.checkpoint.size):
                watch.update(
                    (height, s >> height) for s, height in blocks(start, end) if height < 8
                )
        self._frontier = Frontier(keep=(_KEPT_LEVEL,), watch=watch)
        self._next = 0  # index in the plan of the next checkpoint to reach
        self._verified = 0
        self._mismatch: _Mismatch | None = None

    @property
    def planned(self) -> bool:
        return bool(self._plan)

    @property
    def refused(self) -> list[CheckpointFailure]:
        """The lines refused before any event is read: not a checkpoint, not signed by a
        given key, or disagreeing with another of the same size."""
        return [failure for _, failure in self._early]

    def feed(self, position: int, payload: bytes, hash_: str) -> None:
        """The next event of the ledger (``verify_chain`` has checked its position)."""
        frontier = self._frontier
        frontier.append(event_leaf_hash(position, payload))
        plan = self._plan
        if self._next < len(plan) and plan[self._next].checkpoint.size == frontier.size:
            self._reached(plan[self._next], hash_)
            self._next += 1

    def _reached(self, planned: _Planned, head_hash: str) -> None:
        if self._mismatch is not None:
            return
        signed = planned.checkpoint
        root = self._frontier.root().hex()
        problems = []
        if root != signed.root:
            problems.append(
                f"the ledger's tree at size {signed.size} has root {root}, the checkpoint "
                f"signed {signed.root}"
            )
        if head_hash != signed.head_hash:
            problems.append(
                f"the ledger's head hash at position {signed.size} is {head_hash}, the "
                f"checkpoint signed {signed.head_hash}"
            )
        consistent = self._consistent(planned)
        if consistent is not True:
            before = self._plan[self._plan.index(planned) - 1]
            if consistent is False:
                problems.append(
                    f"it is not consistent with {before.where} (size "
                    f"{before.checkpoint.size}): the two signed trees are not one history"
                )
            elif not problems:  # the ledger matches both: its own proof must verify
                problems.append(f"its consistency with {before.where} could not be shown")
        problem = "; ".join(problems) or None
        if problem is None:
            self._verified += 1
            return
        border = {(s, h): node for s, h, node in self._frontier.border()}
        self._mismatch = _Mismatch(planned, problem, border, consistent)

    def _consistent(self, planned: _Planned) -> bool | None:
        """Does ``planned`` extend the checkpoint before it? None: cannot be shown."""
        index = self._plan.index(planned)
        if index == 0:
            return True
        before, after = self._plan[index - 1].checkpoint, planned.checkpoint
        ranges = consistency_ranges(before.size, after.size)
        theirs: Callable[[int, int], bytes | None] | None = None
        tree = self._tree
        if (
            tree is not None
            and tree.leaves >= after.size
            and range_hash(0, after.size, tree.perfect) == bytes.fromhex(after.root)
        ):
            theirs = tree.perfect
        for source in (self._ours, theirs):
            if source is None:
                continue
            proof = [range_hash(start, end, source) for start, end in ranges]
            hashes = [p for p in proof if p is not None]
            if len(hashes) < len(proof):
                continue
            if verify_consistency(
                before.size,
                after.size,
                bytes.fromhex(before.root),
                bytes.fromhex(after.root),
                hashes,
            ):
                return True
            if source is theirs:
                return False  # the tree that leads to the later root does not extend it
        return None

    def _ours(self, start: int, height: int) -> bytes | None:
        """A perfect subtree of the ledger's tree, from what the pass kept."""
        if height >= _KEPT_LEVEL:
            first, count = start >> _KEPT_LEVEL, 1 << (height - _KEPT_LEVEL)
            kept = self._frontier.kept[_KEPT_LEVEL]
            if first + count > len(kept):
                return None
            return perfect_root(kept[first : first + count])
        return self._frontier.caught.get((height, start >> height))

    async def finish(self, engine: AsyncEngine, *, complete: bool) -> CheckpointReport:
        """The report, once every event was fed (``complete``) or the hash chain broke (the
        checkpoints beyond the events fed are then left unchecked)."""
        ledger_size = self._frontier.size
        failure: CheckpointFailure | None = None
        unchecked = 0
        if self._mismatch is not None:
            failure = await self._locate(engine, self._mismatch, ledger_size)
        elif self._next < len(self._plan):
            if complete:
                planned = self._plan[self._next]
                problem = (
                    f"the ledger ends at position {ledger_size}, the checkpoint signed "
                    f"{planned.checkpoint.size} events"
                )
                failure = await self._locate(engine, _Mismatch(planned, problem), ledger_size)
            else:
                unchecked = len(self._plan) - self._next
        candidates = [*self._early]
        if failure is not None:
            candidates.append((failure.size or 0, failure))
        if not self._lines:
            candidates.append((0, CheckpointFailure("the directory", "it holds no checkpoints")))
        chosen = min(candidates, key=lambda c: c[0])[1] if candidates else None
        return CheckpointReport(
            checkpoints=self._lines,
            verified=self._verified,
            largest_size=self._plan[-1].checkpoint.size if self._plan else 0,
            key_ids=self._key_ids,
            failure=chosen,
            unchecked=unchecked,
        )

    async def _locate(
        self, engine: AsyncEngine, mismatch: _Mismatch, ledger_size: int
    ) -> CheckpointFailure:
        signed = mismatch.planned.checkpoint
        index = self._plan.index(mismatch.planned)
        extends = mismatch.consistent is not False
        after = self._plan[index - 1].checkpoint.size if index and extends else 0
        between = (after + 1, min(signed.size, ledger_size + 1))
        assumed = index > 0 and mismatch.consistent is None
        located = await self._descend(engine, signed, mismatch.border, ledger_size)
        problem = mismatch.problem
        if isinstance(located, int):
            return _failure(mismatch.planned.where, signed, problem, first=located)
        if located is not None:
            problem = f"{problem} ({located})"
        return _failure(mismatch.planned.where, signed, problem, between=between, assumed=assumed)

    async def _descend(
        self,
        engine: AsyncEngine,
        signed: Checkpoint,
        border: dict[tuple[int, int], bytes],
        ledger_size: int,
    ) -> int | str | None:
        """The first position whose leaf differs from the one ``signed`` covers; a reason
        the tree files cannot say; None without tree files."""
        tree = self._tree
        if tree is None or tree.leaves < signed.size:
            return None
        theirs = tree.perfect
        trusted = bytes.fromhex(signed.root)
        if range_hash(0, signed.size, theirs) != trusted:
            return "the directory's tree files do not lead to its signed root"

        def ours_perfect(start: int, height: int) -> bytes | None:
            found = self._ours(start, height)
            return found if found is not None else border.get((start, height))

        def ours(start: int, end: int) -> bytes | None:
            if end > ledger_size:
                return _MISSING
            return range_hash(start, end, ours_perfect)

        start, end = 0, signed.size
        while end - start > 1:
            mid = start + (1 << ((end - start - 1).bit_length() - 1))
            left, right = range_hash(start, mid, theirs), range_hash(mid, end, theirs)
            if left is None or right is None or hash_node(left, right) != trusted:
                return f"the directory's tree files are damaged at positions {start + 1}-{end}"
            mine = ours(start, mid)
            if mine is None:
                break
            start, end, trusted = (start, mid, left) if mine != left else (mid, end, right)
        their_leaves = tree.nodes(0, start, end - start)
        if their_leaves is None or mth(their_leaves) != trusted:
            return f"the directory's tree files are damaged at positions {start + 1}-{end}"
        our_leaves = await _leaf_hashes(engine, start + 1, min(end, ledger_size))
        for offset, theirs_leaf in enumerate(their_leaves):
            if offset >= len(our_leaves) or our_leaves[offset] != theirs_leaf:
                return start + offset + 1
        return "the ledger changed while it was being verified: verify again"


def _failure(
    where: str,
    checkpoint: Checkpoint,
    problem: str,
    *,
    first: int | None = None,
    between: tuple[int, int] | None = None,
    assumed: bool = False,
) -> CheckpointFailure:
    return CheckpointFailure(
        where,
        problem,
        checkpoint.size,
        checkpoint.key_id,
        first_position=first,
        between=between,
        assumed=assumed,
    )


async def _leaf_hashes(engine: AsyncEngine, first: int, last: int) -> list[bytes]:
    """The leaf hashes of positions ``first`` .. ``last`` as the ledger holds them now."""
    if last < first:
        return []
    async with engine.connect() as conn:
        reading = await conn.execution_options(**{READ_ONLY: True})
        found = await read_range(reading, first - 1, last, last - first + 1)
    return [event_leaf_hash(position, payload) for position, _, payload in found]
