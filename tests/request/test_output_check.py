"""Output validation (router/request/output_check.py): what a buffered answer must satisfy, and how
a
violation is described — by where and which rule, never by the content."""

from __future__ import annotations

import json
from typing import Any

import pytest

from router.request.output_check import demands_a_shape, output_violation

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "degrees": {"type": "integer"}},
    "required": ["city", "degrees"],
    "additionalProperties": False,
}
STRICT = {
    "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": True}}
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": SCHEMA, "strict": True},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]


def _answer(*contents: str) -> dict[str, Any]:
    return {"choices": [{"index": i, "message": {"content": c}} for i, c in enumerate(contents)]}


def _calls(*calls: tuple[str, str]) -> dict[str, Any]:
    tool_calls = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    return {"choices": [{"index": 0, "message": {"content": None, "tool_calls": tool_calls}}]}


def test_only_a_strict_schema_or_a_demanded_tool_is_checked():
    assert demands_a_shape(STRICT)
    assert demands_a_shape({"tool_choice": "required", "tools": TOOLS})
    assert demands_a_shape({"tool_choice": {"type": "function", "function": {"name": "x"}}})
    loose = {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}
    for body in ({}, loose, {"response_format": {"type": "json_object"}}, {"tool_choice": "auto"}):
        assert not demands_a_shape(body)
        assert output_violation(body, _answer("anything")) is None


def test_json_that_satisfies_the_schema_passes():
    assert output_violation(STRICT, _answer('{"city": "Paris", "degrees": 21}')) is None


SECRET = "the-secret-answer-text"


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (f"Sure! {SECRET}", "the content is not JSON"),
        (json.dumps({"city": SECRET}), "$: required"),
        (json.dumps({"city": SECRET, "degrees": "warm"}), '$.degrees: type "integer"'),
        (json.dumps({"city": "x", "degrees": 1, SECRET: 1}), "$: additionalProperties"),
    ],
    ids=["not-json", "missing", "wrong-type", "extra"],
)
def test_a_violation_names_where_and_which_rule_never_the_content(content, expected):
    problem = output_violation(STRICT, _answer(content))
    assert problem is not None and expected in problem
    assert SECRET not in problem and "warm" not in problem


def test_every_choice_must_satisfy_it():
    problem = output_violation(STRICT, _answer('{"city": "a", "degrees": 1}', "no"))
    assert problem is not None and problem.startswith("choice 1:")


def test_a_required_tool_choice_needs_a_call_with_json_object_arguments():
    body = {"tool_choice": "required", "tools": TOOLS}
    assert output_violation(body, _calls(("get_time", "{}"))) is None
    assert "no tool call" in (output_violation(body, _answer("I'd rather talk")) or "")
    assert "not JSON" in (output_violation(body, _calls(("get_time", "{oops"))) or "")
    assert "not a JSON object" in (output_violation(body, _calls(("get_time", "[1]"))) or "")


def test_a_named_tool_choice_needs_that_function_and_a_strict_tools_parameters():
    body = {
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "tools": TOOLS,
    }
    good = json.dumps({"city": "Paris", "degrees": 3})
    assert output_violation(body, _calls(("get_weather", good))) is None
    assert "another function" in (output_violation(body, _calls(("get_time", "{}"))) or "")
    problem = output_violation(body, _calls(("get_weather", json.dumps({"city": SECRET}))))
    assert problem is not None and "the parameters of 'get_weather'" in problem
    assert SECRET not in problem


def test_a_response_format_schema_that_is_not_valid_demands_nothing():
    # The provider refuses such a request itself, before any answer.
    spec = {"schema": {"type": 7}, "strict": True}
    broken = {"response_format": {"type": "json_schema", "json_schema": spec}}
    assert not demands_a_shape(broken)
    assert output_violation(broken, _answer("{}")) is None


def test_a_strict_tools_parameters_that_are_not_a_valid_schema_are_reported_as_such():
    tool = {"name": "f", "parameters": {"type": 7}, "strict": True}
    body = {"tool_choice": "required", "tools": [{"type": "function", "function": tool}]}
    problem = output_violation(body, _calls(("f", "{}")))
    assert problem is not None and "not a valid JSON Schema" in problem
