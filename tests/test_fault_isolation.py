"""A model step that fails is not failed whole: the engine bisects the batch, ends only the
requests the executor fails on, and carries the others on with the tokens a clean run gives
them. Model-free (the fake executor); the conftest leak check proves every block came back."""
from __future__ import annotations

import torch
from conftest import FakeExecutor

from batchserve.core.batch import ScheduledBatch, StepOutput
from batchserve.request import SamplingParams
from batchserve.runner.sampler import sample

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


class PoisonExecutor(FakeExecutor):
    """Raises on any batch holding a poisoned request, or (`max_ok`) more seqs than that."""

    def __init__(self, poison: set[str], max_ok: int | None = None) -> None:
        super().__init__(256)
        self.poison, self.max_ok, self.calls = poison, max_ok, 0

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        self.calls += 1
        if any(s.request_id in self.poison for s in batch.seqs):
            raise OverflowError("Python int too large to convert to C long")
        if self.max_ok is not None and batch.num_seqs > self.max_ok:
            raise RuntimeError("out of memory")
        return super().execute(batch)


def run(engine, n: int, poison: tuple[str, ...] = ()) -> dict[str, object]:
    for i in range(n):
        engine.add_request([1, 2, 3 + i], PARAMS, request_id=f"r{i}")
    for rid in poison:
        engine.add_request([9, 9], PARAMS, request_id=rid)
    done = {}
    while engine.has_unfinished:
        for out in engine.step(now=engine.clock.now()).outputs:
            if out.finished:
                done[out.request_id] = out
    return done


def test_a_poison_request_fails_alone_and_its_batch_carries_on(make_fake_engine) -> None:
    clean = run(make_fake_engine(num_blocks=256, executor=FakeExecutor(256)), 8)
    ex = PoisonExecutor({"bad"})
    engine = make_fake_engine(num_blocks=256, executor=ex)
    done = run(engine, 8, poison=("bad",))
    assert done["bad"].finish_reason == "error" and "failed on this request" in done["bad"].error
    assert "C long" not in done["bad"].error  # the exception is logged, not handed to callers
    for i in range(8):
        out = done[f"r{i}"]
        assert (out.finish_reason, out.token_ids) == ("length", clean[f"r{i}"].token_ids)
    assert (engine.num_failed_steps, engine.num_isolated_requests) == (1, 1)
    assert ex.calls <= 6 + 2 * 4  # six steps, and about 2*log2(9) runs to find the culprit


def test_two_poisons_in_one_batch_are_both_found(make_fake_engine) -> None:
    engine = make_fake_engine(num_blocks=256, executor=PoisonExecutor({"bad1", "bad2"}))
    done = run(engine, 14, poison=("bad1", "bad2"))
    assert {r for r, o in done.items() if o.finish_reason == "error"} == {"bad1", "bad2"}
    assert all(done[f"r{i}"].finish_reason == "length" for i in range(14))


def test_a_batch_that_fails_only_whole_fails_nobody(make_fake_engine) -> None:
    """Too big together, fine in halves (a transient or size fault): every request carries on."""
    clean = run(make_fake_engine(num_blocks=256, executor=FakeExecutor(256)), 8)
    engine = make_fake_engine(num_blocks=256, executor=PoisonExecutor(set(), max_ok=4))
    done = run(engine, 8)
    assert {rid: o.token_ids for rid, o in done.items()} == {rid: o.token_ids for rid, o in clean.items()}
    assert all(o.finish_reason == "length" for o in done.values())
    assert engine.num_isolated_requests == 0 and engine.num_failed_steps > 0


class SamplingExecutor(FakeExecutor):
    """Samples with the real sampler (PyTorch path) from fixed logits: a bad parameter that
    slipped past validation fails here, as it would in the model runner."""

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        seqs = [s for s in batch.seqs if s.sample]
        logits = torch.linspace(0, 1, 50, dtype=torch.float64).repeat(len(seqs), 1)
        toks = sample(logits, [s.params for s in seqs], [s.output_index for s in seqs], torch.Generator())
        return StepOutput({s.request_id: t + 3 for s, t in zip(seqs, toks)}, self.step_time)


def test_a_sampler_overflow_ends_only_its_own_request(make_fake_engine) -> None:
    """The operator's case: top_k of 2^63 overflowed the sampler's int64 tensor and failed all
    eight streams of its step. Validation refuses it now; should another such value get past,
    it still ends only its own request."""
    engine = make_fake_engine(num_blocks=256, executor=SamplingExecutor(256))
    poison = SamplingParams(max_tokens=6, ignore_eos=True, top_k=5)
    object.__setattr__(poison, "top_k", 2**63)  # past the validator, on purpose
    for i in range(8):
        engine.add_request([1, 2, 3 + i], PARAMS, request_id=f"r{i}")
    engine.add_request([9, 9], poison, request_id="bad")
    done = {}
    while engine.has_unfinished:
        done.update({o.request_id: o for o in engine.step(now=engine.clock.now()).outputs if o.finished})
    assert done["bad"].finish_reason == "error"
    assert all(done[f"r{i}"].finish_reason == "length" and len(done[f"r{i}"].token_ids) == 6 for i in range(8))
