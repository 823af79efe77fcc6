"""Trace files in the public formats, replayed as workloads (`make_workload(path, ...)`).

Formats (`fmt`; None sniffs it from the file's first line):
- `jsonl`: batchserve's own, one request a line (see `bench.workload`; `save_trace` writes it).
- `burstgpt`: BurstGPT's CSV, columns Timestamp (s from the trace's start), Model, Request
  tokens, Response tokens, Total tokens, Log Type. The class is the log type ("conversation"
  or "api"); rows with 0 response tokens (requests that failed in the original service)
  are skipped, since they have no output to ask for.
- `azure`: the Azure LLM inference trace CSV, columns TIMESTAMP (a date-time, or seconds),
  ContextTokens, GeneratedTokens.
- `mooncake`: Mooncake's JSONL, fields timestamp (ms), input_length, output_length, hash_ids
  (one id per 512-token block of the prompt; equal ids are equal blocks). Prompts are built
  block by block, each block's tokens drawn from (seed, hash id), so requests that share
  leading hash ids share exactly that prompt prefix (prefix caching sees what it would have).

Replay: timestamps are shifted to start at 0, then either multiplied by `time_scale` (0.1
plays an hour of trace in six minutes) or, with `rate` > 0, stretched so the mean rate is
`rate`; the shape (bursts, lulls) is kept either way. `scale` multiplies every length (a
Mooncake block then holds round(512 x scale) tokens). `n` > 0 takes the first n requests.

Small samples ship in `batchserve/bench/traces/` (see its README: they are generated from
the traces' published statistics, not copies); `sample_path("burstgpt")` finds one, and
`make_workload` accepts a sample's name wherever it takes a file.
"""
from __future__ import annotations

import csv
import datetime
import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from batchserve.bench.prompts import ORDINARY_IDS, build_prompt, exact_prompt, one_token_words
from batchserve.bench.workload import WorkItem, trace_number

FORMATS = ("jsonl", "burstgpt", "azure", "mooncake")
MOONCAKE_BLOCK = 512  # tokens per hash id in Mooncake's traces
SAMPLES = {"burstgpt": "burstgpt_sample.csv", "azure-code": "azure_code_sample.csv",
           "azure-conv": "azure_conv_sample.csv", "mooncake": "mooncake_sample.jsonl"}
SAMPLE_DIR = os.path.join(os.path.dirname(__file__), "traces")


@dataclass(frozen=True)
class TraceRequest:
    """One request of a public trace: arrival (s, the trace's clock), lengths in tokens, a
    class label, and Mooncake's block hashes of the prompt (None in the other formats)."""

    timestamp: float
    prompt_len: int
    output_len: int
    cls: str = "default"
    hash_ids: tuple[int, ...] | None = None


def sample_path(name: str) -> str:
    """The bundled sample `name` (one of SAMPLES) as a path."""
    if name not in SAMPLES:
        raise ValueError(f"trace sample: unknown {name!r}; choose from {sorted(SAMPLES)}")
    return os.path.join(SAMPLE_DIR, SAMPLES[name])


def sniff_format(path: str) -> str:
    """The format of `path` from its first non-empty line: a CSV header or a JSON object's keys."""
    with open(path, newline="") as f:
        first = next((line for line in f if line.strip()), "")
    if first.lstrip().startswith("{"):
        try:
            keys = json.loads(first)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: first line is not JSON: {e}") from None
        return "mooncake" if "input_length" in keys else "jsonl"
    head = {h.strip() for h in first.split(",")}
    if {"Timestamp", "Request tokens", "Response tokens"} <= head:
        return "burstgpt"
    if {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= head:
        return "azure"
    raise ValueError(f"{path}: not a trace format batchserve reads ({', '.join(FORMATS)}); header {first.strip()!r}")


def _csv_rows(path: str, need: tuple[str, ...], n: int) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f, skipinitialspace=True)
        missing = [c for c in need if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing columns {missing}")
        rows = []
        for row in reader:
            rows.append(row)
            if 0 < n <= len(rows):
                break
    return rows


def _int(path: str, line: int, row: dict[str, Any], key: str) -> int:
    return int(trace_number(path, line, row.get(key), key))


def read_burstgpt(path: str, n: int = 0) -> list[TraceRequest]:
    out = []
    for line, r in enumerate(_csv_rows(path, ("Timestamp", "Request tokens", "Response tokens"), 0), 2):
        plen, olen = _int(path, line, r, "Request tokens"), _int(path, line, r, "Response tokens")
        if olen < 1:
            continue
        kind = (r.get("Log Type") or "default").strip().lower().removesuffix(" log") or "default"
        out.append(TraceRequest(trace_number(path, line, r["Timestamp"], "Timestamp"), max(1, plen), olen, kind))
        if 0 < n <= len(out):
            break
    return out


def _seconds(text: str) -> float:
    """A TIMESTAMP cell as seconds: a number, or an ISO date-time (fraction up to 7 digits)."""
    try:
        return float(text)
    except ValueError:
        pass
    date, _, frac = text.strip().partition(".")
    t = datetime.datetime.fromisoformat(date.replace("T", " ").removesuffix("Z"))
    return t.replace(tzinfo=datetime.timezone.utc).timestamp() + (float("0." + frac.rstrip("Z")) if frac else 0.0)


def read_azure(path: str, n: int = 0) -> list[TraceRequest]:
    out = []
    for line, r in enumerate(_csv_rows(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"), n), 2):
        try:
            t = _seconds(r["TIMESTAMP"])
        except ValueError:
            raise ValueError(f"{path}:{line}: TIMESTAMP {r['TIMESTAMP']!r} is no date-time or number") from None
        trace_number(path, line, t, "TIMESTAMP")
        out.append(TraceRequest(t, max(1, _int(path, line, r, "ContextTokens")),
                                max(1, _int(path, line, r, "GeneratedTokens"))))
    return out


def read_mooncake(path: str, n: int = 0) -> list[TraceRequest]:
    out = []
    with open(path) as f:
        for line, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                r = json.loads(text)
                req = TraceRequest(float(r["timestamp"]) / 1000.0, max(1, int(r["input_length"])),
                                   max(1, int(r["output_length"])), "default",
                                   tuple(int(h) for h in r.get("hash_ids") or ()))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, OverflowError) as e:
                raise ValueError(f"{path}:{line}: not a Mooncake record "
                                 f"(timestamp, input_length, output_length, hash_ids): {e}") from None
            trace_number(path, line, req.timestamp, "timestamp")
            out.append(req)
            if 0 < n <= len(out):
                break
    return out


READERS = {"burstgpt": read_burstgpt, "azure": read_azure, "mooncake": read_mooncake}


def replay_times(ts: np.ndarray, rate: float = 0.0, time_scale: float | None = None) -> np.ndarray:
    """Trace times from 0: t - min(t), times `time_scale`, or stretched to mean `rate` (n / span)."""
    ts = np.asarray(ts, dtype=float)
    if not np.isfinite(ts).all():
        raise ValueError("trace replay: every timestamp must be a finite number")
    ts = ts - np.min(ts)
    if time_scale is not None:
        if rate > 0:
            raise ValueError("trace replay: give a rate or a time scale, not both")
        if not time_scale > 0:
            raise ValueError(f"trace replay: time scale must be > 0, got {time_scale}")
        return ts * time_scale
    if rate > 0 and ts.max() > 0:
        return ts * (len(ts) / ts.max()) / rate
    return ts


def block_tokens(h: int, size: int, seed: int) -> list[int]:
    """The `size` token ids of the block with hash id `h`: the same for every request."""
    return np.random.default_rng([seed, h & 0xFFFFFFFF, h >> 32]).integers(*ORDINARY_IDS, size=size).tolist()


def block_prompt(hash_ids: tuple[int, ...], n_tokens: int, block: int, seed: int, rng: np.random.Generator,
                 tokenizer: Any = None) -> tuple[str | None, list[int] | None]:
    """A prompt of n_tokens made of the hash ids' blocks in order (tokens past the last block,
    if any, are the request's own). Without a tokenizer, ids; with one, text whose words
    come from the same per-block draw, so shared blocks are shared text."""
    if tokenizer is None:
        ids = [t for h in hash_ids for t in block_tokens(h, block, seed)][:n_tokens]
        return None, ids + rng.integers(*ORDINARY_IDS, size=n_tokens - len(ids)).tolist()
    words = one_token_words(tokenizer)
    picks = [words[t % len(words)] for h in hash_ids for t in block_tokens(h, block, seed)][:n_tokens]
    picks += [words[i] for i in rng.integers(0, len(words), size=n_tokens - len(picks))]
    return exact_prompt(" " + " ".join(picks), n_tokens, rng, tokenizer), None


def trace_workload(path: str, fmt: str | None, n: int, rate: float, rng: np.random.Generator, *,
                   seed: int = 0, arrival: str | None = None, tokenizer: Any = None, scale: float | None = None,
                   time_scale: float | None = None, arrival_kwargs: dict[str, Any] | None = None) -> list[WorkItem]:
    """The requests of a public-format trace as WorkItems (the module docstring's rules);
    `arrival` other than None / "replay" draws new times from that process at `rate`."""
    from batchserve.bench.arrivals import make_arrivals

    fmt = fmt or sniff_format(path)
    if fmt not in READERS:
        raise ValueError(f"trace format: {fmt!r} is not one of {sorted(READERS)}")
    reqs = READERS[fmt](path, n)
    if not reqs:
        raise ValueError(f"{path}: no requests")
    if arrival in (None, "replay"):
        ts = replay_times(np.array([r.timestamp for r in reqs]), rate, time_scale)
    else:
        ts = make_arrivals(arrival, len(reqs), rate, rng, **(arrival_kwargs or {}))
    s = 1.0 if scale is None else scale
    block = max(1, round(MOONCAKE_BLOCK * s))
    items = []
    for r, t in zip(reqs, ts):
        plen, olen = max(1, round(r.prompt_len * s)), max(1, round(r.output_len * s))
        if r.hash_ids:
            text, ids = block_prompt(r.hash_ids, plen, block, seed, rng, tokenizer)
        else:
            text, ids = build_prompt(plen, rng, tokenizer)
        items.append(WorkItem(float(t), plen, text, ids, olen, cls=r.cls))
    items.sort(key=lambda w: w.arrival)
    return items
