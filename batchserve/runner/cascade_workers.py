"""`--cascade-workers`: the prefill stage and the decode stage in two worker processes,
each with its own model copy and its own KV tensors, the KV blocks handed across.

The parent keeps the one scheduler and the one KVCacheManager: block ids mean the same slot
in both workers' pools. Each step's batch (from the `cascade` policy, which in this mode
puts both stages in every step) is split: decodes go to the decode worker, prompt chunks to
the prefill worker, and the two run at once. Before a worker runs a sequence, every block
that sequence reads (positions before its start) must hold the latest KV in *that* worker's
pool; the executor remembers which worker last wrote each block and copies stale ones over
first — normally a request's prompt blocks, prefill -> decode, once, when it starts decoding
(and, with prefix caching, shared blocks wherever they are needed).

The hand-off goes through one shared-memory staging tensor: the owner copies the blocks in,
the other copies them out; commands and acks go over pipes. Its cost (time, bytes, blocks)
is measured and kept in `handoff_*`.
"""
from __future__ import annotations

import atexit
import logging
import math
import os
import time
import weakref
from typing import Any

import torch
import torch.multiprocessing as mp

from batchserve.config import EngineConfig
from batchserve.core.batch import ScheduledBatch, StepOutput

log = logging.getLogger(__name__)
PREFILL, DECODE = 0, 1
STAGING_BLOCKS = 64  # blocks per hand-off round trip


def _worker(conn, config: EngineConfig, staging: torch.Tensor, threads: int) -> None:
    """A stage's process: load the model, then serve exec / export / import until stop."""
    from batchserve.runner.loader import load_model, release_freed_memory
    from batchserve.runner.model_runner import ModelRunner

    torch.set_num_threads(threads)
    runner = ModelRunner(load_model(config.model), config.model, config.cache)
    release_freed_memory()  # the loader's float32 copies the runner did not keep
    bs = runner.block_size
    conn.send(("ready", runner.num_blocks, runner.max_model_len, runner.cfg))
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            return
        if cmd == "exec":
            conn.send(runner.execute(arg))
            continue
        blocks = torch.tensor(arg, dtype=torch.long)
        with torch.no_grad():
            _copy_blocks(runner.kv_caches, staging, blocks, cmd == "export")
        conn.send("ok")


def _copy_blocks(kv_caches: list, staging: torch.Tensor, blocks: torch.Tensor, export: bool) -> None:
    """Pool blocks <-> staging[:n], every layer's K and V (a cache is [blocks, n_kv, bs, row]; a
    staging row holds a block's K elements, then its V elements)."""
    n = len(blocks)
    for layer, (k, v) in enumerate(kv_caches):
        view = staging[:n, layer]  # [n, K elements + V elements]
        kn = k[0].numel()
        if export:
            view[:, :kn].copy_(k[blocks].view(n, -1))
            view[:, kn:].copy_(v[blocks].view(n, -1))
        else:
            k.index_copy_(0, blocks, view[:, :kn].view(n, *k.shape[1:]))
            v.index_copy_(0, blocks, view[:, kn:].view(n, *v.shape[1:]))


class CascadeWorkersExecutor:
    """An Executor (num_blocks, max_model_len, cfg, execute) over a prefill and a decode worker."""

    def __init__(self, config: EngineConfig) -> None:
        from batchserve.runner.loader import load_model
        from batchserve.runner.model_runner import kv_block_shapes, resolve_kv_cache_dtype

        # the parent needs only the model's shape: one throwaway load (weights are dropped)
        loaded = load_model(config.model)
        self.cfg, self.tokenizer, self.name = loaded.config, loaded.tokenizer, loaded.name
        del loaded
        c = self.cfg
        self.block_size = config.cache.block_size
        dtype = resolve_kv_cache_dtype(config.model, config.cache, c)  # what the workers' caches hold
        per_layer = sum(math.prod(shape) for shape in kv_block_shapes(c, self.block_size, dtype))  # K + V
        self._staging = torch.zeros((STAGING_BLOCKS, c.num_layers, per_layer), dtype=dtype).share_memory_()
        self.block_bytes = self._staging[0].numel() * self._staging.element_size()
        ctx = mp.get_context("spawn")
        threads = config.model.num_threads or max(1, (os.cpu_count() or 2) // 2)
        self._conns, self._procs = [], []
        for _ in (PREFILL, DECODE):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(child, config, self._staging, threads), daemon=True)
            p.start()
            self._conns.append(parent)
            self._procs.append(p)
        try:
            ready = [conn.recv() for conn in self._conns]
        except EOFError:
            _shutdown(self._conns, self._procs)
            raise RuntimeError("cascade workers: a worker process died while starting (see its traceback "
                               "above; a script that starts them needs an `if __name__ == '__main__':` "
                               "guard, as spawned processes re-import it)") from None
        self.num_blocks, self.max_model_len = ready[0][1], ready[0][2]
        self._owner: dict[int, int] = {}  # block -> worker holding its latest KV
        self.handoff_seconds = 0.0
        self.handoff_blocks = 0
        self.handoffs = 0
        self.steps = [0, 0]
        self._finalizer = weakref.finalize(self, _shutdown, self._conns, self._procs)
        atexit.register(self._finalizer)

    @property
    def handoff_bytes(self) -> int:
        return self.handoff_blocks * self.block_bytes

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        t0 = time.perf_counter()
        parts: list[list] = [[], []]
        for s in batch.seqs:
            parts[DECODE if s.is_decode else PREFILL].append(s)
        for w in (PREFILL, DECODE):
            self._handoff(w, parts[w])
        for w in (PREFILL, DECODE):  # both stages at once
            if parts[w]:
                self._conns[w].send(("exec", ScheduledBatch(parts[w])))
        sampled: dict[str, int] = {}
        logprobs: dict = {}
        scores: dict = {}
        for w in (PREFILL, DECODE):
            if parts[w]:
                out = self._conns[w].recv()
                sampled.update(out.sampled)
                logprobs.update(out.logprobs or {})
                scores.update(out.prompt_logprobs or {})
                self.steps[w] += 1
                for s in parts[w]:  # the blocks this step wrote now live in worker w
                    first, last = s.start_pos // self.block_size, (s.start_pos + s.num_tokens - 1) // self.block_size
                    for b in s.block_table[first:last + 1]:
                        self._owner[b] = w
        return StepOutput(sampled, time.perf_counter() - t0, logprobs or None, scores or None)

    def _handoff(self, to: int, seqs: list) -> None:
        """Copy every block these sequences read whose latest KV is in the other worker."""
        src = 1 - to
        stale = sorted({b for s in seqs for b in s.block_table[:-(-s.start_pos // self.block_size)]
                        if self._owner.get(b) == src})
        if not stale:
            return
        t0 = time.perf_counter()
        for i in range(0, len(stale), STAGING_BLOCKS):
            chunk = stale[i:i + STAGING_BLOCKS]
            for w, cmd in ((src, "export"), (to, "import")):
                self._conns[w].send((cmd, chunk))
                if self._conns[w].recv() != "ok":
                    raise RuntimeError(f"cascade worker {w}: {cmd} failed")
        for b in stale:
            self._owner[b] = to  # both hold it now; the reader is the one that will write next
        self.handoff_seconds += time.perf_counter() - t0
        self.handoff_blocks += len(stale)
        self.handoffs += 1

    def stats(self) -> dict[str, Any]:
        """Hand-off cost so far, and steps per worker."""
        return {"handoffs": self.handoffs, "handoff_blocks": self.handoff_blocks,
                "handoff_bytes": self.handoff_bytes, "handoff_seconds": self.handoff_seconds,
                "handoff_ms_per_block": 1e3 * self.handoff_seconds / max(1, self.handoff_blocks),
                "prefill_steps": self.steps[PREFILL], "decode_steps": self.steps[DECODE]}

    def close(self) -> None:
        """Stop both workers (also done at exit)."""
        if self._finalizer.alive:
            log.info("cascade workers: %s", self.stats())
        self._finalizer()


def _shutdown(conns: list, procs: list) -> None:
    for conn in conns:
        try:
            conn.send(("stop", None))
        except (OSError, BrokenPipeError):
            pass
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.terminate()
