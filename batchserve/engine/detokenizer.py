"""Incremental detokenization and stop strings.

Decoding only a short window of recent tokens keeps each step O(1) per request; text is
released only once it no longer ends in an incomplete UTF-8 sequence (U+FFFD)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable


@dataclass
class DetokState:
    prefix_offset: int = 0  # start of the window decoded for context
    read_offset: int = 0  # tokens already turned into released text
    text: str = ""


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """token ids -> text, special tokens skipped. A transformers fast tokenizer's decode is its
    Rust tokenizer's plus Python around it (argument conversion, optional clean-up of spaces);
    when it would add nothing, the Rust call is used directly: the same text at a fraction of
    the cost, twice per running request per step."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if callable(getattr(backend, "decode", None)) and getattr(tokenizer, "clean_up_tokenization_spaces", None) is False:
        return functools.partial(backend.decode, skip_special_tokens=True)
    return functools.partial(tokenizer.decode, skip_special_tokens=True)


def detokenize_step(decode: Callable[[list[int]], str], tokens: list[int], st: DetokState) -> str:
    """Advance `st` over `tokens` (all output tokens so far); return newly released text.
    `decode` is text_decoder(tokenizer)."""
    prefix = decode(tokens[st.prefix_offset:st.read_offset])
    full = decode(tokens[st.prefix_offset:])
    if len(full) <= len(prefix) or full.endswith("\ufffd"):
        return ""
    new = full[len(prefix):]
    st.prefix_offset, st.read_offset = st.read_offset, len(tokens)
    st.text += new
    return new


def find_stop(text: str, new_len: int, stops: tuple[str, ...]) -> int:
    """Index in `text` where the earliest stop string that touches the new tail begins, or -1."""
    if not stops:
        return -1
    longest = max(len(s) for s in stops)
    lo = max(0, len(text) - new_len - longest + 1)
    hits = [i for i in (text.find(s, lo) for s in stops) if i >= 0]
    return min(hits) if hits else -1
