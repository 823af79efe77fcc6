"""Latency model: how long a step takes, and from that how long a request still needs.

Step time is modelled as linear in (tokens in the step, sequences in the step):

    t = c + a * num_tokens + b * num_seqs

fitted online by least squares over the engine's most recent steps. Deadlines and
slack-based urgency only ever ask two questions of it, so any model with
`predict_step` / `observe` (a profiled one, a roofline) can take its place.

`ProfiledLatencyModel` is the profiled one: the step-time fit that `batchserve profile`
(`batchserve.runner.profiler`) measures on a live runner and writes as JSON, read back here
by `load_latency_profile`. Reading and evaluating it needs nothing but the file, so the
scheduler, the policies and the simulator use it without a model runner or torch.
"""
from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass, field
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

    def clear(self) -> None:
        """Forget every step seen."""
        self._x.clear()
        self._s.clear()
        self._y.clear()
        self._coef = None

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


def most_tokens(model: LatencyModel, n: int, base: int, seqs: int, limit: float) -> int:
    """The most of `n` tokens on top of `base` in a step of `seqs` predicted within `limit`."""
    predict = model.predict_step
    if limit == math.inf or predict(base + n, seqs) <= limit:
        return n
    if predict(base + 1, seqs) > limit:
        return 0
    lo, hi = 1, n  # predict(lo) fits, predict(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if predict(base + mid, seqs) <= limit:
            lo = mid
        else:
            hi = mid
    return lo


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


# --- the profiled model --------------------------------------------------------------------
# Regressors of the profiled fit, in the order of its coefficients: a constant, prompt tokens,
# decode sequences, decode context (thousands of tokens), prompt attention (millions of
# query-key pairs), the step's rows past the matrix products' knee, 1 for a step with prompt
# tokens, and 1 for a mixed one (prompt tokens and decodes together). Where prompts and decodes
# take different matrix-product paths (prompts on AMX tiles), each path has its own fixed cost, and
# a mixed step streams the weights once per path.
TERMS = ("const", "prefill_token", "decode_seq", "decode_ktoken", "prefill_mpair", "row_excess", "prompt",
         "mixed")


def row_excess(rows: int, row_knee: int | None) -> float:
    """The row_excess regressor: a step's rows (tokens) past the knee, 0 without a knee."""
    return float(max(0, rows - row_knee)) if row_knee else 0.0


def features(prefills: list[tuple[int, int]], decode_ctx: list[int], row_knee: int | None = None) -> list[float]:
    """Regressors of one step (`TERMS`): prefills as (start_pos, num_tokens), decodes by context
    length; with `row_knee`, also the step's rows (tokens) past it (0 without a knee)."""
    prefill_tokens = sum(n for _, n in prefills)
    return [1.0, float(prefill_tokens), float(len(decode_ctx)), sum(decode_ctx) / 1e3,
            sum(n * (s + n) for s, n in prefills) / 1e6, row_excess(prefill_tokens + len(decode_ctx), row_knee),
            float(prefill_tokens > 0), float(prefill_tokens > 0 and len(decode_ctx) > 0)]


@dataclass
class ProfiledLatencyModel:
    """A step-time model from a profile: `predict_step(num_tokens, num_seqs)` in seconds.

    `observe` keeps a slowly moving correction factor (measured / predicted), so a profile
    taken on a quiet machine adapts when the machine is busier. `context_len` is the decode
    context assumed when a caller gives only token and sequence counts.
    """

    coef: dict[str, float]
    context_len: int = 256
    knee_batch: int | None = None
    row_knee: int | None = None  # rows where the products turn from weight-bound to arithmetic-bound
    max_batch_by_context: dict[int, int] = field(default_factory=dict)
    max_model_len: int = 0
    kv_bytes_per_token: int | None = None
    kv_blocks: int | None = None
    correction: float = 1.0
    ready: bool = True

    def predict(self, prefill_tokens: int, decode_seqs: int, context_len: int | None = None) -> float:
        """Seconds for one step: a prompt chunk of `prefill_tokens` plus `decode_seqs` decodes
        at `context_len` tokens each (default: the profile's reference context)."""
        ctx = self.context_len if context_len is None else context_len
        x = features([(0, prefill_tokens)] if prefill_tokens else [], [ctx] * decode_seqs, self.row_knee)
        return self._eval(x)

    def predict_step(self, num_tokens: int, num_seqs: int, context: int | None = None,
                     prompts: int | None = None) -> float:
        """Seconds for a step of `num_tokens` over `num_seqs` sequences. All decodes when the
        counts match, otherwise one prompt chunk and num_seqs - 1 decodes. `context`: the
        step's KV tokens summed over its sequences, when the caller knows it. `prompts`: how
        many of the sequences are whole prompts instead of one chunk, sharing the prompt tokens
        (a request-level batch's prefill: each attends over its own prompt, not over all)."""
        if prompts and num_tokens > num_seqs:
            decodes = max(0, num_seqs - prompts)
            q, r = divmod(num_tokens - decodes, min(prompts, num_seqs))
            rows = [(0, q + (i < r)) for i in range(min(prompts, num_seqs))]
            return self._eval(features([x for x in rows if x[1]], [self.context_len] * decodes, self.row_knee))
        decodes = num_seqs if num_tokens <= num_seqs else max(0, num_seqs - 1)
        prefill = num_tokens - decodes
        if context is None or decodes == 0:
            return self.predict(prefill, decodes)
        x = features([(0, prefill)] if prefill else [], [], self.row_knee)
        x[2], x[3] = float(decodes), max(0, context - prefill) / 1e3
        x[5], x[7] = row_excess(prefill + decodes, self.row_knee), float(prefill > 0)
        return self._eval(x)

    def _eval(self, x: list[float]) -> float:
        return max(0.0, self.correction * sum(self.coef[t] * v for t, v in zip(TERMS, x)))

    def observe(self, num_tokens: int, num_seqs: int, seconds: float, prompts: int | None = None) -> None:
        """A step took `seconds`; `prompts` as in `predict_step`."""
        pred = self.predict_step(num_tokens, num_seqs, prompts=prompts) / self.correction
        if pred > 0 and seconds > 0:
            self.correction = min(4.0, max(0.25, 0.95 * self.correction + 0.05 * seconds / pred))

    def predict_batch(self, batch: int, prompt_len: int, output_len: int) -> float:
        """Seconds for a request-level batch: one prefill of every prompt, then decodes."""
        mid_ctx = prompt_len + output_len // 2
        return (self.predict(batch * prompt_len, 0)
                + max(0, output_len - 1) * self.predict(0, batch, mid_ctx))

    @classmethod
    def load(cls, path: str) -> "ProfiledLatencyModel":
        """The model in a JSON file that `batchserve profile` wrote (its "fit", "knee" and KV
        pool entries; the measured samples are not needed)."""
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not a `batchserve profile` file: {e}") from None
        fitm = d.get("fit") if isinstance(d, dict) else None
        if not isinstance(fitm, dict) or not isinstance(fitm.get("coef"), dict) or "context_len" not in fitm:
            raise ValueError(f"{path}: not a `batchserve profile` file (no \"fit\" with \"coef\" and \"context_len\")")
        # profiles written before a term existed (row_excess, prompt, mixed) have none: 0, the old model
        return cls(coef={t: float(fitm["coef"].get(t, 0.0)) for t in TERMS}, context_len=int(fitm["context_len"]),
                   knee_batch=d.get("knee", {}).get("batch"), row_knee=fitm.get("row_knee"),
                   max_batch_by_context={int(k): v for k, v in d.get("max_batch_by_context", {}).items()},
                   max_model_len=int(d.get("max_model_len", 0)), kv_bytes_per_token=d.get("kv_bytes_per_token"),
                   kv_blocks=d.get("num_blocks"))


def load_latency_profile(path: str) -> ProfiledLatencyModel:
    """The step-time model in a `batchserve profile` JSON file. The engine calls this once and
    hands the one model to both its readers, the scheduler (step predictions) and the policy
    (`dynamic` takes its knee and batch-time prior), instead of each reading the file."""
    return ProfiledLatencyModel.load(path)
