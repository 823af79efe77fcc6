"""The packed-weight cache: a second start maps what the first packed, and multiplies with it
bit for bit as with freshly packed matrices; an unreadable entry is packed again and replaced."""
from __future__ import annotations

import pytest
import torch

from batchserve.config import CacheConfig, ModelConfig
from batchserve.runner import weight_cache
from batchserve.runner.loader import load_model
from batchserve.runner.model_runner import ModelRunner
from batchserve.runner.models import llama

pytestmark = pytest.mark.model

PROMPT = [1, 504, 3458, 314, 260, 3575, 282, 4649, 47]
_FROM_BLOCKS = llama.Linear.from_blocks.__func__


def _runner(monkeypatch, packs: list[bool]) -> ModelRunner:
    """A runner of the default model (int8 products where this CPU has them); `packs` gets, per
    matrix taken from GGUF blocks, whether it was packed here (True) or came from the cache."""
    def spy(cls, raw, src, act_bits=0, isa=-1, packed=None, n=None):
        packs.append(packed is None)
        return _FROM_BLOCKS(cls, raw, src, act_bits, isa, packed, n)

    monkeypatch.setattr(llama.Linear, "from_blocks", classmethod(spy))
    cfg = ModelConfig()
    return ModelRunner(load_model(cfg), cfg, CacheConfig(num_blocks=8, block_size=16))


def _logits(runner: ModelRunner) -> torch.Tensor:
    table = list(range(runner.num_blocks))
    return runner.prompt_logprobs(PROMPT, table)


def test_second_start_maps_the_first_ones_packing(monkeypatch, tmp_path):
    monkeypatch.setenv(weight_cache.CACHE_ENV, str(tmp_path))
    first: list[bool] = []
    a = _runner(monkeypatch, first)
    assert first and all(first)  # nothing cached yet: every matrix packed
    (entry,) = (tmp_path / "weights").iterdir()
    assert entry.suffix == ".pt"
    second: list[bool] = []
    b = _runner(monkeypatch, second)
    assert len(second) == len(first) and not any(second)  # every matrix from the cache
    assert torch.equal(_logits(a), _logits(b))
    # an unreadable entry (a crash mid-write elsewhere, a foreign file): packed again, replaced whole
    entry.write_bytes(b"not a torch file")
    third: list[bool] = []
    _runner(monkeypatch, third)
    assert len(third) == len(first) and all(third)
    assert set(torch.load(entry, mmap=True, weights_only=True)) == set(a.model.packed)
