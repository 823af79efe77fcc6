"""The GGUF tokenizer cache (runner/tokenizer.py), model-free: a small GGUF file with a real
byte-level BPE vocabulary and a chat template, converted by transformers, cached, read back as
a FastTokenizer and compared with what transformers gives for the same file."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest

from batchserve.runner import tokenizer as tk
from batchserve.runner.tokenizer import CACHE_ENV, META, FastTokenizer, cache_entry, fast_differs, gguf_tokenizer

# A template that uses what chat templates use: a system default, tools through tojson, a
# namespace, loop controls, raise_exception, reasoning_content and the generation tag.
TEMPLATE = (
    "{% set ns = namespace(n=0) %}"
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role') }}{% endif %}{% set ns.n = ns.n + 1 %}"
    "<|im_start|>{{ m['role'] }}\n{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %}{% if m.name is defined %}({{ m.name }}){% endif %}<|im_end|>\n"
    "{% if ns.n > 5 %}{% break %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ eos_token if false }}"
)


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-character table, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def write_tokenizer_gguf(path, template: str = TEMPLATE) -> str:
    """A GGUF file carrying a byte-level BPE tokenizer (three special tokens, a few merges)."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_alphabet(), "Ġt", "he", "Ġthe", "Ġa"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_context_length(64)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["Ġ t", "h e", "Ġt he", "Ġ a"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_chat_template(template)
    w.add_vocab_size(len(tokens))
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder of this test's own, and a count of the conversions made."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    calls = []
    real = tk._convert

    def counted(path):
        calls.append(path)
        return real(path)

    monkeypatch.setattr(tk, "_convert", counted)
    return calls


def _reference(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


CHATS = [
    [{"role": "user", "content": "the cat"}],
    [{"role": "system", "content": "a"}, {"role": "user", "content": "東京 <|im_end|>", "name": "bo"},
     {"role": "assistant", "content": "the", "reasoning": "hm"}, {"role": "user", "content": None}],
    [{"role": "user", "content": str(i)} for i in range(8)],  # the loop breaks after six
    [{"role": "tool", "content": "x"}],  # the template refuses it
]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


def test_first_load_converts_and_caches_later_loads_read_the_cache(tmp_path, cache):
    path = write_tokenizer_gguf(tmp_path / "m.gguf")
    first = gguf_tokenizer(path)
    assert isinstance(first, FastTokenizer) and len(cache) == 1
    entry = cache_entry(path)
    assert entry.startswith(str(tmp_path / "cache")) and os.path.exists(os.path.join(entry, "tokenizer.json"))
    assert json.load(open(os.path.join(entry, META)))["fast"] is True
    again = gguf_tokenizer(path)
    assert isinstance(again, FastTokenizer) and len(cache) == 1  # read back, not converted again
    ref = _reference(path)
    assert fast_differs(again, ref) is None
    for text in (" the cat", "a<|im_end|>b", "  ", "naïve ☃"):
        for special in (False, True):
            assert again.encode(text, add_special_tokens=special) == ref.encode(text, add_special_tokens=special)
    ids = ref.encode("<|im_start|> the ☃", add_special_tokens=False)
    assert again.decode(ids) == ref.decode(ids) and again.decode(ids, skip_special_tokens=True) == " the ☃"
    for chat in CHATS:
        for tools in (None, TOOLS):
            for gen in (False, True):
                try:
                    want = ref.apply_chat_template(chat, tools=tools, add_generation_prompt=gen, tokenize=True)
                except Exception as e:  # noqa: BLE001
                    with pytest.raises(type(e)):
                        again.apply_chat_template(chat, tools=tools, add_generation_prompt=gen, tokenize=True)
                    continue
                got = again.apply_chat_template(chat, tools=tools, add_generation_prompt=gen, tokenize=True)
                assert got["input_ids"] == list(want["input_ids"])
                assert (again.apply_chat_template(chat, tools=tools, add_generation_prompt=gen, tokenize=False)
                        == ref.apply_chat_template(chat, tools=tools, add_generation_prompt=gen, tokenize=False))
    assert again.eos_token_id == ref.eos_token_id == 2 and len(again) == len(ref)


def test_a_changed_file_is_converted_again_and_its_old_entry_removed(tmp_path, cache):
    path = write_tokenizer_gguf(tmp_path / "m.gguf")
    old = gguf_tokenizer(path)
    old_entry = cache_entry(path)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: treated as a new file
    assert cache_entry(path) != old_entry
    gguf_tokenizer(path)
    assert len(cache) == 2 and not os.path.exists(old_entry)
    write_tokenizer_gguf(path, template="{% for m in messages %}[{{ m['content'] }}]{% endfor %}")  # rewritten
    new = gguf_tokenizer(path)
    assert len(cache) == 3
    chat = [{"role": "user", "content": "the"}]
    assert new.apply_chat_template(chat, tokenize=False) == "[the]"
    assert old.apply_chat_template(chat, tokenize=False) != "[the]"


def test_the_transformers_tokenizer_is_used_where_the_fast_one_would_differ(tmp_path, cache, monkeypatch):
    path = write_tokenizer_gguf(tmp_path / "m.gguf")
    real = tk.fast_differs
    monkeypatch.setattr(tk, "fast_differs", lambda fast, ref: "decode differs")
    tok = gguf_tokenizer(path)
    assert not isinstance(tok, FastTokenizer) and type(tok).__module__.startswith("transformers")
    assert json.load(open(os.path.join(cache_entry(path), META)))["fast"] is False
    monkeypatch.setattr(tk, "fast_differs", real)
    assert not isinstance(tk.load_entry(cache_entry(path)), FastTokenizer)  # the decision is kept


def test_an_unwritable_cache_still_gives_the_tokenizer(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker))  # a file: no folder can be made under it
    path = write_tokenizer_gguf(tmp_path / "m.gguf")
    tok = gguf_tokenizer(path)
    assert not isinstance(tok, FastTokenizer) and tok.encode(" the", add_special_tokens=False) == [261]


def test_template_variables_and_a_continued_final_message_render_as_transformers_does(tmp_path, cache):
    """vLLM's chat_template_kwargs and continue_final_message, rendered without transformers,
    give the ids transformers gives."""
    template = TEMPLATE.replace("{% if add_generation_prompt %}",
                                "{% if add_generation_prompt %}{% if thinking is defined and not thinking %}"
                                "<think></think>{% endif %}")
    path = write_tokenizer_gguf(tmp_path / "m.gguf", template)
    tok = gguf_tokenizer(path)
    assert isinstance(tok, FastTokenizer)
    open_turn = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "the a "}]
    cases = [(CHATS[0], dict(add_generation_prompt=True, thinking=False)),
             (CHATS[0], dict(add_generation_prompt=True, thinking=True)),
             (open_turn, dict(continue_final_message=True))]
    mine = [tok.apply_chat_template(c, tokenize=False, **kw) for c, kw in cases]
    assert tok._hf is None  # rendered without transformers
    ref = _reference(path)
    assert mine == [ref.apply_chat_template(c, tokenize=False, **kw) for c, kw in cases]
    assert "<think></think>" in mine[0] and "<think>" not in mine[1]
    assert mine[2].endswith("the a ") and "<|im_end|>" not in mine[2].split("assistant")[-1]


def test_the_rest_goes_to_the_transformers_tokenizer_loaded_on_first_need(tmp_path, cache):
    path = write_tokenizer_gguf(tmp_path / "m.gguf")
    tok = gguf_tokenizer(path)
    assert tok._hf is None
    assert tok.convert_ids_to_tokens([261]) == ["Ġthe"] and tok._hf is not None
    assert tok.get_vocab() == _reference(path).get_vocab()
    from batchserve.engine.structured import Compiler

    assert Compiler(tok, len(tok), tok.eos_token_id)._lltokenizer("response_format") is not None


def test_a_cached_tokenizer_loads_without_importing_transformers(tmp_path, cache):
    path = write_tokenizer_gguf(tmp_path / "m.gguf")
    gguf_tokenizer(path)
    code = ("import sys; from batchserve.runner.tokenizer import gguf_tokenizer; "
            f"t = gguf_tokenizer({path!r}); "
            "ids = t.apply_chat_template([{'role': 'user', 'content': 'the'}], add_generation_prompt=True)['input_ids']; "
            "print(type(t).__name__, 'transformers' in sys.modules, t.decode(ids))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}).stdout.split()
    assert out[:2] == ["FastTokenizer", "False"] and "<|im_start|>assistant" in " ".join(out)


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tk.cache_dir() == str(tmp_path / "xdg" / "batchserve")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext" / "torch_extensions"))
    assert tk.cache_dir() == str(tmp_path / "ext" / "batchserve")  # beside the kernels' builds
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "own"))
    assert tk.cache_dir() == str(tmp_path / "own")


@pytest.mark.model
def test_smollm2s_cached_tokenizer_answers_as_the_converted_one(tmp_path, cache):
    from batchserve.runner.loader import resolve_model_path

    path = resolve_model_path("smollm2-135m-instruct")
    gguf_tokenizer(path)
    tok = gguf_tokenizer(path)
    ref = _reference(path)
    assert isinstance(tok, FastTokenizer) and len(cache) == 1 and fast_differs(tok, ref) is None
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True)["input_ids"] == list(
        ref.apply_chat_template(chat, add_generation_prompt=True)["input_ids"])
