"""Every request field a client of an OpenAI-compatible server may send, and what this server
does with it: the one table (`FIELDS`) that request validation, the OpenAPI schema and the
conformance page (docs/api-fields.md) are all derived from.

Each field is one of three things here, so that nothing a client sends is silently ignored:
- honoured: it does what the OpenAI / vLLM docs say;
- default-only: accepted only at its "off" value(s) (listed), refused with a 400 naming it
  otherwise, since ignoring any other value would change the answer;
- refused: any value other than null is a 400 naming it.
null is accepted for every field (clients send it for "unset"). A field the table does not list
for an endpoint is an unknown field (a 400 too, unless the server runs with lenient fields).

The vLLM and llama.cpp columns say what those servers do with the field, read from their request
schemas and docs (vLLM 0.32's OpenAI protocol, llama.cpp's llama-server): ✓ honoured, ◐ only some
values or partly, ✗ not accepted or ignored.

`python -m batchserve.server.fields --markdown` writes docs/api-fields.md from the table.
"""
from __future__ import annotations

import argparse
import enum
import json
import pathlib
from dataclasses import dataclass
from typing import Any


class Status(enum.StrEnum):
    HONOURED = "honoured"
    DEFAULT_ONLY = "default-only"
    REFUSED = "refused"


COMPLETIONS, CHAT = "completions", "chat"
_ENDPOINTS = {"c": frozenset({COMPLETIONS}), "h": frozenset({CHAT}), "b": frozenset({COMPLETIONS, CHAT})}
_STATUS = {"ok": Status.HONOURED, "def": Status.DEFAULT_ONLY, "no": Status.REFUSED}
_MARK = {Status.HONOURED: "✓", Status.DEFAULT_ONLY: "◐", Status.REFUSED: "✗"}


@dataclass(frozen=True)
class FieldSpec:
    """One request field. `type`: JSON types, "|"-separated (null is always allowed).
    `values`: for an honoured field an example a valid request may send; for a default-only
    field the values accepted. `origin`: whose schema defines it (openai, vllm, batchserve)."""

    name: str
    endpoints: frozenset[str]
    type: str
    status: Status
    values: tuple[Any, ...]
    origin: str
    vllm: str
    llama_cpp: str
    note: str

    @property
    def mark(self) -> str:
        return _MARK[self.status]


def _f(name: str, ep: str, type_: str, status: str, values: tuple[Any, ...], origin: str, vllm: str, cpp: str,
       note: str) -> FieldSpec:
    return FieldSpec(name, _ENDPOINTS[ep], type_, _STATUS[status], values, origin, vllm, cpp, note)


_ = ()
# One line per field. ep: c = /v1/completions, h = /v1/chat/completions, b = both.
# status: ok = honoured (values: an example), def = default-only (values: those accepted), no = refused.
# name                            ep   type             status values           origin       vLLM cpp  note
FIELDS: tuple[FieldSpec, ...] = (
    # --- OpenAI, both endpoints ---------------------------------------------------------------------------
    _f("model",                       "b", "string",        "ok",  ("m",),          "openai",     "✓", "✓", "must name the served model (404 otherwise)"),
    _f("max_tokens",                  "b", "integer",       "ok",  (4,),            "openai",     "✓", "✓", "completions default 16; chat default: the room the context leaves, capped by --default-max-tokens"),
    _f("temperature",                 "b", "number",        "ok",  (0.7,),          "openai",     "✓", "✓", "0 is greedy; range [0, 2]"),
    _f("top_p",                       "b", "number",        "ok",  (0.9,),          "openai",     "✓", "✓", "nucleus sampling; (0, 1]"),
    _f("n",                           "b", "integer",       "ok",  (2,),            "openai",     "✓", "◐", "choices per prompt, each its own request; the prompt is prefilled once and its KV blocks shared by the copies; with a seed, choice j uses seed + j; at most 64 choices in all"),
    _f("stream",                      "b", "boolean",       "ok",  (False,),        "openai",     "✓", "✓", "server-sent events, ending with data: [DONE]"),
    _f("stream_options",              "b", "object",        "ok",  ({"include_usage": True},), "openai", "✓", "✓", "include_usage only; only with stream: true"),
    _f("stop",                        "b", "string|array",  "ok",  (["\n\n"],),     "openai",     "✓", "✓", "up to 16 strings; the stop string is not in the output"),
    _f("seed",                        "b", "integer",       "ok",  (7,),            "openai",     "✓", "✓", "reproducible sampling per request, whatever the batch"),
    _f("presence_penalty",            "b", "number",        "ok",  (0.5,),          "openai",     "✓", "✓", "[-2, 2], over the output tokens so far"),
    _f("frequency_penalty",           "b", "number",        "ok",  (0.5,),          "openai",     "✓", "✓", "[-2, 2], times each token's count in the output so far"),
    _f("logit_bias",                  "b", "object",        "ok",  ({"5": 10},),    "openai",     "✓", "✓", "token id (a string) to a bias in [-100, 100], added to the logit; ids outside the vocabulary are a 400"),
    _f("logprobs",                    "c", "integer",       "ok",  (2,),            "openai",     "✓", "✓", "how many alternatives per token (0-20); of the model's logits before temperature and penalties, as vLLM"),
    _f("user",                        "b", "string",        "ok",  ("alice",),      "openai",     "✗", "✗", "the tenant: a queue level's service is shared fairly between tenants"),
    # --- OpenAI, completions only ---------------------------------------------------------------------------
    _f("prompt",                      "c", "string|array",  "ok",  ("Hello",),      "openai",     "✓", "✓", "text or token ids, or a list of either: a choice per prompt (n per prompt), indexed in order"),
    _f("echo",                        "c", "boolean",       "ok",  (True,),         "openai",     "✓", "✗", "the choice's text starts with its prompt; with logprobs, the prompt's tokens are scored too (first: null), not streamed"),
    _f("best_of",                     "c", "integer",       "ok",  (3,),            "openai",     "◐", "✗", "candidates per prompt (>= n, at most 64 in all), prefilled once; the n with the highest cumulative logprob of their sampled tokens are answered, best first; usage counts every candidate; not with stream (vLLM's V1 engine dropped best_of > 1)"),
    _f("suffix",                      "c", "string",        "def", ("",),           "openai",     "✗", "✗", "fill-in-the-middle is not supported"),
    # --- OpenAI, chat only ---------------------------------------------------------------------------------
    _f("messages",                    "h", "array",         "ok",  ([{"role": "user", "content": "Hi"}],), "openai", "✓", "✓", "text content only (string or text parts), through the model's chat template"),
    _f("echo",                        "h", "boolean",       "def", (False,),        "vllm",       "✓", "✗", "vLLM's: continue the last message; not implemented yet"),
    _f("max_completion_tokens",       "h", "integer",       "ok",  (4,),            "openai",     "✓", "✓", "wins over max_tokens"),
    _f("logprobs",                    "h", "boolean",       "ok",  (True,),         "openai",     "✓", "✓", "each token's log-probability, of the model's logits before temperature and penalties, as vLLM"),
    _f("top_logprobs",                "h", "integer",       "ok",  (2,),            "openai",     "✓", "✓", "0-20 alternatives per token; needs logprobs: true"),
    _f("response_format",             "b", "object",        "ok",  ({"type": "json_object"},), "openai", "✓", "✓", "text, json_object or json_schema: the answer is held to the schema token by token (completions: vLLM's extra)"),
    _f("tools",                       "h", "array",         "ok",  ([{"type": "function", "function": {"name": "f"}}],), "openai", "✓", "✓", "functions (name, description, parameters schema); given to the chat template; under tool_choice auto, in a system message to one that does not render tools"),
    _f("tool_choice",                 "h", "string|object", "ok",  ("none",),       "openai",     "✓", "✓", "auto (the default), none, required or a named function, answered by structured outputs; auto: prose, or calls tagged <tool_call>...</tool_call>, which the grammar holds to their schemas"),
    _f("parallel_tool_calls",         "h", "boolean",       "ok",  (False,),        "openai",     "✓", "✓", "false: auto and required make one call at most"),
    _f("functions",                   "h", "array",         "def", ([],),           "openai",     "✗", "✗", "deprecated form of tools"),
    _f("function_call",               "h", "string|object", "def", ("none", "auto"), "openai",    "✗", "✗", "deprecated form of tool_choice"),
    _f("audio",                       "h", "object",        "no",  _,               "openai",     "✗", "✗", "audio output is not supported"),
    _f("modalities",                  "h", "array",         "def", (["text"],),     "openai",     "✗", "✗", "text output only"),
    _f("prediction",                  "h", "object",        "no",  _,               "openai",     "✗", "✗", "predicted outputs are not supported"),
    _f("reasoning_effort",            "h", "string",        "no",  _,               "openai",     "✓", "◐", "no reasoning models or parsers"),
    _f("verbosity",                   "h", "string",        "no",  _,               "openai",     "✗", "✗", "not supported"),
    _f("web_search_options",          "h", "object",        "no",  _,               "openai",     "✗", "✗", "no web search"),
    _f("store",                       "h", "boolean",       "def", (False,),        "openai",     "✗", "✗", "completions are not stored"),
    _f("metadata",                    "h", "object",        "def", ({},),           "openai",     "✗", "✗", "only used with store"),
    _f("service_tier",                "h", "string",        "def", ("auto", "default"), "openai", "◐", "✗", "use priority for service classes"),
    _f("prompt_cache_key",            "h", "string",        "no",  _,               "openai",     "✗", "✗", "the prefix cache needs no key; refused rather than ignored"),
    _f("safety_identifier",           "h", "string",        "no",  _,               "openai",     "✗", "✗", "use user to name the tenant"),
    # --- vLLM's extra sampling parameters --------------------------------------------------------------------
    _f("top_k",                       "b", "integer",       "ok",  (20,),           "vllm",       "✓", "✓", "0 or -1: off"),
    _f("min_p",                       "b", "number",        "ok",  (0.05,),         "vllm",       "✓", "✓", "[0, 1]: drops tokens less likely than min_p times the most likely"),
    _f("repetition_penalty",          "b", "number",        "ok",  (1.1,),          "vllm",       "✓", "✗", "(0, 2], over prompt and output tokens, as vLLM (llama.cpp calls it repeat_penalty)"),
    _f("min_tokens",                  "b", "integer",       "ok",  (1,),            "vllm",       "✓", "✗", "at most max_tokens; EOS, stop_token_ids and stop strings cannot end the answer before"),
    _f("stop_token_ids",              "b", "array",         "ok",  ([5],),          "vllm",       "✓", "✗", "up to 64 token ids; the answer ends at one, with finish reason stop"),
    _f("ignore_eos",                  "b", "boolean",       "ok",  (True,),         "vllm",       "✓", "✓", "keep generating past the end-of-sequence token"),
    _f("use_beam_search",             "b", "boolean",       "def", (False,),        "vllm",       "✓", "✗", "no beam search"),
    _f("length_penalty",              "b", "number",        "def", (1,),            "vllm",       "✓", "✗", "beam search only"),
    _f("include_stop_str_in_output",  "b", "boolean",       "def", (False,),        "vllm",       "✓", "✗", "the stop string is always cut"),
    _f("skip_special_tokens",         "b", "boolean",       "def", (True,),         "vllm",       "✓", "✗", "special tokens are always left out of the text"),
    _f("spaces_between_special_tokens", "b", "boolean",     "def", (True,),         "vllm",       "✓", "✗", "special tokens are never in the text"),
    _f("truncate_prompt_tokens",      "b", "integer",       "no",  _,               "vllm",       "✓", "✗", "a prompt too long is refused, never cut"),
    _f("truncation_side",             "b", "string",        "no",  _,               "vllm",       "✓", "✗", "see truncate_prompt_tokens"),
    _f("prompt_logprobs",             "b", "integer",       "ok",  (1,),            "vllm",       "✓", "✗", "each prompt token's logprob and this many alternatives, as vLLM's choice.prompt_logprobs; such a request skips the prefix cache"),
    _f("logprob_token_ids",           "b", "array",         "no",  _,               "vllm",       "✓", "✗", "not implemented yet"),
    _f("allowed_token_ids",           "b", "array",         "no",  _,               "vllm",       "✓", "✗", "not implemented yet"),
    _f("bad_words",                   "b", "array",         "def", ([],),           "vllm",       "✓", "✗", "not implemented yet"),
    _f("watermarking",                "b", "boolean",       "def", (False,),        "vllm",       "✓", "✗", "not supported"),
    _f("thinking_token_budget",       "b", "integer",       "no",  _,               "vllm",       "✓", "✗", "no reasoning models"),
    _f("repetition_detection",        "b", "object",        "no",  _,               "vllm",       "✓", "✗", "not supported"),
    # --- vLLM's extra request parameters ----------------------------------------------------------------------
    _f("add_special_tokens",          "b", "boolean",       "def", (False,),        "vllm",       "✓", "✗", "prompts are encoded without special tokens (vLLM's completions default is true)"),
    _f("structured_outputs",          "b", "object",        "ok",  ({"choice": ["yes", "no"]},), "vllm", "✓", "✗", "one of json, json_object, regex, choice, grammar (Lark or GBNF); whitespace_pattern for JSON"),
    _f("guided_json",                 "b", "string|object", "ok",  ({"type": "object"},), "vllm",  "◐", "✗", "vLLM's older form of structured_outputs.json"),
    _f("guided_regex",                "b", "string",        "ok",  ("[0-9]+",),     "vllm",       "◐", "✗", "vLLM's older form of structured_outputs.regex"),
    _f("guided_choice",               "b", "array",         "ok",  (["yes", "no"],), "vllm",      "◐", "✗", "vLLM's older form of structured_outputs.choice"),
    _f("guided_grammar",              "b", "string",        "ok",  ('start: "a"+',), "vllm",      "◐", "✗", "vLLM's older form of structured_outputs.grammar"),
    _f("guided_decoding_backend",     "b", "string",        "def", ("auto", "guidance"), "vllm",  "◐", "✗", "one backend: llguidance"),
    _f("guided_whitespace_pattern",   "b", "string",        "ok",  ("[ ]?",),       "vllm",       "◐", "✗", "the whitespace JSON may use between tokens (default: none)"),
    _f("add_generation_prompt",       "h", "boolean",       "ok",  (True,),         "vllm",       "✓", "✓", "false: the template does not open the assistant's turn"),
    _f("continue_final_message",      "h", "boolean",       "ok",  (False,),        "vllm",       "✓", "◐", "true: the last message, the assistant's, is continued (not with add_generation_prompt: true)"),
    _f("chat_template",               "h", "string",        "no",  _,               "vllm",       "✓", "✗", "the model's own template only"),
    _f("chat_template_kwargs",        "h", "object",        "ok",  ({},),           "vllm",       "✓", "✓", "variables for the model's chat template, e.g. enable_thinking"),
    _f("documents",                   "h", "array",         "no",  _,               "vllm",       "✓", "✗", "not supported"),
    _f("mm_processor_kwargs",         "h", "object",        "no",  _,               "vllm",       "✓", "✗", "text models only"),
    _f("media_io_kwargs",             "h", "object",        "no",  _,               "vllm",       "✓", "✗", "text models only"),
    _f("include_reasoning",           "h", "boolean",       "def", (True,),         "vllm",       "✓", "✗", "no reasoning parser: the text is all there is"),
    _f("prompt_embeds",               "c", "string|array",  "no",  _,               "vllm",       "✓", "✗", "token ids or text only"),
    _f("priority",                    "b", "integer",       "ok",  (7,),            "vllm",       "✓", "✗", "native scale 0-10, higher first (default 5); with --priority-order vllm, lower first (default 0)"),
    _f("request_id",                  "b", "string",        "no",  _,               "vllm",       "✓", "✗", "the server names each request (X-Request-Id)"),
    _f("session_id",                  "b", "string",        "no",  _,               "vllm",       "✓", "✗", "not supported"),
    _f("cache_salt",                  "b", "string",        "no",  _,               "vllm",       "✓", "✗", "not supported"),
    _f("kv_transfer_params",          "b", "object",        "no",  _,               "vllm",       "✓", "✗", "no disaggregated serving"),
    _f("ec_transfer_params",          "b", "object",        "no",  _,               "vllm",       "✓", "✗", "no disaggregated serving"),
    _f("vllm_xargs",                  "b", "object",        "no",  _,               "vllm",       "✓", "✗", "no extensions"),
    _f("return_tokens_as_token_ids",  "b", "boolean",       "def", (False,),        "vllm",       "✓", "✗", "only with logprobs"),
    _f("return_token_ids",            "b", "boolean",       "def", (False,),        "vllm",       "✓", "✗", "not implemented yet"),
    _f("return_prompt_text",          "b", "boolean",       "def", (False,),        "vllm",       "✓", "✗", "not implemented yet"),
    _f("return_token_offsets",        "b", "boolean",       "def", (False,),        "vllm",       "✓", "✗", "render endpoints only"),
    _f("return_mm_kwargs",            "b", "boolean",       "def", (True,),         "vllm",       "✓", "✗", "render endpoints only"),
    _f("routed_experts_prompt_start", "b", "integer",       "def", (0,),            "vllm",       "✓", "✗", "no mixture-of-experts models"),
    _f("stream_interval",             "b", "integer",       "def", (1,),            "vllm",       "✓", "✗", "every step's tokens are sent as they come"),
    # --- batchserve's own --------------------------------------------------------------------------------------
    _f("deadline_ms",                 "b", "number",        "ok",  (5000,),         "batchserve", "✗", "✗", "a deadline from arrival; default: the queue level's"),
    _f("deadline_kind",               "b", "string",        "ok",  ("soft",),       "batchserve", "✗", "✗", "hard: fail with 504 when it cannot be met; soft: cut the answer short"),
)


def for_endpoint(chat: bool) -> dict[str, FieldSpec]:
    """The fields a body of /v1/chat/completions (chat) or /v1/completions may hold, by name."""
    ep = CHAT if chat else COMPLETIONS
    return {f.name: f for f in FIELDS if ep in f.endpoints}


def same_value(a: Any, b: Any) -> bool:
    """JSON equality: true is not 1, 0 is 0.0, and lists and objects compare element-wise."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _cell(values: tuple[Any, ...]) -> str:
    return ", ".join(f"`{json.dumps(v)}`" for v in values)


def markdown() -> str:
    """docs/api-fields.md: the conformance table, one row per field and endpoint set."""
    eps = {frozenset({COMPLETIONS, CHAT}): "both", frozenset({COMPLETIONS}): "completions", frozenset({CHAT}): "chat"}
    lines = [
        "# Request fields: batchserve, vLLM, llama.cpp",
        "",
        "Generated by `python -m batchserve.server.fields --markdown` from the table the server validates",
        "requests with (`batchserve/server/fields.py`); a test fails when this page is out of date.",
        "",
        "✓ honoured · ◐ batchserve: accepted only at the default value(s) listed, a 400 naming the field",
        "otherwise; vLLM / llama.cpp: partly, or only some values · ✗ batchserve: refused with a 400 naming",
        "the field (null is accepted for every field); vLLM / llama.cpp: not accepted, or ignored.",
        "The vLLM (0.32) and llama.cpp (llama-server) columns are read from their request schemas and docs.",
        "",
        "| field | endpoints | from | batchserve | vLLM | llama.cpp | accepted values / note |",
        "|---|---|---|:-:|:-:|:-:|---|",
    ]
    for f in FIELDS:
        note = f.note
        if f.status is Status.DEFAULT_ONLY:
            note = f"only {_cell(f.values)}: {note}"
        lines.append(f"| `{f.name}` | {eps[f.endpoints]} | {f.origin} | {f.mark} | {f.vllm} | {f.llama_cpp} | {note} |")
    counts = {s: sum(f.status is s for f in FIELDS) for s in Status}
    lines += ["", f"{len(FIELDS)} rows: {counts[Status.HONOURED]} honoured, {counts[Status.DEFAULT_ONLY]} "
              f"default-only, {counts[Status.REFUSED]} refused.", ""]
    return "\n".join(lines)


DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "api-fields.md"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m batchserve.server.fields", description=__doc__.split("\n")[0])
    p.add_argument("--markdown", action="store_true", help=f"write the conformance table to {DOC}")
    p.add_argument("--stdout", action="store_true", help="print the conformance table instead")
    a = p.parse_args(argv)
    if a.stdout:
        print(markdown(), end="")
    elif a.markdown:
        DOC.write_text(markdown())
        print(f"wrote {DOC}")
    else:
        p.print_help()


if __name__ == "__main__":
    main()
