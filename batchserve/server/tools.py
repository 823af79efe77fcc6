"""Function calling for /v1/chat/completions: `tools` and `tool_choice`, answered by
structured outputs rather than by a model-specific parser.

    tool_choice {"type": "function", "function": {"name": f}}  ->  the answer is f's arguments,
        held to f's `parameters` schema; one tool call, finish reason "stop"
    tool_choice "required"  ->  the answer is a JSON array of {"name", "arguments"} objects, each
        held to its function's schema (one item at most without parallel_tool_calls); a tool
        call per item, finish reason "tool_calls"
    tool_choice "none"  ->  plain text
    tool_choice "auto" (the default with tools)  ->  the model chooses: prose (not starting with
        "<"), or one call (several with parallel_tool_calls) in the tagged form

            <tool_call>{"name": f, "arguments": {...}}</tool_call>

        each held to its function's schema, finish reason "tool_calls". The grammar holds the
        answer to one of the two, so telling a call from prose needs no model-specific parser.

The tools go to the chat template, so a model trained on tools sees them; under "auto", where
the model must see them to choose, a template that does not render tools gets them, and the
tagged form, in a system message instead (`engine.tools_text`),
so that they are never dropped silently. An answer cut by max_tokens is not a complete call: it
comes back as content, with finish reason "length". Streamed, calls go out whole once complete;
an "auto" answer that has started in prose streams as text.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from batchserve.engine.engine import TOOL_CLOSE as _CLOSE
from batchserve.engine.engine import TOOL_OPEN as _OPEN
from batchserve.request import Constraint

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_FUNCTION_FIELDS = frozenset({"name", "description", "parameters", "strict"})
_ANY_OBJECT = {"type": "object"}
_TAGGED = re.compile(re.escape(_OPEN) + r"(.*?)" + re.escape(_CLOSE), re.S)
# JSON inside the grammar as the json constraint makes it (engine/structured.py): fixed separators
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ToolError(ValueError):
    """A bad tools / tool_choice value: `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param, self.message = param, message


@dataclass(frozen=True)
class ToolCalling:
    """How a request's answer becomes tool calls: `name` set, the arguments of that function;
    None, a list of calls (`required`); `auto`, prose or tagged calls."""

    name: str | None
    constraint: Constraint
    auto: bool = False


def parse_tools(body: dict) -> tuple[list[dict] | None, ToolCalling | None]:
    """(the tools for the chat template, how the answer is turned into calls) from a chat body;
    (None, None) without tools or with tool_choice "none" (checked all the same). Raises ToolError."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls", "must be a boolean")
    if tools is None:
        if choice not in (None, "none"):
            raise ToolError("tool_choice", "needs tools")
        return None, None
    if not isinstance(tools, list) or not tools or len(tools) > 128:
        raise ToolError("tools", "must be a list of 1 to 128 tools")
    funcs: dict[str, dict] = {}
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise ToolError(where, 'must be {"type": "function", "function": {...}}')
        if set(t) - {"type", "function"}:
            raise ToolError(where, f"unknown fields {sorted(set(t) - {'type', 'function'})}")
        f = t["function"]
        if set(f) - _FUNCTION_FIELDS:
            raise ToolError(f"{where}.function", f"unknown fields {sorted(set(f) - _FUNCTION_FIELDS)}")
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolError(f"{where}.function.name", "must be 1-64 letters, digits, _ . or -")
        if name in funcs:
            raise ToolError(f"{where}.function.name", f"{name!r} is named twice")
        params = f.get("parameters", _ANY_OBJECT)
        if not isinstance(params, dict):
            raise ToolError(f"{where}.function.parameters", "must be a JSON schema (an object)")
        if not isinstance(f.get("description", ""), str):
            raise ToolError(f"{where}.function.description", "must be a string")
        funcs[name] = params
    if choice == "none":
        return None, None  # no call may be made: the template is not shown tools it may not use
    items = [{"type": "object", "properties": {"name": {"const": n}, "arguments": p},
              "required": ["name", "arguments"], "additionalProperties": False} for n, p in funcs.items()]
    if choice is None or choice == "auto":
        call = {**(items[0] if len(items) == 1 else {"anyOf": items}), "x-guidance": _JSON_STYLE}
        tag = f'{json.dumps(_OPEN)} %json {json.dumps(call)} {json.dumps(_CLOSE)}'
        calls = f'call: {tag}' + ("" if parallel is False else f' ("\\n" {tag})*')
        grammar = f"start: call | prose\n{calls}\nprose: /(?s:([^<].*)?)/\n"
        return tools, ToolCalling(None, Constraint("grammar", grammar, "tools"), auto=True)
    if choice == "required":
        schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if parallel is False:
            schema["maxItems"] = 1
        return tools, ToolCalling(None, Constraint("json", schema, "tools"))
    if isinstance(choice, dict):
        f = choice.get("function")
        name = f.get("name") if isinstance(f, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ToolError("tool_choice", 'must be "none", "auto", "required" or '
                            '{"type": "function", "function": {"name": ...}}')
        if name not in funcs:
            raise ToolError("tool_choice.function.name", f"{name!r} is not one of the tools")
        return tools, ToolCalling(name, Constraint("json", funcs[name], f"tools.{name}.parameters"))
    raise ToolError("tool_choice", 'must be "none", "auto", "required" or {"type": "function", ...}')


def tool_calls(calling: ToolCalling, text: str) -> list[dict] | None:
    """The calls an answer makes, OpenAI-shaped; None if it is not a complete call (or, under
    `auto`, the model answered in prose)."""
    try:
        if calling.auto:
            if not text.startswith(_OPEN):
                return None
            value = [json.loads(body) for body in _TAGGED.findall(text)]
        else:
            value = json.loads(text)
    except ValueError:
        return None
    calls = [(calling.name, text)] if calling.name is not None else [
        (c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in value]
    return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": n, "arguments": a}}
            for n, a in calls]


def tool_message(calling: ToolCalling, text: str, finish: str | None) -> tuple[dict, str | None]:
    """(the assistant message, its finish reason) for an answer made under `calling`."""
    calls = tool_calls(calling, text) if finish == "stop" else None
    if calls is None:
        return {"role": "assistant", "content": text}, finish
    return {"role": "assistant", "content": None, "tool_calls": calls}, ("stop" if calling.name else "tool_calls")


