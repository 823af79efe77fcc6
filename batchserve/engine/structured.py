"""Structured outputs: answers held to a JSON schema, a regular expression, a list of choices or
a grammar, token by token.

    allowed(step) = { t : prefix + t can still be completed to a sentence of the grammar }
    logits[t]     = -inf  for t not in allowed(step)

A request states its constraint as a `Constraint` (plain data, so it crosses thread, process
and replica boundaries). `Compiler.compile` turns it into a `Grammar` when the request is
prepared, off the engine thread; a schema or grammar that does not compile is a RequestError
naming the field it came from. Before each step the engine writes the allowed-token bitmask of
every constrained row that samples (`ScheduledSeq.allowed`, int32 words, bit t % 32 of word
t // 32); the sampler sets every other logit to -inf; `update` feeds the sampled token back, and
the request ends with finish reason "stop" once the grammar is complete and allows nothing
more (or the model picks end-of-sequence where the grammar allows it). A token the grammar
refuses (only possible if the sampler was bypassed) ends the request with an error, never with
text that breaks its constraint silently. `max_tokens` still applies: an answer cut by length
is a prefix of a valid one, as with every engine.

The matching is llguidance's (Earley parsing with a lexer over the tokenizer's trie), which
computes a mask in well under a step's time; its tokenizer view is built once per engine, on
the first constrained request.

JSON is generated with the separators ", " and ": " and no other whitespace, so a small model
cannot fill its answer with blank lines (flexible whitespace is allowed grammatically, and that
is what such models then do)."""
from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np

from batchserve.request import Constraint, RequestError

_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _lark_literal(s: str) -> str:
    return json.dumps(s)  # Lark string literals take JSON's escapes


class Grammar:
    """One request's matcher: which tokens may come next, and whether the answer is complete."""

    __slots__ = ("_m", "_words")

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._m = matcher
        self._words = (vocab_size + 31) // 32

    def mask(self) -> np.ndarray:
        """The allowed next tokens: int32 words, bit t % 32 of word t // 32 set for token t."""
        out = np.zeros(self._words, dtype=np.int32)
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        return out

    def accept(self, token: int) -> bool:
        """Advance past `token`; False (and the grammar is dead) if it was not allowed."""
        return self._m.consume_token(token)

    @property
    def done(self) -> bool:
        """Complete, and nothing more may follow."""
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


class Compiler:
    """Compiles constraints for one tokenizer. Thread-safe; the tokenizer view (about a second
    to build) is made on first use and kept."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        self._tok, self._vocab, self._eos = tokenizer, vocab_size, eos_token_id
        self._ll = None
        self._lock = threading.Lock()

    def _lltokenizer(self, field: str):
        with self._lock:
            if self._ll is None:
                import llguidance.hf

                try:
                    from batchserve.runner.tokenizer import FastTokenizer

                    # llguidance reads a transformers tokenizer: a FastTokenizer's own
                    tok = self._tok.hf if isinstance(self._tok, FastTokenizer) else self._tok
                    self._ll = llguidance.hf.from_tokenizer(tok, n_vocab=self._vocab, eos_token=self._eos)
                except ValueError:  # not a fast (Rust) Hugging Face tokenizer
                    raise RequestError(field, "structured outputs need a fast Hugging Face tokenizer; this "
                                       f"model's is a {type(self._tok).__name__}") from None
            return self._ll

    def compile(self, c: Constraint) -> Grammar:
        if self._tok is None:
            raise RequestError(c.field, "needs a model with a tokenizer")
        import llguidance

        M = llguidance.LLMatcher
        try:
            if c.kind == "json":
                schema = {"type": "object"} if c.spec in ({}, True, "") else c.spec
                opts = dict(_JSON_OPTIONS)
                if c.whitespace is not None:
                    opts.update(whitespace_flexible=True, whitespace_pattern=c.whitespace)
                text = M.grammar_from_json_schema(schema, defaults=opts)
            elif c.kind == "regex":
                text = M.grammar_from_regex(c.spec)
            elif c.kind == "choice":
                text = M.grammar_from_lark("start: " + " | ".join(_lark_literal(s) for s in c.spec))
            else:
                lark = c.spec
                if "::=" in lark:
                    from llguidance.gbnf_to_lark import gbnf_to_lark

                    lark = gbnf_to_lark(lark)
                text = M.grammar_from_lark(lark)
        except Exception as e:  # noqa: BLE001 - the text is the caller's: any failure is its fault
            raise RequestError(c.field, f"is not a valid {c.kind} constraint ({type(e).__name__}: {e!s:.200})") from None
        m = M(self._lltokenizer(c.field), text, log_level=0)
        if m.is_error():
            raise RequestError(c.field, f"is not a valid {c.kind} constraint: {m.get_error()}")
        return Grammar(m, self._vocab)

