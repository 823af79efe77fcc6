"""Incremental detokenization and stop strings.

Decoding only a short window of recent tokens keeps each step O(1) per request; text is
released only once it no longer ends in an incomplete UTF-8 sequence (U+FFFD)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DetokState:
    prefix_offset: int = 0  # start of the window decoded for context
    read_offset: int = 0  # tokens already turned into released text
    text: str = ""


def detokenize_step(tokenizer, tokens: list[int], st: DetokState) -> str:
    """Advance `st` over `tokens` (all output tokens so far); return newly released text."""
    prefix = tokenizer.decode(tokens[st.prefix_offset:st.read_offset], skip_special_tokens=True)
    full = tokenizer.decode(tokens[st.prefix_offset:], skip_special_tokens=True)
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
