"""The OpenAPI request and response schemas of the HTTP routes, built from the field table
(fields.py) so that /openapi.json says what validation does. The routes still parse their raw
bodies by hand (protocol.py): that is what gives the 400s naming fields; these schemas only
describe them, attached with `openapi_extra`.

Per field status: an honoured field is typed (the core ones, parsed in protocol.py, with
their ranges and shapes); a default-only one is an `enum` of the values accepted; a refused
one is listed as `enum: [null]`, described as refused, so that a client reading the schema
learns that the name is known (and refused) rather than unknown. null is allowed everywhere.
"""
from __future__ import annotations

from typing import Any

from batchserve.request import DEFAULT_PRIORITY, MAX_INT32, MAX_PRIORITY
from batchserve.server import fields
from batchserve.server.fields import Status

_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}}}
_MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}, {"type": "null"}]},
    "name": {"type": "string"}}}
_TOKEN = {"type": "integer", "minimum": 0, "maximum": MAX_INT32}
# The honoured fields whose shape is more than their JSON type (see parse_generation).
_CORE: dict[str, dict[str, Any]] = {
    "model": {"type": "string", "minLength": 1},
    "prompt": {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "items": _TOKEN, "minItems": 1}]},
    "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
    "max_tokens": {"type": "integer", "minimum": 1},
    "max_completion_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1, "maximum": MAX_INT32},
    "seed": {"type": "integer"},
    "stop": {"anyOf": [{"type": "string", "minLength": 1},
                       {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 16}]},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "priority": {"type": "integer", "minimum": DEFAULT_PRIORITY - MAX_PRIORITY, "maximum": MAX_PRIORITY,
                 "description": "native 0-10 (higher first) or, with --priority-order vllm, lower first"},
    "deadline_ms": {"type": "number", "exclusiveMinimum": 0},
    "deadline_kind": {"enum": ["soft", "hard"]},
    "user": {"type": "string"},
    "ignore_eos": {"type": "boolean"},
}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    if "enum" in schema:
        return {**schema, "enum": [*schema["enum"], None]}
    return {"anyOf": [schema, {"type": "null"}]}


def field_schema(spec: fields.FieldSpec) -> dict[str, Any]:
    """One field's JSON schema, by its status (see the module docstring)."""
    desc = f"{spec.status.value}: {spec.note}"
    if spec.status is Status.REFUSED:
        return {"enum": [None], "description": f"refused (any value but null is a 400): {spec.note}"}
    if spec.status is Status.DEFAULT_ONLY:
        return {"enum": [*spec.values, None], "description": desc}
    types = spec.type.split("|")
    base = _CORE.get(spec.name) or ({"type": types[0]} if len(types) == 1 else {"type": types})
    return {**_nullable(base), "description": desc}


def request_schema(chat: bool, model: str) -> dict[str, Any]:
    """The body schema of /v1/chat/completions (chat) or /v1/completions."""
    table = fields.for_endpoint(chat)
    props = {name: field_schema(spec) for name, spec in table.items()}
    props["model"] = {**_CORE["model"], "examples": [model], "description": table["model"].note}
    return {"type": "object", "required": ["model", "messages" if chat else "prompt"], "properties": props,
            "example": {"model": model, **({"messages": [{"role": "user", "content": "Hi"}]} if chat
                                           else {"prompt": "Hello"}), "max_tokens": 4}}


ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_ERROR_RESPONSE = {"content": {"application/json": {"schema": ERROR}}}


def route(body: dict[str, Any] | None, ok: dict[str, Any], ok_desc: str = "OK",
          ok_type: str = "application/json", errors: tuple[int, ...] = (400, 401, 413, 503)) -> dict[str, Any]:
    """`openapi_extra` for a route: its JSON body (if any), its 200 and its OpenAI-shaped errors."""
    extra: dict[str, Any] = {"responses": {
        "200": {"description": ok_desc, "content": {ok_type: {"schema": ok}}},
        **{str(s): {"description": "error", **_ERROR_RESPONSE} for s in errors},
        "5XX": {"description": "server error", **_ERROR_RESPONSE}}}
    if body is not None:
        extra["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    return extra


def tokenize_schema(model: str) -> dict[str, Any]:
    """vLLM's /tokenize body: a completion prompt or chat messages."""
    prompt = {"type": "object", "required": ["prompt"], "properties": {
        "model": {"type": "string", "examples": [model]}, "prompt": {"type": "string"},
        "add_special_tokens": {"enum": [False, None]}}, "additionalProperties": False}
    chat = {"type": "object", "required": ["messages"], "properties": {
        "model": {"type": "string", "examples": [model]}, "messages": _CORE["messages"],
        "add_generation_prompt": {"type": "boolean"}, "add_special_tokens": {"enum": [False, None]}},
        "additionalProperties": False}
    return {"oneOf": [prompt, chat]}


TOKENIZE_OK = {"type": "object", "properties": {"count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                                                "tokens": {"type": "array", "items": {"type": "integer"}}}}
DETOKENIZE = {"type": "object", "required": ["tokens"], "additionalProperties": False, "properties": {
    "model": {"type": "string"}, "tokens": {"type": "array", "items": {"type": "integer"}}}}
DETOKENIZE_OK = {"type": "object", "properties": {"prompt": {"type": "string"}}}
