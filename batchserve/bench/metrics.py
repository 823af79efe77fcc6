"""Per-request records and the summary computed from them; one module for `bench` (wall
clock) and `simulate` (virtual clock), so both report the same numbers the same way.

Definitions (all latencies in ms in the summary):
- TTFT = first token time - send time; E2E = end time - send time.
- TPOT = (end - first token) / (output tokens - 1), per request with >= 2 output tokens.
- ITL = every gap between consecutive token arrivals, pooled over requests (a chunk that
  carries several tokens counts as one arrival).
- Latency statistics are over completed requests (`ok`): HTTP 200, no error, not cut off,
  and a finish reason that is not abort / deadline / rejected / error.
- SLO: per-request targets on TTFT, TPOT and E2E (`SLO`, any subset); a class's SLO replaces
  the global one for that class's requests. A request is *good* when it completed (`ok`:
  errors, rejections, timeouts and disconnects are misses), met every target of its SLO (a
  request with < 2 output tokens has no TPOT and meets a TPOT target), and finished within its
  own deadline, or within `slo_ms` when it has none.
- Attainment = good requests / all requests; goodput = good requests / `duration_s`. This is
  `vllm bench serve --goodput`'s and GuideLLM's definition (failed requests are in the
  denominator, never in the numerator); with no SLO, deadline or `slo_ms` every completed
  request is good.
- Percentiles: `percentile` below, linear interpolation between closest ranks (numpy's
  default, Hyndman & Fan type 7); P50/P90/P99 everywhere.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from batchserve.request import DEFAULT_PRIORITY

FAILED_REASONS = frozenset({"abort", "deadline", "rejected", "error"})
QUANTILES = (50, 90, 99)
SLO_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")
_SLO_ALIASES = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2e": "e2e_ms", "e2el": "e2e_ms"}


@dataclass(frozen=True)
class SLO:
    """Latency targets of one request, in ms; None: no target on that metric. A request meets
    it when TTFT <= ttft_ms, TPOT <= tpot_ms and E2E <= e2e_ms for every target that is set."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None and not (isinstance(v, (int, float)) and 0 < v < math.inf):
                raise ValueError(f"SLO {f.name}: must be a positive number of ms, got {v!r}")

    @classmethod
    def parse(cls, text: str) -> "SLO":
        """`ttft_ms=500,tpot_ms=50,e2e_ms=8000` (any subset; `ttft`, `tpot`, `e2e` also accepted,
        and `:` for `=`, as in `vllm bench serve --goodput ttft:500`)."""
        kw: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.replace(" ", ",").split(","))):
            key, sep, val = part.replace(":", "=", 1).partition("=")
            key = _SLO_ALIASES.get(key.strip(), key.strip())
            if not sep or key not in SLO_KEYS:
                raise ValueError(f"SLO {text!r}: expected key=ms with keys {', '.join(SLO_KEYS)}; got {part!r}")
            try:
                kw[key] = float(val)
            except ValueError:
                raise ValueError(f"SLO {text!r}: {key} must be a number of ms, got {val!r}") from None
        if not kw:
            raise ValueError(f"SLO {text!r}: no targets")
        return cls(**kw)

    def targets(self) -> dict[str, float]:
        """The set targets, {key: ms}."""
        return {k: v for k in SLO_KEYS if (v := getattr(self, k)) is not None}


def unmatched_classes(class_slo: Mapping[str, SLO], classes: Iterable[str]) -> str | None:
    """A warning naming the classes given an SLO that no request has (a typo judges nothing),
    or None."""
    have = sorted(set(classes))
    missing = sorted(set(class_slo) - set(have))
    if not missing:
        return None
    return f"--slo for class {', '.join(map(repr, missing))}: no request has it (the classes: {', '.join(have)})"


def parse_slo_args(values: Sequence[str]) -> tuple[SLO | None, dict[str, SLO]]:
    """`--slo` values: `key=ms,...` is the global SLO, `CLASS:key=ms,...` one class's.
    Returns (global, {class: SLO}); the last value given for a scope wins."""
    glob: SLO | None = None
    per: dict[str, SLO] = {}
    for v in values:
        head, sep, rest = v.partition(":")
        if sep and "=" not in head and head.strip() not in _SLO_ALIASES and head.strip() not in SLO_KEYS:
            if not head.strip():
                raise ValueError(f"SLO {v!r}: no class name before ':' (CLASS:key=ms, or key=ms for every request)")
            per[head.strip()] = SLO.parse(rest)
        else:
            glob = SLO.parse(v)
    return glob, per


@dataclass
class RequestRecord:
    """What happened to one request. Times are seconds on one clock (wall or virtual).

    `status` is the HTTP status (200 for a stream that started, even if it ended badly);
    `token_times` has one entry per received token-carrying chunk; `disconnected` is set when
    the connection broke before the stream ended; `retry_after_s` is a 503's Retry-After."""

    id: str
    cls: str = "default"
    priority: int = DEFAULT_PRIORITY
    send_time: float = 0.0
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    end_time: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    status: int = 0
    finish_reason: str | None = None
    error: str | None = None
    deadline_ms: float | None = None
    deadline_kind: str | None = None
    disconnected: bool = False
    retry_after_s: float | None = None

    @property
    def ok(self) -> bool:
        """Completed: a full answer (possibly shortened by a soft deadline) came back."""
        return (self.status == 200 and self.error is None and not self.disconnected
                and self.end_time is not None and self.finish_reason not in FAILED_REASONS)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.send_time

    @property
    def e2e(self) -> float | None:
        return None if self.end_time is None else self.end_time - self.send_time

    @property
    def tpot(self) -> float | None:
        if self.first_token_time is None or self.end_time is None or self.output_tokens < 2:
            return None
        return (self.end_time - self.first_token_time) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    def met_target(self, slo_ms: float | None) -> bool:
        """Completed within its deadline, or within slo_ms when it has none."""
        if not self.ok:
            return False
        limit = self.deadline_ms if self.deadline_ms is not None else slo_ms
        return limit is None or self.e2e * 1000.0 <= limit + 1e-9

    def misses(self, slo: SLO | None, slo_ms: float | None = None) -> list[str]:
        """Why this request is not good: ["failed"] if it did not complete, else the missed
        targets among ttft_ms, tpot_ms, e2e_ms (of `slo`) and "deadline" (its own deadline, or
        `slo_ms` when it has none). Empty: the request is good."""
        if not self.ok:
            return ["failed"]
        # a completed stream whose text was empty until its end recorded no first token: it came by the end
        got = {"ttft_ms": self.ttft if self.ttft is not None else self.e2e, "tpot_ms": self.tpot, "e2e_ms": self.e2e}
        out = [k for k, limit in (slo.targets() if slo else {}).items()
               if got[k] is not None and got[k] * 1000.0 > limit + 1e-9]
        if not self.met_target(slo_ms):
            out.append("deadline")
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RequestRecord":
        return cls(**d)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation between closest ranks: sort, take
    rank h = (n - 1) q / 100, interpolate between floor(h) and floor(h) + 1. Same as
    numpy.percentile's default. None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile: q must be in [0, 100], got {q}")
    xs = sorted(values)
    h = (len(xs) - 1) * q / 100.0
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


def dist(values_s: Iterable[float]) -> dict[str, float | int | None]:
    """count, mean and P50/P90/P99 of durations given in seconds, reported in ms."""
    ms = [v * 1000.0 for v in values_s]
    out: dict[str, float | int | None] = {"n": len(ms), "mean": sum(ms) / len(ms) if ms else None}
    for q in QUANTILES:
        out[f"p{q}"] = percentile(ms, q)
    return out


def _latency(recs: list[RequestRecord]) -> dict[str, dict[str, float | int | None]]:
    ok = [r for r in recs if r.ok]
    return {
        "ttft_ms": dist(r.ttft for r in ok if r.ttft is not None),
        "tpot_ms": dist(r.tpot for r in ok if r.tpot is not None),
        "itl_ms": dist(x for r in ok for x in r.itls()),
        "e2e_ms": dist(r.e2e for r in ok),
    }


def _kind(r: RequestRecord) -> str:
    """ok | rejected (503 or finish 'rejected') | timeout (504 or finish 'deadline') |
    disconnect (the connection broke mid-request) | error (anything else)."""
    if r.ok:
        return "ok"
    if r.status == 503 or (r.status == 200 and r.finish_reason == "rejected"):
        return "rejected"
    if r.status == 504 or (r.status == 200 and r.finish_reason == "deadline"):
        return "timeout"
    if r.disconnected:
        return "disconnect"
    return "error"


def slo_for(cls: str, slo: SLO | None, class_slo: Mapping[str, SLO] | None) -> SLO | None:
    """The SLO a request of class `cls` is judged by: its class's when it has one, else the global."""
    return (class_slo or {}).get(cls, slo)


def goodput(records: Sequence[RequestRecord], duration_s: float, slo: SLO | None = None,
            class_slo: Mapping[str, SLO] | None = None, slo_ms: float | None = None) -> dict[str, Any]:
    """SLO attainment and goodput, overall and per class, from per-request records.

    good = ok and no target missed (`RequestRecord.misses` under `slo_for(cls, ...)`);
    attainment = n_good / n_requests; goodput_rps = n_good / duration_s. `misses` counts,
    per reason (failed, ttft_ms, tpot_ms, e2e_ms, deadline), the requests that missed it
    (one request can miss several). Returns {n_requests, n_good, attainment, goodput_rps,
    misses, slo: the global targets, per_class: {cls: the same keys, slo: the class's}}."""
    if duration_s <= 0:
        raise ValueError(f"goodput: duration_s must be > 0, got {duration_s}")

    def part(recs: list[RequestRecord], judge: SLO | None) -> dict[str, Any]:
        why = [r.misses(slo_for(r.cls, slo, class_slo), slo_ms) for r in recs]
        good = sum(not w for w in why)
        return {"n_requests": len(recs), "n_good": good,
                "attainment": good / len(recs) if recs else None, "goodput_rps": good / duration_s,
                "misses": dict(sorted(Counter(k for w in why for k in w).items())),
                "slo": judge.targets() if judge else {}}

    recs = list(records)
    out = part(recs, slo)
    out["per_class"] = {c: part([r for r in recs if r.cls == c], slo_for(c, slo, class_slo))
                        for c in sorted({r.cls for r in recs})}
    return out


def _counts(recs: list[RequestRecord], duration_s: float, slo_ms: float | None,
            slo: SLO | None = None, class_slo: Mapping[str, SLO] | None = None) -> dict[str, Any]:
    n_ok = sum(r.ok for r in recs)
    good = sum(not r.misses(slo_for(r.cls, slo, class_slo), slo_ms) for r in recs)
    with_deadline = [r for r in recs if r.deadline_ms is not None]
    missed = sum(not r.met_target(None) for r in with_deadline)
    return {
        "n_requests": len(recs),
        "n_ok": n_ok,
        "n_good": good,
        # every failure counts in exactly one of these four kinds
        "n_rejected": sum(_kind(r) == "rejected" for r in recs),
        "n_timeout": sum(_kind(r) == "timeout" for r in recs),
        "n_disconnects": sum(_kind(r) == "disconnect" for r in recs),
        "n_errors": sum(_kind(r) == "error" for r in recs),
        # raw HTTP statuses (a stream can only say "rejected"/"deadline" in its finish_reason)
        "n_503": sum(r.status == 503 for r in recs),
        "n_504": sum(r.status == 504 for r in recs),
        "n_deadline_missed": missed,
        "deadline_miss_rate": missed / len(with_deadline) if with_deadline else None,
        "throughput_rps": n_ok / duration_s,
        "output_tokens_per_s": sum(r.output_tokens for r in recs) / duration_s,
        "goodput_rps": good / duration_s,
        "goodput_frac": good / len(recs) if recs else None,
    }


def summarize(records: Sequence[RequestRecord], duration_s: float, slo_ms: float | None = None,
              slo: SLO | None = None, class_slo: Mapping[str, SLO] | None = None) -> dict[str, Any]:
    """Throughput, goodput, latency percentiles and failure counts, overall and per class.

    `duration_s` is the run's length (first send to last end, or the simulated span);
    `slo_ms` is the end-to-end target for requests without their own deadline; `slo` the
    targets every request is judged by unless its class has its own in `class_slo`. n_good,
    goodput_rps and goodput_frac (the attainment) are `goodput`'s, whose full result,
    with the reasons for misses, is under "goodput". Failures
    split into n_rejected (503, or a stream ending 'rejected'), n_timeout (504, or a stream
    ending 'deadline'), n_disconnects, and n_errors (everything else: other 4xx/5xx, an error
    event or finish_reason error/abort)."""
    if duration_s <= 0:
        raise ValueError(f"summarize: duration_s must be > 0, got {duration_s}")
    recs = list(records)
    out: dict[str, Any] = {"duration_s": duration_s, "slo_ms": slo_ms}
    out.update(_counts(recs, duration_s, slo_ms, slo, class_slo))
    out["finish_reasons"] = dict(sorted(Counter(str(r.finish_reason) for r in recs).items()))
    out["status_codes"] = {str(k): v for k, v in sorted(Counter(r.status for r in recs).items())}
    retry = [r.retry_after_s for r in recs if r.retry_after_s is not None]
    out["retry_after_s_mean"] = sum(retry) / len(retry) if retry else None
    out["latency"] = _latency(recs)
    per: dict[str, Any] = {}
    for cls in sorted({r.cls for r in recs}):
        sub = [r for r in recs if r.cls == cls]
        per[cls] = {**_counts(sub, duration_s, slo_ms, slo, class_slo), "priority": sorted({r.priority for r in sub}),
                    "latency": _latency(sub)}
    out["per_class"] = per
    out["goodput"] = goodput(recs, duration_s, slo, class_slo, slo_ms)
    return out


def span_s(records: Sequence[RequestRecord]) -> float:
    """First send to last end (or send, for requests that never ended): a run's duration."""
    if not records:
        raise ValueError("span_s: no records")
    start = min(r.send_time for r in records)
    end = max(r.end_time if r.end_time is not None else r.send_time for r in records)
    return end - start
