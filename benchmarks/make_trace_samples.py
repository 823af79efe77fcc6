"""Write the small trace samples in batchserve/bench/traces/, in the public formats.

    python -m benchmarks.make_trace_samples            # rewrites the four files, seed 0

The original traces cannot be downloaded here, so these are synthetic: the columns and units
of each format, with lengths and arrivals drawn from the shapes the traces' papers publish.
The parameters below are this script's choices after those descriptions, not the traces'
own numbers:
- BurstGPT (Wang et al., 2024): bursty arrivals (gamma gaps, CV^2 4), heavy-tailed request
  lengths (Zipf-like: lognormal, median 250, sigma 1.1), responses with a long tail (median
  180, sigma 0.9); ChatGPT and GPT-4 rows, conversation and API logs; ~3% of rows with 0
  response tokens (failed requests), as the trace has.
- Azure LLM inference 2023 (Patel et al., Splitwise, 2024): code, prompt median 1,500 and
  output median 13 tokens; conversation, prompt median 1,020 and output median 129; Poisson
  arrivals, date-time timestamps with 7 fractional digits, as the CSV has.
- Mooncake (Qin et al., 2024): mean input ~7,600 and mean output ~180 tokens; prompts made
  of 512-token blocks named by hash ids, with a few popular shared prefixes (system prompts,
  documents) so that requests share leading hash ids; timestamps in ms.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os

import numpy as np

OUT = os.path.join(os.path.dirname(__file__), "..", "batchserve", "bench", "traces")


def _lognormal(rng: np.random.Generator, median: float, sigma: float, n: int, lo: int, hi: int) -> np.ndarray:
    return np.clip(np.rint(rng.lognormal(np.log(median), sigma, n)), lo, hi).astype(int)


def burstgpt(path: str, n: int, rng: np.random.Generator) -> None:
    t = np.cumsum(rng.gamma(0.25, 4.0 / 2.0, n))  # mean gap 0.5 s, CV^2 4
    req = _lognormal(rng, 250, 1.1, n, 1, 16000)
    resp = _lognormal(rng, 180, 0.9, n, 1, 4000)
    resp[rng.random(n) < 0.03] = 0
    model = np.where(rng.random(n) < 0.75, "ChatGPT", "GPT-4")
    log = np.where(rng.random(n) < 0.6, "Conversation log", "API log")
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"])
        for i in range(n):
            w.writerow([f"{t[i]:.3f}", model[i], req[i], resp[i], req[i] + resp[i], log[i]])


def azure(path: str, n: int, rng: np.random.Generator, prompt_median: float, output_median: float) -> None:
    start = datetime.datetime(2023, 11, 16, 18, 15, 46)
    t = np.cumsum(rng.exponential(0.4, n))
    ctx = _lognormal(rng, prompt_median, 0.8, n, 1, 8000)
    gen = _lognormal(rng, output_median, 1.0, n, 1, 2000)
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        for i in range(n):
            ts = start + datetime.timedelta(seconds=float(t[i]))
            w.writerow([ts.strftime("%Y-%m-%d %H:%M:%S.%f") + str(rng.integers(0, 10)), ctx[i], gen[i]])


def mooncake(path: str, n: int, rng: np.random.Generator, block: int = 512) -> None:
    prefixes = [list(range(1000 * k, 1000 * k + int(rng.integers(2, 12)))) for k in range(1, 9)]
    popularity = 1.0 / np.arange(1, len(prefixes) + 1)  # Zipf: a few prefixes carry most requests
    next_id = 100_000
    t = np.cumsum(rng.exponential(300.0, n))  # ms
    with open(path, "w") as f:
        for i in range(n):
            length = int(np.clip(rng.lognormal(np.log(5500), 0.8), 64, 60000))
            blocks = -(-length // block)
            shared = prefixes[rng.choice(len(prefixes), p=popularity / popularity.sum())] if rng.random() < 0.7 else []
            shared = shared[:blocks]
            own = list(range(next_id, next_id + blocks - len(shared)))
            next_id += len(own)
            out = int(np.clip(rng.lognormal(np.log(130), 0.8), 1, 2000))
            f.write(json.dumps({"timestamp": int(t[i]), "input_length": length, "output_length": out,
                                "hash_ids": shared + own}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    os.makedirs(a.out, exist_ok=True)
    burstgpt(os.path.join(a.out, "burstgpt_sample.csv"), 400, rng)
    azure(os.path.join(a.out, "azure_code_sample.csv"), 300, rng, 1500, 13)
    azure(os.path.join(a.out, "azure_conv_sample.csv"), 300, rng, 1020, 129)
    mooncake(os.path.join(a.out, "mooncake_sample.jsonl"), 200, rng)
    print(f"wrote 4 samples in {os.path.abspath(a.out)}")


if __name__ == "__main__":
    main()
