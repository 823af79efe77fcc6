"""The OpenAI request side: strict validation of /v1/completions and /v1/chat/completions
bodies into a GenerationRequest (the engine's RequestSpec plus what only HTTP needs), and
APIError, the one exception every route raises.

Validation is done by hand rather than with pydantic models so that every failure names its
field (`param`) and types are strict: "5" is not an integer, true is not a number.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batchserve.request import (DEFAULT_PRIORITY, MAX_INT32, MAX_LOGPROBS, MAX_PRIORITY, MIN_PRIORITY, Constraint,
                                RequestError, RequestSpec, SamplingParams)
from batchserve.server import fields
from batchserve.server.fields import FieldSpec, Status
from batchserve.server.tools import ToolCalling, ToolError, parse_tools

_ROLES = ("system", "developer", "user", "assistant", "tool")
# Which fields a body may hold, and which of them are accepted only at their defaults or not at
# all, come from the one field table (fields.py): a field this server would ignore is refused.
_FIELDS = {chat: fields.for_endpoint(chat) for chat in (False, True)}
_NAMES = {chat: frozenset(table) for chat, table in _FIELDS.items()}
_LIMITED = {chat: tuple(f for f in table.values() if f.status is not Status.HONOURED) for chat, table in _FIELDS.items()}
_MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})
_STREAM_OPTIONS = frozenset({"include_usage"})
_RESPONSE_FORMAT = {"type", "json_schema"}
_JSON_SCHEMA = frozenset({"name", "schema", "strict", "description"})
# vLLM's structured_outputs keys -> constraint kind (json_object: any JSON object)
_STRUCTURED = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar", "json_object": "json"}
_STRUCTURED_OPTIONS = frozenset({"whitespace_pattern"})
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string literal
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass
class APIError(Exception):
    """An error answered as OpenAI-shaped JSON: {"error": {message, type, param, code}}."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str = "invalid_request_error"
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    """A 400 naming the offending field in both `param` and the message."""
    return APIError(400, f"{param}: {message}" if param else message, param=param, code=code)


MAX_CHOICES = 64  # choices (or best_of candidates) one HTTP request may ask for: prompts times n


@dataclass(frozen=True)
class GenerationRequest:
    """A validated completion or chat request: `specs` for the engine, `candidates` per prompt,
    spec i * candidates + j being prompt i's j-th (request ids, arrival time and the group that
    shares a prompt's prefill are the server's to fill in); the rest for the response. Without
    best_of, `candidates` is `n` and spec i * n + j is choice i * n + j; with best_of > n it is
    best_of, and of each prompt's candidates the n with the highest cumulative logprob of their
    sampled tokens are answered (`ranking_logprobs`: the client asked for no logprobs; the
    candidates report them only for that ranking). `echo`: each choice's text starts with its
    prompt's."""

    chat: bool
    model: str
    specs: tuple[RequestSpec, ...]
    stream: bool
    include_usage: bool
    n: int = 1
    candidates: int = 1
    ranking_logprobs: bool = False
    echo: bool = False
    tool_calling: ToolCalling | None = None  # tool_choice calls a tool: the answer becomes tool calls

    @property
    def spec(self) -> RequestSpec:
        return self.specs[0]


def json_too_deep(raw: bytes, limit: int) -> bool:
    """Whether `raw` nests arrays and objects deeper than `limit`, found without parsing it
    (a parser recurses per level: ~1,000 levels raise RecursionError). Brackets inside string
    literals do not count; a body with no more opening brackets than `limit` is not scanned."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    a = np.frombuffer(_STRING.sub(b'""', raw), dtype=np.uint8)
    step = ((a == 0x5B) | (a == 0x7B)).astype(np.int32) - ((a == 0x5D) | (a == 0x7D)).astype(np.int32)
    return int(np.cumsum(step).max()) > limit


def parse_json(raw: bytes, max_depth: int = 32) -> dict[str, Any]:
    """The body as a JSON object, or a 400: malformed, nested deeper than `max_depth`, or
    holding a string that is not proper Unicode (a lone surrogate escape such as "\\ud800",
    which no tokenizer can take; the 400 names the field)."""
    if json_too_deep(raw, max_depth):
        raise APIError(400, f"the JSON body nests deeper than {max_depth} levels", code="invalid_json")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the JSON body must be an object, got {type(body).__name__}", code="invalid_json")
    where = _bad_text(body, "")
    if where is not None:
        raise bad(where or None, "is not valid Unicode text (it holds a lone surrogate)", code="invalid_text")
    return body


def _bad_text(v: Any, path: str) -> str | None:
    """The path of the first string (key or value) under `v` with a lone surrogate, or None."""
    if isinstance(v, str):
        return path if _SURROGATE.search(v) else None
    if isinstance(v, dict):
        for k, x in v.items():
            sub = f"{path}.{k}" if path else str(k)
            if _SURROGATE.search(k):
                return path or "(a key)"
            found = _bad_text(x, sub)
            if found is not None:
                return found
    elif isinstance(v, list):
        for i, x in enumerate(v):
            found = _bad_text(x, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _refuse_unknown(d: dict, allowed: frozenset[str], where: str = "") -> None:
    unknown = sorted(k for k in d if k not in allowed)
    if unknown:
        names = [f"{where}.{k}" if where else k for k in unknown]
        raise bad(names[0], f"unknown field{'s' if len(names) > 1 else ''} {', '.join(map(repr, names))} "
                  "(this server refuses fields it would ignore)", code="unknown_field")


def _refuse_unsupported(body: dict, spec: FieldSpec) -> None:
    """A 400 naming `spec` if the body sets it to a value this server would not honour: for a
    refused field anything but null, for a default-only one anything but its defaults."""
    v = body.get(spec.name)
    if v is None or (spec.status is Status.DEFAULT_ONLY and any(fields.same_value(v, d) for d in spec.values)):
        return
    if spec.status is Status.REFUSED:
        raise bad(spec.name, f"is not supported by this server ({spec.note})", code="unsupported_parameter")
    only = " or ".join(json.dumps(d) for d in spec.values)
    raise bad(spec.name, f"only {only} is supported by this server, got {_show(v)} ({spec.note})",
              code="unsupported_parameter")


def _show(v: Any) -> str:
    s = json.dumps(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _int(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool):
        raise bad(name, f"must be an integer, got {_show(v)}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"in [{lo}, {hi}]" if lo is not None and hi is not None else f">= {lo}" if lo is not None else f"<= {hi}"
        raise bad(name, f"must be {rng}, got {_show(v)}")
    return v


def _num(body: dict, name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    try:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    except OverflowError:  # an integer too large for a float
        ok = False
    if not ok:
        raise bad(name, f"must be a number, got {_show(v)}")
    return float(v)


def _bool(body: dict, name: str, where: str | None = None) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise bad(where or name, f"must be true or false, got {_show(v)}")
    return v


# chat_template_kwargs may not set what the server passes the template itself
_TEMPLATE_OWN = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                           "tokenize", "return_dict", "chat_template"})


def _template_options(body: dict, messages: list[dict]) -> dict[str, Any] | None:
    """vLLM's chat template fields: add_generation_prompt, continue_final_message (the last
    message, the assistant's, is left open for the model to continue) and chat_template_kwargs
    (template variables, e.g. enable_thinking); None when all are at their defaults."""
    add = _bool(body, "add_generation_prompt")
    cont = _bool(body, "continue_final_message")
    kw = body.get("chat_template_kwargs")
    if kw is not None and (not isinstance(kw, dict) or not all(isinstance(k, str) and k for k in kw)):
        raise bad("chat_template_kwargs", f"must be an object of template variables, got {_show(kw)}")
    if kw and set(kw) & _TEMPLATE_OWN:
        raise bad("chat_template_kwargs", f"cannot set {sorted(set(kw) & _TEMPLATE_OWN)}: they are request fields "
                  "or the server's own")
    if cont:
        if add:
            raise bad("continue_final_message", "cannot be combined with add_generation_prompt: true",
                      code="conflicting_parameters")
        if messages[-1].get("role") != "assistant" or not isinstance(messages[-1].get("content"), str) \
                or not messages[-1]["content"].strip():
            raise bad("continue_final_message", "needs the last message to be the assistant's, with text to continue")
    opts: dict[str, Any] = dict(kw or {})
    if add is False or cont:
        opts["add_generation_prompt"] = False
    if cont:
        opts["continue_final_message"] = True
    return opts or None


def _prompts(body: dict) -> list[str | list[int]]:
    """The prompts of a completions body: a string, token ids, or a list of either."""
    p = body.get("prompt")
    if p is None:
        raise bad("prompt", "is required")
    if isinstance(p, str) or (isinstance(p, list) and p and all(_is_id(t) for t in p)):
        p = [p]
    if not isinstance(p, list) or not p:
        raise bad("prompt", "must be a string, a list of token ids, or a non-empty list of either")
    for i, q in enumerate(p):
        where = "prompt" if len(p) == 1 else f"prompt[{i}]"
        if not q:
            raise bad(where, "must not be empty")
        if not (isinstance(q, str) or (isinstance(q, list) and all(_is_id(t) for t in q))):
            raise bad(where, "must be a string or a list of token ids")
    return p


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _messages(body: dict, lenient: bool) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, "must be an object with role and content")
        if not lenient:
            _refuse_unknown(m, _MESSAGE_FIELDS, where)
        role = m.get("role")
        if role not in _ROLES:
            raise bad(f"{where}.role", f"must be one of {list(_ROLES)}, got {_show(role)}")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is supported
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"{where}.content", "only text content parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise bad(f"{where}.content", f"must be a string or a list of text parts, got {_show(content)}")
        msg = {"role": "system" if role == "developer" else role, "content": content}
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict)
                    and isinstance(c["function"].get("name"), str) and isinstance(c["function"].get("arguments"), str)
                    for c in calls):
                raise bad(f"{where}.tool_calls", "only an assistant message has tool_calls: a list of "
                          '{"id", "type": "function", "function": {"name", "arguments": a string}}')
            msg["tool_calls"] = calls
        tid = m.get("tool_call_id")
        if tid is not None:
            if role != "tool" or not isinstance(tid, str):
                raise bad(f"{where}.tool_call_id", "only a tool message has a tool_call_id, a string")
            msg["tool_call_id"] = tid
        out.append(msg)
    return out


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v) or len(v) > 16:
        raise bad("stop", f"must be a non-empty string or a list of up to 16 of them, got {_show(v)}")
    return tuple(v)


def _token_ids(body: dict) -> tuple[int, ...]:
    v = body.get("stop_token_ids")
    if v is None:
        return ()
    if not isinstance(v, list):
        raise bad("stop_token_ids", f"must be a list of token ids, got {_show(v)}")
    return tuple(v)  # the ids' range: SamplingParams


_TOKEN_KEY = re.compile(r"\d{1,10}")


def _logit_bias(body: dict) -> tuple[tuple[int, Any], ...]:
    """logit_bias as (token id, bias) pairs: the keys are token ids written as strings (JSON's
    object keys); the biases' range is SamplingParams', the ids' the engine's (the vocabulary)."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict) or not all(_TOKEN_KEY.fullmatch(k) for k in v):
        raise bad("logit_bias", f"must be an object from token ids (as strings) to numbers, got {_show(v)}")
    return tuple((int(k), b) for k, b in v.items())


def _one_constraint(kind: str, value: Any, where: str, whitespace: str | None = None) -> Constraint:
    if kind == "choice":
        if not isinstance(value, list):
            raise bad(where, f"must be a list of strings, got {_show(value)}")
        value = tuple(value)
    if kind == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise bad(where, "must be a JSON schema: an object, or a string holding one") from None
    if kind == "json" and not isinstance(value, (dict, bool)):
        raise bad(where, f"must be a JSON schema (an object), got {_show(value)}")
    if kind == "json" and value is False:
        raise bad(where, "false asks for no constraint: leave the field out")
    try:
        return Constraint(kind, {} if value is True else value, where, whitespace)
    except RequestError as e:
        raise bad(e.param, e.message) from None


def _constraint(body: dict, lenient: bool) -> Constraint | None:
    """The structured-output constraint a body asks for, from OpenAI's response_format, vLLM's
    structured_outputs or vLLM's older guided_* fields; at most one of them."""
    found: list[Constraint] = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict):
            raise bad("response_format", f"must be an object, got {_show(rf)}")
        if not lenient:
            _refuse_unknown(rf, _RESPONSE_FORMAT, "response_format")
        t = rf.get("type")
        if t == "json_object":
            found.append(Constraint("json", {}, "response_format"))
        elif t == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise bad("response_format.json_schema", "is required with type json_schema and must be an object")
            if not lenient:
                _refuse_unknown(js, _JSON_SCHEMA, "response_format.json_schema")
            found.append(_one_constraint("json", js.get("schema", True), "response_format.json_schema.schema"))
        elif t != "text":
            raise bad("response_format.type", f"must be 'text', 'json_object' or 'json_schema', got {_show(t)}")
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad("structured_outputs", f"must be an object, got {_show(so)}")
        if not lenient:
            _refuse_unknown(so, frozenset(_STRUCTURED) | _STRUCTURED_OPTIONS, "structured_outputs")
        ws = so.get("whitespace_pattern")
        if ws is not None and not isinstance(ws, str):
            raise bad("structured_outputs.whitespace_pattern", f"must be a string, got {_show(ws)}")
        for key, kind in _STRUCTURED.items():
            if so.get(key) is not None and not (key == "json_object" and so[key] is False):
                found.append(_one_constraint(kind, so[key], f"structured_outputs.{key}", ws))
    ws = body.get("guided_whitespace_pattern")
    if ws is not None and not isinstance(ws, str):
        raise bad("guided_whitespace_pattern", f"must be a string, got {_show(ws)}")
    for key, kind in _GUIDED.items():
        if body.get(key) is not None:
            found.append(_one_constraint(kind, body[key], key, ws))
    if len(found) > 1:
        raise bad(found[1].field, f"only one structured-output constraint per request; {found[0].field} is "
                  "already one", code="conflicting_parameters")
    return found[0] if found else None


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives per token to report, None for no logprobs. Chat: `logprobs` true,
    with `top_logprobs` alternatives (0 to MAX_LOGPROBS); completions: `logprobs` the count."""
    if chat:
        on = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", lo=0, hi=MAX_LOGPROBS)
        if top and not on:
            raise bad("top_logprobs", "needs logprobs: true")
        return (top or 0) if on else None
    return _int(body, "logprobs", lo=0, hi=MAX_LOGPROBS)


def engine_priority(priority: Any, order: str) -> int:
    """The engine's native priority (MIN_PRIORITY..MAX_PRIORITY, higher first) for a request's
    `priority` read in `order`: "native" is that scale itself; "vllm" is vLLM's, lower first with
    0 the default, mapped to DEFAULT_PRIORITY - priority. A vLLM value beyond the native range is
    refused rather than clamped, since clamping would silently make unequal priorities equal."""
    if priority is None:
        return DEFAULT_PRIORITY  # both orders' defaults are the native middle
    if order == "native":
        return priority  # checked by RequestSpec
    lo, hi = DEFAULT_PRIORITY - MAX_PRIORITY, DEFAULT_PRIORITY - MIN_PRIORITY
    if not isinstance(priority, int) or isinstance(priority, bool) or not lo <= priority <= hi:
        raise bad("priority", f"must be an integer in [{lo}, {hi}], lower first (vLLM's order, default 0), "
                  f"got {_show(priority)}")
    return DEFAULT_PRIORITY - priority


def parse_generation(body: dict[str, Any], chat: bool, default_max_tokens: int = 1024,
                     lenient: bool = False, priority_order: str = "native") -> GenerationRequest:
    """Validate a completion (chat=False) or chat completion body; raise APIError (400). A chat
    request that sets no max_tokens may use the room its context leaves, up to `default_max_tokens`.
    A field this server does not know is refused, naming it, unless `lenient` (then ignored).
    `priority` is read in `priority_order` (see engine_priority)."""
    if not lenient:
        _refuse_unknown(body, _NAMES[chat])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "is required and must be a string" if model is None else f"must be a string, got {_show(model)}")
    for spec in _LIMITED[chat]:
        _refuse_unsupported(body, spec)
    prompts, messages, template = [None], None, None
    if chat:
        messages = _messages(body, lenient)
        template = _template_options(body, messages)
        max_tokens = _int(body, "max_completion_tokens", lo=1)
        max_tokens = _int(body, "max_tokens", lo=1) if max_tokens is None else max_tokens
    else:
        prompts = _prompts(body)
        max_tokens = _int(body, "max_tokens", lo=1)
    temperature, top_p = _num(body, "temperature"), _num(body, "top_p")  # ranges: SamplingParams
    penalties = {k: _num(body, k) for k in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")}
    min_tokens = _int(body, "min_tokens") or 0
    logprobs = _logprobs(body, chat)
    top_k = _int(body, "top_k", lo=-1, hi=MAX_INT32)  # -1 (vLLM's "off") is 0 here
    stream = bool(_bool(body, "stream"))
    opts = body.get("stream_options")
    if opts is not None and not stream:
        raise bad("stream_options", "is only allowed when stream is true")
    if opts is not None and not isinstance(opts, dict):
        raise bad("stream_options", "must be an object")
    if opts and not lenient:
        _refuse_unknown(opts, _STREAM_OPTIONS, "stream_options")
    include_usage = bool(_bool(opts, "include_usage", "stream_options.include_usage")) if opts else False
    priority = engine_priority(body.get("priority"), priority_order)
    n = _int(body, "n", lo=1, hi=MAX_CHOICES) or 1
    if n * len(prompts) > MAX_CHOICES:
        raise bad("n", f"{len(prompts)} prompts times n = {n} asks for more than {MAX_CHOICES} choices")
    best_of = None if chat else _int(body, "best_of", lo=1, hi=MAX_CHOICES)
    if best_of is not None:
        if best_of < n:
            raise bad("best_of", f"must be at least n ({n}), got {best_of}")
        if stream:
            raise bad("best_of", "cannot be streamed (the best candidates are known only at the end): set stream "
                      "to false")
        if best_of * len(prompts) > MAX_CHOICES:
            raise bad("best_of", f"{len(prompts)} prompts times best_of = {best_of} asks for more than "
                      f"{MAX_CHOICES} candidates")
    candidates = best_of if best_of is not None and best_of > n else n
    echo = bool(_bool(body, "echo")) if not chat else False
    tools, calling = None, None
    if chat:
        try:
            tools, calling = parse_tools(body)
        except ToolError as e:
            raise bad(e.param, e.message) from None
    constraint = _constraint(body, lenient)
    if calling is not None:
        if constraint is not None:
            raise bad(constraint.field, "cannot be combined with a tool_choice that calls a tool",
                      code="conflicting_parameters")
        constraint = calling.constraint
    prompt_logprobs = _int(body, "prompt_logprobs", lo=0, hi=MAX_LOGPROBS)
    if echo and logprobs is not None:  # the prompt's tokens are scored too (lm-evaluation-harness)
        if stream:
            raise bad("echo", "with logprobs is answered whole: set stream to false")
        prompt_logprobs = logprobs if prompt_logprobs is None else max(logprobs, prompt_logprobs)
    try:
        params = SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else (max(1, min_tokens) if chat else 16),
            temperature=1.0 if temperature is None else temperature, top_p=1.0 if top_p is None else top_p,
            top_k=max(0, top_k or 0), seed=_int(body, "seed"), stop=_stop(body),
            ignore_eos=bool(_bool(body, "ignore_eos")), stop_token_ids=_token_ids(body),
            logit_bias=_logit_bias(body), min_tokens=min_tokens, prompt_logprobs=prompt_logprobs,
            logprobs=0 if logprobs is None and candidates > n else logprobs,  # best_of ranks by them
            **{k: v for k, v in penalties.items() if v is not None})
        spec = RequestSpec(params, prompts[0], messages, priority=priority,
                           deadline_ms=body.get("deadline_ms"), deadline_kind=body.get("deadline_kind"),
                           auto_max_tokens=default_max_tokens if chat and max_tokens is None else None,
                           tenant=body.get("user"), constraint=constraint, tools=tools,
                           describe_tools=calling is not None and calling.auto, template_options=template)
    except RequestError as e:
        raise bad(e.param, e.message) from None
    specs = tuple(spec if i == j == 0 else dataclasses.replace(spec, prompt=p, params=_child(params, j))
                  for i, p in enumerate(prompts) for j in range(candidates))
    return GenerationRequest(chat=chat, model=model, specs=specs, stream=stream, include_usage=include_usage,
                             n=n, candidates=candidates, ranking_logprobs=logprobs is None and candidates > n,
                             echo=echo, tool_calling=calling)


def _child(params: SamplingParams, j: int) -> SamplingParams:
    """The params of a prompt's j-th choice (or best_of candidate): its own seed (seed + j)
    when one is set, so that the choices differ and each stays reproducible."""
    if j == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + j + 2**63) % 2**64 - 2**63)
