"""The stored form (``ledger.store.stored``): what rows are written with never changes."""

from __future__ import annotations

import hashlib

from hypothesis import given
from hypothesis import strategies as st

from ledger.events import CATALOGUE
from ledger.store._dictionary import DICTIONARY_1
from ledger.store.stored import (
    GENESIS_HASH,
    TYPE_CHARACTERS,
    TYPE_CHARS,
    chain_hash,
    compress,
    payloads_of,
    stored_events,
    types_of,
)


def test_the_dictionary_of_format_1_is_the_one_rows_were_written_with() -> None:
    digest = hashlib.sha256(DICTIONARY_1).hexdigest()
    assert digest == "439071485ed280235be6f9ec81f0c6c4aa8915006deb016b75c8c9530519461e"


def test_every_event_type_has_its_own_character_in_catalogue_order() -> None:
    assert set(TYPE_CHARS) == set(CATALOGUE)
    # Characters are given out in order and never reused; none is a LIKE wildcard.
    assert "".join(TYPE_CHARS.values()) == TYPE_CHARACTERS[: len(TYPE_CHARS)]
    assert types_of("".join(TYPE_CHARS.values())) == list(TYPE_CHARS)


# Canonical payloads are compact JSON: no raw newline (the join), any other byte.
_payload = st.binary(max_size=2000).map(lambda b: b.replace(b"\n", b" "))


@given(st.lists(_payload, min_size=1, max_size=12))
def test_compressed_payloads_read_back_byte_for_byte(payloads: list[bytes]) -> None:
    assert payloads_of(compress(payloads)) == payloads


def test_format_0_is_the_joined_bytes_as_they_are() -> None:
    assert payloads_of(b"\x00" + b"a\nbc") == [b"a", b"bc"]


def test_a_rows_hashes_are_chained_from_the_previous_rows() -> None:
    payloads = [b'{"a":1}', b'{"b":2}']
    first = chain_hash(GENESIS_HASH, 1, payloads[0])
    second = chain_hash(first, 2, payloads[1])
    stored = stored_events(1, None, compress(payloads))
    assert stored == [(1, first, payloads[0]), (2, second, payloads[1])]
    assert stored_events(1, None, compress(payloads), after=1) == [(2, second, payloads[1])]
    third = chain_hash(second, 3, b"{}")
    assert stored_events(3, bytes.fromhex(second), compress([b"{}"])) == [(3, third, b"{}")]


def test_an_appends_encoded_json_holds_no_more_memory_than_its_bytes() -> None:
    # orjson hands back its bytes in the buffer it wrote them to (4 KB at least); an append
    # waiting for its commit keeps one per event, so the store keeps copies of their size.
    import tracemalloc

    import orjson

    from ledger.store.append import _exact

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = [_exact(orjson.dumps({"config_generation": f"g{n}"})) for n in range(200)]
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(kept) == 200 and held < 200 * 256, held
