"""The ledger's Merkle tree (ledger/audit/merkle.py) against RFC 9162 §2.1: known answers from the
reference implementation's test vectors, and properties over any size."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.audit.merkle import (
    EMPTY_ROOT,
    Frontier,
    blocks,
    consistency_ranges,
    event_leaf_hash,
    hash_leaf,
    hash_node,
    inclusion_ranges,
    mth,
    perfect_root,
    range_hash,
    root_from_inclusion_proof,
    verify_consistency,
    verify_inclusion,
)

# The RFC 6962 test tree of transparency-dev/merkle (proof/verify_test.go): eight leaves'
# data, the root of each size 1..8, and proofs between them.
KAT_LEAVES = [bytes.fromhex(h) for h in ("", "00", "10", "2021", "3031", "40414243",
              "5051525354555657", "606162636465666768696a6b6c6d6e6f")]  # fmt: skip
KAT_ROOTS = [
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
]
KAT_INCLUSION = [  # (1-based leaf, tree size, proof)
    (1, 1, []),
    (1, 8, ["96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"]),
    (6, 8, ["bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"]),
    (3, 3, ["fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125"]),
    (2, 5, ["6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"]),
]  # fmt: skip
KAT_CONSISTENCY = [  # (size1, size2, proof)
    (1, 1, []),
    (1, 8, ["96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"]),
    (6, 8, ["0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"]),
    (2, 5, ["5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"]),
    (6, 7, ["0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
            "b08693ec2e721597130641e8211e7eedccb4c26413963eee6c1e2ed16ffb1a5f",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"]),
]  # fmt: skip

KAT_HASHES = [hash_leaf(data) for data in KAT_LEAVES]


def _leaves(n: int, salt: int = 0) -> list[bytes]:
    return [hashlib.sha256(f"{salt}:{i}".encode()).digest() for i in range(n)]


def _from_leaves(leaves: list[bytes]):  # a perfect-subtree source over known leaves
    def perfect(start: int, height: int) -> bytes | None:
        end = start + (1 << height)
        return mth(leaves[start:end]) if end <= len(leaves) else None

    return perfect


def _proof(ranges: list[tuple[int, int]], leaves: list[bytes]) -> list[bytes]:
    hashes = [range_hash(start, end, _from_leaves(leaves)) for start, end in ranges]
    assert all(h is not None for h in hashes)
    return [h for h in hashes if h is not None]


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]


# --- known answers ------------------------------------------------------------------------


def test_roots_of_every_size_are_the_reference_roots() -> None:
    frontier = Frontier()
    for size, expected in enumerate(KAT_ROOTS, start=1):
        frontier.append(KAT_HASHES[size - 1])
        assert frontier.root().hex() == expected
        assert mth(KAT_HASHES[:size]).hex() == expected
    assert Frontier().root() == EMPTY_ROOT == mth([])
    assert EMPTY_ROOT.hex() == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


@pytest.mark.parametrize(("leaf", "size", "expected"), KAT_INCLUSION)
def test_inclusion_proofs_are_the_reference_proofs_and_verify(
    leaf: int, size: int, expected: list[str]
) -> None:
    proof = _proof(inclusion_ranges(leaf - 1, size), KAT_HASHES[:size])
    assert [p.hex() for p in proof] == expected
    root = bytes.fromhex(KAT_ROOTS[size - 1])
    assert verify_inclusion(leaf - 1, size, KAT_HASHES[leaf - 1], proof, root)


@pytest.mark.parametrize(("size1", "size2", "expected"), KAT_CONSISTENCY)
def test_consistency_proofs_are_the_reference_proofs_and_verify(
    size1: int, size2: int, expected: list[str]
) -> None:
    proof = _proof(consistency_ranges(size1, size2), KAT_HASHES[:size2])
    assert [p.hex() for p in proof] == expected
    root1, root2 = bytes.fromhex(KAT_ROOTS[size1 - 1]), bytes.fromhex(KAT_ROOTS[size2 - 1])
    assert verify_consistency(size1, size2, root1, root2, proof)


@pytest.mark.parametrize(("leaf", "size", "expected"), KAT_INCLUSION[1:])
def test_corrupted_inclusion_proofs_fail_as_the_reference_verifier_says(
    leaf: int, size: int, expected: list[str]
) -> None:
    # The reference verifier's probes: wrong index or size, wrong leaf or root, garbage
    # before or after, a flipped bit, a component removed or inserted.
    proof = [bytes.fromhex(p) for p in expected]
    root, index, hashed = bytes.fromhex(KAT_ROOTS[size - 1]), leaf - 1, KAT_HASHES[leaf - 1]
    some = bytes.fromhex("abacaba000000000000000000000000000000000000000000060061e00123456")
    probes = [
        (index - 1, size, hashed, proof, root),
        (index + 1, size, hashed, proof, root),
        (index ^ 2, size, hashed, proof, root),
        (index, size * 2, hashed, proof, root),
        (index, size // 2, hashed, proof, root),
        (index, size, b"WrongLeaf", proof, root),
        (index, size, hashed, proof, EMPTY_ROOT),
        (index, size, hashed, proof, some),
        (index, size, hashed, [*proof, b""], root),
        (index, size, hashed, [*proof, root], root),
        (index, size, hashed, [b"", *proof], root),
        (index, size, hashed, [root, *proof], root),
        (index, size, hashed, proof[:-1], root),
    ]
    for i in range(len(proof)):
        flipped = list(proof)
        flipped[i] = bytes([proof[i][0] ^ 8]) + proof[i][1:]
        probes.append((index, size, hashed, flipped, root))
    if len(proof) > 1:
        probes.append((index, size, hashed, [proof[0], some, *proof[1:]], root))
    for probe in probes:
        assert not verify_inclusion(*probe), probe


@pytest.mark.parametrize(("size1", "size2", "expected"), KAT_CONSISTENCY[1:])
def test_corrupted_consistency_proofs_fail_as_the_reference_verifier_says(
    size1: int, size2: int, expected: list[str]
) -> None:
    proof = [bytes.fromhex(p) for p in expected]
    root1, root2 = bytes.fromhex(KAT_ROOTS[size1 - 1]), bytes.fromhex(KAT_ROOTS[size2 - 1])
    probes = [
        (size1 - 1, size2, root1, root2, proof),
        (size1 + 1, size2, root1, root2, proof),
        (size1 ^ 2, size2, root1, root2, proof),
        (size1, size2 * 2, root1, root2, proof),
        (size1, size2 // 2, root1, root2, proof),
        (size1, size2, b"WrongRoot", root2, proof),
        (size1, size2, root1, b"WrongRoot", proof),
        (size1, size2, root2, root1, proof),
        (size1, size2, root1, root2, []),
        (size1, size2, root1, root2, [*proof, b""]),
        (size1, size2, root1, root2, [*proof, root1]),
        (size1, size2, root1, root2, [*proof, root2]),
        (size1, size2, root1, root2, [b"", *proof]),
        (size1, size2, root1, root2, [root1, *proof]),
        (size1, size2, root1, root2, [root2, *proof]),
        (size1, size2, root1, root2, [proof[0], *proof]),
        (size1, size2, root1, root2, proof[:-1]),
    ]
    for i in range(len(proof)):
        flipped = list(proof)
        flipped[i] = bytes([proof[i][0] ^ 16]) + proof[i][1:]
        probes.append((size1, size2, root1, root2, flipped))
    for probe in probes:
        assert not verify_consistency(*probe), probe


def test_trivial_consistency_cases_follow_the_reference_verifier() -> None:
    a, b = b"a" * 32, b"b" * 32
    assert verify_consistency(0, 0, a, a, [])
    assert verify_consistency(0, 1, a, b, [])  # anything extends the empty tree
    assert verify_consistency(1, 1, b, b, [])
    assert not verify_consistency(1, 1, a, b, [])
    assert not verify_consistency(1, 0, a, b, [])
    assert not verify_consistency(2, 1, a, b, [])
    assert not verify_consistency(1, 2, a, b, [])
    assert not verify_consistency(1, 1, a, a, [EMPTY_ROOT])
    assert not verify_consistency(0, 1, a, a, [EMPTY_ROOT])


def test_an_event_leaf_is_its_position_then_its_stored_bytes() -> None:
    payload = b'{"data":{},"type":"KeyRevoked"}'
    expected = hashlib.sha256(b"\x00" + (7).to_bytes(8, "big") + payload).digest()
    assert event_leaf_hash(7, payload) == expected == hash_leaf((7).to_bytes(8, "big") + payload)
    assert (
        hash_node(b"l" * 32, b"r" * 32) == hashlib.sha256(b"\x01" + b"l" * 32 + b"r" * 32).digest()
    )


# --- properties over any size ------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=600), st.integers(min_value=0, max_value=3))
def test_the_incremental_root_is_the_root_from_scratch_at_every_size(n: int, salt: int) -> None:
    leaves = _leaves(n, salt)
    frontier = Frontier()
    for size in range(n + 1):
        if size:
            frontier.append(leaves[size - 1])
        if size in (0, 1, n) or size % 37 == 0:
            assert frontier.root() == mth(leaves[:size])
            assert range_hash(0, size, _from_leaves(leaves)) == mth(leaves[:size])
    # The border is the size's perfect subtrees, and rebuilds the same frontier.
    assert [(s, h) for s, h, _ in frontier.border()] == blocks(0, n)
    again = Frontier.from_source(n, _from_leaves(leaves))
    assert again.root() == frontier.root() and again.border() == frontier.border()


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=1, max_value=1100))
def test_kept_levels_and_watched_nodes_are_the_perfect_subtrees(n: int) -> None:
    leaves = _leaves(n)
    watch = {(h, i) for h in range(0, 11) for i in (0, 1, 3) if (i + 1) << h <= n}
    frontier = Frontier(keep=(0, 2, 8), watch=watch)
    for leaf in leaves:
        frontier.append(leaf)
    for level in (0, 2, 8):
        expected = [mth(leaves[i << level : (i + 1) << level]) for i in range(n >> level)]
        assert frontier.kept[level] == expected
    assert frontier.caught == {(h, i): mth(leaves[i << h : (i + 1) << h]) for h, i in watch}
    assert perfect_root(frontier.kept[0][: 1 << (n.bit_length() - 1)]) == mth(
        leaves[: 1 << (n.bit_length() - 1)]
    )


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_every_inclusion_proof_verifies_and_any_changed_byte_fails(data: st.DataObject) -> None:
    size = data.draw(st.integers(min_value=1, max_value=300))
    index = data.draw(st.integers(min_value=0, max_value=size - 1))
    leaves = _leaves(size)
    root = mth(leaves)
    proof = _proof(inclusion_ranges(index, size), leaves)
    assert len(proof) == len(inclusion_ranges(index, size)) <= size.bit_length()
    assert root_from_inclusion_proof(index, size, leaves[index], proof) == root
    at = data.draw(st.integers(min_value=0, max_value=31))
    assert not verify_inclusion(index, size, _flip(leaves[index], at), proof, root)
    assert not verify_inclusion(index, size, leaves[index], proof, _flip(root, at))
    for i in range(len(proof)):
        changed = [*proof[:i], _flip(proof[i], at), *proof[i + 1 :]]
        assert not verify_inclusion(index, size, leaves[index], changed, root)
    other = data.draw(st.integers(min_value=0, max_value=size - 1))
    if other != index:
        assert not verify_inclusion(other, size, leaves[index], proof, root)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_consistency_proofs_between_any_two_sizes_verify(data: st.DataObject) -> None:
    size2 = data.draw(st.integers(min_value=1, max_value=300))
    size1 = data.draw(st.integers(min_value=0, max_value=size2))
    leaves = _leaves(size2)
    root1, root2 = mth(leaves[:size1]), mth(leaves)
    proof = _proof(consistency_ranges(size1, size2), leaves)
    assert verify_consistency(size1, size2, root1, root2, proof)
    if 0 < size1 < size2:
        at = data.draw(st.integers(min_value=0, max_value=31))
        assert not verify_consistency(size1, size2, _flip(root1, at), root2, proof)
        assert not verify_consistency(size1, size2, root1, _flip(root2, at), proof)
        for i in range(len(proof)):
            changed = [*proof[:i], _flip(proof[i], at), *proof[i + 1 :]]
            assert not verify_consistency(size1, size2, root1, root2, changed)
        # A history rewritten at any leaf below size1 is not consistent with the old root.
        at_leaf = data.draw(st.integers(min_value=0, max_value=size1 - 1))
        forged = [*leaves[:at_leaf], _flip(leaves[at_leaf], 0), *leaves[at_leaf + 1 :]]
        forged_proof = _proof(consistency_ranges(size1, size2), forged)
        assert not verify_consistency(size1, size2, root1, mth(forged), forged_proof)
