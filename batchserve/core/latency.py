"""Latency model: how long a step takes, and from that how long a request still needs.

Step time is modelled as linear in (tokens in the step, sequences in the step):

    t = c + a * num_tokens + b * num_seqs

fitted online by least squares over the engine's most recent steps. Deadlines (S3.2) and
slack-based urgency (S1.5) only ever ask two questions of it, so any model with
`predict_step` / `observe` (a profiled one, a roofline) can take its place.
"""
from __future__ import annotations

import math
from collections import deque
from itertools import repeat
from operator import mul, sub
from typing import Protocol


class LatencyModel(Protocol):
    """The interface the scheduler uses. `predict_step` must return 0.0 while the model knows
    nothing: a zero prediction never ends a request that has not actually missed its deadline."""

    def predict_step(self, num_tokens: int, num_seqs: int) -> float: ...

    def observe(self, num_tokens: int, num_seqs: int, seconds: float) -> None: ...


class OnlineLinearModel:
    """Windowed least squares over the last `window` steps, refitted lazily.

    Steps of one shape only (e.g. decodes, where tokens == seqs) make the two slopes
    inseparable; a tiny ridge term then splits the slope between them, which is still exact
    for steps of that shape. Negative slopes (noise) are dropped and the rest refitted, so
    a bigger step is never predicted to be faster.
    """

    def __init__(self, window: int = 256, min_samples: int = 8) -> None:
        self.window = window
        self.min_samples = min_samples
        # the observed steps, one column each: tokens, sequences, seconds
        self._x: deque[float] = deque(maxlen=window)
        self._s: deque[float] = deque(maxlen=window)
        self._y: deque[float] = deque(maxlen=window)
        self._coef: tuple[float, float, float] | None = None  # (c, a, b); None: refit on next use

    @property
    def ready(self) -> bool:
        """Enough steps seen to predict; before that every prediction is 0.0."""
        return len(self._y) >= self.min_samples

    @property
    def num_samples(self) -> int:
        return len(self._y)

    def observe(self, num_tokens: int, num_seqs: int, seconds: float) -> None:
        if num_seqs <= 0 or seconds < 0 or not math.isfinite(seconds):
            return
        self._x.append(float(num_tokens))
        self._s.append(float(num_seqs))
        self._y.append(float(seconds))
        self._coef = None

    def coefficients(self) -> tuple[float, float, float]:
        """(c, a, b): seconds per step, per token, per sequence."""
        if self._coef is None:
            self._coef = self._fit()
        return self._coef

    def predict_step(self, num_tokens: int, num_seqs: int) -> float:
        if not self.ready:
            return 0.0
        c, a, b = self.coefficients()
        return max(0.0, c + a * num_tokens + b * num_seqs)

    def _fit(self) -> tuple[float, float, float]:
        xs, ss, ys = self._x, self._s, self._y
        n = len(ys)
        if n == 0:
            return (0.0, 0.0, 0.0)
        # Two-pass centred sums, e.g. sxx = sum((x - mx) ** 2 for x in xs), with the loops
        # run by map (this refit runs every step): the same operations in the same order.
        mx, ms, my = sum(xs) / n, sum(ss) / n, sum(ys) / n
        dx = list(map(sub, xs, repeat(mx, n)))
        ds = list(map(sub, ss, repeat(ms, n)))
        dy = list(map(sub, ys, repeat(my, n)))
        sxx = sum(map(pow, dx, repeat(2, n)))
        sss = sum(map(pow, ds, repeat(2, n)))
        sxs = sum(map(mul, dx, ds))
        sxy = sum(map(mul, dx, dy))
        ssy = sum(map(mul, ds, dy))
        ridge = 1e-9 * (sxx + sss) + 1e-12
        a, b = _solve2(sxx + ridge, sxs, sss + ridge, sxy, ssy)
        if a < 0 <= b:  # refit with the negative slope pinned at zero
            a, b = 0.0, max(0.0, ssy / (sss + ridge))
        elif b < 0 <= a:
            a, b = max(0.0, sxy / (sxx + ridge)), 0.0
        elif a < 0 and b < 0:
            a = b = 0.0
        c = my - a * mx - b * ms
        return (c, a, b)


def _solve2(p: float, q: float, r: float, u: float, v: float) -> tuple[float, float]:
    """Solve [[p, q], [q, r]] @ (a, b) = (u, v)."""
    det = p * r - q * q
    if det <= 0:
        return (0.0, 0.0)
    return ((u * r - q * v) / det, (p * v - q * u) / det)


def _first_token_time(model: LatencyModel, compute_left: int, batch_seqs: int, token_budget: int) -> float:
    """Steps that read the remaining `compute_left` tokens (in chunks of at most
    `token_budget`) alongside `batch_seqs - 1` decodes, ending with one sampled token."""
    steps = max(1, -(-compute_left // max(1, token_budget)))
    chunk = -(-compute_left // steps)
    return steps * model.predict_step(chunk + batch_seqs - 1, batch_seqs)


def service_time(model: LatencyModel, compute_left: int, out_left: int, batch_seqs: int,
                 token_budget: int) -> float:
    """Predicted seconds until a request finishes if it runs from now on: it reads
    `compute_left` tokens (prompt, or 1 when decoding), then decodes until `out_left` tokens
    are out, in a batch of `batch_seqs` sequences. Assumes it runs to its max_tokens."""
    if out_left <= 0:
        return 0.0
    b = max(1, batch_seqs)
    first = _first_token_time(model, max(1, compute_left), b, token_budget)
    return first + (out_left - 1) * model.predict_step(b, b)


def tokens_within(model: LatencyModel, seconds: float, compute_left: int, batch_seqs: int,
                  token_budget: int) -> int | None:
    """How many more tokens a request can produce in `seconds` (None: no limit predicted)."""
    if seconds <= 0:
        return 0
    b = max(1, batch_seqs)
    first = _first_token_time(model, max(1, compute_left), b, token_budget)
    if first > seconds:
        return 0
    step = model.predict_step(b, b)
    if step <= 0:
        return None
    return 1 + int((seconds - first) // step)
