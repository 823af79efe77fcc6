"""What a start costs: the KV cache allocated without writing it (model-free)."""
from __future__ import annotations

import os

import pytest
import torch

from batchserve.runner.model_runner import zeroed


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.uint8])
def test_zeroed_is_torch_zeros(dtype):
    z = zeroed((5, 3, 16, 72), dtype, torch.device("cpu"))
    assert z.shape == (5, 3, 16, 72) and z.dtype == dtype and z.is_contiguous()
    assert z.data_ptr() % 64 == 0 and torch.equal(z, torch.zeros_like(z))
    z[2, 1] = 1
    assert int(z.float().sum()) == 16 * 72 and z[2, 0].abs().sum() == 0


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc")
def test_zeroed_takes_no_resident_memory_until_written():
    before = _rss_bytes()
    z = zeroed((256, 1024, 1024), torch.uint8, torch.device("cpu"))  # 256 MiB
    assert _rss_bytes() - before < 32 * 2**20
    z[:16].fill_(1)  # the blocks written are the memory used
    assert 8 * 2**20 < _rss_bytes() - before < 64 * 2**20


def test_warm_up_is_short_and_seeds_the_latency_model_with_mixed_steps(make_fake_engine):
    eng = make_fake_engine(num_blocks=64)
    eng.warm_up()
    shapes = [(sum(len(s.token_ids) for s in b.seqs), len(b.seqs)) for b in eng.executor.batches]
    assert shapes[:3] == [(32, 1), (1, 1), (1, 1)]  # the forgotten round: a prompt, then decodes
    seeded = shapes[3:]
    assert len(seeded) == 10 == eng.scheduler.latency.num_samples and eng.scheduler.latency.ready
    assert seeded[:5] == [(32, 1), (33, 2), (34, 3), (35, 4), (11, 4)]  # each prompt joins the decodes
    assert seeded[-1] == (1, 1) and len(set(seeded)) >= 6
    assert not eng.has_unfinished and eng.scheduler.num_steps == 0 and eng.num_generated_tokens == 0
