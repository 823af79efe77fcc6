"""`batchserve profile`: the fit and knee as pure functions, then a quick run on the tiny dummy
model through the CLI, and the saved file loaded back as a latency model."""
from __future__ import annotations

import json
import random

import pytest

from batchserve.core.latency import TERMS, ProfiledLatencyModel, features, load_latency_profile
from batchserve.runner.profiler import fit, knee


def test_fit_recovers_a_known_model():
    rng = random.Random(0)
    true = [0.002, 1e-4, 5e-4, 3e-3, 0.1]
    rows, times = [], []
    for _ in range(60):
        pre = [(rng.choice([0, 64]), rng.randint(1, 400))] if rng.random() < 0.6 else []
        dec = [rng.randint(16, 1024) for _ in range(rng.randint(0 if pre else 1, 32))]
        x = features(pre, dec)
        rows.append(x)
        times.append(sum(c * v for c, v in zip(true, x)) * rng.uniform(0.98, 1.02))
    coef = fit(rows, times)
    for got, want in zip(coef, true):
        assert got == pytest.approx(want, rel=0.15, abs=2e-5)


def test_fit_never_gives_negative_slopes():
    # times that fall with decode count (noise): the slope is pinned at 0, not negative
    rows = [features([], [100] * b) for b in (1, 2, 4, 8)]
    coef = fit(rows, [0.010, 0.0099, 0.0098, 0.0097])
    assert all(c >= 0 for c in coef[1:])


def test_knee():
    sizes = [1, 2, 4, 8, 16, 32, 64]
    assert knee(sizes, [10, 20, 40, 75, 90, 95, 96]) == 16  # 16 -> 32 adds under 15%
    assert knee(sizes, [10, 20, 40, 80, 160, 320, 640]) == 64  # never flattens
    assert knee(sizes, [10, 10.5, 11, 11, 11, 11, 11]) == 1
    assert knee(sizes, [29, 9, 23, 97, 16, 71, 80]) == 8  # noisy dips do not fake a knee


@pytest.mark.kernel
def test_quick_profile_cli_writes_a_loadable_model(tmp_path, capsys):
    from batchserve.cli import main

    out = tmp_path / "prof.json"
    assert main(["profile", "--quick", "--reps", "1", "--out", str(out), "--block-size", "16"]) == 0
    text = capsys.readouterr().out
    assert "knee" in text and "max batch that fits" in text
    prof = json.loads(out.read_text())
    assert set(prof["fit"]["coef"]) == set(TERMS)
    nb, bs = prof["num_blocks"], prof["block_size"]
    # --quick's 0.01 GiB pool: its blocks times the cache dtype's bytes per token (not the model dtype's)
    assert 0.99 * 0.01 * 2**30 < prof["kv_bytes_per_token"] * bs * nb <= 0.01 * 2**30
    for ctx, cap in prof["max_batch_by_context"].items():
        assert cap == nb // -(-int(ctx) // bs)  # the pool holds exactly that many sequences
    assert prof["knee"]["batch"] in [int(b) for b in prof["knee"]["throughputs"]]
    assert len(prof["samples"]) >= 10 and all(s["seconds"] > 0 for s in prof["samples"])

    m = ProfiledLatencyModel.load(str(out))
    assert m.knee_batch == prof["knee"]["batch"] and m.kv_blocks == nb
    # more work never predicts a faster step
    assert m.predict_step(64, 1) >= m.predict_step(8, 1) > 0
    assert m.predict_step(16, 16) >= m.predict_step(1, 1)
    assert m.predict_step(16, 16, context=16 * 2000) >= m.predict_step(16, 16, context=16 * 10)
    assert m.predict_batch(4, 32, 8) > m.predict(4 * 32, 0)
    before = m.predict_step(8, 8)
    for _ in range(50):
        m.observe(8, 8, 2 * before)  # the machine got busier: predictions follow, slowly
    assert 1.5 * before < m.predict_step(8, 8) <= 2.01 * before


def test_dynamic_policy_takes_cap_and_service_prior_from_a_profile(tmp_path):
    from batchserve.config import SchedulerConfig
    from batchserve.core.policies import make_policy

    path = tmp_path / "p.json"
    path.write_text(json.dumps({
        "fit": {"coef": {"const": 0.01, "prefill_token": 1e-4, "decode_seq": 1e-3, "decode_ktoken": 0.0,
                         "prefill_mpair": 0.0}, "context_len": 128},
        "knee": {"batch": 8}, "max_batch_by_context": {"128": 40}, "num_blocks": 320}))
    pol = make_policy("dynamic", SchedulerConfig(policy="dynamic", max_batch=32),
                      latency=load_latency_profile(str(path)))
    assert pol.max_batch == 8  # the knee: past it a bigger batch only adds latency
    assert pol.service_ms > 0
    assert make_policy("dynamic", SchedulerConfig(policy="dynamic", max_batch=32)).max_batch == 32  # no profile
    assert make_policy("static", SchedulerConfig(), latency=load_latency_profile(str(path))).name == "static"


def test_engine_loads_the_profile_once_for_scheduler_and_policy(tmp_path, make_fake_engine, monkeypatch):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({
        "fit": {"coef": {"const": 0.01, "prefill_token": 1e-4, "decode_seq": 1e-3, "decode_ktoken": 0.0,
                         "prefill_mpair": 0.0}, "context_len": 128}, "knee": {"batch": 8}}))
    loads = []
    real_load = ProfiledLatencyModel.load.__func__
    monkeypatch.setattr(ProfiledLatencyModel, "load", classmethod(lambda cls, p: loads.append(p) or real_load(cls, p)))
    eng = make_fake_engine(policy="dynamic", max_batch=32, latency_profile=str(path))
    assert loads == [str(path)]
    assert isinstance(eng.scheduler.latency, ProfiledLatencyModel)
    assert eng.scheduler.policy.max_batch == 8 and eng.scheduler.policy.service_ms > 0  # the knee, the prior


def test_engine_uses_the_profile_for_step_predictions(tmp_path, make_fake_engine):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({
        "fit": {"coef": {"const": 0.01, "prefill_token": 1e-4, "decode_seq": 1e-3, "decode_ktoken": 0.0,
                         "prefill_mpair": 0.0}, "context_len": 128}, "knee": {"batch": 8}}))
    eng = make_fake_engine(latency_profile=str(path))
    assert isinstance(eng.scheduler.latency, ProfiledLatencyModel)
    assert eng.scheduler.latency.predict_step(4, 4) == pytest.approx(0.01 + 4 * 1e-3)  # 4 decodes
    assert eng.scheduler.latency.predict_step(20, 1) == pytest.approx(0.01 + 20 * 1e-4)  # a prompt


def test_fit_finds_the_row_knee_of_the_matrix_products():
    """Steps that barely grow up to 16 rows (the weights' stream bounds them) and then add each
    row's arithmetic: the fit picks the knee at 16 and follows both sides, where the straight
    fit misses the small steps or the big ones."""
    from batchserve.runner.profiler import fit_with_knee

    def step(pre, dec):  # 10 ms up to 16 rows, +0.6 ms a row after; attention terms on top
        rows = sum(n for _, n in pre) + len(dec)
        return 0.010 + 0.0006 * max(0, rows - 16) + 0.002 * sum(dec) / 1e3 + 0.3 * sum(n * (s + n) for s, n in pre) / 1e6

    samples = [{"prefills": [(0, p)], "decode_ctx": [], "seconds": step([(0, p)], [])} for p in (16, 64, 256, 512)]
    samples += [{"prefills": [], "decode_ctx": [c] * b, "seconds": step([], [c] * b)}
                for c in (128, 512) for b in (1, 2, 4, 8, 16, 32, 64, 128)]
    k, coef, errs = fit_with_knee(samples)
    assert k == 16 and max(errs) < 0.02
    straight = fit([features(s["prefills"], s["decode_ctx"]) for s in samples], [s["seconds"] for s in samples])
    worst = max(abs(sum(c * x for c, x in zip(straight, features(s["prefills"], s["decode_ctx"]))) - s["seconds"])
                / s["seconds"] for s in samples)
    assert worst > 5 * max(errs)
    m = ProfiledLatencyModel(coef=dict(zip(TERMS, coef)), context_len=128, row_knee=k)
    assert m.predict_step(8, 8) == pytest.approx(step([], [128] * 8), rel=0.02)
    assert m.predict_step(64, 64) == pytest.approx(step([], [128] * 64), rel=0.02)
    assert m.predict_step(64, 64, context=64 * 128) == pytest.approx(m.predict_step(64, 64), rel=1e-6)
