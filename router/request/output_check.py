"""Output validation (contract §5 "Output validation"): does a buffered answer give what the
request demanded?

A request demands a shape with ``response_format: {type: json_schema, json_schema: {schema,
strict: true}}`` (every choice's content is JSON that satisfies the schema) or with a
``tool_choice`` of ``required`` (every choice calls a tool) or naming a function (every
choice calls that one). A call's arguments must be a JSON object, and satisfy the tool's
``parameters`` when the tool is ``strict``. Pure; JSON Schema by the ``jsonschema`` library.

The violation is described by where and which rule failed, never by the content: an answer
may hold anything, and the description is recorded in the ledger.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, ValidationError

from ledger.events import Evidence, FailureClass
from router.request.classify import Classification

__all__ = ["INVALID_OUTPUT", "demands_a_shape", "output_violation"]

INVALID_OUTPUT: Final = Classification(
    failure_class=FailureClass.INVALID_OUTPUT,
    evidence=Evidence.STARTED,  # it answered, and said what it used
    breaker_scope="mapping",  # the model, not the endpoint, answered wrongly
    breaker_opens_at_once=False,
    may_fail_over="per_on_invalid_output",
)


def demands_a_shape(body: Mapping[str, Any]) -> bool:
    """Whether :func:`output_violation` has anything to check for this request (cheap)."""
    return _schema(body) is not None or _tool_demand(body) is not None


def output_violation(body: Mapping[str, Any], response: Mapping[str, Any]) -> str | None:
    """What in ``response`` breaks what ``body`` demanded, or None when it does not."""
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices:
        return "the answer has no choices"
    schema = _schema(body)
    demand = _tool_demand(body)
    for index, choice in enumerate(choices):
        message = choice.get("message") if isinstance(choice, dict) else None
        if not isinstance(message, dict):
            return f"choice {index}: no message"
        problem = None
        if demand is not None:
            problem = _tool_violation(body, message, demand)
        elif schema is not None:
            problem = _schema_violation(schema, message.get("content"))
        if problem is not None:
            return f"choice {index}: {problem}"
    return None


def _schema(body: Mapping[str, Any]) -> Mapping[str, Any] | None:
    response_format = body.get("response_format")
    if not isinstance(response_format, dict) or response_format.get("type") != "json_schema":
        return None
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or spec.get("strict") is not True:
        return None
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        return None
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError:
        return None  # the provider refuses such a request itself (a 400), before any answer
    return schema


def _tool_demand(body: Mapping[str, Any]) -> str | None:
    """``"required"``, the name of the function demanded, or None."""
    choice = body.get("tool_choice")
    if choice == "required":
        return "required"
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return str(function["name"])
    return None


def _schema_violation(schema: Mapping[str, Any], content: object) -> str | None:
    if not isinstance(content, str):
        return "no content where JSON satisfying the response_format schema was required"
    try:
        document = json.loads(content)
    except json.JSONDecodeError as error:
        return f"the content is not JSON ({error.msg} at character {error.pos})"
    return _against(schema, document, "the response_format schema")


def _tool_violation(body: Mapping[str, Any], message: Mapping[str, Any], demand: str) -> str | None:
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        return f"no tool call where tool_choice demanded {_demanded(demand)}"
    tools = _tools(body)
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            return "a tool call without a function"
        name = function.get("name")
        if demand != "required" and name != demand:
            return f"a call of another function where tool_choice demanded {demand!r}"
        try:
            arguments = json.loads(function.get("arguments") or "")
        except json.JSONDecodeError as error:
            return f"the arguments of {name!r} are not JSON ({error.msg})"
        if not isinstance(arguments, dict):
            return f"the arguments of {name!r} are not a JSON object"
        tool = tools.get(name) if isinstance(name, str) else None
        if tool is not None and tool.get("strict") is True:
            parameters = tool.get("parameters")
            if isinstance(parameters, dict):
                problem = _against(parameters, arguments, f"the parameters of {name!r}")
                if problem is not None:
                    return problem
    return None


def _tools(body: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    found: dict[str, Mapping[str, Any]] = {}
    for tool in body.get("tools") or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            found[function["name"]] = function
    return found


def _demanded(demand: str) -> str:
    return "a call" if demand == "required" else f"a call of {demand!r}"


def _against(schema: Mapping[str, Any], document: object, what: str) -> str | None:
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as problem:
        return f"{what} is not a valid JSON Schema ({problem.validator} at {_path(problem)})"
    validator = Draft202012Validator(schema)
    error = next(iter(sorted(validator.iter_errors(document), key=_depth)), None)
    if error is None:
        return None
    # The rule and where it failed: never the value found there.
    return f"fails {what} at {error.json_path}: {error.validator} {_rule(error)}"


def _depth(error: ValidationError) -> int:
    return len(error.absolute_path)


def _path(error: SchemaError) -> str:
    return "/" + "/".join(str(p) for p in error.absolute_schema_path)


def _rule(error: ValidationError) -> str:
    value = error.validator_value
    if isinstance(value, str | int | float | bool) or value is None:
        return json.dumps(value)
    if isinstance(value, list) and all(isinstance(v, str) for v in value) and len(value) <= 8:
        return json.dumps(value)
    return "(see the schema)"
