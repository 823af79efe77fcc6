"""Where a request goes: power of two choices on live queue stats, with prefix affinity.

Pure functions over plain numbers, so they are tested without Ray. A replica's load for a
request of priority p is the work queued ahead of it there, in prompt tokens: tokens waiting
at priority >= p (they are served first), a fixed cost per waiting request (its decode), a
smaller one per running request (it slows every step), plus what this router sent since the
replica's last stats (which they do not show yet). With prefix caching, a replica that holds
the prompt's first blocks saves their prefill: that saving is weighed against its load.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

from batchserve.config import EngineConfig

PER_WAITING = 32  # prompt-token equivalents a queued request costs beyond its prompt
PER_RUNNING = 4  # ... and a running one


@dataclass
class Candidate:
    """One replica as the router sees it now."""

    key: int
    waiting_tokens: list[int]  # by priority 0..10
    waiting: list[int]
    running: int
    pending: list[int] = field(default_factory=lambda: [0] * 11)  # router-side, by priority
    prefix: frozenset[int] | None = None  # cached block hashes (None: unknown / caching off)


def layout(config: EngineConfig, replicas: int, prefill: int = 0, decode: int = 0) -> list[tuple[str, EngineConfig]]:
    """(role, engine config) per engine: `replicas` whole engines, or with prefill/decode workers
    the disaggregated pair of pools; prefill workers run at most prefill_max_batch requests."""
    if not prefill:
        return [("both", config)] * replicas
    sc = config.scheduler
    pre = dataclasses.replace(config, scheduler=dataclasses.replace(
        sc, max_num_seqs=min(sc.max_num_seqs, sc.prefill_max_batch)))
    return [("prefill", pre)] * prefill + [("decode", config)] * decode


def load(c: Candidate, priority: int) -> float:
    """Queued work ahead of a request of `priority` on this replica, in prompt tokens."""
    ahead = sum(c.waiting_tokens[priority:]) + PER_WAITING * sum(c.waiting[priority:])
    return ahead + sum(c.pending[priority:]) + PER_RUNNING * c.running


def prefix_match(c: Candidate, hashes: list[int]) -> int:
    """How many of the prompt's leading blocks the replica holds."""
    if not c.prefix or not hashes:
        return 0
    n = 0
    for h in hashes:
        if h not in c.prefix:
            break
        n += 1
    return n


def rank(cands: list[Candidate], priority: int, hashes: list[int] | None = None,
         rng: random.Random | None = None, prompt_tokens: int = 0, block_size: int = 16) -> list[int]:
    """Replica keys in the order to try: the choice first, then the rest by load (for when
    the first refuses: queue full). The choice: two replicas sampled at random, plus with
    prefix hashes the one holding the longest prefix; of these, the least work including
    this request's own prompt tokens that are not cached there."""
    if not cands:
        return []
    rng = rng or random
    loads = {c.key: load(c, priority) for c in cands}
    pool = rng.sample(cands, 2) if len(cands) >= 2 else list(cands)
    cost = dict(loads)
    if hashes:
        matched = {c.key: prefix_match(c, hashes) for c in cands}
        holder = max(cands, key=lambda c: (matched[c.key], -loads[c.key]))
        if matched[holder.key] and holder not in pool:
            pool.append(holder)
        for c in pool:
            cost[c.key] += max(0, prompt_tokens - matched[c.key] * block_size)
    best = min(pool, key=lambda c: cost[c.key])
    rest = sorted((c for c in cands if c.key != best.key), key=lambda c: loads[c.key])
    return [best.key] + [c.key for c in rest]
