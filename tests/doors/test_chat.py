"""A chat request read at the edge (router/doors/chat.py): X-Waybill-Allow-Failover and what makes a
request strict, carried into its requirements."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from router.config import Workspace
from router.doors.chat import ALLOW_FAILOVER_VALUES, HeaderNarrowing, parse_body, read_headers
from router.errors import GatewayError

WORKSPACE = Workspace(id="acme", models=("chat",), regions=frozenset({"us"}), data_class="public")
MESSAGES = [{"role": "user", "content": "hi"}]
FUNCTION = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    ("value", "allow_failover", "allow_unknown_execution"),
    [
        (None, True, False),
        ("true", True, False),
        ("1", True, False),
        ("yes", True, False),
        ("false", False, False),
        ("0", False, False),
        ("no", False, False),
        ("unknown", True, True),
        (" Unknown ", True, True),
        ("FALSE", False, False),
    ],
)
def test_allow_failover_header(
    value: str | None, allow_failover: bool, allow_unknown_execution: bool
) -> None:
    headers = read_headers({} if value is None else {"x-waybill-allow-failover": value})
    assert (headers.allow_failover, headers.allow_unknown_execution) == (
        allow_failover,
        allow_unknown_execution,
    )


@pytest.mark.parametrize("value", ["maybe", "", "unknown,true", "2", "unknowns"])
def test_a_bad_allow_failover_value_is_a_400_listing_the_values(value: str) -> None:
    with pytest.raises(GatewayError) as caught:
        read_headers({"x-waybill-allow-failover": value})
    error = caught.value
    assert (error.status, error.code, error.param) == (
        400,
        "invalid_request",
        "X-Waybill-Allow-Failover",
    )
    assert "true, false or unknown" in error.message


def test_the_documented_values_are_the_ones_read() -> None:
    assert set(ALLOW_FAILOVER_VALUES) == {"true", "false", "unknown", "1", "0", "yes", "no"}
    for value in ALLOW_FAILOVER_VALUES:
        read_headers({"x-waybill-allow-failover": value})


def _requirements(headers: dict[str, str] | None = None, **body: Any) -> Any:
    call = parse_body(orjson.dumps({"model": "chat", "messages": MESSAGES, **body}))
    return call.requirements(WORKSPACE, read_headers(headers or {}))


def test_the_header_reaches_the_requirements() -> None:
    assert _requirements().allow_unknown_execution is False
    allowed = _requirements({"x-waybill-allow-failover": "unknown"})
    assert (allowed.allow_failover, allowed.allow_unknown_execution) == (True, True)


@pytest.mark.parametrize(
    ("workspace_bound", "header", "required"),
    [
        (None, None, None),
        (None, "30d", "30d"),
        (None, " ZERO ", "zero"),
        ("30d", None, "30d"),
        ("30d", "7d", "7d"),  # the header narrows
        ("7d", "30d", "7d"),  # and never widens
        ("zero", "1d", "zero"),
        ("none", "zero", "none"),
    ],
)
def test_the_retention_header_narrows_the_workspaces_bound_never_widens_it(
    workspace_bound: str | None, header: str | None, required: str | None
) -> None:
    workspace = WORKSPACE.model_copy(update={"retention": workspace_bound})
    headers = read_headers({} if header is None else {"x-waybill-retention": header})
    call = parse_body(orjson.dumps({"model": "chat", "messages": MESSAGES}))
    assert call.requirements(workspace, headers).retention == required


@pytest.mark.parametrize("value", ["none", "0d", "30", "d", "-1d", "1.5d", "", "100000d"])
def test_a_bad_retention_header_is_a_400_naming_it(value: str) -> None:
    with pytest.raises(GatewayError) as caught:
        read_headers({"x-waybill-retention": value})
    error = caught.value
    assert (error.status, error.code) == (400, "invalid_request")
    assert error.param == "X-Waybill-Retention"


@pytest.mark.parametrize(
    ("value", "granted"),
    [(None, False), ("true", True), ("yes", True), ("unknown", True), ("false", False)],
)
def test_only_a_header_that_allows_failover_grants_it(value: str | None, granted: bool) -> None:
    headers = {} if value is None else {"x-waybill-allow-failover": value}
    assert _requirements(headers).failover_granted is granted


@pytest.mark.parametrize(
    "body",
    [
        {"tools": [{"type": "web_search"}]},
        {"tools": [{"type": "web_search_preview"}]},
        {"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]},
        {"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]},
        {"tools": [{"type": "mcp", "server_label": "x", "server_url": "https://x.invalid"}]},
        {"tools": [FUNCTION, {"type": "web_search_20250305", "name": "web_search"}]},
        {"tools": [{"type": "code_execution_20250825", "name": "code_execution"}]},
        {"web_search_options": {}},
        {"web_search_options": {"search_context_size": "low"}},
        {"mcp_servers": [{"type": "url", "url": "https://x.invalid", "name": "x"}]},
    ],
    ids=[
        "web_search",
        "web_search_preview",
        "file_search",
        "code_interpreter",
        "mcp",
        "anthropic-web_search",
        "anthropic-code_execution",
        "web_search_options",
        "web_search_options-low",
        "mcp_servers",
    ],
)
def test_server_side_tools_and_fields_make_the_request_strict(body: dict[str, Any]) -> None:
    assert _requirements(**body).server_side_effects is True


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"tools": []},
        {"tools": [FUNCTION]},
        {"tools": [{"type": "custom", "custom": {"name": "grammar"}}]},
        {"tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]},  # no type
        {"web_search_options": None},
    ],
    ids=["none", "empty", "function", "custom", "untyped", "null-search"],
)
def test_client_run_tools_leave_the_request_as_its_policy_says(body: dict[str, Any]) -> None:
    assert _requirements(**body).server_side_effects is False


def test_header_narrowing_defaults_allow_failover_but_no_duplicate() -> None:
    narrowing = HeaderNarrowing()
    assert (narrowing.allow_failover, narrowing.allow_unknown_execution) == (True, False)


def _body(**fields: Any) -> bytes:
    return orjson.dumps({"model": "chat", "messages": MESSAGES, **fields})


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"tools": [FUNCTION], "tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tool_choice",
        ),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
        ({"tools": [FUNCTION], "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"functions": [{"name": "a"}], "function_call": {"name": "b"}}, "function_call"),
    ],
    ids=["undeclared", "no-tools", "no-name", "legacy-undeclared"],
)
def test_forcing_a_function_the_request_does_not_declare_is_a_400(
    fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(GatewayError) as caught:
        parse_body(_body(**fields))
    assert caught.value.status == 400 and caught.value.param == param
    assert "does not declare" in caught.value.message


@pytest.mark.parametrize(
    "fields",
    [
        {
            "tools": [FUNCTION],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
        {"tools": [FUNCTION], "tool_choice": "required"},
        {"tools": [FUNCTION], "tool_choice": "none"},
        {
            "tools": [{"type": "custom", "custom": {"name": "g"}}],
            "tool_choice": {"type": "custom", "custom": {"name": "g"}},
        },
        {"functions": [{"name": "a"}], "function_call": {"name": "a"}},
        {"functions": [{"name": "a"}], "function_call": "auto"},
    ],
    ids=["declared", "required", "none", "custom-passes-through", "legacy-declared", "legacy-auto"],
)
def test_a_choice_of_a_declared_function_or_a_mode_passes(fields: dict[str, Any]) -> None:
    assert parse_body(_body(**fields)).body["model"] == "chat"


def test_the_endpoint_headers_reach_the_requirements() -> None:
    requirements = _requirements(
        {
            "x-waybill-endpoints": "west, provider:anthropic,west",
            "x-waybill-prefer-endpoint": " west ",
            "x-waybill-require-endpoint": "east",
        }
    )
    assert requirements.endpoints == ("provider:anthropic", "west")
    assert (requirements.prefer_endpoint, requirements.require_endpoint) == ("west", "east")
    unnarrowed = _requirements()
    assert (unnarrowed.endpoints, unnarrowed.prefer_endpoint, unnarrowed.require_endpoint) == (
        None,
        None,
        None,
    )


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("X-Waybill-Endpoints", " , "),
        ("X-Waybill-Prefer-Endpoint", " "),
        ("X-Waybill-Require-Endpoint", ""),
    ],
)
def test_an_endpoint_header_naming_nothing_is_a_400_naming_it(name: str, value: str) -> None:
    with pytest.raises(GatewayError) as caught:
        read_headers({name.lower(): value})
    assert (caught.value.status, caught.value.param) == (400, name)
