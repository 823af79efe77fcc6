"""A GGUF file's tokenizer, converted once and then read back from a cache.

transformers builds the tokenizer of a GGUF file by parsing the whole file's metadata and
converting its vocabulary and merges, seconds on each start, and importing transformers is
itself a second or more. `gguf_tokenizer` converts once, saves the result (tokenizer.json,
the chat template, the special tokens) under `cache_dir()`, keyed by the file's path, size and
modification time and the transformers version, and from then on serves it as a
`FastTokenizer`: the Rust `tokenizers` library plus jinja2 for the chat template, with no
transformers import at all until something asks for more than encode, decode and the chat
template (structured outputs, save_pretrained): that is answered by the transformers tokenizer
loaded from the same cached files.

The fast path is taken only where it gives what transformers gives: when the cache is written,
the two are compared on probe texts and conversations, and any difference (or a tokenizer or
template this module does not mirror) records that the transformers tokenizer is to be used.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import threading
from datetime import datetime
from typing import Any

log = logging.getLogger(__name__)

CACHE_ENV = "BATCHSERVE_CACHE_DIR"
META = "batchserve-tokenizer.json"  # written last: an entry without it is incomplete
FORMAT = 2  # of what this module writes; a change makes earlier entries unused (2: default chat templates)


def cache_dir() -> str:
    """Where batchserve keeps what it derives from a model once: $BATCHSERVE_CACHE_DIR, else a
    `batchserve` folder beside the C++ kernels' build root (torch's TORCH_EXTENSIONS_DIR, whose
    default is ~/.cache/torch_extensions; so ~/.cache/batchserve, or $XDG_CACHE_HOME's)."""
    own = os.environ.get(CACHE_ENV)
    if own:
        return own
    ext = os.environ.get("TORCH_EXTENSIONS_DIR")
    if ext:
        return os.path.join(os.path.dirname(os.path.abspath(ext)), "batchserve")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "batchserve")


def _transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def cache_entry(path: str) -> str:
    """The cache folder for the tokenizer of the GGUF file at `path`: a new one whenever the
    file's size or modification time changes (a replaced or rewritten file), or the
    transformers version that converts it."""
    real = os.path.realpath(path)
    st = os.stat(real)
    key = f"{FORMAT}\0{real}\0{st.st_size}\0{st.st_mtime_ns}\0{_transformers_version()}"
    stem = os.path.splitext(os.path.basename(real))[0]
    return os.path.join(cache_dir(), "tokenizers", f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}")


def gguf_tokenizer(path: str) -> Any:
    """The tokenizer of the GGUF file at `path`: from the cache when it holds it (a
    FastTokenizer, or the transformers tokenizer where the fast one would differ), else
    converted by transformers, cached, then read back the same way. Where the cache cannot be
    written, the converted transformers tokenizer itself."""
    entry = cache_entry(path)
    if not os.path.exists(os.path.join(entry, META)):
        try:
            _write_entry(path, entry)
        except OSError as e:
            log.warning("tokenizer cache %s cannot be written (%s); converting the GGUF tokenizer on every start",
                        entry, e)
            return _convert(path)
    return load_entry(entry)


def load_entry(entry: str) -> Any:
    """A cache entry's tokenizer: a FastTokenizer where its check passed, else transformers'."""
    with open(os.path.join(entry, META)) as fh:
        meta = json.load(fh)
    if meta.get("fast"):
        return FastTokenizer(entry, meta)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(entry)


# The chat template of an architecture whose GGUF files may carry none (llama.cpp's converter
# copies one only when the source checkpoint has it): the format its models were trained on.
# Gemma 3's is the template of Google's Hugging Face checkpoints, word for word.
GEMMA3_CHAT_TEMPLATE = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
DEFAULT_CHAT_TEMPLATES = {"gemma3": GEMMA3_CHAT_TEMPLATE}


def _convert(path: str) -> Any:
    from transformers import AutoTokenizer

    log.info("converting the tokenizer of %s (once; cached for later starts)", os.path.basename(path))
    tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    if getattr(tok, "chat_template", None) is None:
        from batchserve.runner.gguf_file import read_gguf

        template = DEFAULT_CHAT_TEMPLATES.get(read_gguf(path).fields.get("general.architecture"))
        if template is not None:
            log.info("%s carries no chat template; using its architecture's own", os.path.basename(path))
            tok.chat_template = template
    return tok


def _write_entry(path: str, entry: str) -> None:
    """Convert, save into a temporary folder beside `entry`, check the fast path against the
    saved files, then move it into place (whole or not at all; a concurrent writer's finished
    entry is kept). Older entries of the same file are removed."""
    from transformers import AutoTokenizer

    parent = os.path.dirname(entry)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    try:
        _convert(path).save_pretrained(tmp)
        reference = AutoTokenizer.from_pretrained(tmp)  # what a later start would otherwise load
        meta = {"source": os.path.realpath(path), "format": FORMAT, **_fast_meta(reference)}
        if meta["fast"]:
            why = fast_differs(FastTokenizer(tmp, meta), reference)
            if why:
                log.info("tokenizer of %s: %s; the transformers tokenizer is used", os.path.basename(path), why)
                meta["fast"] = False
        with open(os.path.join(tmp, META), "w") as fh:
            json.dump(meta, fh)
        try:
            os.replace(tmp, entry)
        except OSError:
            if not os.path.exists(os.path.join(entry, META)):
                raise
        else:
            tmp = None
            _remove_older(parent, entry, meta["source"])
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _remove_older(parent: str, keep: str, source: str) -> None:
    """Remove the entries of `source` other than `keep` (made for an earlier version of the file)."""
    stem = os.path.basename(keep).rsplit("-", 1)[0]
    for name in os.listdir(parent):
        other = os.path.join(parent, name)
        if other == keep or name.rsplit("-", 1)[0] != stem:
            continue
        try:
            with open(os.path.join(other, META)) as fh:
                if json.load(fh).get("source") != source:
                    continue
        except (OSError, ValueError):
            continue
        shutil.rmtree(other, ignore_errors=True)


def _fast_meta(tok: Any) -> dict:
    """What FastTokenizer needs beyond tokenizer.json, and whether it can stand in for `tok` at
    all: a Rust-backed tokenizer without decode clean-up, and one chat template (or none)."""
    special = getattr(tok, "special_tokens_map", {})
    template = getattr(tok, "chat_template", None)
    fast = (getattr(tok, "backend_tokenizer", None) is not None
            and not getattr(tok, "clean_up_tokenization_spaces", True)
            and (template is None or isinstance(template, str))
            and all(isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))
                    for v in special.values()))
    return {"fast": bool(fast), "special_tokens": dict(special) if fast else {}, "chat_template": template if fast else None,
            "eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id, "pad_token_id": tok.pad_token_id}


# What the fast path is checked on when the cache is written: plain and special-token text,
# and conversations through the chat template (system turns, tools, None fields, reasoning).
_PROBE_TEXTS = ("Hello, world!", "  leading spaces\tand\ttabs\n\nnew lines ", "naïve café — 東京 🚀",
                "<|im_start|>user\nhi<|im_end|>", "<eos><s></s>", "")
_PROBE_CHATS = (
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again, 東京?"}],
    [{"role": "user", "content": "x", "name": None}, {"role": "assistant", "content": "y", "reasoning": "z"}],
)
_PROBE_TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the weather",
                                                  "parameters": {"type": "object",
                                                                 "properties": {"city": {"type": "string"}}}}}]


def fast_differs(fast: "FastTokenizer", ref: Any) -> str | None:
    """None when `fast` answers as `ref` (transformers) on the probes, else what differs."""
    for text in _PROBE_TEXTS:
        for special in (False, True):
            ids = ref.encode(text, add_special_tokens=special)
            if fast.encode(text, add_special_tokens=special) != ids:
                return f"encode({text!r}) differs"
            for skip in (False, True):
                if fast.decode(ids, skip_special_tokens=skip) != ref.decode(ids, skip_special_tokens=skip):
                    return f"decode of {text!r} differs"
    if ref.chat_template is None:
        return None
    for chat in _PROBE_CHATS:
        for gen in (False, True):
            for tools in (None, _PROBE_TOOLS):
                want, got = _outcome(ref, chat, gen, tools), _outcome(fast, chat, gen, tools)
                if want != got:
                    return f"chat template differs ({want!r} != {got!r})"
    return None


def _outcome(tok: Any, chat: list[dict], gen: bool, tools: list | None) -> Any:
    """The rendered text and token ids, or the kind of error the template raised."""
    try:
        text = tok.apply_chat_template(chat, add_generation_prompt=gen, tools=tools, tokenize=False)
        out = tok.apply_chat_template(chat, add_generation_prompt=gen, tools=tools, tokenize=True)
        return text, list(out["input_ids"] if hasattr(out, "keys") else out)
    except Exception as e:  # noqa: BLE001 - a template refusing a conversation is an outcome too
        return type(e).__name__


class FastTokenizer:
    """A cached tokenizer's encode, decode and chat template without transformers: the Rust
    tokenizer from tokenizer.json, the template rendered with jinja2 in the environment
    transformers renders it in (sandboxed, trim_blocks / lstrip_blocks, loop controls,
    `raise_exception`, `strftime_now`, a `tojson` that does not escape HTML, the special tokens
    as variables), the conversation normalised as transformers does (keys set to None dropped,
    `reasoning` / `thinking` aliased to `reasoning_content`). Every other attribute, and any
    call with options beyond these, goes to the transformers tokenizer of the same files,
    loaded on first need."""

    clean_up_tokenization_spaces = False

    def __init__(self, entry: str, meta: dict) -> None:
        from tokenizers import Tokenizer

        self.name_or_path = entry
        self._tokenizer = Tokenizer.from_file(os.path.join(entry, "tokenizer.json"))
        self.chat_template = meta["chat_template"]
        self.special_tokens_map = dict(meta["special_tokens"])
        self.eos_token_id, self.bos_token_id = meta["eos_token_id"], meta["bos_token_id"]
        self.pad_token_id = meta["pad_token_id"]
        self._template = None
        self._hf = None
        self._lock = threading.Lock()

    @property
    def backend_tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def hf(self) -> Any:
        """The transformers tokenizer of the same files (loaded on first use)."""
        with self._lock:
            if self._hf is None:
                from transformers import AutoTokenizer

                self._hf = AutoTokenizer.from_pretrained(self.name_or_path)
            return self._hf

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("hf", "_hf", "_lock", "_tokenizer", "_template"):
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: Any, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if kwargs or not isinstance(text, str):
            return self.hf.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> str:
        if kwargs:
            return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation: Any, tools: list | None = None, add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = True, continue_final_message: bool = False,
                            **kwargs: Any) -> Any:
        """transformers' apply_chat_template for one conversation of plain dicts and tools given
        as JSON schemas, `kwargs` being template variables; anything else (batches, documents,
        masks) is handed to transformers. `continue_final_message`: the text ends with the last
        message's content, its turn left open for the model to continue."""
        plain = (isinstance(conversation, list) and all(type(m) is dict for m in conversation)
                 and (tools is None or all(type(t) is dict for t in tools)) and self.chat_template is not None
                 and not set(kwargs) & _HF_ONLY)
        if not plain:
            return self.hf.apply_chat_template(conversation, tools=tools, add_generation_prompt=add_generation_prompt,
                                               tokenize=tokenize, return_dict=return_dict,
                                               continue_final_message=continue_final_message, **kwargs)
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        messages = [_aliased({k: v for k, v in m.items() if v is not None}) for m in conversation]
        variables = {**self.special_tokens_map, **kwargs}
        text = self._compiled().render(messages=messages, tools=tools, documents=None,
                                       add_generation_prompt=add_generation_prompt, **variables)
        if continue_final_message:  # cut after the content as rendered (whole, else stripped)
            last = messages[-1].get("content")
            for piece in (last, last.strip()) if isinstance(last, str) and last.strip() else ():
                end = text.rfind(piece)
                if end >= 0:
                    text = text[:end + len(piece)]
                    break
            else:
                raise ValueError("continue_final_message: the final message's content is not in the rendered text")
        if not tokenize:
            return text
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids

    def _compiled(self) -> Any:
        with self._lock:
            if self._template is None:
                self._template = _environment().from_string(self.chat_template)
            return self._template


_REASONING = ("reasoning_content", "thinking", "reasoning")
# apply_chat_template arguments that are not template variables: transformers handles them
_HF_ONLY = frozenset({"documents", "return_tensors", "padding", "truncation", "max_length", "return_assistant_tokens_mask",
                      "chat_template", "tokenizer_kwargs"})


def _aliased(message: dict) -> dict:
    """A message's reasoning under every name templates read it by, as transformers passes it."""
    reasoning = next((message[k] for k in _REASONING if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _environment() -> Any:
    """The jinja2 environment chat templates are written for (transformers')."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class Namespace(jinja2.utils.Namespace):
        """jinja2's namespace, refusing underscore names (no way to CPython internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")

    class Dict:
        """`dict(...)` and `dict.fromkeys(...)` for templates, nothing more."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (marks the assistant's tokens for training
        masks): renders its body, which is all it does when no mask is asked for."""
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=Dict(), namespace=Namespace)
    return env
