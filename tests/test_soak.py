"""The soak benchmark in seconds: a real uvicorn server on 127.0.0.1 around a model-free engine
whose steps take real time, driven well past its capacity behind a small queue cap, then a
disconnect storm. Every request sent must end answered or refused with a Retry-After, none
lost, and every KV block must come back (the conftest leak check reads the pool after)."""
from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import FakeExecutor
from fake_server import fake_engine
from server_helpers import start_server

from batchserve.bench.client import ClientConfig, run
from batchserve.bench.metrics import RequestRecord
from batchserve.config import QueueConfig
from benchmarks.priority_flood import poisson
from benchmarks.soak import drain, in_use, kv_series, outcome, storm, tally, work

SEATS, STEP_S, OUT = 4, 0.02, 6


class PacedExecutor(FakeExecutor):
    """The fake model, with each step taking its step time on the wall clock: a capacity the
    load can exceed."""

    def execute(self, batch):
        time.sleep(self.step_time)
        return super().execute(batch)


@pytest.mark.http
def test_three_times_capacity_loses_nothing_and_a_storm_frees_every_block() -> None:
    engine = fake_engine(PacedExecutor(256, step_time=STEP_S), num_blocks=256, queue=QueueConfig.bounded(8),
                         max_num_seqs=SEATS)
    srv = start_server(engine)
    try:
        capacity = SEATS / ((OUT + 1) * STEP_S)
        rng = np.random.default_rng(0)
        items = work(poisson(3 * capacity, 3.0, rng), rng, prompt_mean=12, out_lo=OUT, out_hi=OUT)
        res = run(items, ClientConfig(srv.url, extensions=False, request_timeout_s=20.0, progress=False))
        t = tally(res.records)
        assert t["sent"] == len(items) > 100
        assert t["lost"] == 0 and t["failed"] == 0, t["examples"]
        assert t["answered"] + t["refused"] == t["sent"]
        assert t["refused"] > 0 and t["answered"] >= 8, t  # overloaded, and a full queue got in
        assert t["refused_without_retry_after"] == 0
        after, _ = drain(srv.url)
        assert in_use(after) == 0
        s = storm(srv.url, SEATS, max_tokens=400, first_s=10.0)  # ~8 s each if left to finish
        assert s["cut_mid_stream"] == SEATS and s["blocks_in_use_at_cut"] > 0
        assert s["seconds_to_zero"] is not None and s["seconds_to_zero"] < 2.0, s
    finally:
        srv.stop()


def test_outcomes_tell_an_explicit_refusal_from_a_request_lost_on_the_way() -> None:
    def rec(**kw) -> RequestRecord:
        return RequestRecord("r", "soak", 5, end_time=1.0, **kw)

    assert outcome(rec(status=200, finish_reason="length")) == "answered"
    assert outcome(rec(status=503, error="queue full", retry_after_s=1.0)) == "refused"
    assert outcome(rec(status=504, error="deadline")) == "failed"
    assert outcome(rec(status=200, error="in-stream failure")) == "failed"
    assert outcome(rec(status=200, error="timeout: TimeoutError")) == "lost"
    assert outcome(rec(status=200, disconnected=True, error="stream ended before [DONE]")) == "lost"
    assert outcome(rec(error="connect failed: refused")) == "lost"
    t = tally([rec(status=503, error="full"), rec(status=200, finish_reason="length")])
    assert (t["sent"], t["answered"], t["refused"], t["refused_without_retry_after"]) == (2, 1, 1, 1)


def test_the_kv_series_sums_labelled_samples() -> None:
    timeline = [{"t": 1.0, "values": {"batchserve:kv_cache_blocks{model_name=m}": 10.0,
                                      "batchserve:kv_cache_free_blocks{model_name=m}": 7.0,
                                      "batchserve:requests_waiting{level=a,model_name=m}": 2.0,
                                      "batchserve:requests_waiting{level=b,model_name=m}": 1.0}}]
    assert kv_series(timeline) == [(1.0, 3, 3)]
