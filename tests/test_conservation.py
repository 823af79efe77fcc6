"""Conservation: thousands of random requests (priorities, hard/soft deadlines, aborts,
both overflow policies) through the engine with a tiny KV budget — every request added ends
exactly once with a reason the caller can see, and every block comes back."""
import collections
import random

import pytest

from batchserve.config import LevelConfig, QueueConfig
from batchserve.request import OverloadedError, SamplingParams

REASONS = {"stop", "length", "abort", "deadline", "deadline_truncated", "rejected"}
QUEUE = QueueConfig(levels=(LevelConfig("high", tuple(range(7, 11)), capacity=12, overflow="reject"),
                            LevelConfig("normal", (4, 5, 6), capacity=12, overflow="drop_oldest",
                                        deadline_ms=400, deadline_kind="soft"),
                            LevelConfig("low", (0, 1, 2, 3), capacity=20, overflow="drop_oldest")),
                    urgent_after_ms=150, urgent_slack_ms=30)


@pytest.mark.parametrize("seed,policy_kw", [(0, {}), (1, {"max_num_seqs": 3}),
                                             (2, {"max_num_batched_tokens": 24})])
def test_every_request_ends_exactly_once_and_blocks_come_back(make_fake_engine, seed, policy_kw):
    rng = random.Random(seed)
    eng = make_fake_engine(num_blocks=16, block_size=4, eos=30, queue=QUEUE, **policy_kw)
    kv = eng.kv
    ended: dict[str, str] = {}
    live: set[str] = set()
    refused = 0
    hard: dict[str, bool] = {}
    n_requests, t, i = 3000, 0.0, 0
    while i < n_requests or eng.has_unfinished:
        for _ in range(min(rng.choice([0, 0, 1, 1, 2, 5]), n_requests - i)):
            kind = rng.choice([None, None, "hard", "soft"])
            try:
                r = eng.add_request(
                    [rng.randint(1, 900) for _ in range(rng.randint(1, 20))],
                    SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=rng.random() < 0.7,
                                   stop_token_ids=(rng.randint(5, 60),) if rng.random() < 0.2 else ()),
                    now=t, request_id=f"r{i}", priority=rng.randint(0, 10),
                    deadline_ms=rng.uniform(20, 600) if kind else None, deadline_kind=kind)
                live.add(r.request_id)
                hard[r.request_id] = r.hard_deadline
            except OverloadedError as e:
                assert e.level == "high" and e.retry_after_s > 0
                refused += 1
            i += 1
        if live and rng.random() < 0.05:
            eng.abort(rng.choice(sorted(live)), now=t)
        n_batches = len(eng.executor.batches)
        for o in eng.step(now=t).outputs:
            if not o.finished:
                continue
            assert o.request_id not in ended, f"{o.request_id} ended twice"
            assert o.finish_reason in REASONS
            if o.finish_reason in ("deadline", "rejected"):
                assert o.error, "a failure must say why"
            ended[o.request_id] = o.finish_reason
            live.discard(o.request_id)
        # blocks held == blocks in the tables of the running requests and of the preempted ones
        # that kept theirs (no prefix caching here); no other waiting request holds any
        sched = eng.scheduler
        held = sum(len(kv.block_table(r.request_id)) for r in [*sched.running, *sched.parked.values()])
        assert kv.num_free_blocks + held == kv.num_blocks
        assert all(kv.has(r.request_id) == (r.request_id in sched.parked) for r in sched.waiting)
        assert all(r.request_id in sched.waiting for r in sched.parked.values())
        t += eng.executor.step_time if len(eng.executor.batches) > n_batches else 0.005
        assert t < 10_000, "did not drain"
    assert not live and len(ended) + refused == n_requests
    kv.check_all_free()
    reasons = set(ended.values())
    # the mix really exercised every ending (otherwise this test proves little)
    assert {"length", "abort", "deadline", "deadline_truncated", "rejected", "stop"} <= reasons
    st = eng.scheduler.waiting.stats(t)
    assert st.finished == len(ended) and st.length == 0
    assert st.dropped == sum(r == "rejected" for r in ended.values()) and st.rejected == refused
    assert st.deadline_misses["hard"] == sum(r == "deadline" and hard[rid] for rid, r in ended.items())
    assert st.deadline_misses["soft"] >= sum(r == "deadline" and not hard[rid] for rid, r in ended.items())
    assert eng.scheduler.num_preemptions > 0
    assert st.preemptions["priority"] > 0 and st.preemptions["memory"] + st.recomputed_tokens > 0
    print(seed, policy_kw, sorted(collections.Counter(ended.values()).items()), "refused", refused,
          "preemptions", eng.scheduler.num_preemptions, "promotions", st.promotions)
