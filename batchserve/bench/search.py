"""The highest request rate that keeps SLO attainment at a target: `--find-max-goodput`.

    result = find_max_rate(lambda rate: run_at(rate).summary["goodput_frac"], target=0.99, start=1.0)

Search, assuming attainment falls as the rate rises (true of a server up to noise):
1. bracket: from `start`, double the rate while it passes (attainment >= target), or halve it
   while it fails, until one passing and one failing rate are known;
2. bisect between them until hi / lo <= 1 + rel_tol.
`max_runs` bounds the runs in all; halving also stops when two halvings in a row gained less
than PLATEAU of attainment, from above zero (the SLO is missed at any load: the requests are
too long for it on their own; at zero the run may still be overloaded, so halving goes on).
The answer is the highest rate that passed (None if none did), and every probe is kept, so a
non-monotone run shows in them.
Goodput at that rate is the caller's: it has the run.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

PLATEAU = 0.01  # attainment two halvings must gain for the search to keep lowering the rate
NOISE = 0.10  # a lower rate's attainment this far below a higher rate's is reported as noise


@dataclass
class RateSearch:
    """`best`: the highest passing rate (None: none passed); `probes`: (rate, attainment) in
    the order run; `bracketed`: a failing rate above `best` was found (else `best` is only a
    lower bound, the run budget or `max_rate` ran out first)."""

    target: float
    best: float | None = None
    probes: list[tuple[float, float]] = field(default_factory=list)
    bracketed: bool = False


def find_max_rate(attainment_at: Callable[[float], float], target: float, start: float = 1.0, *,
                  rel_tol: float = 0.05, max_runs: int = 12, min_rate: float | None = None,
                  max_rate: float = 1e6) -> RateSearch:
    """Search as the module says; `attainment_at(rate)` runs the workload at `rate` and
    returns its attainment in [0, 1]; `target` is in [0, 1]. `min_rate` defaults to
    start / 64: six halvings, since a run of a fixed request count doubles in length with each."""
    min_rate = start / 64 if min_rate is None else min_rate
    if not 0 < target <= 1:
        raise ValueError(f"target attainment must be in (0, 1], got {target}")
    if not start > 0 or not 0 < min_rate <= start <= max_rate:
        raise ValueError(f"rate search: need 0 < min_rate <= start <= max_rate, got {min_rate}, {start}, {max_rate}")
    res = RateSearch(target)
    lo: float | None = None  # highest passing rate so far
    hi: float | None = None  # lowest failing rate so far

    def probe(rate: float) -> bool:
        a = attainment_at(rate)
        res.probes.append((rate, a))
        return a >= target

    rate = start
    while len(res.probes) < max_runs and (lo is None or hi is None):
        if len(res.probes) >= 3 and lo is None and 0 < res.probes[-1][1] < res.probes[-3][1] + PLATEAU:
            break  # halved twice, gained under a point: a lower rate will not pass either
        if probe(rate):
            lo = rate
            if hi is None:
                if rate >= max_rate:
                    break
                rate = min(rate * 2.0, max_rate)
        else:
            hi = rate
            if lo is None:
                if rate <= min_rate:
                    break
                rate = max(rate / 2.0, min_rate)
    while lo is not None and hi is not None and hi / lo > 1.0 + rel_tol and len(res.probes) < max_runs:
        mid = (lo * hi) ** 0.5  # geometric: the bracket can span orders of magnitude
        if probe(mid):
            lo = mid
        else:
            hi = mid
    res.best, res.bracketed = lo, lo is not None and hi is not None
    return res


def inversions(probes: list[tuple[float, float]], tol: float = NOISE) -> int:
    """Pairs of probes where the lower rate's attainment is below the higher rate's by more
    than `tol`: the search's assumption (attainment falls with rate) broken by noise."""
    return sum(1 for r1, a1 in probes for r2, a2 in probes if r1 < r2 and a1 < a2 - tol)


def one_burst(records: Sequence[Any]) -> bool:
    """Every request was sent before the first answer ended: the run measured a burst of its
    requests, not a rate the server sustains (too few requests for that rate)."""
    ends = [r.end_time for r in records if r.end_time is not None]
    return bool(records) and bool(ends) and max(r.send_time for r in records) <= min(ends)


def search_line(search: dict[str, Any]) -> str:
    """One sentence: the rate `--find-max-goodput` found and its goodput, and whether its
    probes contradict each other (then the answer is only as good as the machine was quiet)."""
    pct = f"{100 * search['target_attainment']:g}%"
    bad = inversions([(p["rate"], p["attainment"]) for p in search["probes"]])
    noisy = (f"; WARNING: in {bad} pairs of runs a lower rate met the SLO less often by over "
             f"{NOISE:.0%}: noise, not load, decided some probes") if bad else ""
    if search["best_rate"] is None:
        low = min(p["rate"] for p in search["probes"])
        return f"max goodput: no rate tried kept attainment >= {pct} (lowest tried {low:g} req/s){noisy}"
    bound = "" if search["bracketed"] else " (a lower bound: no failing rate was reached)"
    burst = ("; WARNING: at that rate every request was sent before the first answer ended, a burst rather "
             "than a sustained load: give more requests") if search.get("best_was_burst") else ""
    return (f"max goodput: {search['best_rate']:.3g} req/s keeps attainment >= {pct}, goodput "
            f"{search['goodput_rps']:.3g} req/s{bound}; {len(search['probes'])} runs{noisy}{burst}")
