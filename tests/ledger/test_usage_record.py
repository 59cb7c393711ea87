"""The recorded form of the prompt-cache dimensions: left out while they hold nothing, so
events that use none keep the bytes they had before the dimensions existed, and read back
the same from either form."""

from __future__ import annotations

from ledger import events as ev
from tests.ledger.factories import succeeded_trail


def test_usage_without_cache_writes_is_recorded_as_before_and_with_them_round_trips() -> None:
    for event in succeeded_trail("r1"):
        data = ev.encode_event(event)
        assert "cache_write" not in repr(data) and "cache_writes" not in repr(data)
        assert ev.decode_event(type(event).type, type(event).schema_version, data) == event
    usage = ev.Usage(
        input_tokens=10, output_tokens=2, cache_write_input_tokens=3, cache_write_1h_input_tokens=1
    )
    assert usage.model_dump(mode="json")["cache_write_1h_input_tokens"] == 1
    assert ev.Usage.model_validate(usage.model_dump(mode="json")) == usage
    older = {"input_tokens": 10, "output_tokens": 2, "cached_input_tokens": 0}
    assert ev.Usage.model_validate(older).cache_write_input_tokens == 0
    asked = ev.Requirements(cache_writes=("5m", "1h"))
    assert ev.Requirements.model_validate(asked.model_dump(mode="json")) == asked
