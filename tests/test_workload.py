"""Workloads: deterministic per seed, the asked statistics, exact prompt lengths, trace replay."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from batchserve.bench.arrivals import make_arrivals
from batchserve.bench.metrics import SLO
from batchserve.bench.workload import (MIXES, ORDINARY_IDS, RequestClass, class_slos, make_workload, mix_classes,
                                       save_trace)


def _gaps(items) -> np.ndarray:
    t = np.array([w.arrival for w in items])
    return np.diff(np.concatenate([[0.0], t]))


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_deterministic_per_seed(mix):
    a = make_workload(mix, 200, 3.0, seed=7)
    b = make_workload(mix, 200, 3.0, seed=7)
    c = make_workload(mix, 200, 3.0, seed=8)
    assert a == b
    assert a != c
    assert all(x.arrival <= y.arrival for x, y in zip(a, a[1:]))
    for w in a:
        assert w.prompt is None and len(w.prompt_token_ids) == w.prompt_len >= 1
        assert all(ORDINARY_IDS[0] <= t < ORDINARY_IDS[1] for t in w.prompt_token_ids)
        assert w.max_tokens >= 1 and 0 <= w.priority <= 10


@pytest.mark.slow
def test_poisson_mean_rate_and_unclipped_gaps():
    items = make_workload("chat", 20000, 4.0, seed=1)
    g = _gaps(items)
    assert 1 / g.mean() == pytest.approx(4.0, rel=0.03)
    assert g.var() / g.mean() ** 2 == pytest.approx(1.0, rel=0.05)  # exponential: CV^2 = 1
    # not clipped: the tail reaches where an exponential's does (P(gap > 5/rate) = e^-5)
    assert g.max() > 2.0 and (g > 1.25).mean() == pytest.approx(np.exp(-5), rel=0.35)


@pytest.mark.slow
@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_is_cv2(burstiness):
    items = make_workload("chat", 20000, 2.0, seed=2, arrival="gamma", burstiness=burstiness)
    g = _gaps(items)
    assert 1 / g.mean() == pytest.approx(2.0, rel=0.05)
    assert g.var() / g.mean() ** 2 == pytest.approx(burstiness, rel=0.1)


def test_step_ramp_onoff_rates():
    rng = np.random.default_rng(3)
    t = make_arrivals("step", 30000, 2.0, rng, factors=(1, 7.5, 1), step_s=500)
    assert np.sum(t < 500) / 500 == pytest.approx(2.0, rel=0.08)
    assert np.sum((t >= 500) & (t < 1000)) / 500 == pytest.approx(15.0, rel=0.05)
    assert np.sum((t >= 1000) & (t < 1500)) / 500 == pytest.approx(2.0, rel=0.08)
    t = make_arrivals("ramp", 20000, 4.0, rng, start=0.0, end=1.0, ramp_s=1000)
    assert np.sum(t < 500) / 500 == pytest.approx(1.0, rel=0.1)  # mean of 0..2 req/s
    assert np.sum((t >= 500) & (t < 1000)) / 500 == pytest.approx(3.0, rel=0.06)
    t = make_arrivals("onoff", 20000, 2.0, rng, on_s=1.0, off_s=3.0)
    assert len(t) / t[-1] == pytest.approx(2.0, rel=0.05)
    phase = np.mod(t, 4.0)
    assert np.all(phase <= 1.0 + 1e-9)  # nothing arrives while OFF
    assert np.all(np.diff(t) >= 0)


@pytest.mark.slow
def test_length_distributions_and_class_shares():
    items = make_workload("mixed", 6000, 1.0, seed=4, scale=1.0)
    by = {c: [w for w in items if w.cls == c] for c in ("code", "summary", "chat")}
    for c, (pin, pout) in {"code": (2000, 500), "summary": (5000, 300), "chat": (200, 200)}.items():
        assert len(by[c]) / len(items) == pytest.approx(1 / 3, abs=0.03)
        assert np.mean([w.prompt_len for w in by[c]]) == pytest.approx(pin, rel=0.02)
        assert np.mean([w.max_tokens for w in by[c]]) == pytest.approx(pout, rel=0.02)
    small = make_workload("mixed", 3000, 1.0, seed=4)  # default scale 0.1 for this CPU
    assert np.mean([w.prompt_len for w in small if w.cls == "summary"]) == pytest.approx(500, rel=0.03)
    sl = make_workload("short-long", 5000, 1.0, seed=5)
    long_ = [w.max_tokens for w in sl if w.cls == "long"]
    assert len(long_) / len(sl) == pytest.approx(0.1, abs=0.015)
    assert np.mean(long_) == pytest.approx(512, rel=0.05)
    chat = make_workload("chat", 5000, 1.0, seed=6)
    outs = np.array([w.max_tokens for w in chat])
    assert outs.mean() == pytest.approx(200, rel=0.03)
    assert outs.std() / outs.mean() == pytest.approx(0.5, rel=0.1)


def test_priority_flood_levels_and_deadlines():
    items = make_workload("priority-flood", 4000, 10.0, seed=9, arrival="step", factors=(1, 7.5), step_s=20,
                          deadline_scale=0.5)
    share = {c: sum(w.cls == c for w in items) / len(items) for c in ("high", "mid", "low")}
    assert share["low"] == pytest.approx(0.7, abs=0.03) and share["high"] == pytest.approx(0.1, abs=0.02)
    high = [w for w in items if w.cls == "high"]
    assert {(w.priority, w.deadline_ms, w.deadline_kind) for w in high} == {(9, 1000.0, "hard")}
    assert {w.deadline_kind for w in items if w.cls == "mid"} == {"soft"}
    assert all(w.deadline_ms is None and w.priority == 1 for w in items if w.cls == "low")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from batchserve.runner.loader import resolve_model_path

    path = resolve_model_path("smollm2-135m-instruct")
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.mark.model
def test_exact_token_lengths_with_real_tokenizer(tokenizer):
    items = make_workload("mixed", 24, 1.0, seed=11, tokenizer=tokenizer)
    items += make_workload("short-long", 24, 1.0, seed=12, tokenizer=tokenizer)
    assert min(w.prompt_len for w in items) < 20 < max(w.prompt_len for w in items)
    for w in items:
        assert w.prompt_token_ids is None
        assert len(tokenizer.encode(w.prompt, add_special_tokens=False)) == w.prompt_len
    again = make_workload("mixed", 24, 1.0, seed=11, tokenizer=tokenizer)
    assert [w.prompt for w in again] == [w.prompt for w in items[:24]]


def test_trace_replay(tmp_path):
    rows = [
        {"timestamp": 100.5, "prompt": "Hello there, how are you?", "max_tokens": 8, "priority": 9,
         "deadline_ms": 500, "deadline_kind": "hard", "cls": "high"},
        {"timestamp": 100.0, "prompt_len": 12, "max_tokens": 4},
        {"timestamp": 102.0, "prompt_len": 3, "max_tokens": 2, "priority": 1},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    items = make_workload(str(path), 0, 0.0)
    assert [w.arrival for w in items] == [0.0, 0.5, 2.0]  # shifted to 0, sorted, gaps kept
    assert items[1].prompt == "Hello there, how are you?" and items[1].priority == 9
    assert (items[1].deadline_ms, items[1].deadline_kind, items[1].cls) == (500.0, "hard", "high")
    assert items[0].prompt_len == 12 and len(items[0].prompt_token_ids) == 12
    assert [w.max_tokens for w in items] == [4, 8, 2]
    faster = make_workload(str(path), 0, 3.0)  # stretched so that 3 requests span 1 s
    assert [w.arrival for w in faster] == pytest.approx([0.0, 0.25, 1.0])
    assert len(make_workload(str(path), 2, 0.0)) == 2
    redrawn = make_workload(str(path), 0, 1.0, arrival="poisson", seed=3)
    assert sorted(w.max_tokens for w in redrawn) == [2, 4, 8]
    # round trip: a generated workload saved as a trace replays to the same requests
    gen = make_workload("priority-flood", 50, 5.0, seed=1)
    save_trace(gen, str(tmp_path / "gen.jsonl"))
    back = make_workload(str(tmp_path / "gen.jsonl"), 0, 0.0)
    assert [(w.prompt_len, w.max_tokens, w.priority, w.deadline_ms, w.cls) for w in back] == \
           [(w.prompt_len, w.max_tokens, w.priority, w.deadline_ms, w.cls) for w in gen]
    assert [w.arrival for w in back] == pytest.approx([w.arrival - gen[0].arrival for w in gen])


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="neither a mix"):
        make_workload("nope", 10, 1.0)
    with pytest.raises(ValueError, match="rate"):
        make_workload("chat", 10, 0.0)
    with pytest.raises(ValueError, match="arrival"):
        make_workload("chat", 10, 1.0, arrival="uniform")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "max_tokens": 3}\n')
    with pytest.raises(ValueError, match="prompt"):
        make_workload(str(bad), 0, 0.0)


def test_request_classes_as_the_mix():
    hi = RequestClass("high", 0.18, 64, 32, cv=0.2, priority=9, deadline_ms=2000.0, deadline_kind="hard",
                      slo=SLO(ttft_ms=300.0))
    mid = RequestClass("mid", 0.20, 128, 16, priority=5, deadline_ms=5000.0, deadline_kind="soft")
    low = RequestClass("low", 0.62, 256, 64, priority=1)
    items = make_workload([hi, mid, low], 3000, 5.0, seed=2, deadline_scale=0.5)
    assert items == make_workload([hi, mid, low], 3000, 5.0, seed=2, deadline_scale=0.5)
    by = {c.name: [w for w in items if w.cls == c.name] for c in (hi, mid, low)}
    assert sum(map(len, by.values())) == len(items)  # every item carries its class's name
    for c, share in ((hi, 0.18), (mid, 0.20), (low, 0.62)):
        ws = by[c.name]
        assert len(ws) / len(items) == pytest.approx(share, abs=0.025)
        assert np.mean([w.prompt_len for w in ws]) == pytest.approx(c.prompt_mean, rel=0.06)
        assert np.mean([w.max_tokens for w in ws]) == pytest.approx(c.output_mean, rel=0.06)
        assert {w.priority for w in ws} == {c.priority}
        assert {w.deadline_kind for w in ws} == {c.deadline_kind}
        assert {w.deadline_ms for w in ws} == {None if c.deadline_ms is None else c.deadline_ms / 2}
    assert class_slos([hi, mid, low]) == {"high": SLO(ttft_ms=300.0)}
    assert mix_classes([hi, low]) == (hi, low) and mix_classes("chat")[0].name == "chat"
    assert mix_classes("some-trace.jsonl") == ()
    for bad in (dict(weight=0), dict(priority=11), dict(deadline_kind="firm", deadline_ms=5.0),
                dict(prompt_mean=-1.0), dict(deadline_ms=0.0)):
        with pytest.raises(ValueError):
            RequestClass(**{"name": "x", "weight": 1.0, **bad})
    with pytest.raises(ValueError, match="prompt_mean"):
        make_workload([RequestClass("x", 1.0)], 10, 1.0)  # a synthetic mix needs lengths
    with pytest.raises(ValueError, match="repeat"):
        make_workload([low, low], 10, 1.0)


def test_classes_relabel_a_trace(tmp_path):
    gen = make_workload("chat", 400, 5.0, seed=1)
    save_trace(gen, str(tmp_path / "t.jsonl"))
    hi, lo = RequestClass("high", 1.0, priority=9, deadline_ms=800.0, deadline_kind="hard"), RequestClass("low", 3.0)
    items = make_workload(str(tmp_path / "t.jsonl"), 0, 0.0, classes=[hi, lo], seed=4)
    assert [(w.arrival, w.prompt_len, w.max_tokens) for w in items] == \
           [(pytest.approx(w.arrival - gen[0].arrival), w.prompt_len, w.max_tokens) for w in gen]  # the trace's
    high = [w for w in items if w.cls == "high"]
    assert len(high) / len(items) == pytest.approx(0.25, abs=0.06)
    assert {(w.priority, w.deadline_ms, w.deadline_kind) for w in high} == {(9, 800.0, "hard")}
    assert all(w.priority == lo.priority and w.deadline_ms is None for w in items if w.cls == "low")
    with pytest.raises(ValueError, match="relabels a trace"):
        make_workload("chat", 10, 1.0, classes=[hi])


def test_piecewise_rate_profile():
    rng = np.random.default_rng(5)
    t = make_arrivals("piecewise", 20000, 2.0, rng, phases=[(1000, 1), (1000, 3), (500, 0, 2)])
    assert np.sum(t < 1000) / 1000 == pytest.approx(2.0, rel=0.08)
    assert np.sum((t >= 1000) & (t < 2000)) / 1000 == pytest.approx(6.0, rel=0.05)
    assert np.sum((t >= 2000) & (t < 2500)) / 500 == pytest.approx(2.0, rel=0.1)  # ramp 0 -> 4 req/s
    assert np.sum((t >= 2500) & (t < 3000)) / 500 == pytest.approx(4.0, rel=0.08)  # the last rate holds
    assert np.all(np.diff(t) >= 0)
    surge = make_workload("chat", 600, 2.0, seed=1, arrival="piecewise", phases=[(50, 1), (50, 3), (50, 1)])
    assert np.sum([50 <= w.arrival < 100 for w in surge]) > 2 * np.sum([w.arrival < 50 for w in surge])
    for bad in ([], [(0, 1)], [(10, -1)], [(10,)]):
        with pytest.raises(ValueError, match="piecewise"):
            make_arrivals("piecewise", 10, 1.0, rng, phases=bad)
