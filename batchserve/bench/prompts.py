"""Prompts for workloads: random ordinary token ids, or, with a tokenizer, text of single-token
words that re-encodes (add_special_tokens=False) to exactly the asked number of tokens."""
from __future__ import annotations

from typing import Any

import numpy as np

ORDINARY_IDS = (1000, 30000)  # token-id range with no special tokens in common vocabularies
_WORDS: dict[int, list[str]] = {}  # id(tokenizer) -> words that are one token after a space


def one_token_words(tokenizer: Any) -> list[str]:
    """Lower-case alphabetic words w such that " w" encodes to a single token. Scanned in id
    order so the list (and so every prompt) is the same for the same tokenizer."""
    key = id(tokenizer)
    if key not in _WORDS:
        words = []
        for tid in range(min(len(tokenizer), 20000)):
            w = tokenizer.decode([tid]).strip()
            if 3 <= len(w) <= 8 and w.isascii() and w.isalpha() and w.islower() \
                    and len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1:
                words.append(w)
            if len(words) >= 2000:
                break
        if len(words) < 50:
            raise ValueError("tokenizer: too few single-token words to build prompts")
        _WORDS[key] = words
    return _WORDS[key]


def build_prompt(n_tokens: int, rng: np.random.Generator, tokenizer: Any = None) -> tuple[str | None, list[int] | None]:
    """(text, None) re-encoding to exactly n_tokens with a tokenizer, else (None, random ids)."""
    if tokenizer is None:
        return None, rng.integers(*ORDINARY_IDS, size=n_tokens).tolist()
    words = one_token_words(tokenizer)
    picks = [words[i] for i in rng.integers(0, len(words), size=n_tokens)]
    return exact_prompt(" " + " ".join(picks), n_tokens, rng, tokenizer), None


def exact_prompt(text: str, n_tokens: int, rng: np.random.Generator, tokenizer: Any) -> str:
    """`text` (single-token words, each after a space) trimmed or padded at its end until it
    re-encodes to exactly n_tokens; merges across words are rare, so this rarely changes it."""
    words = one_token_words(tokenizer)
    for _ in range(8):
        m = len(tokenizer.encode(text, add_special_tokens=False))
        if m == n_tokens:
            return text
        if m > n_tokens:
            text = text.rsplit(" ", m - n_tokens)[0] if " " in text.strip() else text
        else:
            text += " " + " ".join(words[i] for i in rng.integers(0, len(words), size=n_tokens - m))
    raise ValueError(f"could not build a prompt of exactly {n_tokens} tokens with this tokenizer")
