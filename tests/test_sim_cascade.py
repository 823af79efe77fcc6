"""The two-device cascade (sim/cascade.py) and the mixed-step interference term (sim/cost.py):
the stages run at once, the hand-off costs exactly its formula, nothing is lost on either
device, and interference 1 is today's roofline to the bit while > 1 slows mixed steps only."""
from __future__ import annotations

import dataclasses

import pytest

from batchserve.bench.workload import WorkItem, make_workload
from batchserve.config import CacheConfig, EngineConfig, SchedulerConfig
from batchserve.core.batch import ScheduledBatch, ScheduledSeq
from batchserve.request import SamplingParams
from batchserve.sim.cascade import CascadeSimulator, overlap
from batchserve.sim.cluster import kv_bytes_per_token
from batchserve.sim.cost import RooflineCost, StepShape
from batchserve.sim.simulator import Simulator

A100 = RooflineCost("a100-80gb", "llama-2-7b")
H100 = RooflineCost("h100", "llama-2-7b")
P = SamplingParams()


def cascade_config(seats: int = 8, prefill: int = 6, tokens: int = 512) -> EngineConfig:
    return EngineConfig(cache=CacheConfig(block_size=4),
                        scheduler=SchedulerConfig(policy="cascade", max_num_seqs=32, max_num_batched_tokens=tokens,
                                                  prefill_max_batch=prefill, decode_max_batch=seats))


def burst(n: int, prompt: int, output: int) -> list[WorkItem]:
    return [WorkItem(0.001 * i, prompt, None, None, output) for i in range(n)]


def test_stages_run_at_once() -> None:
    """Prompts keep arriving while earlier requests decode: both devices are busy together,
    so the run is shorter than the two devices' work laid end to end."""
    sim = CascadeSimulator(cascade_config(), A100, record_batches=True)
    res = sim.run([WorkItem(0.02 * i, 400, None, None, 40) for i in range(60)])
    pre, dec = res.stages["prefill"], res.stages["decode"]
    assert pre["steps"] > 10 and dec["steps"] > 10
    assert res.overlap_s > 0.25 * min(pre["busy_s"], dec["busy_s"])
    assert res.span_s < pre["busy_s"] + dec["busy_s"]
    # the cascade policy's two stages: prompts only on one device, decodes only on the other
    assert all(n > 1 or start == 0 for batch in sim.prefill.executor.trace for _, n, start in batch)
    assert all(n == 1 and start > 0 for batch in sim.decode.executor.trace for _, n, start in batch)
    assert max(len(b) for b in sim.decode.executor.trace) == 8  # the decode seats, all used
    assert res.summary["n_ok"] == 60


def test_overlap_of_interval_lists() -> None:
    assert overlap([(0, 2), (3, 5)], [(1, 4)]) == 2.0
    assert overlap([(0, 1)], [(1, 2)]) == 0.0
    assert overlap([], [(0, 1)]) == 0.0


@pytest.mark.parametrize("bandwidth,latency", [(1e9, 0.01), (25e9, 50e-6), (1e12, 0.0)])
def test_hand_off_delays_the_second_token_by_the_formula(bandwidth: float, latency: float) -> None:
    """One request, prefill on an H100, decode on an A100: its second token comes exactly one
    hand-off (n * kv bytes / bandwidth + latency) plus one A100 decode step after its first."""
    n = 300
    sim = CascadeSimulator(cascade_config(), H100, A100, link_bytes_per_s=bandwidth, link_latency_s=latency)
    res = sim.run([WorkItem(0.0, n, None, None, 3)])
    r = res.records[0]
    first, second, third = r.token_times
    delay = n * kv_bytes_per_token(H100) / bandwidth + latency
    step1 = A100.step_time(ScheduledBatch([ScheduledSeq("r0", [1], n, [], True, P, 1)]))
    step2 = A100.step_time(ScheduledBatch([ScheduledSeq("r0", [1], n + 1, [], True, P, 2)]))
    prefill = H100.step_time(ScheduledBatch([ScheduledSeq("r0", [1] * n, 0, [], True, P, 0)]))
    assert first == pytest.approx(prefill, abs=1e-12)  # TTFT: the H100's prefill step alone
    assert second - first == pytest.approx(delay + step1, abs=1e-12)
    assert third - second == pytest.approx(step2, abs=1e-12)
    assert res.handoff["count"] == 1 and res.handoff["seconds"] == pytest.approx(delay)
    assert res.handoff["bytes"] == n * kv_bytes_per_token(H100) and res.handoff["wait_s"] == 0.0


@pytest.mark.parametrize("decode_blocks", [None, 100])
def test_every_request_ends_once_and_both_pools_drain(decode_blocks: int | None) -> None:
    """Mixed lengths, some one-token answers (they end on the prefill device). With a small
    decode pool, hand-offs wait for blocks there (the prefill device holds their K/V): still
    every request ends exactly once with its full length, and no block is left anywhere."""
    items = make_workload("chat", 120, 200.0, seed=7, scale=0.2)
    items = [dataclasses.replace(it, max_tokens=1) if i % 10 == 0 else it for i, it in enumerate(items)]
    sim = CascadeSimulator(cascade_config(), A100, prefill_blocks=200, decode_blocks=decode_blocks,
                           record_batches=True)
    res = sim.run(items)
    assert sorted(res.ends) == sorted(f"r{i}" for i in range(len(items)))
    assert set(res.ends.values()) == {1}
    for i, (item, r) in enumerate(zip(items, res.records)):
        assert r.id == f"r{i}" and r.ok and r.finish_reason == "length"
        assert r.output_tokens == item.max_tokens == len(r.token_times)
    for node in sim.nodes:
        node.engine.kv.check_all_free()
        assert not node.engine.has_unfinished
    handed = [it for it in items if it.max_tokens > 1]
    assert res.handoff["count"] == len(handed)
    assert res.stages["prefill"]["tokens_computed"] == sum(it.prompt_len for it in items)
    assert max(len(b) for b in sim.decode.executor.trace) <= 8
    assert res.handoff["wait_s"] > 0  # the seats (and the small pool) held hand-offs back
    if decode_blocks is None:
        assert res.stages["decode"]["tokens_computed"] == sum(it.max_tokens - 1 for it in handed)


@pytest.mark.parametrize("seats", [8, 1])
def test_a_request_the_decode_pool_cannot_hold_is_refused_there(seats: int) -> None:
    """A request whose prompt and output need more blocks than the whole decode pool does not
    wait for a seat forever: the decode engine refuses it after its first token, and both
    pools drain. With one decode seat, the hand-off behind it starts once the refusal frees
    that seat."""
    sim = CascadeSimulator(cascade_config(seats=seats), A100, decode_blocks=10)
    res = sim.run([WorkItem(0.0, 100, None, None, 4), WorkItem(0.0, 8, None, None, 4)])
    big, small = res.records
    assert big.first_token_time is not None and big.finish_reason == "error" and "KV" in big.error
    assert small.ok and small.output_tokens == 4
    assert res.ends == {"r1": 1}
    for node in sim.nodes:
        node.engine.kv.check_all_free()


def test_only_the_cascade_policy() -> None:
    cfg = dataclasses.replace(cascade_config(), scheduler=SchedulerConfig(policy="continuous"))
    with pytest.raises(ValueError, match="policy"):
        CascadeSimulator(cfg, A100)


# --- the mixed-step interference term ----------------------------------------------------------
def mixed() -> ScheduledBatch:
    decodes = [ScheduledSeq(f"d{i}", [5], 300 + i, [], True, P, 3) for i in range(32)]
    return ScheduledBatch(decodes + [ScheduledSeq("p", [5] * 700, 0, [], True, P, 0)])


# Today's numbers (the roofline before the interference term existed), to the last bit:
# a chunked run of make_workload("mixed", 40, 20.0, seed=11, scale=0.2) on the A100 roofline.
PINNED = (225, 3.57659924616598, 860.3144462714024, 21.113926993188574)


def chunked_run(cost: RooflineCost) -> tuple:
    cfg = EngineConfig(cache=CacheConfig(block_size=16),
                       scheduler=SchedulerConfig(policy="chunked", max_num_seqs=64, max_num_batched_tokens=1024,
                                                 chunk_size=256))
    res = Simulator(cfg, cost).run(make_workload("mixed", 40, 20.0, seed=11, scale=0.2))
    return res.num_steps, res.busy_s, res.summary["output_tokens_per_s"], res.summary["latency"]["tpot_ms"]["p99"]


def test_interference_one_is_todays_roofline_exactly() -> None:
    one = RooflineCost("a100-80gb", "llama-2-7b", interference=1.0)
    for batch in (mixed(), ScheduledBatch(mixed().seqs[:32]), ScheduledBatch(mixed().seqs[32:])):
        assert one.step_time(batch) == one.time_of(StepShape.of(batch)) == A100.step_time(batch)
    assert chunked_run(one) == PINNED


def test_interference_slows_mixed_steps_only() -> None:
    f = 1.5
    slow = RooflineCost("a100-80gb", "llama-2-7b", interference=f)
    batch = mixed()
    decodes = ScheduledBatch(batch.seqs[:32])
    prompt = ScheduledBatch(batch.seqs[32:])
    assert slow.step_time(batch) == pytest.approx(A100.step_time(batch) + (f - 1) * A100.step_time(decodes))
    assert slow.step_time(batch) > A100.step_time(batch)
    assert slow.step_time(decodes) == A100.step_time(decodes)  # steps of one kind are unchanged
    assert slow.step_time(prompt) == A100.step_time(prompt)
    base, slowed = chunked_run(A100), chunked_run(slow)
    assert slowed[1] > base[1]  # busier
    assert slowed[2] < base[2]  # fewer output tokens per second
    assert slowed[3] > base[3]  # the decodes that shared steps with prompts wait longer
    with pytest.raises(ValueError, match="interference"):
        RooflineCost("a100-80gb", "llama-2-7b", interference=0.5)


def test_cascade_stages_never_mix() -> None:
    """Neither device runs a mixed step, so interference leaves a cascade run unchanged."""
    items = burst(30, 200, 20)
    a = CascadeSimulator(cascade_config(), A100).run(items)
    b = CascadeSimulator(cascade_config(), RooflineCost("a100-80gb", "llama-2-7b", interference=3.0)).run(items)
    assert [r.to_dict() for r in a.records] == [r.to_dict() for r in b.records]
