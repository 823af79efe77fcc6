"""Each supported model family against transformers, on tiny random checkpoints that
transformers writes here: the same greedy tokens for a batch of prompts (the prompts of
different lengths batched together, prefill and decode, sliding windows that bite).

The weights are redrawn with a larger spread than transformers' initialisation (N(0, 0.02)
gives near-uniform logits, where greedy ties would be decided by rounding), and every norm and
bias gets random values, so that a norm or bias the decoder missed changes the tokens."""
from __future__ import annotations

import pytest
import torch

from batchserve.request import SamplingParams

pytestmark = pytest.mark.model

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
PROMPTS = [[5, 17, 33, 2, 9, 41, 70, 12, 3, 88, 14, 25, 61], [7, 7, 19], [90, 1, 4, 56, 23, 11, 8, 30]]
NEW = 14
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def write_checkpoint(config, path: str, seed: int = 0):
    """A transformers model of `config` with redrawn weights, saved to `path`; returns it (eval mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen) if "gemma" not in config.model_type
                        else 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    model.save_pretrained(path)
    return model


def hf_greedy(model, ids: list[int], n: int = NEW) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                         eos_token_id=[], pad_token_id=0)
    return out[0, len(ids):].tolist()


def ours(path: str, **kw) -> list[list[int]]:
    from batchserve.llm import LLM

    kw = {"attention_backend": "torch", "linear_backend": "torch", "num_blocks": 64, "block_size": 4, **kw}
    llm = LLM(model=path, **kw)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def assert_parity(config, tmp_path, **kw) -> None:
    model = write_checkpoint(config, str(tmp_path))
    want = [hf_greedy(model, p) for p in PROMPTS]
    assert len({tuple(w) for w in want}) > 1, "degenerate reference: every prompt gives the same tokens"
    assert ours(str(tmp_path), **kw) == want


def test_llama_with_attention_and_mlp_biases(tmp_path):
    from transformers import LlamaConfig

    assert_parity(LlamaConfig(**TINY, attention_bias=True, mlp_bias=True), tmp_path)


def test_llama_with_biases_on_the_cpp_paths(tmp_path):
    """The C++ GEMM and attention kernels (auto backends) with biases: the fused layer loop does
    not compute biases, so the model must leave it and still match."""
    from transformers import LlamaConfig

    assert_parity(LlamaConfig(**TINY, attention_bias=True), tmp_path, attention_backend="auto",
                  linear_backend="auto")


def test_mistral_sliding_window_that_bites(tmp_path):
    """A window of 6 over prompts of up to 13 tokens and 14 new ones: prefill, chunked prefill
    (4-token chunks) and decode all attend to the window only, as transformers' mask does."""
    from transformers import MistralConfig

    assert_parity(MistralConfig(**TINY, sliding_window=6), tmp_path)
    assert ours(str(tmp_path), policy="chunked", chunk_size=4) == ours(str(tmp_path))


def test_qwen2_qkv_biases(tmp_path):
    from transformers import Qwen2Config

    assert_parity(Qwen2Config(**TINY, tie_word_embeddings=True), tmp_path)


def test_qwen2_sliding_window_on_the_upper_layers(tmp_path):
    from transformers import Qwen2Config

    assert_parity(Qwen2Config(**TINY, use_sliding_window=True, sliding_window=5, max_window_layers=1), tmp_path)


def test_qwen3_qk_norm_and_wide_heads(tmp_path):
    """Qwen3's per-head q/k RMSNorm, with head_dim * heads != hidden_size as in the real models."""
    from transformers import Qwen3Config

    assert_parity(Qwen3Config(**TINY, head_dim=32, rope_theta=1e6), tmp_path)


def test_qwen3_with_attention_bias(tmp_path):
    from transformers import Qwen3Config

    assert_parity(Qwen3Config(**TINY, head_dim=16, attention_bias=True), tmp_path)
