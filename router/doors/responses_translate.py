"""A Responses body as the core's canonical chat body (:func:`translate`): its input items,
instructions, tools and fields checked (a 400 names the first offending one) and translated,
noting what only the provider's own Responses API can serve. Pure.

Waybill keeps no content, so what needs the provider's state or effects cannot be translated
onto chat completions: the request then needs the capability ``responses`` (a mapping that
declares it is sent the body natively, contract §4), and names what needed it
(:attr:`Translation.needs_provider`):

- ``previous_response_id``, ``conversation``, ``store: true``, ``background: true``,
  ``prompt`` (a stored prompt), ``item_reference`` input items: the provider's state.
- built-in tools (``web_search``, ``file_search``, ``code_interpreter``, ``mcp``, any tool
  type other than ``function``) and a ``tool_choice`` naming one: the provider's effects
  (the request is strict too, contract §5).
- input items the chat shape has no place for (``web_search_call``, ``computer_call``, ...).

Dropped on the translation, as not changing the answer's meaning: ``reasoning`` input items
(earlier turns' reasoning, which a stateless chat endpoint never reads back), ``include``,
``truncation``, ``metadata`` (the client's own tags: Waybill records none of the content),
``reasoning.summary``, ``top_logprobs``; ``store: false`` and an absent ``store`` alike (Waybill
translates such a request; an endpoint that is sent it natively applies its own default).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from router.doors.messages_translate import number, positive_int, typed
from router.errors import invalid_request

__all__ = ["RESPONSES_FIELDS", "Translation", "translate"]

RESPONSES_FIELDS: Final = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "max_output_tokens",
        "max_tool_calls",
        "temperature",
        "top_p",
        "top_logprobs",
        "text",
        "reasoning",
        "metadata",
        "stream",
        "stream_options",
        "store",
        "background",
        "previous_response_id",
        "conversation",
        "prompt",
        "include",
        "truncation",
        "user",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "service_tier",
        "context_management",
    }
)
"""The Responses API's documented request fields."""
# Fields passed to a chat endpoint as they are (chat completions reads them alike).
_PASSED: Final = ("user", "safety_identifier", "prompt_cache_key", "service_tier")
_ROLES: Final = frozenset({"user", "assistant", "system", "developer"})
_TOOL_CHOICES: Final = frozenset({"auto", "none", "required"})
# Input items that are a turn's own (a message, a function call and its output) and those
# carrying no meaning for a stateless endpoint (an earlier turn's reasoning).
_DROPPED_ITEMS: Final = frozenset({"reasoning"})
_MAX_ID: Final = 200


@dataclass(slots=True)
class Translation:
    """What translating a body found, and the canonical messages."""

    images: int = 0
    files: int = 0
    needs_provider: list[str] = field(default_factory=list)  # what only a native endpoint serves
    server_side_effects: bool = False  # built-in tools: strict (contract §5)
    web_search: bool = False  # a web_search tool: billed per search
    chat: list[dict[str, Any]] = field(default_factory=list)

    def native(self, feature: str) -> None:
        if feature not in self.needs_provider:
            self.needs_provider.append(feature)


def translate(body: Mapping[str, Any], *, stream: bool) -> tuple[dict[str, Any], Translation]:
    """The canonical chat body of a Responses ``body`` (whose top-level fields are known to
    be allowed), and what was found."""
    reading = Translation()
    _state(body, reading)
    instructions = typed(body, "instructions", str, None)
    if instructions:
        reading.chat.append({"role": "system", "content": instructions})
    _input(body.get("input"), reading)
    if not reading.chat:
        # Nothing a chat endpoint reads (earlier reasoning, or items only the provider
        # reads): the canonical body holds one empty turn.
        reading.chat.append({"role": "user", "content": ""})
    chat: dict[str, Any] = {"model": body["model"], "messages": reading.chat}
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    limit = positive_int(body.get("max_output_tokens"), "max_output_tokens")
    if limit is not None:
        # Responses' bound counts reasoning tokens too, as max_completion_tokens does.
        chat["max_completion_tokens"] = limit
    for name in ("temperature", "top_p"):
        value = number(body, name)
        if value is not None:
            chat[name] = value
    for name in _PASSED:
        value = typed(body, name, str, None)
        if value is not None:
            chat[name] = value
    _tools(body, chat, reading)
    _text(body, chat)
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise invalid_request("'reasoning' must be an object", param="reasoning")
        effort = typed(reasoning, "effort", str, None, "reasoning.")
        if effort is not None:
            chat["reasoning_effort"] = effort
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise invalid_request("'metadata' must be an object", param="metadata")
    return chat, reading


def _state(body: Mapping[str, Any], reading: Translation) -> None:
    """The fields that ask the provider to keep or read state (module docstring)."""
    for name in ("previous_response_id", "conversation", "prompt", "context_management"):
        if body.get(name) is not None:
            reading.native(name)
    previous = typed(body, "previous_response_id", str, None)
    # An id is looked up in the ledger's read model: no longer than an id it holds, and no
    # NUL, which PostgreSQL text cannot hold.
    if previous is not None and not (0 < len(previous) <= _MAX_ID and "\x00" not in previous):
        raise invalid_request(
            f"'previous_response_id' must be 1 to {_MAX_ID} characters, no NUL",
            param="previous_response_id",
        )
    for name in ("store", "background"):
        if typed(body, name, bool, False):
            reading.native(f"{name}: true")
    if body.get("max_tool_calls") is not None:
        positive_int(body.get("max_tool_calls"), "max_tool_calls")
        reading.native("max_tool_calls")


# --- input ---


def _input(value: object, reading: Translation) -> None:
    if isinstance(value, str):
        reading.chat.append({"role": "user", "content": value})
        return
    if not isinstance(value, list) or not value:
        raise invalid_request(
            "'input' must be a string or a non-empty array of items", param="input"
        )
    for index, item in enumerate(value):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise invalid_request(f"'{where}' must be an object", param=where)
        kind = item.get("type", "message")
        if not isinstance(kind, str):
            raise invalid_request(f"'{where}.type' must be a string", param=where)
        if kind == "message":
            _message(item, where, reading)
        elif kind == "function_call":
            _function_call(item, where, reading)
        elif kind == "function_call_output":
            _function_output(item, where, reading)
        elif kind not in _DROPPED_ITEMS:
            reading.native(f"input item {kind}")  # item_reference, built-in tools' calls


def _message(item: Mapping[str, Any], where: str, reading: Translation) -> None:
    role = item.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise invalid_request(
            f"'{where}.role' must be user, assistant, system or developer", param=where
        )
    content = item.get("content")
    if isinstance(content, str):
        reading.chat.append({"role": role, "content": content})
        return
    if not isinstance(content, list):
        raise invalid_request(f"'{where}.content' must be a string or an array", param=where)
    parts = [_part(part, where, reading) for part in content]
    if role == "user":
        reading.chat.append({"role": role, "content": parts})
    else:  # an assistant's (or instructions') parts are text: chat takes them joined
        text = "".join(part.get("text", "") for part in parts if part.get("type") == "text")
        reading.chat.append({"role": role, "content": text})


def _part(part: object, where: str, reading: Translation) -> dict[str, Any]:
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise invalid_request(f"'{where}.content' parts must be typed objects", param=where)
    kind = part["type"]
    if kind in ("input_text", "output_text", "text"):
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid_request(f"'{where}' {kind} parts need a string 'text'", param=where)
        return {"type": "text", "text": text}
    if kind == "refusal":
        return {"type": "text", "text": str(part.get("refusal") or "")}
    if kind == "input_image":
        reading.images += 1
        url = part.get("image_url")
        if not isinstance(url, str):
            reading.native("input_image by file_id")  # the provider's stored file
            url = ""
        image: dict[str, Any] = {"url": url}
        if isinstance(part.get("detail"), str):
            image["detail"] = part["detail"]
        return {"type": "image_url", "image_url": image}
    if kind == "input_file":
        reading.files += 1
        file: dict[str, Any] = {
            name: part[name] for name in ("file_data", "file_id", "filename") if name in part
        }
        if "file_url" in part:
            reading.native("input_file by file_url")
        return {"type": "file", "file": file}
    reading.native(f"content part {kind}")
    return {"type": "text", "text": ""}


def _function_call(item: Mapping[str, Any], where: str, reading: Translation) -> None:
    """An earlier turn's call: a tool call of the assistant turn just before, if it was one
    (parallel calls come as consecutive items), else of a new assistant turn."""
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str):
            raise invalid_request(f"'{where}' function_call items need '{name}'", param=where)
    call = {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }
    last = reading.chat[-1] if reading.chat else None
    if last is not None and last["role"] == "assistant" and "tool_calls" in last:
        last["tool_calls"].append(call)
    elif last is not None and last["role"] == "assistant" and isinstance(last["content"], str):
        last["tool_calls"] = [call]
    else:
        reading.chat.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _function_output(item: Mapping[str, Any], where: str, reading: Translation) -> None:
    call_id = item.get("call_id")
    if not isinstance(call_id, str):
        raise invalid_request(f"'{where}' function_call_output items need 'call_id'", param=where)
    output = item.get("output")
    if isinstance(output, list):
        pieces = [_part(part, where, reading) for part in output]
        text = "".join(p.get("text", "") for p in pieces if p.get("type") == "text")
    elif isinstance(output, str):
        text = output
    else:
        raise invalid_request(
            f"'{where}.output' must be a string or an array of parts", param=where
        )
    reading.chat.append({"role": "tool", "tool_call_id": call_id, "content": text})


# --- tools and text ---


def _tools(body: Mapping[str, Any], chat: dict[str, Any], reading: Translation) -> None:
    tools = body.get("tools")
    names: set[str] = set()
    functions = []
    if tools is not None:
        if not isinstance(tools, list):
            raise invalid_request("'tools' must be an array", param="tools")
        for index, tool in enumerate(tools):
            where = f"tools[{index}]"
            if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
                raise invalid_request(f"'{where}' must be a typed object", param=where)
            if tool["type"] != "function":
                reading.native(f"tool {tool['type']}")
                reading.server_side_effects = True
                reading.web_search |= tool["type"].startswith("web_search")
                continue
            if not isinstance(tool.get("name"), str):
                raise invalid_request(f"'{where}' function tools need a 'name'", param=where)
            names.add(tool["name"])
            function: dict[str, Any] = {"name": tool["name"]}
            for name in ("description", "parameters", "strict"):
                if tool.get(name) is not None:
                    function[name] = tool[name]
            functions.append({"type": "function", "function": function})
    choice = body.get("tool_choice")
    if choice is None or (isinstance(choice, str) and choice in _TOOL_CHOICES):
        translated: Any = choice
    elif isinstance(choice, dict) and choice.get("type") == "function":
        forced = choice.get("name")
        if not isinstance(forced, str) or forced not in names:
            raise invalid_request(
                f"'tool_choice' forces function {forced!r}, which 'tools' does not declare",
                param="tool_choice",
            )
        translated = {"type": "function", "function": {"name": forced}}
    elif isinstance(choice, dict) and isinstance(choice.get("type"), str):
        reading.native(f"tool_choice {choice['type']}")
        translated = None
    else:
        raise invalid_request(
            "'tool_choice' must be auto, none, required or an object", param="tool_choice"
        )
    parallel = typed(body, "parallel_tool_calls", bool, None)
    if functions:  # a chat endpoint takes no tool_choice without tools
        chat["tools"] = functions
        if translated is not None:
            chat["tool_choice"] = translated
        if parallel is not None:
            chat["parallel_tool_calls"] = parallel


def _text(body: Mapping[str, Any], chat: dict[str, Any]) -> None:
    text = body.get("text")
    if text is None:
        return
    if not isinstance(text, dict):
        raise invalid_request("'text' must be an object", param="text")
    verbosity: str | None = typed(text, "verbosity", str, None, "text.")
    if verbosity is not None:
        chat["verbosity"] = verbosity
    fmt = text.get("format")
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return
    if kind == "json_object":
        chat["response_format"] = {"type": "json_object"}
        return
    if kind != "json_schema":
        raise invalid_request(
            "'text.format' must be an object whose type is text, json_object or json_schema",
            param="text.format",
        )
    assert isinstance(fmt, dict)
    schema = fmt.get("schema")
    name = fmt.get("name")
    if not isinstance(schema, dict) or not isinstance(name, str):
        raise invalid_request(
            "'text.format' json_schema needs a 'name' and a 'schema' object",
            param="text.format",
        )
    spec: dict[str, Any] = {"name": name, "schema": schema}
    for key in ("strict", "description"):
        if fmt.get(key) is not None:
            spec[key] = fmt[key]
    chat["response_format"] = {"type": "json_schema", "json_schema": spec}
