"""/metrics as a Prometheus server and its linter read it: Prometheus's naming and format rules
checked in Python (so CI without promtool still checks them), then by `promtool check metrics`
itself where the binary is installed (Debian's `prometheus` package). Model-free: the app around
the fake engine, after traffic that fills every kind of family, and the Ray router's families
(distributed/metrics.py) appended as `serve --ray` appends them.

The one rule left out is promtool's "metric names should not contain ':'": `batchserve:*` follows
vLLM's `vllm:*`, which dashboards built for vLLM select on.
"""
from __future__ import annotations

import asyncio
import math
import re
import shutil
import subprocess

import pytest
from fake_server import MODEL, fake_engine, serve_app
from prometheus_client.parser import text_string_to_metric_families

from batchserve.distributed.metrics import ReplicaView, RouterCounters, router_metrics_text

COLON = "metric names should not contain ':'"
_NAME = re.compile(r"[a-z_:][a-z0-9_:]*")
# promtool's list of abbreviations, and units that have a base unit to use instead
_ABBREVIATED = {"s", "ms", "us", "ns", "sec", "b", "kb", "mb", "gb", "tb", "pb", "m", "h", "d"}
_NOT_BASE = {"milliseconds", "microseconds", "nanoseconds", "minutes", "hours", "days", "weeks", "bits",
             "kilobytes", "megabytes", "gigabytes", "percent"}
_TIME_WORDS = {"time", "latency", "duration", "delay", "seconds"}
_SUFFIXES = {"histogram": ("_bucket", "_count", "_sum"), "summary": ("_count", "_sum")}


def problems(text: str, model_name: str) -> list[str]:
    """Each way `text` breaks the exposition rules, as "<name>: <rule>": a HELP and a TYPE line,
    once, for every family; counters named `_total` and nothing else; snake_case names in base
    units (seconds for times); histogram buckets ascending and cumulative, +Inf = _count; every
    sample labelled with `model_name`."""
    out: list[str] = []
    helps: dict[str, str] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            parts = line[7:].split(" ", 1)
            name, rest = parts[0], (parts[1] if len(parts) > 1 else "").strip()
            seen = helps if line.startswith("# HELP ") else types
            if name in seen:
                out.append(f"{name}: declared twice")
            seen[name] = rest
    for name in sorted(set(helps) | set(types)):
        kind = types.get(name)
        if not helps.get(name):
            out.append(f"{name}: no HELP text")
        if kind is None:
            out.append(f"{name}: no TYPE")
        if not _NAME.fullmatch(name):
            out.append(f"{name}: not snake_case")
        if kind == "counter" and not name.endswith("_total"):
            out.append(f"{name}: a counter's name ends in _total")
        if kind not in (None, "counter") and name.endswith("_total"):
            out.append(f"{name}: only a counter's name ends in _total")
        if kind not in _SUFFIXES and name.endswith(("_bucket", "_count", "_sum")):
            out.append(f"{name}: _bucket, _count and _sum are a histogram's or summary's")
        words = set(re.split(r"[_:]", name))
        for w in sorted(words & (_ABBREVIATED | _NOT_BASE)):
            out.append(f"{name}: unit {w!r} is not a base unit in full")
        stem = re.sub(r"_(total|created)$", "", name)
        if words & _TIME_WORDS and not name.endswith("_created") and not stem.endswith("_seconds"):
            out.append(f"{name}: a time is in _seconds")
    for fam in text_string_to_metric_families(text):  # raises on a line it cannot read
        if fam.type == "unknown":
            out.append(f"{fam.name}: samples without a TYPE")
        for s in fam.samples:
            if s.labels.get("model_name") != model_name:
                out.append(f"{s.name}: no model_name={model_name!r} label")
            if fam.type != "histogram" and (s.name.endswith("_bucket") or "le" in s.labels):
                out.append(f"{s.name}: bucket outside a histogram")
        if fam.type == "histogram":
            out += _histogram_problems(fam)
    return out


def _histogram_problems(fam) -> list[str]:
    series: dict[tuple, dict[str, list]] = {}
    for s in fam.samples:
        key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
        d = series.setdefault(key, {"bucket": [], "count": [], "sum": []})
        for suffix in ("bucket", "count", "sum"):
            if s.name == f"{fam.name}_{suffix}":
                d[suffix].append((float(s.labels["le"]), s.value) if suffix == "bucket" else s.value)
    out = []
    for key, d in series.items():
        if not d["bucket"] and not d["count"]:
            continue  # only a _created sample
        bounds = [b for b, _ in d["bucket"]]
        counts = [c for _, c in d["bucket"]]
        if bounds != sorted(set(bounds)) or not bounds or bounds[-1] != math.inf:
            out.append(f"{fam.name}{dict(key)}: bucket bounds not ascending up to +Inf: {bounds}")
        if counts != sorted(counts):
            out.append(f"{fam.name}{dict(key)}: bucket counts not cumulative: {counts}")
        if d["count"] != counts[-1:] or len(d["sum"]) != 1:
            out.append(f"{fam.name}{dict(key)}: _count {d['count']} is not the +Inf bucket, or no single _sum")
    return out


ROUTER = router_metrics_text(MODEL, [ReplicaView(0, "prefill", True, 3), ReplicaView(1, "decode", False, 2)],
                             RouterCounters(1, 2, 3, 40, 0.5, 0.25))


def served_page() -> str:
    """/metrics after a plain, a streamed, a tenant's, a refused (400) and a hard-deadline request."""
    async def scenario() -> str:
        async with serve_app(fake_engine()) as (client, _):
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
            for extra in ({}, {"stream": True}, {"user": "alice"}, {"max_tokens": "x"}):
                await client.post("/v1/completions", json={**body, **extra})
            await client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 3,
                                                            "messages": [{"role": "user", "content": "hi"}]})
            r = await client.get("/metrics")
            assert r.status_code == 200
            return r.text

    return asyncio.run(scenario())


@pytest.fixture(scope="module")
def page() -> str:
    return served_page()


def test_the_served_page_keeps_the_rules(page) -> None:
    assert "batchserve:tenant_requests_total" in page and "batchserve:inter_token_latency_seconds_bucket" in page
    assert 'batchserve:http_errors_total{model_name="fake",status="400"} 1.0' in page
    assert problems(page, MODEL) == []


def test_the_router_families_keep_the_rules_and_name_the_model() -> None:
    assert problems(ROUTER, MODEL) == []
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for fam in text_string_to_metric_families(ROUTER) for s in fam.samples}
    assert values[("batchserve:replica_up", (("model_name", MODEL), ("replica", "1"), ("role", "decode")))] == 0
    assert values[("batchserve:replica_routed_total", (("model_name", MODEL), ("replica", "0"),
                                                       ("role", "prefill")))] == 3
    assert values[("batchserve:router_retries_total", (("model_name", MODEL),))] == 2
    assert values[("batchserve:kv_handoff_copy_seconds_total", (("model_name", MODEL),))] == 0.25
    assert problems(ROUTER, "another") != []  # the label is checked, not just present


def test_the_page_and_the_router_families_do_not_collide(page) -> None:
    assert problems(page + ROUTER, MODEL) == []


@pytest.mark.parametrize("text, rule", [
    ("# HELP a_total x\n# TYPE a_total counter\na_total{model_name=\"fake\"} 1\n", None),
    ("# HELP a x\n# TYPE a counter\na{model_name=\"fake\"} 1\n", "ends in _total"),
    ("# HELP a_total x\n# TYPE a_total gauge\na_total{model_name=\"fake\"} 1\n", "only a counter"),
    ("# TYPE a gauge\na{model_name=\"fake\"} 1\n", "no HELP"),
    ("a{model_name=\"fake\"} 1\n", "without a TYPE"),
    ("# HELP a x\n# TYPE a gauge\na 1\n", "no model_name"),
    ("# HELP step_time_ms x\n# TYPE step_time_ms gauge\nstep_time_ms{model_name=\"fake\"} 1\n", "'ms'"),
    ("# HELP wait_time x\n# TYPE wait_time gauge\nwait_time{model_name=\"fake\"} 1\n", "_seconds"),
    ("# HELP aB x\n# TYPE aB gauge\naB{model_name=\"fake\"} 1\n", "snake_case"),
    ("# HELP h_seconds x\n# TYPE h_seconds histogram\n"
     'h_seconds_bucket{le="1.0",model_name="fake"} 2\nh_seconds_bucket{le="+Inf",model_name="fake"} 1\n'
     'h_seconds_count{model_name="fake"} 1\nh_seconds_sum{model_name="fake"} 1\n', "not cumulative"),
    ("# HELP h_seconds x\n# TYPE h_seconds histogram\n"
     'h_seconds_bucket{le="1.0",model_name="fake"} 1\nh_seconds_bucket{le="+Inf",model_name="fake"} 2\n'
     'h_seconds_count{model_name="fake"} 3\nh_seconds_sum{model_name="fake"} 1\n', "+Inf bucket"),
])
def test_the_rules_catch_what_they_name(text: str, rule: str | None) -> None:
    found = problems(text, MODEL)
    if rule is None:
        assert found == []
    else:
        assert any(rule in p for p in found), found


def promtool(text: str) -> list[str]:
    """promtool's findings on `text`, but for the ':' in every batchserve name."""
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode in (0, 3), lines  # 3: lint findings; anything else: it could not read the page
    return [ln for ln in lines if not ln.endswith(COLON)]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian: prometheus)")
def test_promtool_finds_nothing_but_the_colon(page) -> None:
    assert promtool(page + ROUTER) == []
    assert promtool("# TYPE x counter\nx 1\n")  # it reads stdin and reports: the check is live
