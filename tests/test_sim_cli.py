"""`batchserve simulate`: bench's report files, byte-identical per seed; sweeps; the seed's
scenarios at a small size; and a small live-vs-simulated fidelity check on a tiny model."""
from __future__ import annotations

import json
import os

import pytest

from batchserve.bench.workload import make_workload
from batchserve.cli import main
from batchserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from batchserve.scenarios import SCENARIOS, ScenarioUnavailable, run_scenario


def _files(d: str) -> dict[str, bytes]:
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}


@pytest.mark.slow  # renders the report's plots
def test_simulate_writes_the_bench_report_identically_per_seed(tmp_path, capsys) -> None:
    args = ["simulate", "--workload", "chat", "--scale", "0.2", "--requests", "150", "--rate", "20",
            "--policy", "continuous", "--hardware", "h100", "--seed", "3"]
    assert main(args + ["--out", str(tmp_path / "a")]) == 0
    out_a = capsys.readouterr().out
    assert main(args + ["--out", str(tmp_path / "c")]) == 0
    out_c = capsys.readouterr().out
    a, c = _files(str(tmp_path / "a")), _files(str(tmp_path / "c"))
    assert {"summary.json", "records_r20.jsonl", "timeline_r20.json", "table.md", "latency_cdf_r20.png",
            "timeline_r20.png", "sweep.png"} <= set(a)
    for name, data in a.items():
        if name.endswith(".png"):
            assert data[:8] == b"\x89PNG\r\n\x1a\n"
        else:
            assert data == c[name], name  # byte-identical for the same seed
    assert out_a.split("requests 150")[1] == out_c.split("requests 150")[1]
    run = json.load(open(tmp_path / "a" / "summary.json"))["runs"][0]["summary"]
    assert run["n_ok"] == 150 and run["throughput_rps"] > 0
    records = [json.loads(x) for x in a["records_r20.jsonl"].decode().splitlines()]
    assert len(records) == 150 and all(r["finish_reason"] == "length" for r in records)


@pytest.mark.slow
def test_sweep_finds_the_best_setting_under_the_slo(capsys) -> None:
    base = ["simulate", "--workload", "chat", "--requests", "200", "--slo-ms", "8000"]
    assert main(base + ["--sweep", "rate=2,8,400"]) == 0
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split("|")[1].strip() for r in rows] == ["2", "8", "400"]
    assert "no |" in rows[2]  # 400 req/s: everything queued at once, P99 far past 8 s
    assert "best rate: 8" in table
    assert main(base + ["--rate", "30", "--policy", "static", "--sweep", "max-batch=2,32"]) == 0
    assert "| max_batch |" in capsys.readouterr().out


def test_sweep_without_an_slo_and_judged_by_attainment(capsys) -> None:
    """A sweep needs no SLO (every run that completes qualifies), and with `--slo` a run
    qualifies only at `--target-attainment`, whatever its end-to-end P99."""
    base = ["simulate", "--workload", "chat", "--requests", "50", "--sweep", "rate=1,4,16"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "meets SLO (99% completed)" in out and "best rate: 16" in out
    assert main(base + ["--slo", "ttft_ms=25", "--slo-ms", "100000"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    attained = [float(r.split("|")[3]) / float(r.split("|")[2]) for r in rows]  # goodput / throughput
    assert all(a < 0.99 for a in attained) and all(r.rstrip(" |").endswith("no") for r in rows)
    assert "no setting meets the SLO (99% completed, E2E P99 <= 100000 ms, attainment >= 99%)" in out


def test_max_tokens_is_a_bound_and_outputs_end_at_their_drawn_length(tmp_path, capsys) -> None:
    """`--max-tokens`: every request asks for that many, each output stops where the workload's
    drawn length says (finish reason stop), and a bound below 1 is refused by name."""
    args = ["simulate", "--workload", "chat", "--scale", "0.2", "--requests", "40", "--rate", "20", "--seed", "3",
            "--out", str(tmp_path)]
    assert main(args + ["--max-tokens", "300"]) == 0
    records = [json.loads(x) for x in open(tmp_path / "records_r20.jsonl")]
    drawn = [w.max_tokens for w in make_workload("chat", 40, 20.0, seed=3, scale=0.2)]
    assert [r["output_tokens"] for r in records] == drawn
    assert {r["finish_reason"] for r in records} == {"stop"}
    capsys.readouterr()
    assert main(args + ["--max-tokens", "0"]) != 0
    assert "--max-tokens must be >= 1, got 0" in capsys.readouterr().err


def test_a_run_whose_every_request_is_refused_still_reports(capsys) -> None:
    """One request longer than the context is refused at once: the run spans no time, and
    still prints its summary (an error, no throughput) instead of failing."""
    assert main(["simulate", "--trace", "mooncake", "--requests", "1", "--max-model-len", "1024"]) == 0
    out = capsys.readouterr().out
    assert "requests 1  ok 0" in out and "errors 1" in out and "throughput 0.00 req/s" in out


def test_simulate_on_a_profile(tmp_path, capsys) -> None:
    coef = {"const": 0.003, "prefill_token": 2e-5, "decode_seq": 1e-4, "decode_ktoken": 1e-4, "prefill_mpair": 0.0}
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"fit": {"coef": coef, "context_len": 128}, "max_model_len": 2048,
                                "num_blocks": 500, "kv_bytes_per_token": 4096}))
    assert main(["simulate", "--profile", str(path), "--requests", "40", "--rate", "5", "--scale", "0.2"]) == 0
    out = capsys.readouterr()
    assert "ok 40" in out.out and "profiled" in out.out and "500 KV blocks" in out.err


def test_bad_flags_fail_clearly(capsys) -> None:
    assert main(["simulate", "--sweep", "bogus=1,2"]) == 2
    assert "--sweep" in capsys.readouterr().err
    assert main(["simulate", "--hardware", "h100", "--profile", "x.json"]) == 2
    assert main(["simulate", "--model", "no-such-model"]) == 2
    for bad, says in [(["--scale", "-1"], "--scale must be"), (["--rate", "0"], "--rate must be"),
                      (["--trace", "burstgpt", "--time-scale", "0.5", "--rate", "3"], "not with --rate"),
                      (["--arrival-args", "{bad"], "--arrival-args: not JSON"),
                      (["--arrival-args", "[1]"], "--arrival-args: expected a JSON object"),
                      (["--slo", ":ttft_ms=5"], "no class name"),
                      (["--profile", "no-such-profile.json"], "no-such-profile.json")]:
        capsys.readouterr()
        assert main(["simulate", *bad]) == 2, bad
        assert says in capsys.readouterr().err, bad


def test_an_slo_for_a_class_no_request_has_is_warned_about(capsys) -> None:
    assert main(["simulate", "--workload", "chat", "--requests", "20", "--slo", "chta:ttft_ms=100"]) == 0
    assert "warning: --slo for class 'chta': no request has it (the classes: chat)" in capsys.readouterr().err
    assert main(["simulate", "--workload", "chat", "--requests", "20", "--slo", "chat:ttft_ms=100"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_file_that_is_not_a_profile_is_named(tmp_path, capsys) -> None:
    for text in ('{"samples": []}', "not json", '{"fit": {"coef": {}}}'):
        path = tmp_path / "p.json"
        path.write_text(text)
        assert main(["simulate", "--profile", str(path)]) == 2
        assert f"{path}: not a `batchserve profile` file" in capsys.readouterr().err
    assert main(["profile", "--quick", "--out", str(tmp_path / "no" / "dir" / "p.json")]) == 2
    assert "not a writable directory" in capsys.readouterr().err


@pytest.mark.slow
def test_every_scenario_runs_small_and_prints_the_seed_next_to_the_simulation() -> None:
    text = run_scenario("all", requests=80, seed=1)
    for name in SCENARIOS:
        assert f"## {name}:" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "| metric |" not in line]
    seed_rows = [r for r in rows if r.split("|")[2].strip() != "-"]
    # every before/after figure the seed gives, next to the simulated pair (S3's throughput twice:
    # request level's padding accounted, and paid)
    assert len(seed_rows) == 12
    assert all(r.rsplit("|", 2)[1].strip() in ("agrees", "DISAGREES", "unchanged") for r in seed_rows)
    assert "| 450 | 120 |" in text and "| 2,500 | 800 |" in text


def test_scenario_names_a_missing_policy(monkeypatch, capsys) -> None:
    from batchserve.core import policies

    monkeypatch.delitem(policies.POLICIES, "cascade")
    with pytest.raises(ScenarioUnavailable, match="cascade policy"):
        run_scenario("static-vs-continuous", requests=40)
    assert main(["simulate", "--scenario", "static-vs-continuous"]) == 2
    assert "needs the cascade policy" in capsys.readouterr().err


def _tiny_profiled(tmp_path) -> tuple[EngineConfig, str]:
    """A tiny random model's engine config and the path of its quick profile."""
    from batchserve.runner.profiler import run_profile, save

    model = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024}
    cfg = EngineConfig(model=ModelConfig(model="dummy", dummy_config=model, num_threads=1),
                       cache=CacheConfig(kv_cache_gb=0.02), scheduler=SchedulerConfig(max_num_seqs=16))
    path = str(tmp_path / "profile.json")
    save(run_profile(cfg, quick=True), path)
    return cfg, path


@pytest.mark.kernel
def test_fidelity_on_a_tiny_model(tmp_path) -> None:
    """The CI-sized version of `python -m benchmarks.fidelity`: a tiny random model is
    profiled, then the same workload runs live (wall clock) and simulated, calibrated on the
    live run itself (a shared CI machine's speed drifts between runs). Throughput must agree
    within 10%; P50 latency only within a factor of two, because a ~1 ms model step on a
    shared box is at the mercy of the OS scheduler (the full-size run on a quiet machine
    holds 5% / 5% / 10%)."""
    from benchmarks.fidelity import format_rows, run_fidelity

    cfg, path = _tiny_profiled(tmp_path)
    rows = run_fidelity(cfg, path, 30, [10.0, 25.0], seed=2, scale=0.1, same_run=True)
    assert "speed replayed" in format_rows(rows)
    for r in rows:
        assert r["own"]["sim"] == r["sim"], r  # calibrated on the run itself, both predictions are one
        assert "each" not in r["ahead"], r  # so no warm-up per rate was run
        assert r["rel_error"]["throughput_rps"] <= 0.10, r
        ratio = r["sim"]["e2e_p50_ms"] / r["live"]["e2e_p50_ms"]
        assert 0.5 <= ratio <= 2.0, r


@pytest.mark.kernel
def test_fidelity_warmup_at_each_rate(tmp_path) -> None:
    """`--warmup each`: every rate gets its own warm-up just before its run, which prices it,
    and the row keeps the one-warm-up prediction beside it, both on the same live run."""
    from benchmarks.fidelity import format_rows, run_fidelity

    cfg, path = _tiny_profiled(tmp_path)
    rows = run_fidelity(cfg, path, 20, [10.0, 25.0], seed=3, scale=0.1)  # warmup="each", the default
    assert "Predicted ahead by the two warm-up protocols" in format_rows(rows)
    for r in rows:
        assert set(r["ahead"]) == {"once", "each"} and r["sim"] == r["ahead"]["each"], r
        ratio = r["ahead"]["each"]["throughput_rps"] / r["live"]["throughput_rps"]
        assert 0.8 <= ratio <= 1.25, r
    assert rows[0]["ahead"]["once"] != rows[0]["ahead"]["each"]  # two calibrations, two predictions


def test_simulate_says_padding_is_only_accounted(capsys) -> None:
    base = ["simulate", "--workload", "mixed", "--requests", "30", "--rate", "20", "--scale", "0.2"]
    assert main(base + ["--policy", "static"]) == 0
    out = capsys.readouterr().out
    assert "padding:" in out and "accounted only" in out and "unpadded" in out
    assert main(base + ["--policy", "static", "--pay-padding"]) == 0
    out = capsys.readouterr().out
    assert "padding:" in out and "paid" in out and "accounted only" not in out
    assert main(base + ["--policy", "continuous"]) == 0  # nothing padded, nothing to say
    assert "padding:" not in capsys.readouterr().out


def test_policies_benchmark_says_which_padding_is_only_accounted() -> None:
    from benchmarks.policies import PADDING_NOTE, POLICY_SETTINGS, table, targets

    assert "accounted in static / dynamic, computed in static-padded / dynamic-padded" in PADDING_NOTE
    assert "ragged" in PADDING_NOTE
    assert all(POLICY_SETTINGS[f"{n}-padded"] == {**POLICY_SETTINGS[n], "pay_padding": True}
               for n in ("static", "dynamic"))
    assert "padding (share; run or only accounted)" in table([])
    from benchmarks.policies import Workload

    w = Workload("b: mixed", "mixed", 1, 1.0, 1.0)
    res = {n: {"summary": {"output_tokens_per_s": tp}} for n, tp in
           (("chunked", 30.0), ("static", 20.0), ("dynamic", 15.0), ("static-padded", 12.0))}
    lines = targets([(w, n, r) for n, r in res.items()])
    assert lines == ["- (b) token-level (chunked) / best request-level throughput, padding accounted: 1.50x "
                     "(seed: >= 1.5x)",
                     "- (b) token-level (chunked) / best request-level throughput, padding paid: 2.50x "
                     "(seed: >= 1.5x)"]
