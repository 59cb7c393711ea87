"""The OpenAPI bodies of the later doors (Responses, count_tokens, embeddings), added to the
component schemas, and the chat request's ``n`` bound by the serving limits."""

from __future__ import annotations

from typing import Final

from router.config import Limits
from router.doors.chat import MAX_JSON_INTEGER
from router.http.openapi_parts import (
    STRING,
    TOKENS,
    Schema,
    nullable,
    object_schema,
    ref,
    when,
)
from router.http.openapi_schemas import SCHEMAS


def n_schema(max_n: int) -> Schema:
    return nullable(
        {
            "type": "integer",
            "minimum": 1,
            "maximum": max_n,
            "description": "Choices to generate, each billed its own output tokens. At most "
            "the config's limits.max_n: more is refused (400 invalid_request, param n).",
        }
    )


ANY: Final[Schema] = {}
TEXT_PARTS: Final = ("input_text", "output_text", "text")
SCHEMAS["ResponsesRequest"] = {
    "description": (
        "An OpenAI Responses API request; model names a Waybill model group. A field outside "
        "the documented set is refused (400). A stateless request is served by any eligible "
        "mapping, translated to chat completions; previous_response_id, conversation, "
        "store: true, background: true, a stored prompt and built-in tools need a mapping "
        'that declares the capability responses (contract §3 "The Responses door"). Also '
        'accepted, beyond what this schema can say: tool_choice {"type": "function", '
        '"name"} naming a declared function tool, or naming a built-in tool.'
    ),
    "type": "object",
    "required": ["model", "input"],
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "input": {
            "anyOf": [
                STRING,
                {"type": "array", "minItems": 1, "items": ref("ResponsesItem")},
            ]
        },
        "instructions": nullable(STRING),
        "tools": nullable({"type": "array", "items": ref("ResponsesTool")}),
        "tool_choice": nullable({"enum": ["auto", "none", "required"]}),
        "parallel_tool_calls": nullable({"type": "boolean"}),
        "max_output_tokens": nullable(TOKENS),
        "max_tool_calls": nullable(TOKENS),
        "temperature": nullable({"type": "number"}),
        "top_p": nullable({"type": "number"}),
        "text": nullable(
            {
                "type": "object",
                "properties": {
                    "format": nullable(ref("ResponsesFormat")),
                    "verbosity": nullable(STRING),
                },
            }
        ),
        "reasoning": nullable({"type": "object", "properties": {"effort": nullable(STRING)}}),
        "metadata": nullable({"type": "object"}),
        "stream": nullable({"type": "boolean"}),
        "store": nullable({"type": "boolean"}),
        "background": nullable({"type": "boolean"}),
        "previous_response_id": nullable({"type": "string", "minLength": 1, "maxLength": 200}),
        "user": nullable(STRING),
        "safety_identifier": nullable(STRING),
        "prompt_cache_key": nullable(STRING),
        "service_tier": nullable(STRING),
        # Passed to a native endpoint as they are, or dropped on the translation.
        "conversation": ANY,
        "prompt": ANY,
        "context_management": ANY,
        "include": ANY,
        "truncation": ANY,
        "top_logprobs": ANY,
        "stream_options": ANY,
        "prompt_cache_retention": ANY,
    },
    "additionalProperties": False,
}
SCHEMAS["ResponsesItem"] = {
    "description": (
        "An input item: a message (the default type), function_call, function_call_output, "
        "reasoning; other types are sent natively to a mapping that declares responses."
    ),
    "type": "object",
    "properties": {"type": STRING},
    "allOf": [
        when(
            "message",
            role={"enum": ["user", "assistant", "system", "developer"]},
            content={"anyOf": [STRING, {"type": "array", "items": ref("ResponsesPart")}]},
        ),
        when("function_call", call_id=STRING, name=STRING, arguments=STRING),
        when(
            "function_call_output",
            call_id=STRING,
            output={"anyOf": [STRING, {"type": "array", "items": ref("ResponsesPart")}]},
        ),
    ],
}
SCHEMAS["ResponsesPart"] = {
    "description": "A content part: input_text, input_image, input_file, output_text, ...",
    "type": "object",
    "required": ["type"],
    "properties": {"type": STRING},
    "allOf": [when(kind, text=STRING) for kind in TEXT_PARTS],
}
SCHEMAS["ResponsesTool"] = {
    "description": "A function tool (name required), or a built-in tool of another type.",
    "type": "object",
    "required": ["type"],
    "properties": {"type": STRING},
    "allOf": [when("function", name=STRING)],
}
SCHEMAS["ResponsesFormat"] = {
    "type": "object",
    "required": ["type"],
    "properties": {"type": {"enum": ["text", "json_object", "json_schema"]}},
    "allOf": [when("json_schema", name=STRING, schema={"type": "object"})],
}
SCHEMAS["Response"] = {
    "description": "OpenAI's response object.",
    "type": "object",
    "required": ["id", "object", "status", "output", "model"],
    "properties": {
        "id": STRING,
        "object": {"type": "string", "enum": ["response"]},
        "status": STRING,
        "output": {"type": "array", "items": {"type": "object"}},
        "model": nullable(STRING),
        "usage": nullable({"type": "object"}),
    },
}


# A count_tokens body is a Messages body whose max_tokens may be left out.
SCHEMAS["MessagesCountRequest"] = {
    **SCHEMAS["MessagesRequest"],
    "description": "A Messages API request to count (max_tokens may be left out).",
    "required": ["model", "messages"],
}


# The embeddings door (router/doors/embeddings.py).
TOKEN_ARRAY: Final[Schema] = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "integer", "minimum": 0, "maximum": MAX_JSON_INTEGER},
}
SCHEMAS["EmbeddingsRequest"] = {
    "description": (
        "An OpenAI embeddings request, for a model group of kind embeddings (another kind: "
        "400 model_kind_mismatch). Fields the gateway does not read pass through to the "
        "upstream unchanged. Before each attempt the gateway reserves the input at the "
        "mapping's input_per_mtok: exact for token arrays, a token per byte for text; "
        "there is no output."
    ),
    "type": "object",
    "required": ["model", "input"],
    "properties": {
        "model": {
            "type": "string",
            "minLength": 1,
            "description": "A model group of kind embeddings the key may call.",
        },
        "input": {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 2048,
                    "items": {"type": "string", "minLength": 1},
                },
                TOKEN_ARRAY,
                {"type": "array", "minItems": 1, "maxItems": 2048, "items": TOKEN_ARRAY},
            ]
        },
        "dimensions": nullable(TOKENS),
        "encoding_format": nullable({"enum": ["float", "base64"]}),
        "user": nullable(STRING),
    },
    "additionalProperties": True,
}
SCHEMAS["Embeddings"] = {
    "description": "OpenAI's embeddings list: one embedding per input, in order.",
    "type": "object",
    "required": ["object", "data", "model", "usage"],
    "properties": {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "items": object_schema(
                ["object", "index", "embedding"],
                object={"const": "embedding"},
                index={"type": "integer", "minimum": 0},
                embedding={
                    "anyOf": [
                        {"type": "array", "items": {"type": "number"}},
                        {"type": "string", "description": "base64 of float32s, little-endian"},
                    ]
                },
            ),
        },
        "model": STRING,
        "usage": object_schema(
            ["prompt_tokens", "total_tokens"],
            prompt_tokens={"type": "integer", "minimum": 0},
            total_tokens={"type": "integer", "minimum": 0},
        ),
    },
}


def schemas_for(limits: Limits) -> dict[str, Schema]:
    request = SCHEMAS["ChatCompletionRequest"]
    properties = {**request["properties"], "n": n_schema(limits.max_n)}
    return {**SCHEMAS, "ChatCompletionRequest": {**request, "properties": properties}}
