"""Writes tests/data/gemma3_270m_reference.json, what transformers answers on the Gemma 3 270M
GGUF file (loaded by transformers itself, dequantized to float32), for tests/test_gemma3_gguf.py:

    python -m tests.gemma3_reference

Per prompt: the prompt's token ids (batchserve's chat template), transformers' 16 greedy tokens,
and its next-token logits at the 64 highest ids and at 64 fixed ids drawn across the vocabulary,
with the largest logit's magnitude. Kept in the repository because transformers' GGUF load parses
the 262,144-token vocabulary element by element, minutes on two cores, on every fresh machine.
Run it again when the package's file or the prompts change (the test checks the file's digest).
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib

import torch

OUT = pathlib.Path(__file__).with_name("data") / "gemma3_270m_reference.json"
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain photosynthesis in one sentence.", "Who wrote Hamlet?"]
NEW = 16
TOP = 64


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def main() -> None:
    from transformers import AutoModelForCausalLM

    from batchserve.llm import LLM
    from batchserve.runner.loader import resolve_model_path

    path = resolve_model_path("gemma3-270m")
    llm = LLM(model="gemma3-270m", num_blocks=16)
    prompts = [llm.engine.tokenize(messages=[{"role": "user", "content": q}]) for q in QUESTIONS]
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    fixed = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(0))[:TOP]
    cases = []
    with torch.inference_mode():
        for q, ids in zip(QUESTIONS, prompts):
            x = torch.tensor([ids])
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False,
                                 eos_token_id=[], pad_token_id=0)
            logits = model(x).logits[0, -1].float()
            top = torch.topk(logits, TOP).indices
            at = torch.cat([top, fixed])
            cases.append({"question": q, "prompt": ids, "greedy": out[0, len(ids):].tolist(),
                          "ids": at.tolist(), "logits": logits[at].tolist(), "max_abs": logits.abs().max().item()})
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({"file_sha256": file_digest(path), "new_tokens": NEW, "cases": cases}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
