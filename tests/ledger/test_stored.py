"""The stored form (``ledger.store.stored``): what rows are written with never changes."""

from __future__ import annotations

import hashlib
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest
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


@given(st.lists(_payload, min_size=1, max_size=12), st.integers(min_value=1, max_value=9))
def test_format_1_rows_written_before_format_2_are_still_read(
    payloads: list[bytes], level: int
) -> None:
    # Format 1: raw deflate against DICTIONARY_1 in a 16 KB window, at any level.
    deflate = zlib.compressobj(level, zlib.DEFLATED, -14, 8, zdict=DICTIONARY_1)
    column = b"\x01" + deflate.compress(b"\n".join(payloads)) + deflate.flush()
    assert payloads_of(column) == payloads


_REQUEST_COMPLETED = (
    b'{"data":{"attempts":1,"cost_usd":"0.000019000000","duration_ms":7,"endpoint":"fake",'
    b'"finish_reason":"stop","http_status":200,"model":"fake-model","request_id":"req_01a24fc'
    b'2f8c43c3da7cf3db56462","usage":{"audio_input_tokens":0,"audio_output_tokens":0,"cached_i'
    b'nput_tokens":0,"input_tokens":7,"output_tokens":6,"web_searches":0}},"metadata":{"config'
    b'_generation":"bench-1"},"recorded_at":"2026-12-07T09:08:27.468622+00:00","schema_version'
    b'":1,"stream_id":"request-req_01a24fc2f8c43c3da7cf3db56462","type":"RequestCompleted","ve'
    b'rsion":7}'
)


def test_format_2_rows_are_a_zstandard_frame_against_the_dictionary_of_format_1() -> None:
    # A row as written on 2026-12-07: it must read back for ever, whatever level writes now.
    column = bytes.fromhex(
        "026014010d0200840237346663326638633433633364613763663364623536343632375430393a"
        "30383a32372e34363836070017840070e16585c02903cf0a12509880547a411240"
    )
    assert payloads_of(column) == [_REQUEST_COMPLETED]
    assert compress([_REQUEST_COMPLETED])[0] == 2


def test_damaged_compressed_payloads_are_a_value_error() -> None:
    column = compress([_REQUEST_COMPLETED, _REQUEST_COMPLETED])
    for damaged in (column[:-3], column[:1] + b"\xff" + column[2:], b"\x09" + column[1:]):
        with pytest.raises(ValueError):
            payloads_of(damaged)


def test_rows_compress_on_any_thread() -> None:
    # A Zstandard context serves one call at a time: the SQLite backend decides on its
    # writer thread while the loop's thread, or a reader's, compresses or reads a row.
    rows = [[_REQUEST_COMPLETED.replace(b"req_01", f"req_{n:02d}".encode())] * 3 for n in range(64)]
    with ThreadPoolExecutor(4) as pool:
        columns = list(pool.map(compress, rows * 8))
        read = list(pool.map(payloads_of, columns))
    assert read == rows * 8


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
