"""A Messages body as the core's canonical chat body (:func:`translate`): its system, turns,
blocks and fields checked (a 400 names the first offending one), counted (images,
documents, their bytes) and translated, noting the first feature an OpenAI-dialect endpoint
cannot carry. Pure.

What an OpenAI-dialect endpoint cannot carry, by feature (the candidate is excluded
``dialect_unsupported``, detail naming the feature, or the field is dropped where dropping
cannot change the answer's meaning):

- ``thinking`` ``enabled``: excluded (``thinking``): the answer would lack what was asked for.
  ``adaptive`` thinking is the model's choice, so an answer without it is one it may give:
  dropped. Thinking blocks in earlier turns are dropped (Anthropic itself ignores earlier
  turns' thinking outside a tool loop, and a request with thinking enabled is excluded).
- ``document`` blocks, images inside a ``tool_result``, content block types the door does
  not translate, Anthropic-defined tools (a ``type`` other than ``custom``), more than four
  ``stop_sequences``: excluded, naming the block, the tool type or the field.
- ``context_management``: ``clear_thinking_*`` edits only touch thinking, which is never
  sent to an OpenAI endpoint: dropped; any other edit changes what the model sees: excluded.
- ``output_config``: ``effort`` becomes ``reasoning_effort`` (low, medium, high; another
  value is excluded), ``format`` becomes ``response_format``; any other key: excluded.
  ``output_format`` (structured outputs beta) becomes ``response_format``.
- ``mcp_servers``, ``container``: excluded (the provider's own tools and sandbox).
- ``cache_control``, ``top_k``, ``service_tier``: dropped (price, sampling and scheduling,
  not meaning). ``metadata.user_id`` becomes ``user``; a ``tool_result``'s ``is_error`` is
  kept as an ``Error:`` prefix of its text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from router.doors.headers import MAX_JSON_INTEGER
from router.errors import invalid_request

__all__ = ["Translation", "number", "positive_int", "translate", "typed"]

_ROLES: Final = frozenset({"user", "assistant"})
_EFFORTS: Final = frozenset({"low", "medium", "high"})
_TOOL_CHOICES: Final = frozenset({"auto", "any", "tool", "none"})
_MAX_OPENAI_STOPS: Final = 4


@dataclass(slots=True)
class Translation:
    """What translating a body found, as it goes, and the canonical messages."""

    images: int = 0
    documents: int = 0
    binary_bytes: int = 0  # the JSON of image and document blocks: not text
    openai_gap: str | None = None  # the first feature an OpenAI endpoint cannot carry
    cache_writes: set[str] = field(default_factory=set)  # the lifetimes cache_control asks for
    chat: list[dict[str, Any]] = field(default_factory=list)  # the canonical messages

    def gap(self, feature: str) -> None:
        if self.openai_gap is None:
            self.openai_gap = feature


def translate(
    body: Mapping[str, Any], *, max_tokens: int, stream: bool, system_turns: bool
) -> tuple[dict[str, Any], Translation, list[Any]]:
    """The canonical chat body of a Messages ``body`` (whose top-level fields are known to
    be allowed), what was found, and its tools as sent. ``system_turns``: the request named
    the beta that allows turns of role ``system``."""
    reading = Translation()
    system = body.get("system")
    if system is not None:
        reading.chat.append({"role": "system", "content": _system_text(system, "system", reading)})
    for index, message in enumerate(body["messages"]):
        _read_message(message, index, reading, system_turns=system_turns)
    chat: dict[str, Any] = {
        "model": body["model"],
        "messages": reading.chat,
        "max_tokens": max_tokens,
    }
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    _sampling(body, chat, reading)
    tools = _tools(body, chat, reading)
    _thinking(body, max_tokens, reading)
    _beta_fields(body, chat, reading)
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise invalid_request("'metadata' must be an object", param="metadata")
        user = typed(metadata, "user_id", str, None, "metadata.")
        if user:
            chat["user"] = user
    return chat, reading, tools


# --- fields ---


def typed(source: Mapping[str, Any], name: str, kind: type, default: Any, prefix: str = "") -> Any:
    value = source.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise invalid_request(
            f"'{prefix}{name}' must be a {kind.__name__}", param=f"{prefix}{name}"
        )
    return value


def positive_int(value: object, name: str, *, required: bool = False) -> int | None:
    if value is None and not required:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_JSON_INTEGER:
        raise invalid_request(
            f"'{name}' must be an integer from 1 to {MAX_JSON_INTEGER}", param=name
        )
    return value


def number(body: Mapping[str, Any], name: str) -> float | int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid_request(f"'{name}' must be a number", param=name)
    return value


def _system_text(system: object, where: str, reading: Translation) -> str:
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        texts = []
        for block in system:
            if not isinstance(block, dict) or block.get("type") != "text":
                raise invalid_request(f"'{where}' blocks must be text blocks", param=where)
            _cache_marker(block, where, reading)
            texts.append(_text(block, where))
        return "\n\n".join(texts)
    raise invalid_request(f"'{where}' must be a string or an array of text blocks", param=where)


def _text(block: Mapping[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise invalid_request(f"'{where}' text blocks must have a string 'text'", param=where)
    return text


def _sampling(body: Mapping[str, Any], chat: dict[str, Any], reading: Translation) -> None:
    for name in ("temperature", "top_p"):
        value = number(body, name)
        if value is not None:
            chat[name] = value
    top_k = body.get("top_k")  # checked; an OpenAI endpoint has no top_k (dropped)
    if isinstance(top_k, float) and top_k.is_integer() and abs(top_k) <= MAX_JSON_INTEGER:
        top_k = int(top_k)  # JSON has numbers, not ints: 5.0 is the integer 5
    if top_k is not None and (
        isinstance(top_k, bool) or not isinstance(top_k, int) or abs(top_k) > MAX_JSON_INTEGER
    ):
        raise invalid_request(
            f"'top_k' must be an integer of at most {MAX_JSON_INTEGER}", param="top_k"
        )
    typed(body, "service_tier", str, None)
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise invalid_request(
                "'stop_sequences' must be an array of strings", param="stop_sequences"
            )
        if stops:
            chat["stop"] = list(stops)
        if len(stops) > _MAX_OPENAI_STOPS:
            reading.gap(f"stop_sequences over {_MAX_OPENAI_STOPS}")


def _tools(body: Mapping[str, Any], chat: dict[str, Any], reading: Translation) -> list[Any]:
    tools = body.get("tools")
    if tools is None:
        _tool_choice(body.get("tool_choice"), set(), {})  # checked; nothing to choose from
        return []
    if not isinstance(tools, list):
        raise invalid_request("'tools' must be an array", param="tools")
    functions = []
    names = set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise invalid_request(f"'{where}' must be an object with a 'name'", param=where)
        names.add(tool["name"])
        _cache_marker(tool, where, reading)
        kind = tool.get("type", "custom")
        if kind != "custom":
            reading.gap(f"tool type {kind}")
            continue
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise invalid_request(f"'{where}.input_schema' must be an object", param=where)
        function: dict[str, Any] = {"name": tool["name"], "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        functions.append({"type": "function", "function": function})
    choice: dict[str, Any] = {}
    _tool_choice(body.get("tool_choice"), names, choice)
    if functions:  # an OpenAI endpoint takes no tool_choice without tools
        chat["tools"] = functions
        chat.update(choice)
    return tools


def _tool_choice(choice: object, names: set[str], chat: dict[str, Any]) -> None:
    if choice is None:
        return
    if not isinstance(choice, dict) or choice.get("type") not in _TOOL_CHOICES:
        raise invalid_request(
            "'tool_choice' must be an object whose type is auto, any, tool or none",
            param="tool_choice",
        )
    kind = choice["type"]
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or name not in names:
            raise invalid_request(
                f"'tool_choice' forces tool {name!r}, which 'tools' does not declare",
                param="tool_choice",
            )
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    if choice.get("disable_parallel_tool_use") is True and kind != "none":
        chat["parallel_tool_calls"] = False


def _thinking(body: Mapping[str, Any], max_tokens: int, reading: Translation) -> None:
    thinking = body.get("thinking")
    if thinking is None:
        return
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise invalid_request(
            "'thinking' must be an object whose type is enabled, adaptive or disabled",
            param="thinking",
        )
    if kind == "enabled":
        budget = positive_int(thinking.get("budget_tokens"), "thinking.budget_tokens")
        if budget is None or budget >= max_tokens:
            raise invalid_request(
                "'thinking.budget_tokens' must be given and below 'max_tokens'",
                param="thinking.budget_tokens",
            )
        reading.gap("thinking")


def _beta_fields(body: Mapping[str, Any], chat: dict[str, Any], reading: Translation) -> None:
    """The betas' fields (already allowed by the header): translated for an OpenAI endpoint,
    dropped, or a gap (module docstring)."""
    management = body.get("context_management")
    if management is not None:
        edits = management.get("edits") if isinstance(management, dict) else None
        if not isinstance(edits, list):
            raise invalid_request(
                "'context_management.edits' must be an array", param="context_management"
            )
        for edit in edits:
            kind = edit.get("type") if isinstance(edit, dict) else None
            if not (isinstance(kind, str) and kind.startswith("clear_thinking")):
                reading.gap(f"context_management {kind}")
    config = body.get("output_config")
    if config is not None:
        if not isinstance(config, dict):
            raise invalid_request("'output_config' must be an object", param="output_config")
        for key, value in config.items():
            if key == "effort" and value in _EFFORTS:
                chat["reasoning_effort"] = value
            elif key == "format" and isinstance(value, dict):
                _response_format(value, chat, reading)
            else:
                reading.gap(f"output_config.{key}")
    output_format = body.get("output_format")
    if output_format is not None:
        if not isinstance(output_format, dict):
            raise invalid_request("'output_format' must be an object", param="output_format")
        _response_format(output_format, chat, reading)
    for name in ("mcp_servers", "container"):
        if body.get(name) is not None:
            reading.gap(name)


def _response_format(fmt: Mapping[str, Any], chat: dict[str, Any], reading: Translation) -> None:
    schema = fmt.get("schema")
    if fmt.get("type") != "json_schema" or not isinstance(schema, dict):
        reading.gap(f"output format {fmt.get('type')}")
        return
    chat["response_format"] = {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema, "strict": True},
    }


# --- messages ---


def _read_message(message: object, index: int, reading: Translation, *, system_turns: bool) -> None:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid_request(f"'{where}' must be an object", param=where)
    role = message.get("role")
    if role == "system" and system_turns:
        reading.chat.append(
            {"role": "system", "content": _system_text(message.get("content"), where, reading)}
        )
        return
    if role not in _ROLES:
        raise invalid_request(f"'{where}.role' must be user or assistant", param=where)
    content = message.get("content")
    if isinstance(content, str):
        reading.chat.append({"role": role, "content": content})
        return
    if not isinstance(content, list):
        raise invalid_request(f"'{where}.content' must be a string or an array", param=where)
    for block in content:
        _check_block(block, where, reading)
    if role == "assistant":
        reading.chat.append(_assistant(content, where, reading))
    else:
        reading.chat.extend(_user(content, where, reading))


# The fields each kind of block must have (the same in every turn), with their types.
_BLOCK_FIELDS: Final[Mapping[str, tuple[tuple[str, type], ...]]] = {
    "text": (("text", str),),
    "image": (("source", dict),),
    "tool_use": (("id", str), ("name", str)),
    "tool_result": (("tool_use_id", str),),
}


def _check_block(block: object, where: str, reading: Translation, *, nested: bool = False) -> None:
    """A content block's type, the fields its kind must have and its cache marker; a
    ``tool_result``'s own content, as blocks in it (``nested``) or a string."""
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise invalid_request(f"'{where}.content' blocks must be typed objects", param=where)
    _cache_marker(block, where, reading)
    kind = block["type"]
    for name, type_ in _BLOCK_FIELDS.get(kind, ()):
        if not isinstance(block.get(name), type_):
            shape = "a string" if type_ is str else "an object"
            raise invalid_request(f"'{where}' {kind} blocks need '{name}', {shape}", param=where)
    if kind == "tool_result" and not nested:
        content = block.get("content")
        if isinstance(content, list):
            for part in content:
                _check_block(part, where, reading, nested=True)
        elif content is not None and not isinstance(content, str):
            raise invalid_request(
                f"'{where}' tool_result content must be a string or blocks", param=where
            )


_CACHE_LIFETIMES: Final = frozenset({"5m", "1h"})


def _cache_marker(marked: Mapping[str, Any], where: str, reading: Translation) -> None:
    """A ``cache_control`` marker on a block or a tool: the lifetime of the cache write it
    asks for (``ttl``, five minutes unless it says an hour), which an Anthropic endpoint
    bills at its own price (``Requirements.cache_writes``)."""
    marker = marked.get("cache_control")
    if marker is None:
        return
    ttl = marker.get("ttl", "5m") if isinstance(marker, dict) else None
    if not isinstance(ttl, str) or ttl not in _CACHE_LIFETIMES:  # a JSON object is no ttl
        raise invalid_request(
            f"'{where}' cache_control must be an object whose ttl is 5m or 1h", param=where
        )
    reading.cache_writes.add(ttl)


def _assistant(blocks: list[dict[str, Any]], where: str, reading: Translation) -> dict[str, Any]:
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in blocks:
        kind = block["type"]
        if kind == "text":
            text.append(_text(block, where))
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise invalid_request(
                    f"'{where}' tool_use blocks need an id and a name", param=where
                )
            arguments = orjson.dumps(block.get("input") or {}).decode()
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block["name"], "arguments": arguments},
                }
            )
        elif kind not in ("thinking", "redacted_thinking"):
            _other_block(block, reading)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list[dict[str, Any]], where: str, reading: Translation) -> list[dict[str, Any]]:
    """A user turn: its tool results first, as ``tool`` messages (OpenAI wants them right
    after the assistant's calls), then the rest as one user message."""
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for block in blocks:
        kind = block["type"]
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, where)})
        elif kind == "image":
            parts.append(_image(block, where, reading))
        elif kind == "tool_result":
            results.append(_tool_result(block, where, reading))
        elif kind == "document":
            reading.documents += 1
            reading.binary_bytes += len(orjson.dumps(block, option=orjson.OPT_SORT_KEYS))
            reading.gap("document")
        else:
            _other_block(block, reading)
    if parts:
        results.append({"role": "user", "content": parts})
    return results


def _image(block: Mapping[str, Any], where: str, reading: Translation) -> dict[str, Any]:
    reading.images += 1
    reading.binary_bytes += len(orjson.dumps(block, option=orjson.OPT_SORT_KEYS))
    source = block.get("source")
    if not isinstance(source, dict):
        raise invalid_request(f"'{where}' image blocks need a 'source'", param=where)
    if source.get("type") == "base64":
        url = f"data:{source.get('media_type')};base64,{source.get('data')}"
    elif source.get("type") == "url":
        url = str(source.get("url"))
    else:
        reading.gap(f"image source {source.get('type')}")
        url = ""
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_result(block: Mapping[str, Any], where: str, reading: Translation) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str):
        raise invalid_request(f"'{where}' tool_result blocks need a tool_use_id", param=where)
    content = block.get("content")
    text = ""
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        pieces = []
        for part in content:
            if not isinstance(part, dict):
                raise invalid_request(f"'{where}' tool_result content must be blocks", param=where)
            if part.get("type") == "text":
                pieces.append(_text(part, where))
            elif part.get("type") == "image":
                _image(part, where, reading)
                reading.gap("tool_result image")
            else:
                _other_block(part, reading)
        text = "\n".join(pieces)
    if block.get("is_error") is True:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def _other_block(block: Mapping[str, Any], reading: Translation) -> None:
    """A block the door does not translate (search results, server tool results, ...): sent
    natively to Anthropic endpoints, counted as text, never to an OpenAI endpoint."""
    reading.gap(f"content block {block.get('type')}")
