"""`--find-max-goodput`: the rate search on a known attainment curve, then `bench` and
`simulate` driving it end to end (bench against a fake client: no server, a virtual clock)."""
from __future__ import annotations

import json

import pytest

from batchserve.bench import cli as bench_cli
from batchserve.bench.client import ClientConfig, RunResult
from batchserve.bench.metrics import SLO, RequestRecord, goodput
from batchserve.bench.search import find_max_rate


def _cliff(at: float):
    """Attainment 1 up to `at` req/s, then falling; records every rate asked."""
    asked: list[float] = []

    def f(rate: float) -> float:
        asked.append(rate)
        return 1.0 if rate <= at else max(0.0, 1.0 - (rate - at))
    return f, asked


@pytest.mark.parametrize("start", [0.3, 7.0, 100.0])
def test_search_brackets_then_bisects_to_the_cliff(start):
    f, asked = _cliff(7.3)
    res = find_max_rate(f, 0.99, start, rel_tol=0.02, max_runs=30)
    assert res.bracketed and 7.3 / 1.02 <= res.best <= 7.3 + 0.01
    assert [r for r, _ in res.probes] == asked and res.best in asked
    assert all(a >= 0.99 for r, a in res.probes if r <= res.best)
    assert len(asked) < 15


def test_search_reports_a_lower_bound_or_nothing():
    res = find_max_rate(lambda r: 1.0, 0.99, 1.0, max_runs=4)  # never fails within the budget
    assert res.best == 8.0 and not res.bracketed and len(res.probes) == 4
    res = find_max_rate(lambda r: 0.5 + 1e-3 / r, 0.99, 10.0, max_runs=20)  # the SLO is missed at any load
    assert res.best is None and not res.bracketed
    assert len(res.probes) == 3  # two halvings that gained nothing: stop
    with pytest.raises(ValueError):
        find_max_rate(lambda r: 1.0, 99.0, 1.0)  # a fraction, not a percentage


def _fake_run(capacity: float):
    """A server that serves `capacity` req/s: each request waits behind the earlier ones
    (M/D/1-like, a virtual clock), so TTFT grows without bound past the capacity."""
    def run(items, cfg):
        free, recs = 0.0, []
        for i, w in enumerate(items):
            start = max(w.arrival, free)
            free = start + 1.0 / capacity
            first, end = start + 0.02, free
            recs.append(RequestRecord(f"b{i}", w.cls, w.priority, w.arrival, first, [first, end], end,
                                      w.prompt_len, 2, 200, "length"))
        return RunResult(recs, max(r.end_time for r in recs), [], "fake")
    return run


def test_bench_find_max_goodput_writes_the_search(tmp_path, monkeypatch):
    from batchserve.bench import client as bench_client

    monkeypatch.setattr(bench_client, "run", _fake_run(capacity=20.0))  # run_sweep imports it on call
    cfg = ClientConfig("http://fake", progress=False)
    path = bench_cli.run_sweep(cfg, "chat", 300, [2.0], str(tmp_path), label="fake", plot=False,
                               slo=SLO(ttft_ms=500.0), search_target=0.95)
    doc = json.load(open(path))
    search = doc["meta"]["search"]
    assert search["bracketed"] and 10.0 < search["best_rate"] < 22.0  # near the 20 req/s capacity
    assert doc["meta"]["slo"] == {"ttft_ms": 500.0}
    by_rate = {e["rate"]: e["summary"] for e in doc["runs"]}
    assert sorted(by_rate) == sorted(p["rate"] for p in search["probes"])  # every probe is in the report
    best = by_rate[search["best_rate"]]
    assert best["goodput_frac"] >= 0.95 and search["goodput_rps"] == best["goodput_rps"]
    assert all(by_rate[p["rate"]]["goodput_frac"] == p["attainment"] for p in search["probes"])
    table = (tmp_path / "table.md").read_text()
    assert "max goodput:" in table and "ttft_ms <= 500" in table and "attain" in table


def test_a_trace_at_its_own_timing_is_labelled_by_the_rate_it_offers(tmp_path, monkeypatch, capsys):
    from batchserve.bench import client as bench_client
    from batchserve.bench.workload import make_workload

    monkeypatch.setattr(bench_client, "run", _fake_run(capacity=20.0))
    cfg = ClientConfig("http://fake", progress=False)
    path = bench_cli.run_sweep(cfg, "burstgpt", 40, [0.0], str(tmp_path), label="fake", plot=False,
                               class_slo={"API": SLO(e2e_ms=1000.0)})
    items = make_workload("burstgpt", 40, 0.0)
    offered = float(f"{40 / items[-1].arrival:.3g}")
    assert [e["rate"] for e in json.load(open(path))["runs"]] == [offered]
    assert (tmp_path / f"records_r{offered:g}.jsonl").exists()
    err = capsys.readouterr().err
    assert f"at its own timing ({offered:g} req/s)" in err
    assert "warning: --slo for class 'API': no request has it (the classes: api, conversation)" in err


def test_bench_warns_when_the_run_ends_before_the_last_arrival(tmp_path, monkeypatch, capsys):
    from batchserve.bench import client as bench_client

    monkeypatch.setattr(bench_client, "run", _fake_run(capacity=20.0))
    for limit, warned in ((1e6, False), (5.0, True)):  # 100 requests at 2 req/s arrive over ~50 s
        cfg = ClientConfig("http://fake", progress=False, max_duration_s=limit)
        bench_cli.run_sweep(cfg, "chat", 100, [2.0], str(tmp_path), label="fake", plot=False)
        err = capsys.readouterr().err
        assert ("will not be sent and count as failures" in err) == warned
        if warned:
            arrivals = [w.arrival for w in bench_cli.make_workload("chat", 100, 2.0, seed=0)]
            assert f"{sum(a > 5.0 for a in arrivals)} of 100 requests" in err


def test_bench_flags_are_checked_before_sending(capsys):
    from batchserve.cli import main

    for extra, msg in ((["--slo", "ttft=x"], "--slo"), (["--target-attainment", "150"], "percentage"),
                       (["--find-max-goodput"], "starting rate"), (["--rates", "1,x"], "--rates"),
                       (["--rates", "-1"], "--rates"), (["--rates", "nan"], "--rates"),
                       (["--arrival-args", "{bad"], "--arrival-args"), (["--slo", ":e2e_ms=5"], "no class name")):
        assert main(["bench", "--url", "http://127.0.0.1:9", "--no-progress", *extra]) == 1
        assert msg in capsys.readouterr().err
    assert main(["bench", "--compare", "no-such-run/summary.json", "--out", "cmp"]) == 2
    assert "no-such-run/summary.json" in capsys.readouterr().err


def test_simulate_reports_goodput_per_class_and_searches(tmp_path, capsys):
    from batchserve.cli import main

    base = ["simulate", "--workload", "priority-flood", "--requests", "60", "--rate", "20", "--scale", "0.3",
            "--slo", "e2e_ms=4000", "--slo", "high:ttft_ms=100"]
    assert main(base + ["--out", str(tmp_path / "one")]) == 0
    assert "attainment" in capsys.readouterr().out
    doc = json.load(open(tmp_path / "one" / "summary.json"))
    recs = [RequestRecord.from_dict(json.loads(x)) for x in open(tmp_path / "one" / "records_r20.jsonl")]
    s = doc["runs"][0]["summary"]
    # the simulator's numbers are the metrics module's, from its own records
    assert s["goodput"] == goodput(recs, s["duration_s"], SLO(e2e_ms=4000.0), {"high": SLO(ttft_ms=100.0)})
    assert s["goodput"]["per_class"]["high"]["slo"] == {"ttft_ms": 100.0}
    assert s["goodput"]["per_class"]["low"]["slo"] == {"e2e_ms": 4000.0}
    assert main(base + ["--find-max-goodput", "--target-attainment", "90"]) == 0
    assert "max goodput:" in capsys.readouterr().out


def test_search_stops_halving_and_flags_noisy_probes():
    from batchserve.bench.search import inversions, search_line

    res = find_max_rate(lambda r: 0.0, 0.9, 8.0, max_runs=30)  # never passes, never plateaus above 0
    assert res.best is None and min(r for r, _ in res.probes) == pytest.approx(8.0 / 64)
    probes = [(2.0, 0.5), (1.0, 0.0), (0.5, 0.3), (0.25, 0.95)]
    assert inversions(probes) == 2  # 1.0 and 0.5 req/s each did worse than 2.0 by over 10 points
    line = search_line({"target_attainment": 0.9, "best_rate": 0.25, "bracketed": True, "goodput_rps": 0.2,
                        "probes": [{"rate": r, "attainment": a} for r, a in probes]})
    assert "0.25 req/s keeps attainment >= 90%" in line and "WARNING: in 2 pairs" in line
    clean = [{"rate": r, "attainment": a} for r, a in ((1.0, 1.0), (2.0, 0.95), (4.0, 0.2))]
    assert "WARNING" not in search_line({"target_attainment": 0.9, "best_rate": 2.0, "bracketed": True,
                                         "goodput_rps": 1.9, "probes": clean})


def test_a_search_answer_measured_on_one_burst_is_flagged(capsys):
    """Too few requests for the rate found: all sent before the first answer, so the probe
    measured a burst, and the answer says so."""
    from batchserve.bench.search import one_burst
    from batchserve.cli import main

    burst = [RequestRecord(f"r{i}", send_time=0.01 * i, end_time=1.0 + i, status=200) for i in range(4)]
    paced = [RequestRecord(f"r{i}", send_time=1.0 * i, end_time=1.0 * i + 0.5, status=200) for i in range(4)]
    assert one_burst(burst) and not one_burst(paced) and not one_burst([])
    base = ["simulate", "--workload", "chat", "--find-max-goodput", "--rate", "1", "--target-attainment", "90"]
    assert main(base + ["--requests", "8", "--slo", "e2e_ms=20000"]) == 0
    assert "WARNING: at that rate every request was sent before the first answer" in capsys.readouterr().out
    assert main(base + ["--requests", "300", "--slo", "e2e_ms=5000"]) == 0
    assert "WARNING" not in capsys.readouterr().out
