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
    true = [0.002, 1e-4, 5e-4, 3e-3, 0.1, 0.0, 0.006, 0.004]  # no knee; prompts' path 6 ms, a mixed step 4 more
    rows, times = [], []
    for _ in range(60):
        pre = [(rng.choice([0, 64]), rng.randint(1, rng.choice([100, 2000])))] if rng.random() < 0.6 else []
        dec = [rng.randint(16, 1024) for _ in range(rng.choice([0, rng.randint(1, 32)]) if pre else rng.randint(1, 32))]
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
    assert eng.scheduler.policy.max_batch == 8  # the knee


def test_engine_uses_the_profile_for_step_predictions(tmp_path, make_fake_engine):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({
        "fit": {"coef": {"const": 0.01, "prefill_token": 1e-4, "decode_seq": 1e-3, "decode_ktoken": 0.0,
                         "prefill_mpair": 0.0}, "context_len": 128}, "knee": {"batch": 8}}))
    eng = make_fake_engine(latency_profile=str(path))
    assert isinstance(eng.scheduler.latency, ProfiledLatencyModel)
    assert eng.scheduler.latency.predict_step(4, 4) == pytest.approx(0.01 + 4 * 1e-3)  # 4 decodes
    assert eng.scheduler.latency.predict_step(20, 1) == pytest.approx(0.01 + 20 * 1e-4)  # a prompt


def test_a_profile_prices_a_request_level_prefill_as_whole_prompts(make_fake_engine):
    """b prompts of p tokens attend over p each, not over b * p: a step of b whole prompts costs
    b * p * (p) pairs of the quadratic term, one chunk of b * p costs (b * p)^2."""
    from types import SimpleNamespace as NS

    from batchserve.config import SchedulerConfig
    from batchserve.core.controllers import batch_times
    from batchserve.core.policies.dynamic import DynamicPolicy

    coef = {t: 0.0 for t in TERMS} | {"const": 0.01, "prefill_token": 1e-5, "decode_seq": 1e-3, "prefill_mpair": 0.05}
    m = ProfiledLatencyModel(coef=coef, context_len=128)
    assert m.predict_step(8 * 128, 8, prompts=8) == pytest.approx(0.01 + 8 * 128 * 1e-5 + 0.05 * 8 * 128 ** 2 / 1e6)
    chunk = 8 * 128 - 7  # read as one chunk and 7 decodes
    assert m.predict_step(8 * 128, 8) == pytest.approx(0.01 + chunk * 1e-5 + 7e-3 + 0.05 * chunk ** 2 / 1e6)
    assert m.predict_step(8 * 128 + 2, 10, prompts=8) == pytest.approx(  # and two decodes beside them
        0.01 + 8 * 128 * 1e-5 + 2e-3 + 0.05 * 8 * 128 ** 2 / 1e6)
    assert m.predict_step(8, 8, prompts=8) == m.predict_step(8, 8)  # decodes are decodes

    # the dynamic policy's F(b) reads its prefill that way
    now = 50.0
    queue = [NS(request_id=f"r{i}", arrival_time=now, num_prompt_tokens=128, max_tokens=4, deadline_ms=None)
             for i in range(8)]
    sched = NS(waiting=queue, latency=m, config=NS(max_num_seqs=32, max_num_batched_tokens=8192))
    pol = DynamicPolicy(SchedulerConfig(policy="dynamic", max_batch=8, slo_p99_ms=10_000.0), latency=m)
    pol.mean_gap_s, pol.last_arrival = 0.01, now
    pol.update_controls(sched, now)
    assert pol.plan.launch and pol.plan.size == 8
    assert pol._first == pytest.approx(batch_times(lambda t, s: m.predict_step(t, s, prompts=s) if t > s
                                                   else m.predict_step(t, s), 8, 128, [4] * 8, 8192).first)
    assert pol._first < 0.5 * m.predict_step(8 * 128, 8)


def test_the_scheduler_tells_a_profile_how_many_prompts_a_step_had(tmp_path, make_fake_engine):
    from tests.policy_helpers import drive, req

    coef = {t: 0.0 for t in TERMS} | {"const": 0.01, "prefill_token": 1e-5, "decode_seq": 1e-3, "prefill_mpair": 0.05}
    m = ProfiledLatencyModel(coef=coef, context_len=128)
    for _ in range(40):  # steps of 8 whole prompts that took what the profile says they take
        m.observe(8 * 128, 8, m.predict_step(8 * 128, 8, prompts=8), prompts=8)
    assert m.correction == pytest.approx(1.0)

    path = tmp_path / "p.json"
    path.write_text(json.dumps({"fit": {"coef": coef, "context_len": 128}}))
    eng = make_fake_engine(policy="static", window_ms=0.0, max_batch=8, latency_profile=str(path))
    seen = []
    observe = eng.scheduler.latency.observe

    def recording(tokens, seqs, seconds, prompts=None):
        seen.append((tokens, seqs, prompts))
        observe(tokens, seqs, seconds, prompts)

    eng.scheduler.latency.observe = recording
    drive(eng, [(0.0, req(f"r{i}", 16, 3)) for i in range(4)])
    assert seen[0] == (64, 4, 4) and (4, 4, 0) in seen  # the batch's prefill, then its decodes


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


def _machine(busy_calls: int = 0, slowdown: float = 3.0):
    """A fake timing function: 10 ms a step up to 16 rows, +0.6 ms a row past it, plus prompt
    attention; the first `busy_calls` calls run `slowdown` times slower (a busy machine)."""
    calls: list[tuple] = []

    def time_fn(pre, dec):
        rows = sum(n for _, n in pre) + len(dec)
        t = 0.010 + 0.0006 * max(0, rows - 16) + 0.002 * sum(dec) / 1e3 + 0.3 * sum(n * (s + n) for s, n in pre) / 1e6
        calls.append((tuple(pre), tuple(dec)))
        return t * (slowdown if len(calls) <= busy_calls else 1.0)
    return time_fn, calls


def test_sweep_is_repeated_and_interleaved():
    from batchserve.runner.profiler import grid, measure, plan

    points = plan(*grid(False))
    time_fn, calls = _machine()
    measured = measure(points, time_fn, rounds=3, seed=1)
    n = len(points)
    assert len(calls) == 3 * n and all(len(ts) == 3 for _, ts in measured)
    rounds = [calls[k * n:(k + 1) * n] for k in range(3)]
    keyed = {(tuple(p), tuple(d)) for p, d in points}
    assert all(set(r) == keyed for r in rounds)  # every point once a round
    assert rounds[0] != rounds[1] != rounds[2]  # each round in its own order
    small_to_large = [(tuple(p), tuple(d)) for p, d in points]
    assert rounds[0] != small_to_large
    # a step that does not fit is dropped after its first try
    drop, _ = _machine()
    measured = measure(points, lambda p, d: None if len(d) == 128 else drop(p, d), rounds=2)
    assert all(len(d) != 128 for (_, d), _ in measured) and len(measured) == n - 5  # 3 decode, 2 mixed


def test_a_busy_spell_does_not_move_the_knee():
    """The machine is 3x slower for the first third of the run. One small-to-large pass puts the
    spell on the small batches and finds the knee late; interleaved rounds and their median
    find it at 16 (+0.6 ms a row past 16 rows: 32 adds under 15%), and report the spread."""
    from batchserve.runner.profiler import analyse, grid, measure, plan

    points = plan(*grid(False))
    n = len(points)
    time_fn, _ = _machine(busy_calls=n)
    prof = analyse(measure(points, time_fn, rounds=3, seed=0))
    assert prof["knee"]["batch"] == 16 and prof["rounds"] == 3
    assert prof["fit"]["max_rel_error"] < 0.02 and prof["fit"]["row_knee"] == 16
    assert all(s["spread"] == pytest.approx(2.0) for s in prof["samples"])  # one round 3x: (3 - 1) / 1
    assert any("varied by more than" in w for w in prof["warnings"])
    one_pass, _ = _machine(busy_calls=n // 3)
    seq = [(p, [one_pass(p, d)]) for p, d in points]  # the old way: one pass, in plan order
    seq = [((p, d), ts) for (p, ts), (_, d) in zip(seq, points)]
    assert analyse(seq)["knee"]["batch"] > 16
    quiet, _ = _machine()
    calm = analyse(measure(points, quiet, rounds=2))
    assert calm["knee"]["batch"] == 16 and calm["warnings"] == []


def test_a_bad_fit_is_warned_about():
    from batchserve.runner.profiler import analyse, grid, measure, plan, report

    points = plan(*grid(True))
    jagged = {i: 0.5 + 1.5 * ((i * 7) % 5) / 4 for i in range(200)}  # per-step factors 0.5-2: no model fits

    def time_fn(pre, dec):
        return 0.01 * jagged[len(dec) + sum(n for _, n in pre)]
    prof = analyse(measure(points, time_fn, rounds=2))
    assert prof["fit"]["mean_rel_error"] > 0.10
    assert any("fit error is large" in w for w in prof["warnings"])
    assert not any("varied" in w for w in prof["warnings"])  # repeatable, just not linear
    prof.update(model="fake", device="cpu", dtype="float32", num_blocks=10, block_size=16,
                max_batch_by_context={"16": 10})
    text = report(prof)
    assert "WARNING: fit error is large" in text and "knee: " in text and "--max-num-seqs" in text


def test_the_report_says_when_no_knee_was_reached_and_when_there_is_no_spread():
    """A knee at the largest batch measured is a lower bound, not a knee; with one round
    there is no spread to print."""
    from batchserve.runner.profiler import report

    def prof(tps: list[float], rounds: int) -> dict:
        curve = [{"batch": b, "tokens_per_s": t, "spread": 0.05} for b, t in zip((1, 2, 4, 8), tps)]
        from batchserve.runner.profiler import knee
        return {"model": "fake", "device": "cpu", "dtype": "float32", "num_blocks": 10, "block_size": 16,
                "fit": {"coef": {"const": 0.01}, "mean_rel_error": 0.01, "max_rel_error": 0.02},
                "samples": [], "rounds": rounds, "max_batch_by_context": {"16": 10}, "decode_curves": {"16": curve},
                "knee": {"batch": knee([1, 2, 4, 8], tps), "context_len": 16, "min_gain": 0.15}}

    rising = report(prof([100, 190, 350, 600], 3))
    assert "knee: none up to batch 8, the largest measured" in rising and "--max-num-seqs at least 8" in rising
    assert "8: 600 (5%)" in rising
    flat = report(prof([100, 190, 200, 205], 1))
    assert "knee: batch 2 (no larger batch adds 15% or more" in flat and "--max-num-seqs 2," in flat
    assert "8: 205," not in flat and "8: 205 (one round: no spread)" in flat


def test_profiled_decodes_are_decodes_to_the_runner():
    """The runner sends the rows of requests that have not generated yet down the prompt path
    (AMX tiles where the CPU has them) and the rest down the decode path: a profile's decode
    rows must take the decode path, or its decode times are a prompt path's at one row."""
    from types import SimpleNamespace

    from batchserve.runner.attention import ALL_ROWS, split_rows
    from batchserve.runner.profiler import build_batch

    runner = SimpleNamespace(block_size=16, num_blocks=1000, cfg=SimpleNamespace(vocab_size=512))

    def prompt_rows(batch):  # the runner's rule (ModelRunner.execute)
        return split_rows([(len(s.token_ids), s.output_index == 0) for s in batch.seqs])

    assert prompt_rows(build_batch(runner, [], [128] * 4)) is None
    assert prompt_rows(build_batch(runner, [(0, 64), (64, 32)], [])) is ALL_ROWS
    mine, rest = prompt_rows(build_batch(runner, [(0, 64)], [100, 200]))
    assert (mine, rest) == (slice(0, 64), slice(64, 66))


def test_foundation_decode_steps_are_decodes_to_the_runner():
    """The same rule for the foundation benchmark's decode table."""
    from batchserve.core.kv_cache import KVCacheManager
    from batchserve.runner.attention import split_rows
    from benchmarks.foundation import decode_batch

    batch = decode_batch(KVCacheManager(64, 16), 4, 128)
    assert split_rows([(len(s.token_ids), s.output_index == 0) for s in batch.seqs]) is None


def test_a_step_is_timed_once_it_settles():
    """A step runs slower right after a larger one (caches refill): it is timed once it has run
    WARM_S, so the median is its steady time."""
    import time as _time

    from batchserve.runner.profiler import WARM_S, time_step

    class Runner:
        calls = 0

        def execute(self, batch):
            self.calls += 1
            _time.sleep(0.008 if self.calls <= 5 else 0.001)  # five slow runs, then settled

    r = Runner()
    t = time_step(r, None, reps=3)
    assert 0.001 <= t < 0.005 and r.calls >= 5 + 3  # not the slow runs' 8 ms
    assert r.calls - 3 <= 1 + WARM_S / 0.008 + 1

