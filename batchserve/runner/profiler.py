"""`batchserve profile`: measure step time on this model and machine, fit a
latency model, find the memory-bound max batch and the throughput knee, save it all as JSON.

The runner executes hand-built ScheduledBatches (prompt chunks of P tokens, D decodes at a
context of C tokens; KV contents are irrelevant to timing). The fitted step-time model is

    t = c + a * prefill_tokens + b * decode_seqs + d * decode_context_ktokens
          + e * prefill_attention_mpairs + f * rows_past_knee + g * prompt + h * mixed

(context read by decodes in thousands of tokens; prompt attention in millions of query-key
pairs; prompt is 1 for a step with prompt tokens, mixed 1 for one with prompt tokens and
decodes), least squares with non-negative slopes. The regressors (`core.latency.features`) and
the model that reads the saved file back (`core.latency.ProfiledLatencyModel`) live in the
core, which needs the file and not the runner; this module is the tool that drives a live
ModelRunner to measure it, so it sits beside the runner.

Measurement: every step of the plan is timed once per round (each time the median of `reps`
runs after a warm-up), `rounds` rounds, each in a fresh random order, and a step's time is
the median of its rounds; its spread, (max - min) / median, says how much the machine
disturbed it. The knee is the smallest decode batch that no larger one beats by `min_gain`
of throughput (`knee`), read off the measured medians. The report warns when the fit's
relative error or a step's spread is large. `measure` and `analyse` take any timing
function, so all of this is tested without a model.
"""
from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Callable

import numpy as np

from batchserve.config import EngineConfig
from batchserve.core.batch import ScheduledBatch, ScheduledSeq
from batchserve.core.latency import TERMS, features
from batchserve.request import SamplingParams

log = logging.getLogger(__name__)
# Row counts tried as the knee of the matrix products: below it a step streams the weights and
# barely grows with rows, above it each row adds its arithmetic (row_excess = rows past the knee).
KNEE_CANDIDATES = (4, 8, 16, 32, 64, 128)
TINY_MODEL = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048}
_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)
FIT_WARN_MEAN, FIT_WARN_MAX = 0.10, 0.30  # relative fit errors past which the report warns
SPREAD_WARN = 0.25  # a point whose rounds differ by more than this (of its median) is noisy
WARM_S, WARM_MAX = 0.1, 50  # how long a step runs before it is timed (`time_step`), at most how many times


def fit(rows: list[list[float]], times: list[float]) -> list[float]:
    """Least squares on relative error (a 1 ms step matters as much as a 1 s one) with every
    slope >= 0 (noise must not make a bigger step look faster): negative slopes are pinned
    at zero and the rest refitted."""
    x, y = np.asarray(rows, dtype=float), np.asarray(times, dtype=float)
    w = 1.0 / np.maximum(y, 1e-9)
    x, y = x * w[:, None], y * w
    active = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        neg = [active[i] for i, c in enumerate(coef) if c < 0 and active[i] != 0]
        if not neg:
            break
        active = [i for i in active if i not in neg]
    out = [0.0] * x.shape[1]
    for i, c in zip(active, coef):
        out[i] = float(c)
    return out


def knee(batch_sizes: list[int], throughputs: list[float], min_gain: float = 0.15) -> int:
    """The batch size past which throughput stops rising: the smallest size that no
    larger measured size beats by `min_gain` or more. Comparing against every larger size,
    not just the next, keeps one noisy point from faking an early knee. The largest size
    if throughput never levels off."""
    for i in range(len(batch_sizes) - 1):
        if max(throughputs[i + 1:]) < throughputs[i] * (1.0 + min_gain):
            return batch_sizes[i]
    return batch_sizes[-1]


# --- measurement -----------------------------------------------------------------------------
def _seq(rid: str, n: int, start: int, table: list[int], vocab: int, decode: bool = False) -> ScheduledSeq:
    """A prompt chunk, or (`decode`) a decode: one that has generated a token, which the runner
    multiplies as the engine's decodes (never on the prompt path, e.g. AMX tiles)."""
    toks = [(start + i) * 7919 % vocab for i in range(n)]
    return ScheduledSeq(rid, toks, start, table, True, _GREEDY, int(decode))


def build_batch(runner, prefills: list[tuple[int, int]], decode_ctx: list[int]) -> ScheduledBatch | None:
    """A batch of prompt chunks (start, n) and decodes at the given contexts, with fresh block
    tables; None if it does not fit the KV pool (that is the memory bound)."""
    bs = runner.block_size
    need = [-(-(s + n) // bs) for s, n in prefills] + [-(-(c + 1) // bs) for c in decode_ctx]
    if sum(need) > runner.num_blocks:
        return None
    seqs, nxt = [], 0
    vocab = runner.cfg.vocab_size
    for i, ((s, n), k) in enumerate(zip(prefills, need)):
        seqs.append(_seq(f"p{i}", n, s, list(range(nxt, nxt + k)), vocab))
        nxt += k
    for i, (c, k) in enumerate(zip(decode_ctx, need[len(prefills):])):
        seqs.append(_seq(f"d{i}", 1, c, list(range(nxt, nxt + k)), vocab, decode=True))
        nxt += k
    return ScheduledBatch(seqs)


def time_step(runner, batch: ScheduledBatch, reps: int) -> float:
    """The median of `reps` runs of one step, once it has run WARM_S seconds (at most
    WARM_MAX times): a small step right after a large one runs slower for several repetitions
    while the caches refill, and in a live stream such a step follows steps like it."""
    t0 = time.perf_counter()
    runner.execute(batch)  # allocator, kernels, caches
    first = time.perf_counter() - t0
    for _ in range(min(WARM_MAX, int(WARM_S / max(first, 1e-6)))):
        runner.execute(batch)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.execute(batch)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def fit_with_knee(samples: list[dict]) -> tuple[int | None, list[float], list[float]]:
    """The fit (see `fit`) at each candidate row knee, and without one; the one with the least
    mean relative error wins. Returns (knee or None, coefficients, relative errors)."""
    times = [s["seconds"] for s in samples]
    best = None
    for k in (None, *KNEE_CANDIDATES):
        rows = [features(s["prefills"], s["decode_ctx"], k) for s in samples]
        coef = fit(rows, times)
        errs = [abs(sum(c * x for c, x in zip(coef, r)) - t) / t for r, t in zip(rows, times)]
        if best is None or np.mean(errs) < np.mean(best[2]) - 1e-9:
            best = (k, coef, errs)
    return best


def grid(quick: bool) -> tuple[list[int], list[int], list[int]]:
    """(prefill token counts, decode batch sizes, context lengths) to measure."""
    if quick:
        return [8, 32], [1, 2, 4, 8], [16, 64]
    return [16, 64, 256, 512], [1, 2, 4, 8, 16, 32, 64, 128], [128, 512, 1024]


Point = tuple[list[tuple[int, int]], list[int]]  # (prompt chunks (start, n), decode contexts)
TimeFn = Callable[[list[tuple[int, int]], list[int]], "float | None"]


def plan(prefill_sizes: list[int], batch_sizes: list[int], contexts: list[int]) -> list[Point]:
    """The steps to time: prompt chunks alone (first and later chunks, and a long prompt), decode
    batches of each size at each context (the throughput curves), and mixed steps as chunked /
    continuous run."""
    pts: list[Point] = []
    for p in prefill_sizes:
        pts += [([(0, p)], []), ([(contexts[0], p)], [])]  # a later chunk: attention over earlier context
    pts += [([], [c] * b) for c in contexts for b in batch_sizes]
    pts += [([(0, p)], [contexts[0]] * b) for p in prefill_sizes[:2] for b in batch_sizes[1::2]]
    longest = prefill_sizes[-1]  # a long prompt, whole and as a late chunk: its attention grows as its square
    return pts + [([(0, 4 * longest)], []), ([(3 * longest, longest)], [])]


def measure(points: list[Point], time_fn: TimeFn, rounds: int, seed: int = 0) -> list[tuple[Point, list[float]]]:
    """Every point timed once per round, each round in a fresh random order: a slow spell of
    the machine then lands on different points in different rounds, where one small-to-large
    pass puts all of it on whichever sizes ran during it. `time_fn` returns seconds, or None
    for a step that does not fit (dropped). Returns (point, [seconds per round])."""
    if rounds < 1:
        raise ValueError(f"profile: rounds must be >= 1, got {rounds}")
    rng = np.random.default_rng(seed)
    times: dict[int, list[float]] = {i: [] for i in range(len(points))}
    for _ in range(rounds):
        for i in rng.permutation(len(points)):
            if i in times:
                t = time_fn(*points[i])
                if t is None:
                    del times[i]
                else:
                    times[i].append(t)
    return [(points[i], ts) for i, ts in sorted(times.items())]


def spread(ts: list[float]) -> float:
    """(max - min) / median of one point's rounds: 0 on a quiet machine."""
    return (max(ts) - min(ts)) / statistics.median(ts)


def analyse(measured: list[tuple[Point, list[float]]], min_gain: float = 0.15) -> dict:
    """Fit, knee and warnings from measured points (their per-round medians). The knee is read
    off the decode throughput (batch / step time) at the smallest context: `knee(min_gain)`."""
    samples = [{"prefills": pre, "decode_ctx": dec, "seconds": statistics.median(ts), "rounds": ts,
                "spread": spread(ts)} for (pre, dec), ts in measured]
    row_knee, coef, errs = fit_with_knee(samples)
    curves: dict[int, list[dict]] = {}
    for s in samples:
        if not s["prefills"] and s["decode_ctx"]:
            b = len(s["decode_ctx"])
            curves.setdefault(s["decode_ctx"][0], []).append(
                {"batch": b, "step_s": s["seconds"], "tokens_per_s": b / s["seconds"], "spread": s["spread"]})
    for pts in curves.values():
        pts.sort(key=lambda p: p["batch"])
    ref = min(curves)
    sizes, tput = [p["batch"] for p in curves[ref]], [p["tokens_per_s"] for p in curves[ref]]
    mean_err, max_err = float(np.mean(errs)), float(np.max(errs))
    warnings = []
    if mean_err > FIT_WARN_MEAN or max_err > FIT_WARN_MAX:
        warnings.append(f"fit error is large (mean {mean_err:.1%}, max {max_err:.1%}; warn above "
                        f"{FIT_WARN_MEAN:.0%} / {FIT_WARN_MAX:.0%}): predictions from this profile are off by as much")
    noisy = [s for s in samples if s["spread"] > SPREAD_WARN]
    if noisy:
        warnings.append(f"{len(noisy)} of {len(samples)} steps varied by more than {SPREAD_WARN:.0%} across "
                        f"rounds (worst {max(s['spread'] for s in noisy):.0%}): the machine was busy; "
                        "rerun with more --rounds or on a quieter machine")
    return {
        "fit": {"terms": list(TERMS), "coef": dict(zip(TERMS, coef)), "context_len": ref, "row_knee": row_knee,
                "mean_rel_error": mean_err, "max_rel_error": max_err},
        "decode_curves": {str(c): pts for c, pts in sorted(curves.items())},
        "knee": {"context_len": ref, "batch": knee(sizes, tput, min_gain), "min_gain": min_gain,
                 "throughputs": dict(zip(map(str, sizes), tput))},
        "rounds": max(len(ts) for _, ts in measured), "warnings": warnings, "samples": samples,
    }


def run_profile(config: EngineConfig, quick: bool = False, reps: int = 3, rounds: int = 3, seed: int = 0,
                min_gain: float = 0.15) -> dict:
    """Measure (`rounds` interleaved rounds, each point the median of `reps` steps), fit and
    summarise; returns the JSON-ready profile."""
    from batchserve.runner.loader import load_model
    from batchserve.runner.model_runner import ModelRunner, kv_bytes_per_block

    loaded = load_model(config.model)
    runner = ModelRunner(loaded, config.model, config.cache)
    prefill_sizes, batch_sizes, contexts = grid(quick)
    contexts = [c for c in contexts if c < runner.max_model_len]

    def time_fn(prefills: list[tuple[int, int]], decode_ctx: list[int]) -> float | None:
        batch = build_batch(runner, prefills, decode_ctx)
        if batch is None:
            return None
        t = time_step(runner, batch, reps)
        log.debug("prefills %s, %d decodes at %s: %.2f ms", prefills, len(decode_ctx),
                  decode_ctx[0] if decode_ctx else "-", t * 1e3)
        return t

    prof = analyse(measure(plan(prefill_sizes, batch_sizes, contexts), time_fn, rounds, seed), min_gain)
    bs = config.cache.block_size
    return {
        "model": loaded.name, "device": config.model.device, "dtype": config.model.dtype,
        "block_size": bs, "num_blocks": runner.num_blocks, "max_model_len": runner.max_model_len,
        "kv_bytes_per_token": kv_bytes_per_block(runner.cfg, bs, runner.kv_dtype) // bs,
        "max_batch_by_context": {str(c): runner.num_blocks // -(-c // bs) for c in contexts}, **prof,
    }


def report(prof: dict) -> str:
    """A short human summary of a profile: the fit and its error, each throughput point with
    its spread across rounds, the knee and what it means for --max-num-seqs, then warnings."""
    from batchserve.config import SchedulerConfig

    f, k, rounds = prof["fit"], prof["knee"], prof.get("rounds", 1)
    curve = prof["decode_curves"].get(str(k["context_len"]), [])
    lines = [f"model {prof['model']} on {prof['device']} ({prof['dtype']}), KV pool {prof['num_blocks']} blocks "
             f"x {prof['block_size']} tokens",
             "step time = " + " + ".join(f"{v * 1e3:.4g} ms x {t}" for t, v in f["coef"].items()),
             f"fit error: mean {f['mean_rel_error']:.1%}, max {f['max_rel_error']:.1%} over "
             f"{len(prof['samples'])} steps, {rounds} interleaved rounds each",
             "max batch that fits the KV cache: " + ", ".join(
                 f"{v} at {c} tokens" for c, v in prof["max_batch_by_context"].items()),
             f"decode throughput at context {k['context_len']} (median tok/s, spread across rounds): " + ", ".join(
                 f"{p['batch']}: {p['tokens_per_s']:.0f}" + (f" ({p.get('spread', 0):.0%})" if rounds > 1 else "")
                 for p in curve) + ("" if rounds > 1 else " (one round: no spread)")]
    gain = k.get("min_gain", 0.15)
    open_ended = bool(curve) and k["batch"] >= curve[-1]["batch"]  # throughput never levelled off
    if open_ended:
        lines.append(f"knee: none up to batch {k['batch']}, the largest measured (each larger batch still added "
                     f"{gain:.0%} or more throughput): the knee is at or past it")
    else:
        lines.append(f"knee: batch {k['batch']} (no larger batch adds {gain:.0%} or more throughput)")
    default = SchedulerConfig.max_num_seqs
    if k["batch"] != default:
        at_least = "at least " if open_ended else ""
        lines.append(f"the engine's default --max-num-seqs is {default}, a fixed setting that no profile changes: "
                     f"pass --max-num-seqs {at_least}{k['batch']}, or --latency-profile FILE (the dynamic policy "
                     "caps its batch at the knee)")
    lines += [f"WARNING: {w}" for w in prof.get("warnings", [])]
    return "\n".join(lines)


def save(prof: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(prof, f, indent=1)


__all__ = ["TINY_MODEL", "analyse", "fit", "fit_with_knee", "knee", "measure", "plan", "report", "run_profile",
           "save"]
