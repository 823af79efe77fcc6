"""Helpers for the policy tests: the fake clock driver, request builders, a fake executor
whose step time grows with the batch, and a seeded mixed workload."""
from __future__ import annotations

import random

from batchserve.request import SamplingParams
from tests.conftest import FakeExecutor

G = dict(temperature=0.0)


def expected_tokens(prompt_len: int, max_tokens: int) -> list[int]:
    """What the fake executor produces for an uninterrupted request (token = position + 3)."""
    return [(prompt_len + k) % 1000 + 3 for k in range(max_tokens)]


class SizedFakeExecutor(FakeExecutor):
    """The fake model with a step time that grows with the batch, like a real one."""

    def __init__(self, num_blocks: int, base: float = 0.004, per_seq: float = 0.002) -> None:
        super().__init__(num_blocks)
        self.base, self.per_seq = base, per_seq

    def execute(self, batch):
        self.step_time = self.base + self.per_seq * batch.num_seqs
        return super().execute(batch)


def drive(eng, arrivals=(), dt=0.01, max_steps=20_000):
    """Step the engine on its virtual clock, adding each (time, kwargs) arrival when its time
    comes; a step takes the executor's step time, an idle tick `dt`. Returns
    {request_id: (final output, step index at which it came back)}."""
    pending = sorted(arrivals, key=lambda a: a[0])
    done = {}
    step = 0
    while pending or eng.has_unfinished:
        now = eng.clock.now()
        while pending and pending[0][0] <= now + 1e-12:
            t, kw = pending.pop(0)
            eng.add_request(now=t, **kw)
        ran = len(eng.executor.batches)
        for out in eng.step(now=now).outputs:
            if out.finished:
                assert out.request_id not in done
                done[out.request_id] = (out, step)
        eng.clock.advance(eng.executor.step_time if len(eng.executor.batches) > ran else dt)
        step += 1
        assert step < max_steps, "engine did not finish"
    return done


def req(rid, plen, max_tokens, first=1, **kw):
    return dict(prompt=list(range(first, first + plen)), params=SamplingParams(max_tokens=max_tokens, **G),
                request_id=rid, **kw)


def mixed_workload(n=40, seed=3):
    rng = random.Random(seed)
    return [(round(rng.uniform(0, 0.3), 3), req(f"r{i}", rng.randint(2, 40), rng.randint(1, 25),
                                                first=rng.randint(1, 50), priority=rng.randint(0, 10)))
            for i in range(n)]
