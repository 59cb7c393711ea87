"""What commits a stream: the first chunk with something the client must see. Until then
the gateway may still fail over unseen (contract §5 "Streaming")."""

from __future__ import annotations

from typing import Any

import pytest

from router.request.relay import has_content


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


@pytest.mark.parametrize(
    "chunk",
    [
        _chunk({"content": "Hel"}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}),
        _chunk({"refusal": "I can't"}),
        _chunk({"audio": {"id": "audio_1", "data": "UklGR", "transcript": "Hi"}}),
        _chunk({"function_call": {"name": "f", "arguments": ""}}),
        _chunk({}, finish="stop"),
    ],
)
def test_content_of_any_kind_commits_the_stream(chunk: dict[str, Any]) -> None:
    assert has_content(chunk)


@pytest.mark.parametrize(
    "chunk",
    [
        _chunk({"role": "assistant"}),
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"audio": {}}),
        {"choices": []},  # the usage chunk
        {"id": "x"},
    ],
)
def test_a_preamble_does_not(chunk: dict[str, Any]) -> None:
    assert not has_content(chunk)
