"""The embeddings door's pure parts (router/doors/embeddings.py): what a body may hold, the
input's token bound, and the core's request it becomes (contract §3 "Embeddings")."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from router.config import Workspace
from router.doors import embeddings
from router.doors.headers import read_headers
from router.errors import GatewayError

WORKSPACE = Workspace(
    id="acme", models=("embed",), regions=frozenset({"us"}), data_class="internal"
)


def parse(**body: Any) -> embeddings.EmbeddingsCall:
    return embeddings.parse_body(orjson.dumps({"model": "embed", **body}))


def refused(**body: Any) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        parse(**body)
    return caught.value


def test_text_is_bounded_by_its_utf8_bytes():
    call = parse(input="héllo 日本")
    assert call.input_tokens == call.largest_input_tokens == len("héllo 日本".encode())
    assert call.input_count == 1


def test_a_batch_counts_every_input_and_keeps_the_longest():
    call = parse(input=["ab", "abcd", "a"])
    assert (call.input_count, call.input_tokens, call.largest_input_tokens) == (3, 7, 4)


def test_token_arrays_count_exactly():
    assert parse(input=[[1, 2, 3], [4]]).input_tokens == 4
    single = parse(input=[5, 6, 7])  # a flat array of ids is one token array, as OpenAI reads it
    assert (single.input_count, single.input_tokens) == (1, 3)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": None}, "input"),
        ({"input": ["ok", ""]}, "input[1]"),
        ({"input": ["ok", 3.5]}, "input[1]"),
        ({"input": [[1], []]}, "input[1]"),
        ({"input": [[1, -2]]}, "input[0]"),
        ({"input": [1, True]}, "input"),
        ({"input": ["x"] * 2049}, "input"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "dimensions": "8"}, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "user": 7}, "user"),
        ({"input": "x", "stream": True}, "stream"),
    ],
)
def test_a_malformed_body_is_refused_naming_the_field(body, param):
    error = refused(**body)
    assert (error.status, error.code, error.param) == (400, "invalid_request", param)


def test_the_model_must_be_named():
    with pytest.raises(GatewayError) as caught:
        embeddings.parse_body(b'{"input": "x"}')
    assert caught.value.param == "model"


def test_the_core_request_is_an_embeddings_one_without_output_or_stream():
    call = parse(input=["ab", "abcd"], dimensions=256, user="u-1")
    headers = read_headers({"x-waybill-capabilities": "eu-only", "x-waybill-max-cost-usd": "0.5"})
    core = embeddings.to_core(call, headers, WORKSPACE)
    assert core.api == "openai.embeddings"
    assert core.stream is False and core.max_tokens is None
    assert core.body == {
        "model": "embed",
        "input": ["ab", "abcd"],
        "dimensions": 256,
        "user": "u-1",
    }
    assert core.message_count == 2
    r = core.requirements
    assert r.kind == "embeddings"
    assert r.capabilities == ("embeddings", "eu-only")
    assert (r.estimated_input_tokens, r.largest_input_tokens, r.max_output_tokens) == (6, 4, 0)
    assert str(r.max_cost_usd) == "0.5"


def test_the_prompt_hash_is_of_the_input_alone():
    a = parse(input=["x", "y"], user="one")
    b = parse(input=["x", "y"], user="two")
    assert a.prompt_sha256 == b.prompt_sha256
    assert a.body_sha256() != b.body_sha256()


def test_integers_written_as_json_floats_are_integers():
    # JSON has numbers, not ints: an SDK or a schema-driven client may write 5.0.
    assert parse(input=[[5.0, 6]], dimensions=256.0).input_tokens == 2
    assert parse(input=[7.0, 8.0]).input_count == 1
    assert refused(input=[[5.5]]).param == "input[0]"
    assert refused(input="x", dimensions=2.5).param == "dimensions"


def test_the_endpoint_headers_narrow_an_embeddings_request_too():
    headers = read_headers(
        {"x-waybill-endpoints": "provider:openai", "x-waybill-require-endpoint": "east"}
    )
    requirements = parse(input="hi").requirements(WORKSPACE, headers)
    assert requirements.endpoints == ("provider:openai",)
    assert requirements.require_endpoint == "east"
