"""`pay_padding`: request-level policies put their padding in the batch as rows (PadRow), the
cost models charge them as sequences, and token-level policies never pad. Model-free, except
one test (marked kernel) over a tiny dummy model, no weights file."""
from __future__ import annotations

import dataclasses

import pytest

from batchserve.bench.workload import WorkItem
from batchserve.config import CacheConfig, EngineConfig, SchedulerConfig
from batchserve.core.batch import PadRow, ScheduledBatch, ScheduledSeq
from batchserve.request import SamplingParams
from batchserve.sim.cost import RooflineCost, StepShape
from batchserve.sim.executor import batch_key
from batchserve.sim.simulator import Simulator

COST = RooflineCost("a100-80gb", "llama-2-7b")
PROMPTS = [[5, 6, 7], [8] * 11, [9, 10, 11, 12, 13, 14], [20, 21], [30] * 7]
MAX_TOKENS = [6, 2, 9, 4, 5]


def _seq(rid: str, start: int, n: int, sample: bool) -> ScheduledSeq:
    return ScheduledSeq(rid, [1] * n, start, [0], sample, SamplingParams(), 0)


def test_a_pad_row_costs_what_the_same_row_as_a_sequence_costs() -> None:
    real = [_seq("a", 0, 9, True), _seq("b", 0, 4, True), _seq("c", 30, 1, True)]
    rows = [PadRow(4, 5, False), PadRow(40, 1, True)]
    padded = ScheduledBatch(real, padding=rows)
    as_seqs = ScheduledBatch(real + [_seq("p0", 4, 5, False), _seq("p1", 40, 1, True)])
    assert StepShape.of(padded) == StepShape.of(as_seqs)
    assert COST.step_time(padded) == COST.step_time(as_seqs) > COST.step_time(ScheduledBatch(real))
    # and with no rows, the ragged shape is untouched (the all-decode fast path too)
    decodes = [_seq("a", 9, 1, True), _seq("b", 5, 1, True)]
    assert StepShape.of(ScheduledBatch(decodes, padding=[PadRow(12, 1, True)])) == StepShape(3, 3, 3, 10 + 6 + 13,
                                                                                            29.0)


class _Charged:
    """The cost model, remembering each step's cost with its padding and without it."""

    def __init__(self, cost) -> None:
        self.cost, self.name, self.max_model_len = cost, cost.name, cost.max_model_len
        self.steps: list[tuple[float, float, int]] = []  # (charged, ragged, pad tokens)
        self.keys: list = []

    def step_time(self, batch: ScheduledBatch) -> float:
        t = self.cost.step_time(batch)
        self.steps.append((t, self.cost.step_time(ScheduledBatch(batch.seqs)),
                           sum(r.num_tokens for r in batch.padding)))
        self.keys.append(batch_key(batch))
        return t

    def num_blocks(self, block_size: int) -> int:
        return self.cost.num_blocks(block_size)

    def describe(self) -> dict:
        return self.cost.describe()


def _simulate(policy: str, pay: bool, **sched):
    cfg = EngineConfig(cache=CacheConfig(block_size=16),
                       scheduler=SchedulerConfig(policy=policy, max_batch=3, window_ms=0.0, pay_padding=pay, **sched))
    items = [WorkItem(0.0, 20 * len(p), None, p * 20, m, cls=f"x{i}")
             for i, (p, m) in enumerate(zip(PROMPTS, MAX_TOKENS))]
    cost = _Charged(COST)
    sim = Simulator(cfg, cost)
    res = sim.run(items)
    return res, cost, sim.node.engine


@pytest.mark.parametrize("policy", ["static", "dynamic"])
def test_paid_padding_lengthens_the_run_by_its_cost(policy: str) -> None:
    free, free_cost, free_eng = _simulate(policy, False)
    paid, paid_cost, paid_eng = _simulate(policy, True)
    assert paid_cost.keys == free_cost.keys  # the same batches, all queued at once
    extra = sum(t - ragged for t, ragged, _ in paid_cost.steps)
    assert extra > 0
    assert paid.busy_s == pytest.approx(free.busy_s + extra, rel=1e-12)
    assert all(t == ragged and n == 0 for t, ragged, n in free_cost.steps)
    # the rows are exactly the padding the policy accounts
    pol = paid_eng.scheduler.policy
    assert sum(n for _, _, n in paid_cost.steps) == pol.padding_tokens == free_eng.scheduler.policy.padding_tokens
    for res in (free, paid):
        assert len(res.records) == len(PROMPTS) and all(r.ok for r in res.records)
        assert [r.output_tokens for r in res.records] == MAX_TOKENS
    for eng in (free_eng, paid_eng):
        assert not eng.scheduler.has_unfinished
        eng.kv.check_all_free()


@pytest.mark.parametrize("policy,kw", [("continuous", {}), ("chunked", {"chunk_size": 8})])
def test_token_level_policies_ignore_the_flag(policy: str, kw: dict) -> None:
    free, free_cost, _ = _simulate(policy, False, **kw)
    paid, paid_cost, _ = _simulate(policy, True, **kw)
    assert paid_cost.keys == free_cost.keys
    assert paid_cost.steps == free_cost.steps and all(n == 0 for _, _, n in paid_cost.steps)
    assert paid.busy_s == free.busy_s


def _drive(eng, prompts, max_tokens):
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        eng.add_request(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True), now=0.0,
                        request_id=f"q{i}")
    finished: dict[str, list[list[int]]] = {}
    while eng.has_unfinished:
        for o in eng.step(now=eng.clock.now()).outputs:
            if o.finished:
                finished.setdefault(o.request_id, []).append(list(o.token_ids))
        eng.clock.advance(0.01)
    return finished


def test_rows_are_the_padded_batch(make_fake_engine) -> None:
    """First step: each member padded to the longest prompt; later steps: one growing decode row
    per finished member; every request ends once (the fixture checks every block came back)."""
    eng = make_fake_engine(num_blocks=64, policy="static", max_batch=4, window_ms=0.0, pay_padding=True)
    finished = _drive(eng, PROMPTS[:4], MAX_TOKENS[:4])
    assert sorted(finished) == [f"q{i}" for i in range(4)] and all(len(v) == 1 for v in finished.values())
    batches = [b for b in eng.executor.batches if b.seqs]
    assert batches[0].padding == [PadRow(3, 8, False), PadRow(6, 5, False), PadRow(2, 9, False)]
    # q1 (11 + 2 tokens) is done after two steps: from the third its row runs on at 12, 13, ...
    assert [b.padding for b in batches[2:4]] == [[PadRow(12, 1, True)], [PadRow(13, 1, True)]]
    assert all(sum(r.num_tokens for r in b.padding) == b.num_padding_tokens for b in batches)


def test_no_rows_without_the_flag(make_fake_engine) -> None:
    eng = make_fake_engine(num_blocks=64, policy="static", max_batch=4, window_ms=0.0)
    _drive(eng, PROMPTS[:4], MAX_TOKENS[:4])
    assert all(not b.padding for b in eng.executor.batches)
    assert sum(b.num_padding_tokens for b in eng.executor.batches) > 0


@pytest.mark.kernel
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_runner_runs_the_rows_in_a_scratch_block(backend: str) -> None:
    """A tiny dummy model, on the PyTorch path and the C++ kernels': padded and ragged static
    runs give the same tokens, and the pad rows' K/V land in the scratch block."""
    import torch

    from batchserve.config import ModelConfig
    from batchserve.engine.clock import SimClock
    from batchserve.engine.engine import LLMEngine
    from batchserve.runner.loader import load_model
    from batchserve.runner.model_runner import ModelRunner
    from batchserve.runner.profiler import TINY_MODEL

    mcfg = ModelConfig(model="dummy", dummy_config=TINY_MODEL, num_threads=1, attention_backend=backend,
                       linear_backend=backend)
    ccfg = CacheConfig(block_size=4, num_blocks=64)
    runner = ModelRunner(load_model(mcfg), mcfg, ccfg)
    assert runner.scratch_block == runner.num_blocks == 64
    assert runner.kv_caches[0][0].shape[0] == 65

    def run(pay: bool):
        cfg = EngineConfig(cache=ccfg, scheduler=SchedulerConfig(policy="static", max_batch=4, window_ms=0.0,
                                                                 pay_padding=pay))
        eng = LLMEngine(cfg, runner, clock=SimClock())
        out = _drive(eng, PROMPTS[:4], MAX_TOKENS[:4])
        eng.kv.check_all_free()
        return {k: v[0] for k, v in out.items()}

    for k, _ in runner.kv_caches:
        k.zero_()
    ragged = run(False)
    assert not runner.kv_caches[0][0][runner.scratch_block].any()  # nothing pads without the flag
    assert run(True) == ragged
    assert runner.kv_caches[0][0][runner.scratch_block].any()  # the rows ran, into the scratch block
    assert all(torch.isfinite(k[:runner.num_blocks].float()).all() for k, _ in runner.kv_caches)
