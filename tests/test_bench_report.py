"""Reports without a server: files round-trip, tables, timeline series, comparison plots."""
from __future__ import annotations

import os

import numpy as np
import pytest

from batchserve.bench.metrics import RequestRecord, summarize
from batchserve.bench.plots import timeline_series
from batchserve.bench.report import RateRun, compare_reports, load_report, write_report


def _records(rate: float, n: int = 30, seed: int = 0) -> list[RequestRecord]:
    rng = np.random.default_rng(seed)
    out = []
    t = 0.0
    for i in range(n):
        t += rng.exponential(1 / rate)
        ttft = 0.05 + rng.exponential(0.1)
        toks = [t + ttft + 0.02 * k for k in range(8)]
        cls = "high" if i % 3 == 0 else "low"
        out.append(RequestRecord(f"r{i}", cls, 9 if cls == "high" else 1, t, toks[0], toks, toks[-1], 16, 8, 200,
                                 "length", deadline_ms=500.0 if cls == "high" else None))
    out.append(RequestRecord("x", "low", 1, t, status=503, error="full", end_time=t + 0.001, retry_after_s=1.0))
    return out


def _timeline() -> list[dict]:
    pts = []
    for k in range(5):
        pts.append({"t": 0.5 * k, "values": {
            "batchserve:requests_waiting{level=high}": float(k), "batchserve:requests_running": 2.0,
            "batchserve:kv_cache_usage": 0.1 * k, "batchserve:scheduling_window_seconds": 0.05,
            "batchserve:batch_size_sum": 6.0 * k, "batchserve:batch_size_count": 2.0 * k,
            "batchserve:requests_total{finish_reason=length}": float(k)}})
    return pts


def test_timeline_series_panels():
    s = timeline_series(_timeline())
    assert list(s["queue depth"]) == ["batchserve:requests_waiting{level=high}"]
    assert s["queue depth"]["batchserve:requests_waiting{level=high}"][1] == [0, 1, 2, 3, 4]
    assert s["KV usage"]["batchserve:kv_cache_usage"][1][-1] == 0.4
    assert s["window (s)"]["batchserve:scheduling_window_seconds"][0] == [0, 0.5, 1.0, 1.5, 2.0]
    # the batch-size histogram's deltas: 6 requests over 2 steps in each interval -> 3 per step
    assert s["batch size"]["batchserve:batch_size (mean per step)"] == ([0, 0.5, 1.0, 1.5], [3.0, 3.0, 3.0, 3.0])
    assert "batchserve:requests_running" in s["batch size"]
    assert not any("requests_total" in k for panel in s.values() for k in panel)


@pytest.mark.slow  # renders the report's plots
def test_write_load_and_compare(tmp_path):
    dirs = []
    for label, speed in (("fast", 1.0), ("slow", 3.0)):
        runs = []
        for rate in (1.0, 2.0):
            recs = _records(rate, seed=int(rate))
            for r in recs:  # "slow" stretches every latency
                if r.first_token_time is not None:
                    r.token_times = [r.send_time + (x - r.send_time) * speed for x in r.token_times]
                    r.first_token_time, r.end_time = r.token_times[0], r.token_times[-1]
            runs.append(RateRun(rate, recs, summarize(recs, 20.0, slo_ms=400), _timeline()))
        d = str(tmp_path / label)
        path = write_report(d, {"label": label, "slo_ms": 400}, runs)
        dirs.append(path)
        for f in ("sweep.png", "latency_cdf_r1.png", "timeline_r2.png", "records_r2.jsonl", "table.md"):
            assert os.path.getsize(os.path.join(d, f)) > 0, f
        meta, back = load_report(path)
        assert meta["label"] == label and [r.rate for r in back] == [1.0, 2.0]
        assert back[0].records == runs[0].records and back[1].timeline == runs[1].timeline
        assert back[0].summary["n_rejected"] == 1
    md = compare_reports(dirs, str(tmp_path / "cmp"))
    main_table = md.split("\n\n")[0]
    rows = [ln for ln in main_table.splitlines() if ln.startswith(("| fast |", "| slow |"))]
    assert len(rows) == 4  # 2 runs x 2 rates, sorted by run then rate
    assert md.count("| fast | 2 | low |") == 1  # per class table: 2 runs x 2 rates x 2 classes
    fast_p99 = float(rows[0].split("|")[12])
    slow_p99 = float(rows[2].split("|")[12])
    assert slow_p99 > 2 * fast_p99  # E2E P99 column reflects the stretch
    assert "| fast | 1 | high | 9 |" in md
    for f in ("compare_sweep.png", "compare_cdf.png", "compare.md"):
        assert os.path.getsize(str(tmp_path / "cmp" / f)) > 0


def test_write_section_replaces_only_the_section_with_that_heading(tmp_path):
    """A section is found by its heading at the start of a line: '## X' replaces '## X ...' up to
    the next '## ', never starting inside a '### X ...' subsection; a missing one is appended.
    What follows the section's KEEP_MARK (readings written by hand) survives a rerun."""
    from benchmarks.report_md import KEEP_MARK, write_section

    p = tmp_path / "b.md"
    p.write_text("# B\n\n## A\n\na\n\n### X history\n\nkept\n\n## X (old run)\n\nold\n\n## C\n\nc\n")
    write_section(str(p), "## X", "## X (new run)\n\nnew\n\n")
    assert p.read_text() == ("# B\n\n## A\n\na\n\n### X history\n\nkept\n\n## X (new run)\n\nnew\n\n"
                             f"{KEEP_MARK}\n\n## C\n\nc\n")
    # a reading added under the mark stays; the generated part above it is replaced
    p.write_text(p.read_text().replace(f"{KEEP_MARK}\n", f"{KEEP_MARK}\n\nReading: X got faster.\n"))
    write_section(str(p), "## X", "## X (third run)\n\nnewer\n")
    assert p.read_text() == ("# B\n\n## A\n\na\n\n### X history\n\nkept\n\n## X (third run)\n\nnewer\n\n"
                             f"{KEEP_MARK}\n\nReading: X got faster.\n\n## C\n\nc\n")
    write_section(str(p), "## Z", "## Z\n\nz\n")
    assert p.read_text().endswith(f"## C\n\nc\n\n## Z\n\nz\n\n{KEEP_MARK}\n")
    write_section(str(p), "## Z", "## Z\n\nz2\n")  # the last section, with its mark
    assert p.read_text().endswith(f"## C\n\nc\n\n## Z\n\nz2\n\n{KEEP_MARK}\n")