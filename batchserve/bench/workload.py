"""Seeded workloads = arrival process x request mix; shared by `bench` and `simulate`.

    items = make_workload("chat", n=200, rate=2.0, seed=0)                    # Poisson, chat mix
    items = make_workload("mixed", 100, 1.0, arrival="gamma", burstiness=4)   # bursty
    items = make_workload("trace.jsonl", 0, 0.0)                              # replay a trace
    classes = [RequestClass("high", 0.2, 64, 32, priority=9, deadline_ms=2000, deadline_kind="hard",
                            slo=SLO(ttft_ms=500)),
               RequestClass("low", 0.8, 64, 32, priority=1)]
    items = make_workload(classes, 500, 4.0, arrival="piecewise", phases=[(20, 1), (20, 3), (20, 1)])
    class_slos(classes)                                # {"high": SLO(ttft_ms=500)}: for summarize

Mixes (lengths in tokens, before `scale`; every class's lengths are lognormal with the given
mean and coefficient of variation, rounded and clipped to [1, 4 x mean]):

- `chat`: prompt 200, output 200 (the seed's chat class), CV 0.5. Scale 1.
- `mixed` (the mixed-granularity case): code-gen 2000 in / 500 out, summaries 5000 / 300, chat 200 / 200, one
  third each, CV 0.1. Default scale 0.1 (200/50, 500/30, 20/20): at full size one summary
  prompt takes this 2-core CPU several seconds; pass scale=1 for the seed's sizes (simulator).
- `short-long` (the static-vs-continuous case): 90% short (prompt 64, output 32), 10% long (prompt 64, output 512).
- `priority-flood` (the seed's surge case): levels high (priority 9, hard deadline 2 s, 10%), mid (priority
  5, soft deadline 5 s, 20%), low (priority 1, no deadline, 70%: the flood); prompt 64,
  output 32. Pair it with arrival="step" for the seed's 7.5x surge. `deadline_scale` scales
  every deadline (e.g. to the hardware being simulated).
- `surge` (the priority flood as measured against vLLM on a 2-core CPU): high (priority 9, 18%,
  first token within 1 s and a hard 6 s deadline), mid (priority 5, 20%, a soft 6 s deadline),
  low (priority 1, 62%); prompt 64, output 48, CV 0.5. With arrival="step" and factors
  (0.5, 3, 0.5) of the rate the machine sustains: half load, a 3x surge, back.

A mix is a sequence of `RequestClass`: a name, a share (weights, normalised), lengths, a
priority, a deadline and its kind, and an SLO by which `bench.metrics` judges its requests;
`make_workload` takes a named mix or the classes themselves. Every item carries its class's
name in `cls`.

A file name (or a bundled sample's name) replays a trace: BurstGPT, Azure and Mooncake
files are read by `bench.traces`; batchserve's own JSONL has one request a line: `timestamp` (s) , `prompt` (text) or
`prompt_len`, `max_tokens`, and optionally `priority`, `deadline_ms`, `deadline_kind`, `cls`.
With arrival None or "replay" the trace's own timestamps are used (shifted to start at 0 and,
when rate > 0, stretched so the mean rate is `rate`); any other arrival keeps the trace's
requests and draws new times. `n` > 0 takes the first n lines.

Prompts: with a tokenizer, `prompt` is text that re-encodes (add_special_tokens=False) to
exactly `prompt_len` tokens; without one, `prompt_token_ids` are random ordinary ids.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from batchserve.bench.arrivals import make_arrivals
from batchserve.bench.metrics import SLO
from batchserve.bench.prompts import ORDINARY_IDS, build_prompt  # noqa: F401 (ORDINARY_IDS: re-exported)
from batchserve.request import DEFAULT_PRIORITY, DeadlineKind, check_priority


@dataclass(frozen=True)
class WorkItem:
    """One request of a workload. `arrival` is seconds from the start; `cls` labels the
    request class / priority level for per-class statistics; `user` the OpenAI field (the
    tenant), sent when set; `eos_after` where the simulator's model ends the output (its EOS,
    1 <= eos_after <= max_tokens; None: it runs to max_tokens; a live run with ignore_eos off
    ends where its model does)."""

    arrival: float
    prompt_len: int
    prompt: str | None
    prompt_token_ids: list[int] | None
    max_tokens: int
    priority: int = DEFAULT_PRIORITY
    deadline_ms: float | None = None
    deadline_kind: str | None = None
    cls: str = "default"
    user: str | None = None
    eos_after: int | None = None

    def __post_init__(self) -> None:
        if self.eos_after is not None and not 1 <= self.eos_after <= self.max_tokens:
            raise ValueError(f"WorkItem: eos_after must be in [1, max_tokens={self.max_tokens}], got {self.eos_after}")


@dataclass(frozen=True)
class RequestClass:
    """One class of a mix. `weight` is its share of requests (the weights of a mix are
    normalised); prompt and output lengths are lognormal with means `prompt_mean` and
    `output_mean` (tokens) and coefficient of variation `cv` (None: a trace's own lengths;
    a synthetic mix needs both); `priority` 0-10; `deadline_ms` the end-to-end deadline sent
    with each request, `deadline_kind` "hard" or "soft"; `slo` the targets its requests are
    judged by (`bench.metrics.SLO`; None: the run's global SLO)."""

    name: str
    weight: float
    prompt_mean: float | None = None
    output_mean: float | None = None
    cv: float = 0.5
    priority: int = DEFAULT_PRIORITY
    deadline_ms: float | None = None
    deadline_kind: str | None = None
    slo: SLO | None = None

    def __post_init__(self) -> None:
        if not self.name or not self.weight > 0:
            raise ValueError(f"request class {self.name!r}: needs a name and a weight > 0, got {self.weight!r}")
        for k in ("prompt_mean", "output_mean"):
            if (v := getattr(self, k)) is not None and not v > 0:
                raise ValueError(f"request class {self.name!r}: {k} must be > 0, got {v!r}")
        check_priority(self.priority)
        if self.deadline_ms is not None and not self.deadline_ms > 0:
            raise ValueError(f"request class {self.name!r}: deadline_ms must be > 0, got {self.deadline_ms!r}")
        if self.deadline_kind is not None:
            DeadlineKind(self.deadline_kind)  # ValueError for anything but hard / soft


def class_slos(classes: Sequence[RequestClass]) -> dict[str, SLO]:
    """{class name: SLO} of the classes that have one: `summarize`'s `class_slo`."""
    return {c.name: c.slo for c in classes if c.slo is not None}


def mix_classes(name_or_classes: str | Sequence[RequestClass]) -> tuple[RequestClass, ...]:
    """The classes of a named mix, or the given classes; () for a trace file."""
    if isinstance(name_or_classes, str):
        return MIXES[name_or_classes][1] if name_or_classes in MIXES else ()
    return tuple(name_or_classes)


MIXES: dict[str, tuple[float, tuple[RequestClass, ...]]] = {  # name -> (default scale, classes)
    "chat": (1.0, (RequestClass("chat", 1.0, 200, 200),)),
    "mixed": (0.1, (RequestClass("code", 1 / 3, 2000, 500, cv=0.1),
                    RequestClass("summary", 1 / 3, 5000, 300, cv=0.1),
                    RequestClass("chat", 1 / 3, 200, 200, cv=0.1))),
    "short-long": (1.0, (RequestClass("short", 0.9, 64, 32, cv=0.3),
                         RequestClass("long", 0.1, 64, 512, cv=0.3))),
    "priority-flood": (1.0, (RequestClass("high", 0.1, 64, 32, 0.3, 9, 2000.0, "hard"),
                             RequestClass("mid", 0.2, 64, 32, 0.3, 5, 5000.0, "soft"),
                             RequestClass("low", 0.7, 64, 32, 0.3, 1))),
    "surge": (1.0, (RequestClass("high", 0.18, 64, 48, 0.5, 9, 6000.0, "hard", slo=SLO(ttft_ms=1000)),
                    RequestClass("mid", 0.2, 64, 48, 0.5, 5, 6000.0, "soft"),
                    RequestClass("low", 0.62, 64, 48, 0.5, 1))),
}


def lognormal_lengths(rng: np.random.Generator, mean: float, cv: float, size: int) -> np.ndarray:
    """Integer lengths, lognormal with the given mean and CV, clipped to [1, 4 x mean]."""
    sigma2 = np.log1p(cv * cv)
    mu = np.log(mean) - sigma2 / 2
    x = rng.lognormal(mu, np.sqrt(sigma2), size=size)
    return np.clip(np.rint(x), 1, max(1, round(4 * mean))).astype(int)


def make_workload(name_or_file: str | Sequence[RequestClass], n: int, rate: float, seed: int = 0,
                  arrival: str | None = None, tokenizer: Any = None, scale: float | None = None,
                  deadline_scale: float = 1.0, classes: Sequence[RequestClass] | None = None,
                  trace_format: str | None = None, time_scale: float | None = None,
                  max_tokens: int | None = None, **arrival_kwargs: Any) -> list[WorkItem]:
    """`n` requests of a mix (a name in MIXES, or a sequence of RequestClass) or a trace file,
    at mean `rate` requests/s.

    Deterministic per `seed`. `arrival` is a process of `bench.arrivals` (poisson, gamma,
    step, ramp, onoff, piecewise) whose extra parameters come in `arrival_kwargs`; None means
    poisson for a mix and "replay" (the file's own timestamps) for a trace file. `scale`
    multiplies every length (None: the mix's default, 1 for classes and traces),
    `deadline_scale` every deadline. `classes`, for a trace only, relabels its requests: each
    is drawn into a class by share and takes its name, priority and deadline (the trace's
    lengths are kept). A trace is a file, or the name of a sample in `bench.traces.SAMPLES`,
    in `trace_format` (`bench.traces.FORMATS`; None: sniffed); `time_scale` multiplies its
    timestamps (instead of stretching them to `rate`). `max_tokens`: every request asks for
    that many and ends where its drawn length says, or at the bound (`ending_at_eos`); None: it
    asks for its drawn length."""
    if max_tokens is not None:
        return ending_at_eos(make_workload(name_or_file, n, rate, seed, arrival, tokenizer, scale, deadline_scale,
                                           classes, trace_format, time_scale, **arrival_kwargs), max_tokens)
    rng = np.random.default_rng(seed)
    if isinstance(name_or_file, str) and name_or_file not in MIXES:
        from batchserve.bench import traces  # traces builds on this module's WorkItem and prompts

        path = traces.sample_path(name_or_file) if name_or_file in traces.SAMPLES else name_or_file
        if not os.path.isfile(path):
            raise ValueError(f"workload: {name_or_file!r} is neither a mix {sorted(MIXES)}, a trace sample "
                             f"{sorted(traces.SAMPLES)} nor a file")
        fmt = trace_format or traces.sniff_format(path)
        if fmt == "jsonl":
            items = _from_trace(path, n, rate, rng, arrival, tokenizer, scale, deadline_scale, time_scale,
                                arrival_kwargs)
        else:
            items = traces.trace_workload(path, fmt, n, rate, rng, seed=seed, arrival=arrival, tokenizer=tokenizer,
                                          scale=scale, time_scale=time_scale, arrival_kwargs=arrival_kwargs)
        return assign_classes(items, classes, rng, deadline_scale) if classes else items
    if trace_format is not None or time_scale is not None:
        raise ValueError(f"workload: trace_format and time_scale are for traces, and {name_or_file!r} is a mix")
    if classes is not None:
        raise ValueError("workload: `classes` relabels a trace; for a mix pass the classes as the workload")
    if n < 1:
        raise ValueError(f"workload: n must be >= 1, got {n}")
    if arrival == "replay":
        raise ValueError(f"workload: arrival 'replay' needs a trace file, and {name_or_file!r} is a mix")
    if isinstance(name_or_file, str):
        default_scale, mix = MIXES[name_or_file]
    else:
        default_scale, mix = 1.0, tuple(name_or_file)
    if not mix or any(c.prompt_mean is None or c.output_mean is None for c in mix):
        raise ValueError("workload: a mix needs >= 1 class, each with prompt_mean and output_mean")
    if len({c.name for c in mix}) != len(mix):
        raise ValueError(f"workload: class names repeat in {[c.name for c in mix]}")
    scale = default_scale if scale is None else scale
    times = make_arrivals(arrival or "poisson", n, rate, rng, **arrival_kwargs)
    which = _draw_classes(mix, n, rng)
    plens = np.empty(n, dtype=int)
    olens = np.empty(n, dtype=int)
    for k, c in enumerate(mix):  # lengths drawn per class, in a fixed order: seed-stable
        idx = np.flatnonzero(which == k)
        plens[idx] = lognormal_lengths(rng, c.prompt_mean * scale, c.cv, idx.size)
        olens[idx] = lognormal_lengths(rng, c.output_mean * scale, c.cv, idx.size)
    items = []
    for i in range(n):
        c = mix[which[i]]
        text, ids = build_prompt(int(plens[i]), rng, tokenizer)
        dl = None if c.deadline_ms is None else c.deadline_ms * deadline_scale
        items.append(WorkItem(float(times[i]), int(plens[i]), text, ids, int(olens[i]), c.priority,
                              dl, c.deadline_kind, c.name))
    return items


def _draw_classes(mix: Sequence[RequestClass], n: int, rng: np.random.Generator) -> np.ndarray:
    weights = np.array([c.weight for c in mix], dtype=float)
    return rng.choice(len(mix), size=n, p=weights / weights.sum())


def assign_classes(items: Sequence[WorkItem], classes: Sequence[RequestClass], rng: np.random.Generator,
                   deadline_scale: float = 1.0) -> list[WorkItem]:
    """Each item drawn into one of `classes` by share: it takes the class's name, priority and
    deadline; arrival, prompt and lengths stay. How a trace gets request classes."""
    which = _draw_classes(classes, len(items), rng)
    out = []
    for w, k in zip(items, which):
        c = classes[k]
        dl = None if c.deadline_ms is None else c.deadline_ms * deadline_scale
        out.append(dataclasses.replace(w, priority=c.priority, deadline_ms=dl, deadline_kind=c.deadline_kind,
                                       cls=c.name))
    return out


def ending_at_eos(items: Sequence[WorkItem], max_tokens: int) -> list[WorkItem]:
    """The same requests as clients send them when max_tokens is only a bound: each asks for
    `max_tokens`, and its own length becomes where its output ends (`eos_after`); one longer
    than the bound is cut there (finish reason "length"). A scheduler then knows a request's
    length only once it has ended."""
    if max_tokens < 1:
        raise ValueError(f"ending_at_eos: max_tokens must be >= 1, got {max_tokens}")
    return [dataclasses.replace(w, max_tokens=max_tokens, eos_after=w.max_tokens if w.max_tokens <= max_tokens else None)
            for w in items]


def offered_rate(arrivals: Sequence[float]) -> float:
    """Requests per second over first to last arrival (0 when they all came at once)."""
    span = max(arrivals) - min(arrivals) if arrivals else 0.0
    return len(arrivals) / span if span > 0 else 0.0


def json_object(text: str, where: str, what: str) -> dict[str, Any]:
    """`text` parsed as a JSON object, or a ValueError saying `where` and what was expected."""
    try:
        x = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON: {e}") from None
    if not isinstance(x, dict):
        raise ValueError(f"{where}: expected a JSON object ({what}), got {text.strip()[:40]!r}")
    return x


def parse_arrival_args(text: str | None) -> dict[str, Any]:
    """`--arrival-args`: a JSON object of the arrival process's parameters ({} for none)."""
    return json_object(text, "--arrival-args", "the arrival's parameters") if text else {}


def trace_number(path: str, line: int, value: Any, name: str, least: float | None = None) -> float:
    """A trace cell as a finite float (at least `least` when given), or a ValueError naming
    the file, line and field: a trace is user input, and an infinite or NaN time would stall
    or void the replay."""
    try:
        if isinstance(value, bool):
            raise TypeError
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{path}:{line}: {name} must be a number, got {value!r}") from None
    if not np.isfinite(x) or (least is not None and x < least):
        bound = "a finite number" if least is None else f"a finite number >= {least:g}"
        raise ValueError(f"{path}:{line}: {name} must be {bound}, got {value!r}")
    return x


def _trace_item(path: str, line: int, r: dict[str, Any], t: float, s: float, deadline_scale: float,
                rng: np.random.Generator, tokenizer: Any) -> WorkItem:
    """One line of batchserve's JSONL trace as a WorkItem, every field checked."""
    if "max_tokens" not in r or ("prompt" not in r and "prompt_len" not in r):
        raise ValueError(f"{path}:{line}: needs max_tokens and prompt or prompt_len")
    text, ids = r.get("prompt"), None
    if text is not None and not isinstance(text, str):
        raise ValueError(f"{path}:{line}: prompt must be a string, got {type(text).__name__}")
    if "prompt_len" in r:
        plen = max(1, round(trace_number(path, line, r["prompt_len"], "prompt_len", 1) * s))
        if text is None:
            text, ids = build_prompt(plen, rng, tokenizer)
    elif tokenizer is not None:
        plen = len(tokenizer.encode(text, add_special_tokens=False))
    else:
        plen = max(1, round(len(text) / 4))  # rough: about 4 characters a token in English
    out = max(1, round(trace_number(path, line, r["max_tokens"], "max_tokens", 1) * s))
    dl, kind = r.get("deadline_ms"), r.get("deadline_kind")
    try:
        priority = check_priority(r.get("priority", DEFAULT_PRIORITY))
    except ValueError as e:
        raise ValueError(f"{path}:{line}: {e}") from None
    if kind is not None and kind not in tuple(DeadlineKind):
        raise ValueError(f"{path}:{line}: deadline_kind must be one of {[k.value for k in DeadlineKind]}, got {kind!r}")
    if dl is not None:
        dl = trace_number(path, line, dl, "deadline_ms") * deadline_scale
        if not dl > 0:
            raise ValueError(f"{path}:{line}: deadline_ms must be > 0, got {r['deadline_ms']!r}")
    return WorkItem(t, plen, text, ids, out, priority, dl, kind, str(r.get("cls", r.get("class", "default"))))


def _from_trace(path: str, n: int, rate: float, rng: np.random.Generator, arrival: str | None,
                tokenizer: Any, scale: float | None, deadline_scale: float, time_scale: float | None,
                arrival_kwargs: dict[str, Any]) -> list[WorkItem]:
    from batchserve.bench.traces import replay_times

    rows: list[tuple[int, dict[str, Any]]] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                rows.append((lineno, json_object(line, f"{path}:{lineno}", "one request")))
            if 0 < n <= len(rows):
                break
    if not rows:
        raise ValueError(f"{path}: no requests")
    if arrival in (None, "replay"):
        ts = replay_times(np.array([trace_number(path, ln, r.get("timestamp", r.get("arrival", 0.0)), "timestamp")
                                    for ln, r in rows]), rate, time_scale)
    else:
        ts = make_arrivals(arrival, len(rows), rate, rng, **arrival_kwargs)
    s = 1.0 if scale is None else scale
    items = [_trace_item(path, ln, r, float(t), s, deadline_scale, rng, tokenizer) for (ln, r), t in zip(rows, ts)]
    items.sort(key=lambda w: w.arrival)
    return items


def save_trace(items: list[WorkItem], path: str) -> None:
    """Write items as a JSONL trace that `make_workload(path, ...)` replays (a row's max_tokens is
    its output length, so items that end before their max_tokens have no row form)."""
    if any(w.eos_after is not None for w in items):
        raise ValueError("save_trace: items ending at EOS (eos_after) have no trace form; save them before "
                         "ending_at_eos")
    with open(path, "w") as f:
        for w in items:
            row: dict[str, Any] = {"timestamp": w.arrival, "prompt_len": w.prompt_len, "max_tokens": w.max_tokens,
                                   "priority": w.priority, "cls": w.cls}
            if w.prompt is not None:
                row["prompt"] = w.prompt
            if w.deadline_ms is not None:
                row.update(deadline_ms=w.deadline_ms, deadline_kind=w.deadline_kind)
            f.write(json.dumps(row) + "\n")
