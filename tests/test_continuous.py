"""The continuous policy with a fake executor and a virtual clock: schedule -> fake output ->
update -> assert. No model."""
from batchserve.request import SamplingParams


def run_all(eng, max_steps=10_000):
    finished = {}
    steps = 0
    while eng.has_unfinished:
        for out in eng.step(now=eng.clock.now()).outputs:
            if out.finished:
                finished[out.request_id] = out
        eng.clock.advance(0.01)
        steps += 1
        assert steps < max_steps, "engine did not finish"
    return finished


def test_budget_and_whole_prompts(make_fake_engine):
    eng = make_fake_engine(max_num_batched_tokens=32, max_num_seqs=8)
    for i in range(5):
        eng.add_request(list(range(1, 11)), SamplingParams(max_tokens=3, temperature=0), now=0.0,
                        request_id=f"r{i}")
    eng.step(now=0.0)
    b0 = eng.executor.batches[0]
    assert [s.request_id for s in b0.seqs] == ["r0", "r1", "r2"]  # the 4th prompt would not fit whole
    assert b0.num_tokens == 30 and all(s.sample for s in b0.seqs)
    eng.step(now=0.01)
    b1 = eng.executor.batches[1]
    assert [s.num_tokens for s in b1.seqs] == [1, 1, 1, 10, 10]  # decodes first, then new prompts
    assert b1.num_tokens <= 32
    run_all(eng)
    assert all(b.num_tokens <= 32 for b in eng.executor.batches)


def test_max_num_seqs(make_fake_engine):
    eng = make_fake_engine(max_num_seqs=2)
    for i in range(5):
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=4), now=0.0)
    outs = run_all(eng)
    assert len(outs) == 5
    assert max(b.num_seqs for b in eng.executor.batches) == 2


def test_finished_leave_at_once_with_their_tokens(make_fake_engine):
    eng = make_fake_engine()
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=2), now=0.0, request_id="short")
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=6), now=0.0, request_id="long")
    done_at = {}
    step = 0
    while eng.has_unfinished:
        for o in eng.step(now=float(step)).outputs:
            if o.finished:
                done_at[o.request_id] = (step, o)
        step += 1
    assert done_at["short"][0] == 1 and done_at["long"][0] == 5
    s = done_at["short"][1]
    assert s.finish_reason == "length" and s.token_ids == [6, 7]  # fake token = sequence length + 3
    assert len(done_at["long"][1].token_ids) == 6
    # the long request ran alone once the short one left
    assert [b.num_seqs for b in eng.executor.batches] == [2, 2, 1, 1, 1, 1]


def test_eos_and_stop_token_ids(make_fake_engine):
    eng = make_fake_engine(eos=9)
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=10), now=0.0, request_id="eos")
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=(11,)),
                    now=0.0, request_id="stoptok")
    outs = run_all(eng)
    assert outs["eos"].token_ids == [6, 7, 8, 9] and outs["eos"].finish_reason == "stop"
    assert outs["stoptok"].token_ids == [6, 7, 8, 9, 10, 11] and outs["stoptok"].finish_reason == "stop"


def test_long_prompt_is_split_across_steps(make_fake_engine):
    eng = make_fake_engine(num_blocks=64, max_num_batched_tokens=16)
    eng.add_request(list(range(1, 41)), SamplingParams(max_tokens=2), now=0.0)
    outs = run_all(eng)
    sizes = [b.num_tokens for b in eng.executor.batches]
    assert sizes == [16, 16, 8, 1]
    assert [s.sample for b in eng.executor.batches for s in b.seqs] == [False, False, True, True]
    assert list(outs.values())[0].token_ids == [43, 44]


def test_preemption_when_blocks_run_out(make_fake_engine):
    eng = make_fake_engine(num_blocks=12, block_size=4)
    for i in range(8):
        eng.add_request(list(range(1, 9)), SamplingParams(max_tokens=12), now=0.0, request_id=f"r{i}",
                        priority=i % 3)
    outs = run_all(eng)
    assert len(outs) == 8 and all(len(o.token_ids) == 12 for o in outs.values())
    assert eng.scheduler.num_preemptions > 0
    # recompute gives the same tokens as an uninterrupted run
    assert all(o.token_ids == list(range(11, 23)) for o in outs.values())
    assert all(b.num_tokens > 0 for b in eng.executor.batches)


def test_preemption_victim_is_lowest_priority_then_latest(make_fake_engine):
    eng = make_fake_engine(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    eng.add_request([1] * 8, SamplingParams(max_tokens=16), now=0.0, request_id="hi", priority=9)
    eng.add_request([1] * 8, SamplingParams(max_tokens=16), now=0.1, request_id="lo-early", priority=1)
    eng.add_request([1] * 3, SamplingParams(max_tokens=16), now=0.2, request_id="lo-late", priority=1)
    eng.step(now=0.3)
    first_preempted = None
    while eng.has_unfinished and first_preempted is None:
        eng.step(now=eng.clock.now())
        for rid in ("hi", "lo-early", "lo-late"):
            r = eng.scheduler.requests.get(rid)
            if r is not None and r.num_preemptions:
                first_preempted = rid
    assert first_preempted == "lo-late"
    run_all(eng)


def test_abort_frees_blocks_at_once(make_fake_engine):
    eng = make_fake_engine(num_blocks=16)
    eng.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=50), now=0.0, request_id="a")
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=50), now=0.0, request_id="queued",
                    priority=0)
    eng.step(now=0.0)
    used = eng.kv.num_blocks - eng.kv.num_free_blocks
    assert used > 0
    eng.abort("a", now=0.01)
    eng.abort("queued", now=0.01)
    eng.abort("nope", now=0.01)  # unknown id: no error
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    outs = eng.step(now=0.02).outputs
    assert {o.request_id: o.finish_reason for o in outs} == {"a": "abort", "queued": "abort"}
    assert not eng.has_unfinished


def test_oversized_request_is_refused_with_named_field(make_fake_engine):
    import pytest

    from batchserve.request import RequestError

    eng = make_fake_engine(num_blocks=4, block_size=4)
    with pytest.raises(RequestError) as e:  # 16 tokens of cache: the prompt alone does not fit
        eng.add_request(list(range(1, 20)), SamplingParams(max_tokens=4), now=0.0)
    assert e.value.param == "prompt"
    with pytest.raises(RequestError) as e:  # the prompt fits, not with its max_tokens
        eng.add_request(list(range(1, 11)), SamplingParams(max_tokens=10), now=0.0)
    assert e.value.param == "max_tokens"
    with pytest.raises(RequestError) as e:
        eng.add_request([], SamplingParams(max_tokens=4), now=0.0)
    assert e.value.param == "prompt"


def test_a_decoding_request_keeps_one_scheduled_seq_updated_in_place(make_fake_engine):
    """The scheduler does not rebuild a decode's ScheduledSeq each step: one object per request,
    brought up to date (a batch is valid until the next schedule)."""
    eng = make_fake_engine()
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=5), now=0.0, request_id="a")
    seqs = []
    for step in range(4):
        eng.step(now=float(step))
        (s,) = eng.executor.batches[-1].seqs
        seqs.append(s)
        req = eng.scheduler.requests["a"]
        # what this step computes: the newest token at its position, sampling the next
        if step:
            assert (s.token_ids, s.start_pos, s.output_index) == (req.output_token_ids[-2:-1], 2 + step, step)
            assert s.sample and s.block_table == eng.kv.block_table("a")
    assert seqs[0] is not seqs[1]  # the prompt's own
    assert seqs[1] is seqs[2] is seqs[3]
    run_all(eng)


def test_running_outputs_read_as_snapshots(make_fake_engine):
    import pickle

    from batchserve.core.batch import RequestOutput
    from batchserve.engine.request_stream import merge_outputs

    eng = make_fake_engine()
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=3), now=0.0, request_id="a")
    (o1,) = eng.step(now=0.0).outputs
    (o2,) = eng.step(now=1.0).outputs
    (last,) = eng.step(now=2.0).outputs
    assert last.finished and last.finish_time == 2.01 and last.token_ids == [6, 7, 8]  # steps take 0.01 s
    # the earlier outputs still say what they said when they were made
    assert (o1.new_token_ids, o1.finished, o1.finish_reason, o1.finish_time) == ([6], False, None, None)
    assert o2.new_token_ids == [7] and o2.first_token_time == 0.01 and o2.arrival_time == 0.0
    plain = RequestOutput("a", [1, 2, 3], [6, 7, 8], [7], False, None, "", "", None, 0.0, 0.0, 0.01, None, 5, 0,
                          level="default")
    assert o2 == plain and plain == o2
    copy = pickle.loads(pickle.dumps(o2))
    assert type(copy) is RequestOutput and copy == plain
    merged = merge_outputs(o1, o2)
    assert type(merged) is RequestOutput and merged.new_token_ids == [6, 7] and not merged.finished


def test_every_scheduled_seq_matches_its_request_through_block_boundaries_and_preemption(make_fake_engine):
    """Checked as each step executes: each seq's tokens are its request's at those positions,
    its block table is the request's live one and covers them, and the batch's token count is
    the seqs' (the policies count it as they schedule) -- across block boundaries (the decode
    fast path skips the block check inside a block) and preemptions (which replace a table)."""
    from tests.conftest import FakeExecutor

    class Checking(FakeExecutor):
        def execute(self, batch):
            assert batch.num_tokens == sum(len(s.token_ids) for s in batch.seqs)
            for s in batch.seqs:
                req = eng.scheduler.requests[s.request_id]
                end = s.start_pos + len(s.token_ids)
                assert s.token_ids == req.tokens_slice(s.start_pos, end)
                assert s.block_table is eng.kv.block_table(s.request_id)
                assert len(s.block_table) * 4 >= end
                assert s.sample == (end == req.num_tokens) and s.output_index == req.num_output_tokens
            return super().execute(batch)

    for policy in ("continuous", "chunked"):
        # 8 blocks of 4 tokens for 4 requests that each grow to 3-4 blocks: preemptions
        eng = make_fake_engine(num_blocks=8, block_size=4, executor=Checking(8), policy=policy,
                               max_num_batched_tokens=16)
        for i in range(4):
            eng.add_request([10 + i] * (3 + i), SamplingParams(max_tokens=9), now=0.0, request_id=f"r{i}")
        done = run_all(eng)
        assert eng.scheduler.num_preemptions > 0
        for i in range(4):  # the fake executor's token at position p is p + 3 (for p < 997)
            assert done[f"r{i}"].token_ids == [3 + i + k + 3 for k in range(9)]
