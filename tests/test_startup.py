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
