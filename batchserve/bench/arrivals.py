"""Arrival processes for workloads: when each request is sent, in seconds from the start.

Every process takes `n`, a mean `rate` (requests/s) and a numpy Generator, and returns `n`
non-decreasing times. Gaps are never clipped: clipping Poisson gaps (as some simulators do)
removes exactly the bursts a batching policy must survive.

- `poisson`: exponential gaps, mean 1/rate.
- `gamma`: gamma gaps with mean 1/rate and squared coefficient of variation `burstiness`
  (CV^2; 1 is Poisson, >1 burstier, <1 more regular): shape k = 1/burstiness,
  scale = burstiness/rate.
- `step`: a Poisson process whose rate is `rate * factors[i]` during phase i; each phase lasts
  `step_s` seconds and the last one lasts forever. Default factors (1, 7.5, 1): the seed's
  7.5x surge (its priority-flood case).
- `ramp`: rate grows linearly from `rate * start` to `rate * end` over `ramp_s` seconds, then
  stays at `rate * end`.
- `piecewise`: any rate profile. `phases` is a list of (duration_s, factor) — a constant rate
  `rate * factor` for that long — or (duration_s, start, end) — a linear ramp from
  `rate * start` to `rate * end`; after the last phase its final rate holds forever. `step`
  and `ramp` are special cases; a surge to 3x and back is [(30, 1), (30, 3), (30, 1)].
- `onoff`: bursts. ON for `on_s` seconds, OFF for `off_s`, repeating; during ON the rate is
  `rate * (on_s + off_s) / on_s`, so the long-run mean is still `rate`.

Time-varying processes use the exact time-change construction: unit-rate Poisson times are
mapped through the inverse of the cumulative intensity, so no gap is ever invented or cut.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def poisson(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    return np.cumsum(rng.exponential(1.0 / rate, size=n))


def gamma(n: int, rate: float, rng: np.random.Generator, burstiness: float = 1.0) -> np.ndarray:
    if burstiness <= 0:
        raise ValueError(f"gamma arrivals: burstiness (CV^2) must be > 0, got {burstiness}")
    k = 1.0 / burstiness
    return np.cumsum(rng.gamma(k, burstiness / rate, size=n))


def _piecewise(n: int, rng: np.random.Generator, segments: Sequence[tuple[float, float, float]],
               tail_rate: float) -> np.ndarray:
    """Poisson process whose rate goes linearly from r0 to r1 over each (duration, r0, r1)
    segment, then stays at `tail_rate`. Exact inversion of the cumulative intensity."""
    if tail_rate <= 0:
        raise ValueError("the rate after the last phase must be > 0, or the workload never ends")
    unit = np.cumsum(rng.exponential(1.0, size=n))  # arrival times of a unit-rate process
    out = np.empty(n)
    seg, t0, lam0 = 0, 0.0, 0.0  # current segment, its start time and Lambda(start)
    for i, target in enumerate(unit):
        while seg < len(segments):
            dur, r0, r1 = segments[seg]
            area = 0.5 * (r0 + r1) * dur
            if lam0 + area >= target:
                break
            seg, t0, lam0 = seg + 1, t0 + dur, lam0 + area
        if seg == len(segments):
            out[i] = t0 + (target - lam0) / tail_rate
            continue
        dur, r0, r1 = segments[seg]
        need, a = target - lam0, (r1 - r0) / (2.0 * dur)
        # root of a*x^2 + r0*x = need, in the form that is stable for a -> 0 and r0 -> 0
        out[i] = t0 + 2.0 * need / (r0 + np.sqrt(max(0.0, r0 * r0 + 4.0 * a * need)))
    return out


def piecewise(n: int, rate: float, rng: np.random.Generator,
              phases: Sequence[Sequence[float]] = ((10.0, 1.0), (10.0, 3.0), (10.0, 1.0))) -> np.ndarray:
    if not phases:
        raise ValueError("piecewise arrivals: phases must not be empty")
    segs = []
    for ph in phases:
        if len(ph) not in (2, 3) or not ph[0] > 0 or min(ph[1:]) < 0:
            raise ValueError(f"piecewise arrivals: a phase is (duration_s > 0, factor >= 0) or "
                             f"(duration_s, start, end), got {tuple(ph)}")
        dur, f0, f1 = float(ph[0]), float(ph[1]), float(ph[-1])
        segs.append((dur, rate * f0, rate * f1))
    return _piecewise(n, rng, segs, segs[-1][2])


def step(n: int, rate: float, rng: np.random.Generator, factors: Sequence[float] = (1.0, 7.5, 1.0),
         step_s: float = 10.0) -> np.ndarray:
    segs = [(step_s, rate * f, rate * f) for f in factors[:-1]]
    return _piecewise(n, rng, segs, rate * factors[-1])


def ramp(n: int, rate: float, rng: np.random.Generator, start: float = 0.1, end: float = 1.0,
         ramp_s: float = 30.0) -> np.ndarray:
    return _piecewise(n, rng, [(ramp_s, rate * start, rate * end)], rate * end)


def onoff(n: int, rate: float, rng: np.random.Generator, on_s: float = 2.0, off_s: float = 2.0) -> np.ndarray:
    # Only ON time accrues intensity: map a Poisson process on "ON time" back to wall time.
    on_rate = rate * (on_s + off_s) / on_s
    on_time = np.cumsum(rng.exponential(1.0 / on_rate, size=n))
    cycles = np.floor(on_time / on_s)
    return cycles * (on_s + off_s) + (on_time - cycles * on_s)


ARRIVALS: dict[str, Callable[..., np.ndarray]] = {
    "poisson": poisson, "gamma": gamma, "step": step, "ramp": ramp, "piecewise": piecewise, "onoff": onoff,
}


def make_arrivals(kind: str, n: int, rate: float, rng: np.random.Generator, **kwargs: object) -> np.ndarray:
    """`n` arrival times (seconds, non-decreasing) of process `kind` at mean/base `rate`."""
    if kind not in ARRIVALS:
        raise ValueError(f"arrival: unknown {kind!r}; choose from {sorted(ARRIVALS)} or 'replay'")
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    return ARRIVALS[kind](n, rate, rng, **kwargs)
