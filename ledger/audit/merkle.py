"""The ledger's Merkle tree, hashed as RFC 9162 §2.1 does: pure functions, no I/O.

The tree's leaves are the ledger's events in position order; leaf ``i`` is the event at
position ``i + 1``, and its leaf bytes are that position as 8 big-endian bytes followed by
the event's stored canonical payload (contract §7):

    leaf hash = SHA-256(0x00 ‖ position (8 bytes, big-endian) ‖ payload)
    node hash = SHA-256(0x01 ‖ left ‖ right)

so any RFC 6962 / RFC 9162 tool checks it once given those leaf bytes. The tree of size
``n`` is the RFC's MTH(D[0:n]): split at the largest power of two below ``n``, left subtree
perfect, recursively. Hence every subtree this module names is either *perfect* (``2^h``
leaves starting at a multiple of ``2^h``: a node at level ``h``, index ``start >> h``) or a
*right edge* ``[a, n)`` made of perfect blocks of decreasing size.

- :class:`Frontier` keeps the tree's right border (one perfect subtree per set bit of the
  size), so appending a leaf costs O(log n) hashes at worst and one on average, and the
  root at any size is O(log n) away. It can keep the nodes of chosen levels as they form
  (the sink's tree files) and catch chosen nodes (what a proof needs) in the same pass.
- :func:`inclusion_ranges` and :func:`consistency_ranges` say which subtrees an RFC 9162
  §2.1.3.1 inclusion proof or §2.1.4.1 consistency proof is made of, in the RFC's order;
  :func:`range_hash` computes one from whatever source of perfect subtrees there is.
- :func:`root_from_inclusion_proof` and :func:`verify_consistency` are the RFC's
  verification algorithms (§2.1.3.2, §2.1.4.2) step by step, with the edge cases
  (equal sizes, size 0) as the transparency-dev reference verifier treats them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from typing import Final

__all__ = [
    "EMPTY_ROOT",
    "HASH_SIZE",
    "Frontier",
    "PerfectSource",
    "ProofError",
    "blocks",
    "consistency_ranges",
    "event_leaf_hash",
    "hash_leaf",
    "hash_node",
    "inclusion_ranges",
    "mth",
    "perfect_root",
    "range_hash",
    "root_from_inclusion_proof",
    "verify_consistency",
    "verify_inclusion",
]

HASH_SIZE: Final = 32
EMPTY_ROOT: Final = hashlib.sha256(b"").digest()
"""MTH({}) = SHA-256() (RFC 9162 §2.1.1)."""

_sha256 = hashlib.sha256
# Each hash starts from a copy of its prefix's state: cheaper than hashing a concatenation
# (bench/README.md, "Decisions"), and the tree costs one leaf and about one node hash per
# event.
_LEAF_PREFIX = hashlib.sha256(b"\x00")
_NODE_PREFIX = hashlib.sha256(b"\x01")

PerfectSource = Callable[[int, int], bytes | None]
"""``(start, height) -> hash`` of the perfect subtree of ``2^height`` leaves from ``start``,
or None when the source does not hold it."""


class ProofError(ValueError):
    """A proof that does not fit the sizes it claims to be for."""


def hash_leaf(data: bytes) -> bytes:
    """RFC 9162's leaf hash: SHA-256(0x00 ‖ data)."""
    return _sha256(b"\x00" + data).digest()


def event_leaf_hash(position: int, payload: bytes) -> bytes:
    """The leaf hash of the event stored at ``position`` with these canonical bytes."""
    digest = _LEAF_PREFIX.copy()
    digest.update(position.to_bytes(8, "big"))
    digest.update(payload)
    return digest.digest()


def hash_node(left: bytes, right: bytes) -> bytes:
    """RFC 9162's interior node hash: SHA-256(0x01 ‖ left ‖ right)."""
    digest = _NODE_PREFIX.copy()
    digest.update(left)
    digest.update(right)
    return digest.digest()


def _split(n: int) -> int:
    """The largest power of two smaller than ``n`` (n > 1): where MTH splits D[0:n]."""
    return 1 << ((n - 1).bit_length() - 1)


def mth(leaves: Sequence[bytes]) -> bytes:
    """MTH over leaf hashes, straight from the RFC's recursive definition (for tests and
    small trees; :class:`Frontier` is the incremental way)."""
    if not leaves:
        return EMPTY_ROOT
    if len(leaves) == 1:
        return leaves[0]
    k = _split(len(leaves))
    return hash_node(mth(leaves[:k]), mth(leaves[k:]))


def perfect_root(hashes: Sequence[bytes]) -> bytes:
    """The root of a perfect subtree from its ``2^k`` nodes of one level, left to right."""
    level = list(hashes)
    if not level or len(level) & (len(level) - 1):
        raise ValueError(f"a perfect subtree has 2^k nodes on a level, not {len(level)}")
    while len(level) > 1:
        level = [hash_node(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def blocks(start: int, end: int) -> list[tuple[int, int]]:
    """``[start, end)`` as perfect subtrees ``(start, height)`` of decreasing size, as MTH
    splits it: the subtrees of an RFC proof are all of this shape."""
    found = []
    while start < end:
        height = (end - start).bit_length() - 1
        found.append((start, height))
        start += 1 << height
    return found


def range_hash(start: int, end: int, perfect: PerfectSource) -> bytes | None:
    """MTH of the leaves ``[start, end)`` from ``perfect``; None if it lacks a block."""
    hashes = []
    for block_start, height in blocks(start, end):
        found = perfect(block_start, height)
        if found is None:
            return None
        hashes.append(found)
    if not hashes:
        return EMPTY_ROOT
    root = hashes[-1]
    for left in reversed(hashes[:-1]):
        root = hash_node(left, root)
    return root


class Frontier:
    """The right border of the tree over the leaves appended so far.

    ``keep``: levels whose every node is kept, in index order, as it forms (``kept[level]``:
    the caller drains them). ``watch``: nodes ``(level, index)`` to catch as they form
    (``caught``). Level 0 is the leaves themselves."""

    __slots__ = ("_border", "_observing", "caught", "keep", "kept", "size", "watch")

    def __init__(
        self,
        size: int = 0,
        border: Iterable[bytes] = (),
        *,
        keep: Iterable[int] = (),
        watch: Iterable[tuple[int, int]] = (),
    ) -> None:
        self.size = size
        self._border = list(border)  # one hash per set bit of size, highest bit first
        if len(self._border) != bin(size).count("1"):
            raise ValueError(f"a border of size {size} holds {bin(size).count('1')} hashes")
        self.keep = frozenset(keep)
        self.kept: dict[int, list[bytes]] = {level: [] for level in self.keep}
        self.watch = frozenset(watch)
        self.caught: dict[tuple[int, int], bytes] = {}
        self._observing = bool(self.keep or self.watch)

    @classmethod
    def from_source(
        cls, size: int, perfect: PerfectSource, *, keep: Iterable[int] = ()
    ) -> Frontier:
        """The frontier at ``size`` from a source holding the border's perfect subtrees."""
        border = []
        for start, height in blocks(0, size):
            found = perfect(start, height)
            if found is None:
                raise ValueError(f"no hash for the subtree of 2^{height} leaves from {start}")
            border.append(found)
        return cls(size, border, keep=keep)

    def append(self, leaf: bytes) -> None:
        """Add the next leaf hash: O(log n) at worst, one node hash on average."""
        border = self._border
        index = self.size
        self.size = index + 1
        node = leaf
        if not self._observing:
            while index & 1:
                node = hash_node(border.pop(), node)
                index >>= 1
            border.append(node)
            return
        level = 0
        self._observe(0, index, node)
        while index & 1:
            node = hash_node(border.pop(), node)
            index >>= 1
            level += 1
            self._observe(level, index, node)
        border.append(node)

    def _observe(self, level: int, index: int, node: bytes) -> None:
        if level in self.keep:
            self.kept[level].append(node)
        if (level, index) in self.watch:
            self.caught[(level, index)] = node

    def root(self) -> bytes:
        """MTH of the leaves so far."""
        border = self._border
        if not border:
            return EMPTY_ROOT
        root = border[-1]
        for left in reversed(border[:-1]):
            root = hash_node(left, root)
        return root

    def border(self) -> list[tuple[int, int, bytes]]:
        """The border's subtrees: ``(start, height, hash)``, left to right."""
        return [
            (start, height, node)
            for (start, height), node in zip(blocks(0, self.size), self._border, strict=True)
        ]


# --- which subtrees a proof is made of (RFC 9162 §2.1.3.1 and §2.1.4.1) -------------------


def inclusion_ranges(index: int, size: int) -> list[tuple[int, int]]:
    """PATH(index, D[0:size]): the subtrees ``[start, end)`` whose hashes prove leaf
    ``index``, deepest first."""
    if not 0 <= index < size:
        raise ProofError(f"leaf {index} is not in a tree of size {size}")
    path: list[tuple[int, int]] = []
    start, end = 0, size
    while end - start > 1:
        k = _split(end - start)
        if index < start + k:
            path.append((start + k, end))
            end = start + k
        else:
            path.append((start, start + k))
            start += k
    path.reverse()
    return path


def consistency_ranges(size1: int, size2: int) -> list[tuple[int, int]]:
    """PROOF(size1, D[0:size2]): the subtrees ``[start, end)`` proving that the tree of
    ``size2`` leaves extends the one of ``size1``; empty when size1 is 0 or equal."""
    if not 0 <= size1 <= size2:
        raise ProofError(f"no consistency proof from size {size1} to size {size2}")
    if size1 == 0 or size1 == size2:
        return []
    proof: list[tuple[int, int]] = []
    start, end, m, whole = 0, size2, size1, True
    while m != end - start:
        k = _split(end - start)
        if m <= k:
            proof.append((start + k, end))
            end = start + k
        else:
            proof.append((start, start + k))
            start, m, whole = start + k, m - k, False
    if not whole:
        proof.append((start, end))  # SUBPROOF(m, D[m], false) = {MTH(D[m])}
    proof.reverse()
    return proof


# --- verification (RFC 9162 §2.1.3.2 and §2.1.4.2) ---------------------------------------


def root_from_inclusion_proof(index: int, size: int, leaf: bytes, proof: Sequence[bytes]) -> bytes:
    """The root an inclusion proof leads to, by §2.1.3.2; ProofError if the proof does not
    fit the index and size (too long, too short, a hash of the wrong size)."""
    if not 0 <= index < size:
        raise ProofError(f"leaf index {index} is not below the tree size {size}")
    if len(leaf) != HASH_SIZE or any(len(p) != HASH_SIZE for p in proof):
        raise ProofError("every hash is 32 bytes")
    fn, sn, r = index, size - 1, leaf
    for p in proof:
        if sn == 0:
            raise ProofError("the proof is longer than the path to the root")
        if fn & 1 or fn == sn:
            r = hash_node(p, r)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            r = hash_node(r, p)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise ProofError("the proof is shorter than the path to the root")
    return r


def verify_inclusion(
    index: int, size: int, leaf: bytes, proof: Sequence[bytes], root: bytes
) -> bool:
    try:
        return root_from_inclusion_proof(index, size, leaf, proof) == root
    except ProofError:
        return False


def verify_consistency(
    size1: int, size2: int, root1: bytes, root2: bytes, proof: Sequence[bytes]
) -> bool:
    """Does the tree of ``size2`` with ``root2`` extend the one of ``size1`` with
    ``root1``? §2.1.4.2 for 0 < size1 < size2; equal sizes need equal roots and an empty
    proof, and any tree extends the empty one (with an empty proof)."""
    if size1 < 0 or size2 < size1:
        return False
    if any(len(p) != HASH_SIZE for p in proof):
        return False
    if size1 == size2:
        return not proof and root1 == root2
    if size1 == 0:
        return not proof
    if not proof:
        return False
    path = list(proof)
    if size1 & (size1 - 1) == 0:  # size1 is a power of two: its root is a node of the path
        path.insert(0, root1)
    fn, sn = size1 - 1, size2 - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr = hash_node(c, fr)
            sr = hash_node(c, sr)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            sr = hash_node(sr, c)
        fn >>= 1
        sn >>= 1
    return sn == 0 and fr == root1 and sr == root2
