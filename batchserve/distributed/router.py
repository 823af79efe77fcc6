"""`batchserve serve --ray`: engine replicas as Ray actors behind the one HTTP app.

RayEngineClient is an EngineClient, as AsyncEngine is, so routes, errors and metrics are the
single-process server's.
In the HTTP process it tokenizes (for prefix-aware routing), places each request on a replica
(routing.rank: power of two choices on live queue stats, prefix affinity), and runs one `pull`
loop per replica that brings back outputs, step records and stats.

Failures: a replica's queue full -> the next replica by load; all full -> OverloadedError (503
with Retry-After). A replica that dies: its requests that have sent nothing yet are placed again
once; the others end with a clear error; Ray restarts the actor (max_restarts) and the router
takes it back once it answers `ready`.

Disaggregated (prefill_workers, decode_workers > 0): a request goes to a prefill worker, which
returns its first token and its prompt's K/V (Ray object store; the router passes the reference
on without reading it); a decode worker adopts it and streams the rest.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from batchserve.config import ConfigError, EngineConfig
from batchserve.core.batch import RequestOutput
from batchserve.core.kv_cache import prefix_hashes
from batchserve.core.stats import EngineSnapshot
from batchserve.distributed.metrics import ReplicaView, RouterCounters, router_metrics_text
from batchserve.distributed.replica import NUM_PRIORITIES, EngineReplica, ReplicaStats
from batchserve.distributed.routing import PER_WAITING, Candidate, layout, rank
from batchserve.core.batch import StepRecord
from batchserve.engine.client import EngineClient, EngineStoppedError
from batchserve.engine.engine import tokenize
from batchserve.engine.request_stream import RequestStream
from batchserve.request import OverloadedError, RequestError, RequestSpec
from batchserve.server.config import model_name as served_name

log = logging.getLogger(__name__)
RESTART_POLL_S = 1.0


def _ray():
    try:
        import ray
    except ImportError:
        raise RuntimeError("--ray needs Ray: pip install 'batchserve[ray]'") from None
    return ray


def _actor_down_errors() -> tuple[type[BaseException], ...]:
    ex = _ray().exceptions
    return tuple(getattr(ex, n) for n in ("RayActorError", "ActorUnavailableError", "ObjectLostError")
                 if hasattr(ex, n))


def _cause(e: BaseException) -> BaseException:
    """The exception a remote method raised (Ray wraps it in a RayTaskError)."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e


@dataclass
class _Replica:
    key: int
    role: str  # both | prefill | decode
    handle: Any
    up: bool = False
    info: dict = field(default_factory=dict)
    stats: ReplicaStats | None = None
    pending: list[tuple[float, int, int]] = field(default_factory=list)  # (sent at, priority, cost)
    routed: int = 0
    failures: int = 0
    task: asyncio.Task | None = None

    def candidate(self) -> Candidate:
        s = self.stats or ReplicaStats()
        pend = [0] * NUM_PRIORITIES
        for _, p, cost in self.pending:
            pend[p] += cost
        return Candidate(self.key, s.waiting_tokens, s.waiting, s.running, pend, s.prefix_hashes)


@dataclass
class _Track:
    """One request the router answers for."""

    rid: str
    stream: RequestStream
    ids: list[int]
    spec: RequestSpec  # prompt as token ids, max_tokens resolved, arrival_time unset
    arrival: float  # router clock
    replica: int | None = None
    stage: str = "both"  # both | prefill | decode
    delivered: bool = False  # a replica has sent output (the client may not have seen it: stream.seen)
    retried: bool = False
    aborted: bool = False
    done: bool = False
    token_ids: list[int] = field(default_factory=list)


class RayEngineClient(EngineClient):
    """N engine replicas (or P prefill + D decode workers) on Ray, for server/app.py.

    Construct it in the main thread (it connects to Ray, or starts a local Ray, and creates the
    actors); `start(loop)` then waits for the models in the background (`ready` turns True)."""

    @property
    def text_tokenizer(self):
        return self.tokenizer

    def __init__(self, config: EngineConfig, *, replicas: int = 1, prefill_workers: int = 0,
                 decode_workers: int = 0, address: str | None = None, replica_cpus: float = 1.0,
                 replica_gpus: float = 0.0, object_store_mb: int = 512, max_restarts: int = -1,
                 seed: int | None = None, model_name: str | None = None) -> None:
        """`model_name`: the name clients use, the `model_name` label of the router's metrics
        (default: the model's alias or file name, as /v1/models has it without --served-model-name)."""
        if (prefill_workers > 0) != (decode_workers > 0):
            raise ConfigError("prefill_workers / decode_workers: disaggregated serving needs both >= 1")
        if replicas < 1 or prefill_workers < 0 or decode_workers < 0:
            raise ConfigError("replicas: must be >= 1 (workers >= 0)")
        if replica_cpus <= 0:
            raise ConfigError("replica_cpus: must be > 0")
        ray = _ray()
        self.config = config
        self.model_name = model_name or served_name(config.model.model)
        self.disaggregated = prefill_workers > 0
        self.on_step: Callable[[StepRecord], None] | None = None
        self.on_finish: Callable[[RequestOutput], None] | None = None
        self.load_error: BaseException | None = None
        self._rng = random.Random(seed)
        self._tracks: dict[str, _Track] = {}
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = False
        self.tokenizer: Any = None
        self._max_model_len = 0
        self._room = 0  # tokens one request may span (context and KV pool)
        self.block_size = config.cache.block_size
        self.prefix_routing = config.cache.prefix_caching  # (prefill workers only, when disaggregated)
        self.handoffs = 0
        self.handoff_tokens = 0
        self.handoff_seconds = 0.0  # first token out of the prefill worker -> adopted by a decode worker
        self.handoff_import_seconds = 0.0
        self.handoff_export_seconds = 0.0
        self.retries = 0
        self.replica_failures = 0

        self._own_ray = not ray.is_initialized()
        if self._own_ray:
            kw: dict[str, Any] = {"address": address, "include_dashboard": False, "log_to_driver": True}
            if address in (None, "local"):
                kw.update(address=None, object_store_memory=object_store_mb * 2**20)
            ray.init(**kw)
        threads = config.model.num_threads or max(1, int(replica_cpus))
        base = dataclasses.replace(config, model=dataclasses.replace(config.model, num_threads=threads))
        actor = ray.remote(EngineReplica).options  # one class, three roles
        opts = {"num_cpus": replica_cpus, "num_gpus": replica_gpus, "max_restarts": max_restarts, "max_task_retries": 0,
                "max_concurrency": 10_000}
        self.replicas: list[_Replica] = []
        for key, (role, cfg) in enumerate(layout(base, replicas, prefill_workers, decode_workers)):
            handle = actor(**opts).remote(cfg, role, f"{role}-{key}")
            self.replicas.append(_Replica(key, role, handle))

    # --- lifecycle ---------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._boot_task = self._loop.create_task(self._boot())

    async def _boot(self) -> None:
        from batchserve.runner.loader import load_tokenizer

        try:
            self.tokenizer = await asyncio.to_thread(load_tokenizer, self.config.model)
            infos = await asyncio.gather(*(r.handle.ready.remote() for r in self.replicas))
        except Exception as e:  # noqa: BLE001 - reported through /health
            log.exception("replicas failed to start")
            self.load_error = _cause(e)
            return
        for r, info in zip(self.replicas, infos):
            r.info, r.up = info, True
            r.task = self._loop.create_task(self._pull_loop(r))
        self._max_model_len = min(i["max_model_len"] for i in infos)
        self._room = min(min(i["max_model_len"], i["kv_blocks"] * i["block_size"]) for i in infos)
        self._ready = True
        log.info("ray: %d %s up", len(infos), "workers" if self.disaggregated else "replicas")

    @property
    def ready(self) -> bool:
        if not self._ready or self._stopping:
            return False
        if self.disaggregated:
            return any(r.up for r in self.replicas if r.role == "prefill") and \
                any(r.up for r in self.replicas if r.role == "decode")
        return any(r.up for r in self.replicas)

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def now(self) -> float:
        return time.monotonic()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the actors (and the local Ray this client started). Blocking."""
        ray = _ray()
        self._stopping = True
        for r in self.replicas:
            if r.task is not None and self._loop is not None and not self._loop.is_closed():
                try:
                    self._loop.call_soon_threadsafe(r.task.cancel)
                except RuntimeError:  # closed meanwhile
                    pass
            try:
                ray.kill(r.handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self._own_ray:
            ray.shutdown()

    # --- requests ----------------------------------------------------------------------
    async def add(self, spec: RequestSpec) -> RequestStream:
        """As AsyncEngine.add: raises RequestError, OverloadedError or EngineStoppedError."""
        if not self.ready:
            raise EngineStoppedError("the model is not loaded yet" if not self._stopping else "shutting down")
        # off the event loop: a long prompt must not hold up the other requests' streams
        ids = await asyncio.to_thread(tokenize, self.tokenizer, spec.prompt, spec.messages)
        if not ids:
            raise RequestError("messages" if spec.messages is not None else "prompt", "must not be empty")
        params = spec.params
        if spec.auto_max_tokens is not None:
            params = dataclasses.replace(params, max_tokens=max(1, min(spec.auto_max_tokens, self._room - len(ids))))
        rid = spec.request_id
        assert rid is not None, "the caller names the request"
        arrival = spec.arrival_time or self.now()
        placed = dataclasses.replace(spec, prompt=ids, messages=None, params=params, auto_max_tokens=None,
                                     arrival_time=None)
        t = _Track(rid, RequestStream(rid), ids, placed, arrival)
        self._tracks[rid] = t
        try:
            await self._place(t)
        except BaseException:
            self._tracks.pop(rid, None)
            raise
        return t.stream

    def abort(self, request_id: str) -> None:
        t = self._tracks.get(request_id)
        if t is None or t.done:
            return
        t.aborted = True
        if t.replica is not None and t.stage != "prefill-done":
            self.replicas[t.replica].handle.abort.remote(request_id)

    def abort_all(self) -> None:
        for rid in list(self._tracks):
            self.abort(rid)

    async def _place(self, t: _Track, exclude: frozenset[int] = frozenset()) -> None:
        """Send `t` to the best replica that takes it (the first stage when disaggregated)."""
        role = "prefill" if self.disaggregated else "both"
        pool = [r for r in self.replicas if r.role == role and r.up and r.key not in exclude]
        if not pool:
            raise EngineStoppedError("no replica is up")
        prio = t.spec.priority
        hashes = prefix_hashes(t.ids, self.block_size) if self.prefix_routing else None
        order = rank([r.candidate() for r in pool], prio, hashes, self._rng, len(t.ids), self.block_size)
        refused: OverloadedError | None = None
        for key in order:
            r = self.replicas[key]
            sent = self.now()
            # counted before the call: requests placed while this one is in flight must see it
            entry = (sent, prio, len(t.ids) + PER_WAITING)
            r.pending.append(entry)
            try:
                await r.handle.add.remote(t.spec, sent - t.arrival)
            except BaseException as e:
                if entry in r.pending:
                    r.pending.remove(entry)
                if isinstance(e, _actor_down_errors()):
                    continue  # its pull loop will notice
                if not isinstance(e, Exception):
                    raise
                cause = _cause(e)  # the replica refused: say why
                if isinstance(cause, OverloadedError):
                    refused = cause
                    continue
                raise cause from None
            t.replica, t.stage = key, ("prefill" if self.disaggregated else "both")
            r.routed += 1
            if self.disaggregated:
                self._loop.create_task(self._hand_off(t, r))
            return
        if refused is not None:
            raise OverloadedError(f"every replica refused the request: {refused}", refused.retry_after_s,
                                  refused.level)
        raise EngineStoppedError("no replica could take the request")

    # --- outputs -----------------------------------------------------------------------
    async def _pull_loop(self, r: _Replica) -> None:
        down = _actor_down_errors()
        while not self._stopping:
            asked = self.now()
            try:
                outs, steps, stats = await r.handle.pull.remote(self.prefix_routing and r.role != "decode")
            except asyncio.CancelledError:
                return
            except down as e:
                if self._stopping:
                    return
                await self._replica_down(r, e)
                continue
            except Exception:  # noqa: BLE001 - keep pulling; a bug here must not stall the replica
                log.exception("pull from replica %d failed", r.key)
                await asyncio.sleep(0.1)
                continue
            r.stats = stats
            r.pending = [p for p in r.pending if p[0] >= asked]  # older ones show in these stats
            if self.on_step is not None:
                for rec in steps:
                    self.on_step(rec)
            for out in outs:
                t = self._tracks.get(out.request_id)
                if t is not None and t.replica == r.key:
                    self._deliver(t, out)

    def _deliver(self, t: _Track, out: RequestOutput) -> None:
        if t.done:
            return
        t.token_ids = out.token_ids  # (a copy already: it came through Ray)
        if out.new_token_ids or out.new_text or out.finished:
            t.delivered = True
        if out.finished:
            t.done = True
            self._tracks.pop(t.rid, None)
            if self.on_finish is not None:
                self.on_finish(out)
        t.stream.put(out)

    def _fail(self, t: _Track, message: str) -> None:
        now = self.now()
        self._deliver(t, RequestOutput(
            request_id=t.rid, prompt_token_ids=t.ids, token_ids=list(t.token_ids), new_token_ids=[],
            finished=True, finish_reason="abort" if t.aborted else "error", error=message,
            arrival_time=t.arrival, finish_time=now, priority=t.spec.priority))

    async def _lost(self, t: _Track, r: _Replica, err: BaseException) -> None:
        """`t`'s replica died under it: place it again, from its prompt, if the client has seen
        nothing (any non-streamed request, a stream before its first token), else fail it."""
        msg = f"replica {r.key} ({r.role}) died: {type(err).__name__}"
        if not t.stream.seen and not t.retried and not t.aborted and not self._stopping:
            t.retried = True
            self.retries += 1
            t.stream.restart()  # what the dead replica produced is dropped
            t.token_ids, t.delivered = [], False
            try:
                await self._place(t, exclude=frozenset({r.key}))
                log.warning("request %s: %s; placed again on replica %s", t.rid, msg, t.replica)
                return
            except Exception as e:  # noqa: BLE001 - reported in the error
                msg += f"; placing it again failed: {e}"
        self._fail(t, msg)

    async def _replica_down(self, r: _Replica, err: BaseException) -> None:
        """Handle a dead replica's requests, then wait until Ray has restarted it."""
        if r.up:
            r.up = False
            r.failures += 1
            self.replica_failures += 1
            r.stats, r.pending = None, []
            log.error("replica %d (%s) is down: %s", r.key, r.role, err)
            lost = [t for t in self._tracks.values() if t.replica == r.key and t.stage in ("both", "decode")]
            await asyncio.gather(*(self._lost(t, r, err) for t in lost))
        down = _actor_down_errors()
        while not self._stopping:
            try:
                r.info = await r.handle.ready.remote()
            except down:
                await asyncio.sleep(RESTART_POLL_S)
                continue
            except Exception:  # noqa: BLE001 - e.g. the model fails to load after the restart
                log.exception("replica %d did not come back", r.key)
                await asyncio.sleep(RESTART_POLL_S * 5)
                continue
            r.up = True
            log.info("replica %d (%s) is back", r.key, r.role)
            return

    # --- disaggregated: prefill -> decode ----------------------------------------------
    async def _hand_off(self, t: _Track, p: _Replica) -> None:
        try:
            meta_ref, kv_ref = p.handle.take_handoff.options(num_returns=2).remote(t.rid)
            handoff = await meta_ref
        except _actor_down_errors() as e:
            if p.up:  # the pull loop will see it too; take this request's share now
                self._loop.create_task(self._replica_down(p, e))
            await self._lost(t, p, e)
            return
        except Exception as e:  # noqa: BLE001
            self._fail(t, f"prefill failed: {_cause(e)}")
            return
        got = time.perf_counter()
        ttft_s = self.now() - t.arrival
        out = handoff.output
        self._deliver(t, out)
        if handoff.kv_tokens == 0:  # ended at the prefill worker (EOS, max_tokens=1, an error)
            return
        t.stage = "prefill-done"
        if t.aborted:
            self._fail(t, "aborted")
            return
        prio = t.spec.priority
        pool = [r for r in self.replicas if r.role == "decode" and r.up]
        order = rank([r.candidate() for r in pool], prio, None, self._rng)
        reason = "no decode worker is up"
        for key in order:
            d = self.replicas[key]
            t.replica, t.stage = key, "decode"  # before the call: its outputs may come first
            entry = (self.now(), prio, PER_WAITING)
            d.pending.append(entry)
            try:
                import_s = await d.handle.adopt.remote(t.spec, out.token_ids[0], self.now() - t.arrival, ttft_s,
                                                       kv_ref, out.logprobs[0] if out.logprobs else None)
            except _actor_down_errors() as e:
                if entry in d.pending:
                    d.pending.remove(entry)
                reason = f"decode worker {key} died: {type(e).__name__}"
                continue
            except Exception as e:  # noqa: BLE001
                if entry in d.pending:
                    d.pending.remove(entry)
                cause = _cause(e)
                reason = f"decode worker {key} refused: {cause}"
                if isinstance(cause, OverloadedError):
                    continue
                break
            d.routed += 1
            self.handoffs += 1
            self.handoff_tokens += handoff.kv_tokens
            self.handoff_seconds += time.perf_counter() - got + handoff.export_s
            self.handoff_export_seconds += handoff.export_s
            self.handoff_import_seconds += import_s
            if t.aborted:
                d.handle.abort.remote(t.rid)
            return
        t.stage = "prefill-done"
        self._fail(t, reason)

    # --- metrics -----------------------------------------------------------------------
    async def snapshot(self) -> Any:
        """The replicas' gauges summed (KV usage and prefix hit rate averaged), for /metrics."""

        snaps = [r.stats.snapshot for r in self.replicas if r.up and r.stats is not None and r.stats.snapshot]
        if not snaps:
            return None
        waiting: dict[str, int] = {}
        for s in snaps:
            for level, n in s.waiting.items():
                waiting[level] = waiting.get(level, 0) + n
        n = len(snaps)
        return EngineSnapshot(
            waiting=waiting, running=sum(s.running for s in snaps), kv_usage=sum(s.kv_usage for s in snaps) / n,
            kv_free_blocks=sum(s.kv_free_blocks for s in snaps), kv_blocks=sum(s.kv_blocks for s in snaps),
            preemptions=sum(s.preemptions for s in snaps), prefix_hit_rate=sum(s.prefix_hit_rate for s in snaps) / n)

    def metrics_text(self) -> str:
        """Router gauges and counters in the Prometheus text format (appended to /metrics),
        labelled `model_name` as the server's own are (distributed/metrics.py)."""
        replicas = [ReplicaView(r.key, r.role, r.up, r.routed) for r in self.replicas]
        counters = RouterCounters(self.replica_failures, self.retries, self.handoffs, self.handoff_tokens,
                                  self.handoff_seconds, self.handoff_export_seconds + self.handoff_import_seconds)
        return router_metrics_text(self.model_name, replicas, counters)

    def handoff_stats(self) -> dict[str, float]:
        """Hand-off cost so far (disaggregated mode)."""
        n = max(1, self.handoff_tokens)
        return {"handoffs": self.handoffs, "tokens": self.handoff_tokens, "seconds": self.handoff_seconds,
                "ms_per_token": 1e3 * self.handoff_seconds / n,
                "export_ms_per_token": 1e3 * self.handoff_export_seconds / n,
                "import_ms_per_token": 1e3 * self.handoff_import_seconds / n}
