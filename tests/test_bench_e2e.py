"""A short real run: `batchserve serve` (the default model) as a subprocess on a free loopback
port, then `batchserve bench` against it: records, a summary, a table and valid PNGs; then
`bench --compare` over two runs. Bounded: a handful of tiny requests, a time limit."""
from __future__ import annotations

import json
import os
import time

import pytest

from batchserve.bench.report import load_report

pytestmark = [pytest.mark.model, pytest.mark.http]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _check_png(path: str) -> None:
    import matplotlib.image

    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE, path
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 200 and img.shape[2] in (3, 4)
    assert img.std() > 0.01  # not a blank canvas


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    from benchmarks.standard import running_server

    log = str(tmp_path_factory.mktemp("server") / "server.log")
    try:
        with running_server(["--kv-cache-gb", "0.25"], log, timeout_s=120) as url:
            yield url
    except RuntimeError:
        print(open(log).read()[-3000:])
        raise


def test_bench_against_real_server(server_url, tmp_path, capsys):
    from batchserve.cli import main

    t0 = time.monotonic()
    out = str(tmp_path / "run")
    rc = main(["bench", "--url", server_url, "--workload", "priority-flood", "--requests", "4", "--rates", "1,4",
               "--scale", "0.2", "--out", out, "--slo-ms", "30000", "--label", "live", "--no-progress",
               "--max-duration", "45"])
    assert rc == 0
    meta, runs = load_report(os.path.join(out, "summary.json"))
    assert meta["label"] == "live" and meta["model"] and [r.rate for r in runs] == [1.0, 4.0]
    for run in runs:
        assert len(run.records) == 4
        s = run.summary
        assert s["n_requests"] == 4 and s["n_errors"] == 0 and s["n_disconnects"] == 0
        done = [r for r in run.records if r.ok]
        assert done, [r.error for r in run.records]
        assert s["n_ok"] + s["n_timeout"] + s["n_rejected"] == 4  # a 2 s hard deadline may be missed on CPU
        for r in done:
            assert r.status == 200 and r.finish_reason == "length" and r.output_tokens >= 1
            assert r.send_time <= r.first_token_time <= r.end_time and len(r.token_times) >= 1
        assert s["latency"]["e2e_ms"]["p50"] > 0 and s["throughput_rps"] > 0
        assert run.timeline, "the server's /metrics was not polled"
        assert any(k.startswith("batchserve:kv_cache_usage") for p in run.timeline for k in p["values"])
        with open(os.path.join(out, f"records_r{run.rate:g}.jsonl")) as f:
            assert len([json.loads(line) for line in f]) == 4
        _check_png(os.path.join(out, f"latency_cdf_r{run.rate:g}.png"))
        _check_png(os.path.join(out, f"timeline_r{run.rate:g}.png"))
    _check_png(os.path.join(out, "sweep.png"))
    assert "| live | 4 |" in open(os.path.join(out, "table.md")).read()
    assert "| live | 1 |" in capsys.readouterr().out

    cmp_dir = str(tmp_path / "cmp")
    assert main(["bench", "--compare", os.path.join(out, "summary.json"), os.path.join(out, "summary.json"),
                 "--out", cmp_dir]) == 0
    md = open(os.path.join(cmp_dir, "compare.md")).read()
    assert md.split("\n\n")[0].count("| live (run) | 4 |") == 2  # both runs, one label made unique
    _check_png(os.path.join(cmp_dir, "compare_sweep.png"))
    _check_png(os.path.join(cmp_dir, "compare_cdf.png"))
    print(f"bench run + compare took {time.monotonic() - t0:.1f} s")  # a figure, not a timed assertion
