"""Unit tests for the byte-level SSE reader and writer (router/drivers/sse.py, contract §5
Streaming)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.drivers.sse import (
    DONE_FRAME,
    MAX_FRAME_BYTES,
    EndReason,
    InvalidEvent,
    JSONObject,
    SSEDecodeError,
    SSEError,
    SSEFrame,
    SSEFrameTooLarge,
    SSEIdleTimeout,
    SSEParser,
    SSEStream,
    encode_data,
)

BOM = b"\xef\xbb\xbf"

# Several frames mixing every line end, a BOM, a comment, fields, and multibyte UTF-8
# (2-, 3- and 4-byte characters), so that splitting it anywhere cuts through all of them.
SAMPLE = (
    BOM
    + (
        ": keep-alive\r\n"
        "event: grüße\r\n"
        "data: héllo 日本 🚀\r"
        "data: second line\n"
        "\r\n"
        "id: 7\n"
        'data: {"x": "🚀"}\r'
        "\r"
        "retry: 1500\r\n"
        "data:no-space\n"
        "\n"
    ).encode()
)

SAMPLE_FRAMES = [
    SSEFrame(data="héllo 日本 🚀\nsecond line", event="grüße"),
    SSEFrame(data='{"x": "🚀"}', id="7"),
    SSEFrame(data="no-space", id="7", retry=1500),
]


def parse(*chunks: bytes) -> tuple[list[SSEFrame], EndReason]:
    parser = SSEParser()
    frames = [frame for chunk in chunks for frame in parser.feed(chunk)]
    return frames, parser.close()


def parse_frames(*chunks: bytes) -> list[SSEFrame]:
    frames, end = parse(*chunks)
    assert end is EndReason.EOF
    return frames


def byte_by_byte(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


async def source(*chunks: bytes) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


async def collect(stream: SSEStream) -> list[object]:
    return [payload async for payload in stream]


def sse_json(*payloads: object) -> bytes:
    return b"".join(encode_data(orjson.dumps(payload)) for payload in payloads)


# --- line ends ---------------------------------------------------------------------------


def test_lf_line_ends_dispatch_a_frame() -> None:
    assert parse_frames(b"data: a\n\n") == [SSEFrame("a")]


def test_crlf_line_ends_dispatch_a_frame() -> None:
    assert parse_frames(b"data: a\r\n\r\n") == [SSEFrame("a")]


def test_cr_line_ends_dispatch_a_frame() -> None:
    assert parse_frames(b"data: a\r\r") == [SSEFrame("a")]


def test_mixed_line_ends_in_one_stream() -> None:
    stream = b"data: a\rdata: b\r\n\ndata: c\n\r\ndata: d\r\n\r"
    assert parse_frames(stream) == [SSEFrame("a\nb"), SSEFrame("c"), SSEFrame("d")]


def test_cr_at_chunk_end_followed_by_lf_is_one_line_end() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: a\r") == []
    assert parser.feed(b"\ndata: b\n") == []  # the LF completes the CR, it is no blank line
    assert parser.feed(b"\n") == [SSEFrame("a\nb")]
    assert parser.close() is EndReason.EOF


def test_cr_at_chunk_end_then_empty_chunks_then_lf_is_one_line_end() -> None:
    assert parse_frames(b"data: a\r", b"", b"", b"\ndata: b\n\n") == [SSEFrame("a\nb")]


def test_cr_at_chunk_end_followed_by_cr_is_a_blank_line() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: a\r") == []
    assert parser.feed(b"\r") == [SSEFrame("a")]


def test_cr_at_chunk_end_followed_by_other_byte_ends_the_line() -> None:
    assert parse_frames(b"data: a\r", b"data: b\r\r") == [SSEFrame("a\nb")]


def test_blank_line_ended_by_cr_dispatches_without_waiting_for_the_next_byte() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: a\n\r") == [SSEFrame("a")]
    assert parser.feed(b"\n") == []  # the LF belongs to that CR
    assert parser.close() is EndReason.EOF


def test_lf_then_cr_are_two_line_ends() -> None:
    assert parse_frames(b"data: a\n\rdata: b\n\n") == [SSEFrame("a"), SSEFrame("b")]


def test_crlf_then_cr_are_two_line_ends() -> None:
    assert parse_frames(b"data: a\r\n\r") == [SSEFrame("a")]


def test_lf_in_a_later_chunk_after_a_non_cr_line_end_is_a_blank_line() -> None:
    assert parse_frames(b"data: a\n", b"\n") == [SSEFrame("a")]


# --- chunking ----------------------------------------------------------------------------


def test_sample_parses_to_expected_frames_in_one_chunk() -> None:
    assert parse_frames(SAMPLE) == SAMPLE_FRAMES


@pytest.mark.parametrize("cut", range(len(SAMPLE) + 1))
def test_every_single_split_point_yields_identical_frames(cut: int) -> None:
    assert parse_frames(SAMPLE[:cut], SAMPLE[cut:]) == SAMPLE_FRAMES


def test_every_pair_of_split_points_yields_identical_frames() -> None:
    for first in range(len(SAMPLE) + 1):
        for second in range(first, len(SAMPLE) + 1):
            chunks = (SAMPLE[:first], SAMPLE[first:second], SAMPLE[second:])
            assert parse_frames(*chunks) == SAMPLE_FRAMES, (first, second)


def test_byte_by_byte_feeding_yields_identical_frames() -> None:
    assert parse_frames(*byte_by_byte(SAMPLE)) == SAMPLE_FRAMES


def test_frames_are_returned_by_the_feed_that_completes_them() -> None:
    parser = SSEParser()
    returned = [parser.feed(chunk) for chunk in byte_by_byte(b"data: a\n\ndata: b\n\n")]
    completing = [i for i, frames in enumerate(returned) if frames]
    assert completing == [8, 17]
    assert [frame for frames in returned for frame in frames] == [SSEFrame("a"), SSEFrame("b")]


def test_four_byte_character_split_in_every_way_decodes() -> None:
    rocket = "🚀".encode()
    for cut in range(1, len(rocket)):
        stream = (b"data: ", rocket[:cut], rocket[cut:], b"\n\n")
        assert parse_frames(*stream) == [SSEFrame("🚀")]


# --- fields ------------------------------------------------------------------------------


def test_multiple_data_lines_join_with_newline() -> None:
    assert parse_frames(b"data: a\ndata: b\ndata: c\n\n") == [SSEFrame("a\nb\nc")]


def test_data_lines_with_empty_values_keep_their_newlines() -> None:
    assert parse_frames(b"data\ndata:\ndata: x\ndata\n\n") == [SSEFrame("\n\nx\n")]


def test_comment_lines_are_ignored() -> None:
    stream = b": hello\ndata: a\n:\n:: still a comment\ndata: b\n\n"
    assert parse_frames(stream) == [SSEFrame("a\nb")]


def test_comment_only_block_dispatches_nothing() -> None:
    assert parse_frames(b": ping\n\n: ping\n\n") == []


def test_event_field_sets_event_type() -> None:
    assert parse_frames(b"event: delta\ndata: a\n\n") == [SSEFrame("a", event="delta")]


def test_event_type_defaults_to_message() -> None:
    assert parse_frames(b"data: a\n\n")[0].event == "message"


def test_empty_event_field_means_message() -> None:
    assert parse_frames(b"event:\ndata: a\n\n") == [SSEFrame("a", event="message")]


def test_last_event_field_in_a_frame_wins() -> None:
    assert parse_frames(b"event: a\nevent: b\ndata: x\n\n") == [SSEFrame("x", event="b")]


def test_event_type_resets_after_dispatch() -> None:
    frames = parse_frames(b"event: delta\ndata: a\n\ndata: b\n\n")
    assert [frame.event for frame in frames] == ["delta", "message"]


def test_event_of_a_frame_without_data_does_not_leak_into_the_next_frame() -> None:
    assert parse_frames(b"event: ghost\n\ndata: a\n\n") == [SSEFrame("a")]


def test_id_field_persists_across_frames() -> None:
    frames = parse_frames(b"id: 1\ndata: a\n\ndata: b\n\nid: 2\ndata: c\n\n")
    assert [frame.id for frame in frames] == ["1", "1", "2"]


def test_id_set_by_a_frame_without_data_still_counts() -> None:
    assert parse_frames(b"id: 9\n\ndata: a\n\n") == [SSEFrame("a", id="9")]


def test_empty_id_resets_last_event_id() -> None:
    frames = parse_frames(b"id: 1\ndata: a\n\nid\ndata: b\n\n")
    assert [frame.id for frame in frames] == ["1", ""]


def test_id_containing_nul_is_ignored() -> None:
    frames = parse_frames(b"id: 1\ndata: a\n\nid: 2\x003\ndata: b\n\n")
    assert [frame.id for frame in frames] == ["1", "1"]


def test_retry_field_sets_reconnection_time_and_persists() -> None:
    frames = parse_frames(b"retry: 2500\ndata: a\n\ndata: b\n\n")
    assert [frame.retry for frame in frames] == [2500, 2500]


def test_retry_defaults_to_none() -> None:
    assert parse_frames(b"data: a\n\n")[0].retry is None


@pytest.mark.parametrize("value", [b"", b"1.5", b"-1", b"10ms", b" 10", b"\xd9\xa3"])
def test_retry_that_is_not_ascii_digits_is_ignored(value: bytes) -> None:
    stream = b"retry: 100\ndata: a\n\nretry: " + value + b"\ndata: b\n\n"
    assert [frame.retry for frame in parse_frames(stream)] == [100, 100]


def test_field_without_colon_has_empty_value() -> None:
    assert parse_frames(b"data\n\n") == [SSEFrame("")]
    assert parse_frames(b"event\ndata: a\n\n") == [SSEFrame("a", event="message")]


def test_no_space_after_colon_is_accepted() -> None:
    assert parse_frames(b"event:x\ndata:a\n\n") == [SSEFrame("a", event="x")]


def test_only_one_leading_space_is_stripped() -> None:
    assert parse_frames(b"data:  a \n\n") == [SSEFrame(" a ")]


def test_tab_after_colon_is_kept() -> None:
    assert parse_frames(b"data:\ta\n\n") == [SSEFrame("\ta")]


def test_value_may_contain_colons() -> None:
    assert parse_frames(b'data: {"a": "b:c"}\n\n') == [SSEFrame('{"a": "b:c"}')]


def test_unknown_fields_are_ignored() -> None:
    assert parse_frames(b"foo: bar\ndata: a\nbaz\n\n") == [SSEFrame("a")]


def test_field_names_are_case_sensitive() -> None:
    assert parse_frames(b"Data: a\nDATA: b\n\n") == []


def test_field_name_with_leading_space_is_unknown() -> None:
    assert parse_frames(b" data: a\n\n") == []


def test_frame_without_data_field_is_not_dispatched() -> None:
    assert parse_frames(b"event: x\nid: 1\nretry: 5\n\n") == []


def test_data_field_with_empty_value_is_dispatched_with_empty_data() -> None:
    # WHATWG: "data:" makes the data buffer "\n", which is not empty.
    assert parse_frames(b"data:\n\n") == [SSEFrame("")]


def test_consecutive_blank_lines_dispatch_nothing_extra() -> None:
    assert parse_frames(b"\n\n\ndata: a\n\n\n\r\n\r") == [SSEFrame("a")]


def test_frame_data_is_unicode_text() -> None:
    assert parse_frames("data: héllo 日本 🚀\n\n".encode()) == [SSEFrame("héllo 日本 🚀")]


def test_nul_in_data_is_kept() -> None:
    assert parse_frames(b"data: a\x00b\n\n") == [SSEFrame("a\x00b")]


# --- end of stream -----------------------------------------------------------------------


def test_empty_stream_is_a_clean_eof() -> None:
    assert parse() == ([], EndReason.EOF)


def test_clean_eof_on_a_frame_boundary_is_eof() -> None:
    assert parse(b"data: a\n\n") == ([SSEFrame("a")], EndReason.EOF)


def test_frame_cut_at_eof_is_not_dispatched_and_reported() -> None:
    assert parse(b"data: a\n\ndata: b\n") == ([SSEFrame("a")], EndReason.EOF_MID_FRAME)


def test_frame_cut_after_a_cr_line_end_is_reported() -> None:
    assert parse(b"data: a\r") == ([], EndReason.EOF_MID_FRAME)


def test_partial_line_at_eof_is_not_dispatched_and_reported() -> None:
    assert parse(b"data: a\n\ndata: b") == ([SSEFrame("a")], EndReason.EOF_MID_FRAME)


def test_partial_comment_line_at_eof_is_reported() -> None:
    assert parse(b"data: a\n\n: ke") == ([SSEFrame("a")], EndReason.EOF_MID_FRAME)


def test_frame_with_only_event_field_cut_at_eof_is_reported() -> None:
    assert parse(b"event: x\n") == ([], EndReason.EOF_MID_FRAME)


def test_complete_comment_line_at_eof_is_a_clean_eof() -> None:
    assert parse(b"data: a\n\n: bye\n") == ([SSEFrame("a")], EndReason.EOF)


def test_blank_line_ended_by_cr_at_eof_is_a_clean_eof() -> None:
    assert parse(b"data: a\r\r") == ([SSEFrame("a")], EndReason.EOF)


def test_feed_after_close_raises() -> None:
    parser = SSEParser()
    parser.close()
    with pytest.raises(RuntimeError):
        parser.feed(b"data: a\n\n")
    with pytest.raises(RuntimeError):
        parser.close()


# --- size limit --------------------------------------------------------------------------


def data_line(total_bytes: int) -> bytes:
    """A `data:` line of exactly `total_bytes` bytes, without its line end."""
    return b"data:" + b"x" * (total_bytes - len(b"data:"))


def test_frame_limit_is_32_kib() -> None:
    assert MAX_FRAME_BYTES == 32768


def test_frame_of_exactly_32_kib_is_accepted() -> None:
    frames = parse_frames(data_line(MAX_FRAME_BYTES) + b"\n\n")
    assert frames == [SSEFrame("x" * (MAX_FRAME_BYTES - 5))]


def test_frame_one_byte_over_32_kib_raises() -> None:
    with pytest.raises(SSEFrameTooLarge) as caught:
        SSEParser().feed(data_line(MAX_FRAME_BYTES + 1) + b"\n\n")
    assert caught.value.limit == MAX_FRAME_BYTES
    assert caught.value.size == MAX_FRAME_BYTES + 1


def test_frame_size_adds_up_all_field_lines() -> None:
    half = MAX_FRAME_BYTES // 2
    assert len(parse_frames(data_line(half) + b"\n" + data_line(half) + b"\n\n")) == 1
    with pytest.raises(SSEFrameTooLarge):
        SSEParser().feed(data_line(half) + b"\nid: 1\n" + data_line(half) + b"\n\n")


def test_line_ends_do_not_count_toward_the_frame_size() -> None:
    half = MAX_FRAME_BYTES // 2
    stream = data_line(half) + b"\r\n" + data_line(half) + b"\r\n\r\n"
    assert len(parse_frames(stream)) == 1


def test_frame_size_resets_after_dispatch() -> None:
    frame = data_line(MAX_FRAME_BYTES) + b"\n\n"
    assert len(parse_frames(frame * 3)) == 3


def test_frame_size_resets_after_an_undispatched_frame() -> None:
    stream = b"event:" + b"e" * (MAX_FRAME_BYTES - 6) + b"\n\n" + data_line(MAX_FRAME_BYTES)
    assert len(parse_frames(stream + b"\n\n")) == 1


def test_unterminated_line_of_exactly_32_kib_is_buffered() -> None:
    parser = SSEParser()
    assert parser.feed(data_line(MAX_FRAME_BYTES)) == []
    assert parser.feed(b"\n\n") == [SSEFrame("x" * (MAX_FRAME_BYTES - 5))]


def test_unterminated_line_one_byte_over_32_kib_raises_before_its_line_end() -> None:
    parser = SSEParser()
    parser.feed(data_line(MAX_FRAME_BYTES))
    with pytest.raises(SSEFrameTooLarge):
        parser.feed(b"x")


def test_unterminated_line_raises_as_soon_as_it_outgrows_the_limit_in_small_chunks() -> None:
    parser = SSEParser()
    parser.feed(b"data:")
    fed = 5
    with pytest.raises(SSEFrameTooLarge):
        while True:
            parser.feed(b"x" * 100)
            fed += 100
    assert fed <= MAX_FRAME_BYTES


def test_unterminated_line_counts_the_frame_lines_before_it() -> None:
    parser = SSEParser()
    parser.feed(b"event: x\n")  # 8 bytes of this frame already
    parser.feed(data_line(MAX_FRAME_BYTES - 8))
    with pytest.raises(SSEFrameTooLarge):
        parser.feed(b"x")


def test_comment_lines_do_not_count_toward_the_frame_size() -> None:
    comment = b":" + b"c" * (MAX_FRAME_BYTES - 1) + b"\n"
    stream = comment + data_line(MAX_FRAME_BYTES) + b"\n" + comment + b"\n"
    assert len(parse_frames(stream)) == 1


def test_single_comment_line_over_32_kib_raises() -> None:
    with pytest.raises(SSEFrameTooLarge):
        SSEParser().feed(b":" + b"c" * MAX_FRAME_BYTES)


def test_bytes_are_counted_after_utf8_not_as_characters() -> None:
    emoji_line = b"data:" + "🚀".encode() * ((MAX_FRAME_BYTES - 5) // 4)
    assert len(emoji_line) <= MAX_FRAME_BYTES
    assert len(parse_frames(emoji_line + b"\n\n")) == 1
    with pytest.raises(SSEFrameTooLarge):
        SSEParser().feed(emoji_line + "🚀".encode() + b"\n\n")


def test_max_frame_bytes_can_be_configured() -> None:
    parser = SSEParser(max_frame_bytes=8)
    assert parser.feed(b"data:abc\n\n") == [SSEFrame("abc")]
    with pytest.raises(SSEFrameTooLarge):
        parser.feed(b"data:abcd\n\n")


# --- errors ------------------------------------------------------------------------------


def test_invalid_utf8_line_raises_decode_error_with_its_offset() -> None:
    with pytest.raises(SSEDecodeError) as caught:
        parse(b"data: ok\n\ndata: a\xffb\n\n")
    assert caught.value.offset == len(b"data: ok\n\ndata: a")


def test_decode_error_offset_counts_the_bom_and_earlier_chunks() -> None:
    with pytest.raises(SSEDecodeError) as caught:
        parse(*byte_by_byte(BOM + b"data: ok\r\n\r\ndata: \xc3\x28\n\n"))
    assert caught.value.offset == len(BOM + b"data: ok\r\n\r\ndata: ")


def test_utf8_character_truncated_by_a_line_end_is_invalid() -> None:
    with pytest.raises(SSEDecodeError):
        parse("data: 日".encode()[:-1] + b"\n\n")


def test_utf8_encoded_surrogate_is_invalid() -> None:
    with pytest.raises(SSEDecodeError):
        parse(b"data: \xed\xa0\x80\n\n")


def test_overlong_utf8_encoding_is_invalid() -> None:
    with pytest.raises(SSEDecodeError):
        parse(b"data: \xc0\xaf\n\n")


def test_invalid_utf8_in_a_comment_is_ignored() -> None:
    assert parse_frames(b": \xff\xfe\ndata: a\n\n") == [SSEFrame("a")]


def test_frames_before_an_error_in_the_same_chunk_are_returned_then_the_error_raises() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: a\n\ndata: \xff\n\n") == [SSEFrame("a")]
    with pytest.raises(SSEDecodeError):
        parser.feed(b"data: b\n\n")


def test_parser_stays_failed_after_an_error() -> None:
    parser = SSEParser()
    with pytest.raises(SSEFrameTooLarge):
        parser.feed(data_line(MAX_FRAME_BYTES + 1))
    with pytest.raises(SSEFrameTooLarge):
        parser.feed(b"\n\n")
    with pytest.raises(SSEFrameTooLarge):
        parser.close()


def test_sse_errors_share_one_base() -> None:
    for error in (SSEFrameTooLarge, SSEDecodeError, SSEIdleTimeout):
        assert issubclass(error, SSEError)


# --- byte order mark ---------------------------------------------------------------------


def test_leading_bom_is_stripped() -> None:
    assert parse_frames(BOM + b"data: a\n\n") == [SSEFrame("a")]


def test_bom_split_across_chunks_is_stripped() -> None:
    assert parse_frames(*byte_by_byte(BOM + b"data: a\n\n")) == [SSEFrame("a")]


def test_only_the_first_bom_is_stripped() -> None:
    # The second BOM becomes part of the field name, an unknown field.
    assert parse_frames(BOM + BOM + b"data: a\n\ndata: b\n\n") == [SSEFrame("b")]


def test_bom_later_in_the_stream_is_data() -> None:
    assert parse_frames(b"data: " + BOM + b"a\n\n") == [SSEFrame("\ufeffa")]


def test_character_sharing_the_bom_prefix_is_not_stripped() -> None:
    # U+FFFD is EF BF BD: its first byte matches the BOM's, the second does not.
    stream = "\ufffddata: a\n\ndata: b\n\n".encode()
    assert parse_frames(*byte_by_byte(stream)) == [SSEFrame("b")]


def test_stream_shorter_than_a_bom_is_processed_at_once() -> None:
    parser = SSEParser()
    parser.feed(b"d")
    assert parser.feed(b"ata: a\n\n") == [SSEFrame("a")]


def test_blank_line_before_the_bom_is_decided_is_not_lost() -> None:
    parser = SSEParser()
    assert parser.feed(b"\n") == []
    assert parser.feed(b"data: a\n\n") == [SSEFrame("a")]


def test_partial_bom_at_eof_is_reported() -> None:
    assert parse(BOM[:2]) == ([], EndReason.EOF_MID_FRAME)


def test_bom_alone_is_a_clean_eof() -> None:
    assert parse(BOM) == ([], EndReason.EOF)


# --- frame helpers and encoder -----------------------------------------------------------


def test_done_sentinel_is_recognised() -> None:
    assert SSEFrame("[DONE]").is_done
    assert parse_frames(DONE_FRAME)[0].is_done


@pytest.mark.parametrize("data", ["", "DONE", "[done]", " [DONE]", '"[DONE]"', "[DONE]\n"])
def test_other_data_is_not_the_done_sentinel(data: str) -> None:
    assert not SSEFrame(data).is_done


def test_frames_are_frozen() -> None:
    frame = SSEFrame("a")
    with pytest.raises(AttributeError):
        frame.data = "b"  # type: ignore[misc]


def test_done_frame_bytes() -> None:
    assert DONE_FRAME == b"data: [DONE]\n\n"


def test_encode_data_from_str() -> None:
    assert encode_data('{"a": "é"}') == 'data: {"a": "é"}\n\n'.encode()


def test_encode_data_from_bytes() -> None:
    assert encode_data(b'{"a":1}') == b'data: {"a":1}\n\n'


def test_encode_data_splits_line_ends_into_data_lines() -> None:
    assert encode_data("a\nb\r\nc\rd") == b"data: a\ndata: b\ndata: c\ndata: d\n\n"


def test_encode_data_of_empty_payload() -> None:
    assert encode_data("") == b"data: \n\n"


@pytest.mark.parametrize(
    "payload",
    ["", "a", " leading space", "trailing\n", "\n", "a\n\nb", "héllo 日本 🚀", ":colon", "[DONE]"],
)
def test_encoder_round_trips_through_the_parser(payload: str) -> None:
    assert parse_frames(encode_data(payload)) == [SSEFrame(payload)]


def test_encoder_normalises_cr_and_crlf_to_lf() -> None:
    assert parse_frames(encode_data("a\r\nb\rc")) == [SSEFrame("a\nb\nc")]


# --- JSON stream -------------------------------------------------------------------------


async def test_stream_yields_json_objects_in_order() -> None:
    stream = SSEStream(source(sse_json({"n": 1}, {"n": 2}), DONE_FRAME))
    assert await collect(stream) == [{"n": 1}, {"n": 2}]


async def test_done_ends_iteration_with_reason_done() -> None:
    body = sse_json({"n": 1}) + DONE_FRAME + sse_json({"n": 2})
    stream = SSEStream(source(body, sse_json({"n": 3})))
    assert await collect(stream) == [{"n": 1}]
    assert stream.end_reason is EndReason.DONE


async def test_batches_group_the_objects_each_chunk_completed() -> None:
    stream = SSEStream(
        source(
            sse_json({"n": 1}, {"n": 2}) + b'data: {"n"',
            b": 3}\n\n" + sse_json({"n": 4}),
            b": only a comment\n\n",
            sse_json({"n": 5}) + DONE_FRAME + sse_json({"n": 6}),
        )
    )
    assert [batch async for batch in stream.batches()] == [
        [{"n": 1}, {"n": 2}],
        [{"n": 3}, {"n": 4}],
        [{"n": 5}],
    ]
    assert stream.end_reason is EndReason.DONE


async def test_batches_skip_a_chunk_of_invalid_events_only() -> None:
    stream = SSEStream(source(b"data: [1]\n\ndata: nope\n\n", sse_json({"n": 1})))
    assert [batch async for batch in stream.batches()] == [[{"n": 1}]]
    assert stream.invalid_events == 2
    assert stream.end_reason is EndReason.EOF


async def test_done_stops_reading_the_body() -> None:
    pulled: list[bytes] = []

    async def body() -> AsyncIterator[bytes]:
        for chunk in (sse_json({"n": 1}), DONE_FRAME, b"never read"):
            pulled.append(chunk)
            yield chunk

    stream = SSEStream(body())
    await collect(stream)
    assert pulled == [sse_json({"n": 1}), DONE_FRAME]
    assert stream.bytes_read == len(sse_json({"n": 1}) + DONE_FRAME)


async def test_clean_eof_without_done_reports_eof() -> None:
    stream = SSEStream(source(sse_json({"finish_reason": "stop"})))
    assert await collect(stream) == [{"finish_reason": "stop"}]
    assert stream.end_reason is EndReason.EOF


async def test_body_cut_mid_frame_reports_eof_mid_frame_and_drops_the_partial_frame() -> None:
    stream = SSEStream(source(sse_json({"n": 1}), b'data: {"n": 2}\n'))
    assert await collect(stream) == [{"n": 1}]
    assert stream.end_reason is EndReason.EOF_MID_FRAME


async def test_body_cut_mid_line_reports_eof_mid_frame() -> None:
    stream = SSEStream(source(sse_json({"n": 1}), b'data: {"n": 2}'))
    assert await collect(stream) == [{"n": 1}]
    assert stream.end_reason is EndReason.EOF_MID_FRAME


async def test_empty_body_reports_eof() -> None:
    stream = SSEStream(source())
    assert await collect(stream) == []
    assert stream.end_reason is EndReason.EOF
    assert stream.frames == 0


async def test_invalid_json_frame_is_skipped_and_recorded_and_later_frames_still_come() -> None:
    body = sse_json({"n": 1}) + b"data: {not json\n\n" + sse_json({"n": 2}) + DONE_FRAME
    stream = SSEStream(source(body))
    assert await collect(stream) == [{"n": 1}, {"n": 2}]
    assert stream.end_reason is EndReason.DONE
    assert stream.invalid_events == 1
    [invalid] = stream.invalid_samples
    assert invalid.frame_index == 1
    assert invalid.sample == "{not json"
    assert invalid.reason.startswith("invalid JSON")


@pytest.mark.parametrize("data", [b"42", b"[1, 2]", b'"text"', b"null", b"true"])
async def test_json_that_is_not_an_object_is_skipped_and_recorded(data: bytes) -> None:
    stream = SSEStream(source(encode_data(data), sse_json({"n": 1})))
    assert await collect(stream) == [{"n": 1}]
    assert stream.invalid_events == 1
    assert "not an object" in stream.invalid_samples[0].reason


async def test_empty_data_event_is_recorded_as_invalid() -> None:
    stream = SSEStream(source(b"data:\n\n", sse_json({"n": 1})))
    assert await collect(stream) == [{"n": 1}]
    assert stream.invalid_events == 1


async def test_invalid_event_sample_is_truncated() -> None:
    stream = SSEStream(source(encode_data("x" * 10_000)))
    await collect(stream)
    [invalid] = stream.invalid_samples
    assert invalid.sample == "x" * 80 + "…"


async def test_invalid_samples_are_capped_but_the_count_is_exact() -> None:
    body = b"".join(encode_data(f"bad {i}") for i in range(50))
    stream = SSEStream(source(body, sse_json({"n": 1})))
    assert await collect(stream) == [{"n": 1}]
    assert stream.invalid_events == 50
    assert 0 < len(stream.invalid_samples) < 50
    assert stream.invalid_samples[0] == InvalidEvent(0, stream.invalid_samples[0].reason, "bad 0")


async def test_bytes_read_and_frames_are_counted() -> None:
    chunks = (sse_json({"n": 1}), b": ping\n\n", b"data: bad\n\n", sse_json({"n": 2}), DONE_FRAME)
    stream = SSEStream(source(*chunks))
    await collect(stream)
    assert stream.bytes_read == sum(len(chunk) for chunk in chunks)
    assert stream.frames == 4  # two objects, one invalid, [DONE]; the comment is no frame


async def test_stream_reassembles_json_split_byte_by_byte() -> None:
    payloads = [{"content": "héllo 日本 🚀"}, {"content": "\n"}]
    stream = SSEStream(source(*byte_by_byte(sse_json(*payloads) + DONE_FRAME)))
    assert await collect(stream) == payloads
    assert stream.end_reason is EndReason.DONE


async def test_stream_reads_crlf_and_cr_bodies() -> None:
    body = b'data: {"n": 1}\r\n\r\ndata: {"n": 2}\r\rdata: [DONE]\r\n\r\n'
    stream = SSEStream(source(body))
    assert await collect(stream) == [{"n": 1}, {"n": 2}]
    assert stream.end_reason is EndReason.DONE


async def test_end_reason_is_none_until_iteration_finishes() -> None:
    stream = SSEStream(source(sse_json({"n": 1}, {"n": 2})))
    assert stream.end_reason is None
    async for _ in stream:
        assert stream.end_reason is None
    assert stream.end_reason is EndReason.EOF


async def test_stream_can_be_iterated_only_once() -> None:
    stream = SSEStream(source(sse_json({"n": 1})))
    await collect(stream)
    with pytest.raises(RuntimeError):
        await collect(stream)


async def test_oversized_frame_raises_from_the_stream() -> None:
    stream = SSEStream(source(sse_json({"n": 1}), data_line(MAX_FRAME_BYTES + 1)))
    seen: list[object] = []
    with pytest.raises(SSEFrameTooLarge):
        async for payload in stream:
            seen.append(payload)
    assert seen == [{"n": 1}]
    assert stream.end_reason is None


async def test_frame_before_a_fault_in_the_same_chunk_is_still_yielded() -> None:
    stream = SSEStream(source(sse_json({"n": 1}) + b"data: \xff\n\n"))
    seen: list[object] = []
    with pytest.raises(SSEDecodeError):
        async for payload in stream:
            seen.append(payload)
    assert seen == [{"n": 1}]


async def test_invalid_utf8_raises_from_the_stream() -> None:
    with pytest.raises(SSEDecodeError):
        await collect(SSEStream(source(b"data: \xff\n\n")))


async def test_stream_max_frame_bytes_can_be_configured() -> None:
    with pytest.raises(SSEFrameTooLarge):
        await collect(SSEStream(source(sse_json({"n": 123})), max_frame_bytes=8))


# --- the plain path: whole data frames, kept as their bytes ------------------------------


async def raw_batches(*chunks: bytes) -> list[tuple[list[JSONObject], bytes | None]]:
    stream = SSEStream(source(*chunks))
    return [(batch, stream.raw) async for batch in stream.batches()]


async def test_a_chunk_of_whole_data_frames_keeps_its_bytes() -> None:
    # As a provider sends them: spacing and escapes orjson would not write come back as is.
    first = b'data: {"n": 1}\n\n'
    second = b'data:{"t":"caf\\u00e9"}\n\ndata: {"n":  3}\n\n'
    assert await raw_batches(first, second) == [
        ([{"n": 1}], first),  # a stream's first bytes too: starting with "data:", no BOM
        ([{"t": "café"}, {"n": 3}], second),
    ]


async def test_a_stream_that_starts_with_a_bom_takes_the_general_path_then_the_plain_one() -> None:
    first = BOM + b'data: {"n": 1}\n\n'
    second = b'data: {"n": 2}\n\n'
    assert await raw_batches(first, second) == [([{"n": 1}], None), ([{"n": 2}], second)]


async def test_a_bom_split_across_reads_is_still_stripped_after_a_plain_look() -> None:
    # The first read is one byte of the BOM: undecided, held; the rest decides it.
    stream = SSEStream(source(BOM[:1], BOM[1:] + b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n'))
    assert [batch async for batch in stream.batches()] == [[{"n": 1}], [{"n": 2}]]


async def test_the_bytes_of_a_chunk_that_ends_the_stream_stop_before_done() -> None:
    last = b'data: {"n": 2}\n\ndata: [DONE]\n\ndata: {"n": 3}\n\n'
    stream = SSEStream(source(sse_json({"n": 1}), last))
    assert [(batch, stream.raw) async for batch in stream.batches()][1:] == [
        ([{"n": 2}], b'data: {"n": 2}\n\n')
    ]
    assert stream.end_reason is EndReason.DONE
    assert stream.frames == 3


@pytest.mark.parametrize(
    "chunk",
    [
        b': ping\n\ndata: {"n": 2}\n\n',  # a comment
        b'event: delta\ndata: {"n": 2}\n\n',  # a field
        b'data: {"n": 2}\r\n\r\n',  # CR
        b'data: {"n":\ndata: 2}\n\n',  # a multi-line data field
        b'data: {"n": 2}\n\ndata: {"n"',  # a frame cut by the read
        b'data: {"n": 2}\n\ndata: [2]\n\n',  # an event that is not a JSON object
    ],
)
async def test_anything_but_whole_plain_json_frames_takes_the_general_path(chunk: bytes) -> None:
    batches = await raw_batches(sse_json({"n": 1}), chunk, b": 3}\n\n")
    assert batches[1] == ([{"n": 2}], None)
    assert all(raw is None for _, raw in batches[2:])


async def test_bytes_that_are_not_utf8_fail_the_stream_on_the_plain_path_too() -> None:
    stream = SSEStream(source(sse_json({"n": 1}), b'data: {"t": "\xff"}\n\n'))
    with pytest.raises(SSEDecodeError):
        await collect(stream)


async def test_a_relay_can_take_a_plain_chunk_outside_batches() -> None:
    taken = sse_json({"n": 2}, {"n": 3})
    stream = SSEStream(source(sse_json({"n": 1}), sse_json({"n": 4}), DONE_FRAME))
    batches = stream.batches()
    assert stream.plain(taken) is None  # not before the stream is being read
    assert await anext(batches) == [{"n": 1}]
    assert stream.plain(taken + b'data: {"n"') is None
    assert stream.plain(taken + DONE_FRAME) is None  # the end is for batches() to read
    objects = stream.plain(taken)
    assert objects == [{"n": 2}, {"n": 3}]
    stream.took(taken, objects)
    assert stream.raw == taken
    assert [batch async for batch in batches] == [[{"n": 4}]]
    read = sse_json({"n": 1}) + taken + sse_json({"n": 4}) + DONE_FRAME
    assert (stream.frames, stream.bytes_read) == (5, len(read))


# --- idle timeout ------------------------------------------------------------------------
#
# On a clock only the test moves: no real time passes, and each deadline is checked at its
# very instant, not a few milliseconds either side of it.

LIMIT = 0.05


class FakeDeadline:
    """One wait's deadline on a :class:`FakeClock`, as :class:`asyncio.Timeout` behaves: once
    the clock reaches ``when`` it cancels the wait, and leaving it raises ``TimeoutError``."""

    def __init__(self, clock: FakeClock, when: float | None) -> None:
        self.clock = clock
        self.when = when
        self.fired = False
        self._task: asyncio.Task[Any] | None = None

    async def __aenter__(self) -> FakeDeadline:
        self._task = asyncio.current_task()
        self.clock.armed.append(self)
        self.clock.changed.set()
        self.reach(self.clock.now)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.clock.armed.remove(self)
        self.clock.changed.set()
        if self.fired and exc_type is asyncio.CancelledError:
            assert self._task is not None
            self._task.uncancel()
            raise TimeoutError from exc

    def reach(self, now: float) -> bool:
        """Fire if ``now`` is this deadline's time or later; whether it fired now."""
        if self.fired or self.when is None or now < self.when:
            return False
        self.fired = True
        assert self._task is not None
        self._task.cancel()
        return True

    def expired(self) -> bool:
        return self.fired


class FakeClock:
    """The clock an :class:`SSEStream` gets its deadlines from (``timeout=clock.timeout``)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.delays: list[float | None] = []  # every delay asked for, in order
        self.armed: list[FakeDeadline] = []  # the deadlines of the waits going on
        self.changed = asyncio.Event()  # a wait began or ended

    def timeout(self, delay: float | None) -> FakeDeadline:
        self.delays.append(delay)
        return FakeDeadline(self, None if delay is None else self.now + delay)

    async def waiting(self, reader: asyncio.Task[Any]) -> FakeDeadline:
        """The deadline of the wait ``reader`` is in, once it is in one; a reader that ends
        first fails the test (it waited on another clock, or not at all)."""
        reader.add_done_callback(lambda _: self.changed.set())
        await self._until(lambda: bool(self.armed) or reader.done())
        assert self.armed, f"the reader ended without a wait on this clock: {reader.exception()!r}"
        return self.armed[-1]

    async def left(self, deadline: FakeDeadline) -> None:
        """Once the reader's wait under ``deadline`` is over."""
        await self._until(lambda: deadline not in self.armed)

    async def _until(self, done: Callable[[], bool]) -> None:
        while not done():
            self.changed.clear()
            await self.changed.wait()

    def advance_to(self, now: float) -> list[FakeDeadline]:
        """Move the clock to ``now``; the deadlines that fired."""
        assert now >= self.now, "time runs forward"
        self.now = now
        return [deadline for deadline in list(self.armed) if deadline.reach(now)]


def just_before(when: float | None) -> float:
    assert when is not None
    return math.nextafter(when, 0.0)


class Body:
    """A body that sends what the test gives it, when the test gives it."""

    def __init__(self) -> None:
        self._chunks: asyncio.Queue[bytes] = asyncio.Queue()

    def send(self, chunk: bytes) -> None:
        self._chunks.put_nowait(chunk)

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            yield await self._chunks.get()


async def next_batch(batches: AsyncIterator[list[JSONObject]]) -> list[JSONObject]:
    return await anext(batches)


async def test_silence_raises_the_idle_timeout_at_its_limit_and_not_before() -> None:
    clock, body = FakeClock(), Body()
    body.send(sse_json({"n": 1}))
    stream = SSEStream(body.chunks(), idle_timeout_s=LIMIT, timeout=clock.timeout)
    batches = stream.batches()
    assert await anext(batches) == [{"n": 1}]
    reading = asyncio.create_task(next_batch(batches))
    deadline = await clock.waiting(reading)
    assert clock.delays == [LIMIT, LIMIT]  # one deadline per wait, of exactly the limit
    assert deadline.when == LIMIT
    assert clock.advance_to(just_before(deadline.when)) == []
    assert clock.advance_to(deadline.when) == [deadline]
    with pytest.raises(SSEIdleTimeout) as caught:
        await reading
    assert caught.value.idle_timeout_s == LIMIT
    assert stream.end_reason is None


async def test_a_chunk_just_before_the_limit_is_read_not_timed_out() -> None:
    clock, body = FakeClock(), Body()
    stream = SSEStream(body.chunks(), idle_timeout_s=LIMIT, timeout=clock.timeout)
    reading = asyncio.create_task(collect(stream))
    deadline = await clock.waiting(reading)
    assert deadline.when == LIMIT
    assert clock.advance_to(just_before(deadline.when)) == []
    body.send(sse_json({"n": 1}) + DONE_FRAME)
    assert await reading == [{"n": 1}]
    assert stream.end_reason is EndReason.DONE


async def test_idle_timeout_applies_before_the_first_chunk() -> None:
    clock = FakeClock()
    stream = SSEStream(Body().chunks(), idle_timeout_s=LIMIT, timeout=clock.timeout)
    reading = asyncio.create_task(collect(stream))
    deadline = await clock.waiting(reading)
    assert deadline.when == LIMIT
    assert clock.advance_to(just_before(deadline.when)) == []
    assert clock.advance_to(deadline.when) == [deadline]
    with pytest.raises(SSEIdleTimeout):
        await reading


async def test_an_idle_timeout_set_between_reads_bounds_the_later_waits() -> None:
    clock, body = FakeClock(), Body()
    body.send(sse_json({"n": 1}))
    stream = SSEStream(body.chunks(), timeout=clock.timeout)
    batches = stream.batches()
    assert await anext(batches) == [{"n": 1}]
    assert clock.delays == []  # no idle timeout, no deadline: the common path
    stream.idle_timeout_s = LIMIT
    reading = asyncio.create_task(next_batch(batches))
    deadline = await clock.waiting(reading)
    assert clock.delays == [LIMIT]
    assert clock.advance_to(LIMIT) == [deadline]
    with pytest.raises(SSEIdleTimeout):
        await reading


async def test_idle_timeout_bounds_each_gap_not_the_whole_stream() -> None:
    clock, body = FakeClock(), Body()
    pieces = byte_by_byte(sse_json({"n": 1}) + DONE_FRAME)
    stream = SSEStream(body.chunks(), idle_timeout_s=LIMIT, timeout=clock.timeout)
    reading = asyncio.create_task(collect(stream))
    # Every gap is the longest that is not idleness; together they last many limits.
    for piece in pieces:
        deadline = await clock.waiting(reading)
        assert deadline.when == clock.now + LIMIT  # counted from the wait's own start
        assert clock.advance_to(just_before(deadline.when)) == []
        body.send(piece)
        await clock.left(deadline)
    assert await reading == [{"n": 1}]
    assert stream.end_reason is EndReason.DONE
    assert clock.now > 10 * LIMIT


async def test_time_spent_by_the_consumer_is_not_idleness() -> None:
    clock, body = FakeClock(), Body()
    body.send(sse_json({"n": 1}))
    body.send(sse_json({"n": 2}) + DONE_FRAME)
    stream = SSEStream(body.chunks(), idle_timeout_s=LIMIT, timeout=clock.timeout)
    seen: list[object] = []
    async for payload in stream:
        seen.append(payload)
        # The consumer works for twice the limit: no wait is going on, no deadline runs.
        assert clock.armed == []
        clock.advance_to(clock.now + 2 * LIMIT)
    assert seen == [{"n": 1}, {"n": 2}]
    assert stream.end_reason is EndReason.DONE
    assert clock.delays == [LIMIT, LIMIT]


async def test_no_idle_timeout_by_default() -> None:
    stream = SSEStream(source(sse_json({"n": 1})))
    assert await collect(stream) == [{"n": 1}]


async def test_timeout_error_raised_by_the_body_is_not_an_idle_timeout() -> None:
    async def failing() -> AsyncIterator[bytes]:
        yield sse_json({"n": 1})
        raise TimeoutError("read timeout")

    with pytest.raises(TimeoutError) as caught:
        await collect(SSEStream(failing(), idle_timeout_s=5))
    assert not isinstance(caught.value, SSEIdleTimeout)


# --- properties --------------------------------------------------------------------------

_LINE_ENDS = (b"\n", b"\r\n", b"\r")
_no_line_ends = st.characters(codec="utf-8", exclude_characters="\r\n")
_data = st.text(st.characters(codec="utf-8", exclude_characters="\r"))


class _Encoder:
    """Writes fields with randomly chosen line ends and colon spacing."""

    def __init__(self, draw: st.DrawFn) -> None:
        self.draw = draw
        self.out = bytearray()
        self.last_end = b""

    def line(self, content: bytes) -> None:
        # CR then LF would read as one CRLF line end, so never pick LF right after CR.
        choices = [end for end in _LINE_ENDS if not (self.last_end == b"\r" and end == b"\n")]
        self.last_end = self.draw(st.sampled_from(choices))
        self.out += content + self.last_end

    def field(self, name: bytes, value: str) -> None:
        if value == "" and self.draw(st.booleans()):
            self.line(name)
            return
        spaced = value.startswith(" ") or self.draw(st.booleans())
        self.line(name + (b": " if spaced else b":") + value.encode())


@st.composite
def encoded_streams(draw: st.DrawFn) -> tuple[list[bytes], list[SSEFrame]]:
    events = draw(st.lists(st.tuples(st.none() | st.text(_no_line_ends), _data), max_size=6))
    encoder = _Encoder(draw)
    if draw(st.booleans()):
        encoder.out += BOM
    for event, data in events:
        if draw(st.booleans()):
            encoder.line(b":" + draw(st.text(_no_line_ends)).encode())
        if event is not None:
            encoder.field(b"event", event)
        for piece in data.split("\n"):
            encoder.field(b"data", piece)
        encoder.line(b"")
    body = bytes(encoder.out)
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=12)))
    chunks = [body[start:end] for start, end in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    return chunks, [SSEFrame(data, event=event or "message") for event, data in events]


@settings(max_examples=300, deadline=None)
@given(encoded_streams())
def test_any_frames_with_any_line_ends_and_splits_parse_back_exactly(
    case: tuple[list[bytes], list[SSEFrame]],
) -> None:
    chunks, expected = case
    assert parse(*chunks) == (expected, EndReason.EOF)


@settings(max_examples=200, deadline=None)
@given(encoded_streams())
def test_any_stream_cut_before_its_last_line_end_is_reported_mid_frame(
    case: tuple[list[bytes], list[SSEFrame]],
) -> None:
    chunks, expected = case
    body = b"".join(chunks)
    if not expected:
        return
    # Drop the final blank line (and a CRLF's LF): the last frame must not be dispatched.
    cut = body[:-2] if body.endswith(b"\r\n") else body[:-1]
    frames, end = parse(cut)
    assert frames == expected[:-1]
    assert end is EndReason.EOF_MID_FRAME


@settings(max_examples=200, deadline=None)
@given(st.text(st.characters(codec="utf-8")), st.integers(0, 64))
def test_encode_data_round_trips_any_text(payload: str, cut: int) -> None:
    body = encode_data(payload)
    cut = min(cut, len(body))
    normalised = payload.replace("\r\n", "\n").replace("\r", "\n")
    assert parse(body[:cut], body[cut:]) == ([SSEFrame(normalised)], EndReason.EOF)


_json_events = st.one_of(
    st.dictionaries(
        st.text(max_size=4), st.integers(-(2**53), 2**53) | st.text(max_size=6), max_size=3
    ),
    st.sampled_from(["[1]", "nope", "[DONE]"]),
)


@st.composite
def json_streams(draw: st.DrawFn) -> list[bytes]:
    """Data frames of JSON objects (now and then something else: not an object, not JSON,
    [DONE], a comment, a field), split anywhere."""
    out = bytearray()
    for event in draw(st.lists(_json_events, max_size=8)):
        if draw(st.integers(0, 9)) == 0:
            out += draw(st.sampled_from([b": ping\n", b"event: x\n", b"id: 1\n"]))
        data = event.encode() if isinstance(event, str) else orjson.dumps(event)
        out += (b"data: " if draw(st.booleans()) else b"data:") + data + b"\n\n"
    body = bytes(out)
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=10)))
    return [body[start:end] for start, end in zip([0, *cuts], [*cuts, len(body)], strict=True)]


def _general(chunks: list[bytes]) -> tuple[list[JSONObject], int]:
    """The objects the general path alone reads, and the invalid events it skips."""
    parser, invalid = SSEParser(), 0
    objects: list[JSONObject] = []
    for frame in (frame for chunk in chunks for frame in parser.feed(chunk)):
        if frame.is_done:
            break
        try:
            payload = orjson.loads(frame.data)
        except orjson.JSONDecodeError:
            payload = None
        if isinstance(payload, dict):
            objects.append(payload)
        else:
            invalid += 1
    return objects, invalid


@settings(max_examples=300, deadline=None)
@given(json_streams())
def test_the_plain_path_reads_what_the_general_path_reads_and_keeps_exactly_its_bytes(
    chunks: list[bytes],
) -> None:
    async def read() -> tuple[list[tuple[list[JSONObject], bytes | None]], int]:
        stream = SSEStream(source(*chunks))
        batches = [(batch, stream.raw) async for batch in stream.batches()]
        return batches, stream.invalid_events

    batches, invalid = asyncio.run(read())
    assert ([o for batch, _ in batches for o in batch], invalid) == _general(chunks)
    for batch, raw in batches:
        if raw is not None:  # exactly the batch's events, as plain data frames
            assert _general([raw]) == (batch, 0)
            assert parse_frames(raw) and b"\r" not in raw and b"[DONE]" not in raw
