"""AsyncEngine: the LLMEngine on a thread of its own, driven from asyncio.

One engine thread owns the LLMEngine and everything under it (scheduler, queue, KV cache). The
event loop never touches that state: it posts commands (add, abort, call) into an inbox that the
engine thread drains between steps, and it receives each request's outputs on an asyncio.Queue,
fed by one `loop.call_soon_threadsafe` per step (not one per token). Tokenization, scheduling,
the model and detokenization all run on the engine thread, so the event loop stays light.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from batchserve.core.batch import RequestOutput, ScheduledBatch, StepOutput
from batchserve.engine.engine import LLMEngine
from batchserve.engine.request_stream import RequestStream
from batchserve.request import RequestError, RequestStatus, SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")
_IDLE_POLL_S = 0.002  # a policy may hold work back (a batching window): look again this soon


class EngineStoppedError(RuntimeError):
    """The engine thread is not running (still loading, failed to load, or shut down)."""


@dataclass(frozen=True)
class StepRecord:
    """What one model step did, for metrics."""

    num_seqs: int
    num_tokens: int
    num_sampled: int
    step_time: float


class _ObservedExecutor:
    """Passes steps through to the real executor and remembers each batch, so the engine
    thread knows a step's size and which requests a failed step hit."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.last_batch: ScheduledBatch | None = None
        self.last_output: StepOutput | None = None

    def __getattr__(self, name: str) -> Any:  # num_blocks, max_model_len, cfg, ...
        return getattr(self.inner, name)

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        self.last_batch, self.last_output = batch, None
        self.last_output = self.inner.execute(batch)
        return self.last_output


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int] | None
    messages: list[dict] | None
    params: SamplingParams
    auto_max_tokens: bool
    options: dict[str, Any]
    future: asyncio.Future


class AsyncEngine:
    """Runs an LLMEngine in a background thread; `add` returns a RequestStream.

    `source` is an engine or a factory that builds one (called on the engine thread, so a slow
    model load does not hold up the caller; `ready` turns True when it is done).
    `on_step` / `on_finish` are called on the engine thread after each model step and for each
    finished request; they must be quick and thread-safe (prometheus-client metrics are).
    """

    def __init__(self, source: LLMEngine | Callable[[], LLMEngine], *, default_max_tokens: int = 1024,
                 on_step: Callable[[StepRecord], None] | None = None,
                 on_finish: Callable[[RequestOutput], None] | None = None) -> None:
        self._source = source
        self.default_max_tokens = default_max_tokens
        self.on_step = on_step
        self.on_finish = on_finish
        self.engine: LLMEngine | None = None
        self.load_error: BaseException | None = None
        self._executor: _ObservedExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # event-loop side only
        self._inbox: list[tuple[str, Any]] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self.num_steps = 0  # model steps run (readable from any thread)

    # --- lifecycle ---------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; outputs are delivered on `loop` (default: the running one)."""
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="batchserve-engine", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        """True once the model is loaded and the engine thread is serving."""
        return self._ready.is_set() and not self._stopping and self._thread is not None and self._thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is left, stop the thread and wait for it (blocking)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def max_model_len(self) -> int:
        return self.engine.executor.max_model_len if self.engine is not None else 0

    def now(self) -> float:
        """The engine clock (monotonic seconds), readable from any thread."""
        return self.engine.clock.now() if self.engine is not None else time.monotonic()

    # --- the event-loop side -----------------------------------------------------------
    async def add(self, request_id: str, params: SamplingParams, prompt: str | list[int] | None = None,
                  messages: list[dict] | None = None, auto_max_tokens: bool = False,
                  **options: Any) -> RequestStream:
        """Queue a request. Raises what `LLMEngine.add_request` raises (RequestError,
        OverloadedError), or EngineStoppedError. With `auto_max_tokens`, max_tokens becomes
        whatever room the context leaves, up to `default_max_tokens`. `options` are passed on
        (priority, deadline_ms, deadline_kind, now); None values are left out."""
        if not self.ready:
            raise EngineStoppedError("the model is not loaded yet" if not self._stopping else "shutting down")
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        fut = asyncio.get_running_loop().create_future()
        opts = {k: v for k, v in options.items() if v is not None}
        self._post("add", _Add(request_id, prompt, messages, params, auto_max_tokens, opts, fut))
        try:
            await fut
        except asyncio.CancelledError:
            self.abort(request_id)  # the caller left while the add was in flight
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """End a request now (client gone); its blocks are freed before the next step."""
        self._post("abort", request_id)

    def abort_all(self) -> None:
        """Abort every request this engine is answering (end of a shutdown grace period)."""
        for rid in list(self._streams):
            self.abort(rid)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps (consistent reads of its state)."""
        fut = asyncio.get_running_loop().create_future()
        self._post("call", (fn, fut))
        return await fut

    def _post(self, kind: str, item: Any) -> None:
        with self._cond:
            self._inbox.append((kind, item))
            self._cond.notify()

    def _deliver(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            stream.put(out)

    # --- the engine thread -------------------------------------------------------------
    def _to_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed under us (process exit): nobody is listening
            pass

    def _resolve(self, fut: asyncio.Future, result: Any = None, error: BaseException | None = None,
                 request_id: str | None = None) -> None:
        def settle() -> None:
            if error is not None and request_id is not None:
                self._streams.pop(request_id, None)  # a refused add never sends an output
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

        self._to_loop(settle)

    def _run(self) -> None:
        try:
            engine = self._source() if callable(self._source) else self._source
            self._executor = _ObservedExecutor(engine.executor)
            engine.executor = self._executor
            self.engine = engine
        except BaseException as e:  # noqa: BLE001 - reported through /health and the log
            log.exception("engine failed to start")
            self.load_error = e
            self._fail_inbox(EngineStoppedError(f"engine failed to start: {e}"))
            return
        self._ready.set()
        while True:
            with self._cond:
                if not self._inbox and not self._stopping and not engine.has_unfinished:
                    self._cond.wait()
                inbox, self._inbox = self._inbox, []
                stopping = self._stopping
            for kind, item in inbox:
                self._handle(engine, kind, item)
            if stopping:
                self._stop(engine)
                return
            if engine.has_unfinished and not self._step(engine):
                with self._cond:  # nothing ran (e.g. a window is open): don't spin
                    if not self._inbox and not self._stopping:
                        self._cond.wait(_IDLE_POLL_S)

    def _handle(self, engine: LLMEngine, kind: str, item: Any) -> None:
        if kind == "abort":
            engine.abort(item)
        elif kind == "call":
            fn, fut = item
            try:
                self._resolve(fut, fn(engine))
            except Exception as e:  # noqa: BLE001 - handed to the caller
                self._resolve(fut, error=e)
        else:
            self._add(engine, item)

    def _add(self, engine: LLMEngine, a: _Add) -> None:
        try:
            ids = engine.tokenize(a.prompt, a.messages)
            if not ids:
                raise RequestError("messages" if a.messages is not None else "prompt", "must not be empty")
            params = a.params
            if a.auto_max_tokens:
                room = min(engine.executor.max_model_len, engine.kv.num_blocks * engine.kv.block_size) - len(ids)
                params = dataclasses.replace(params, max_tokens=max(1, min(self.default_max_tokens, room)))
            engine.add_request(ids, params, request_id=a.request_id, **a.options)
        except Exception as e:  # noqa: BLE001 - RequestError / OverloadedError go to the caller
            self._resolve(a.future, error=e, request_id=a.request_id)
            return
        self._resolve(a.future, a.request_id)

    def _step(self, engine: LLMEngine) -> bool:
        """One engine step; True if the model ran."""
        ex = self._executor
        ex.last_batch = None
        try:
            outs = engine.step()
        except Exception as e:  # noqa: BLE001 - a failed step fails its batch, not the server
            log.exception("engine step failed")
            self._fail_batch(engine, ex.last_batch, e)
            return True
        batch = ex.last_batch
        if batch is not None:
            self.num_steps += 1
        if batch is not None and self.on_step is not None:
            sampled = sum(1 for s in batch.seqs if s.sample)
            step_time = ex.last_output.step_time if ex.last_output is not None else 0.0
            self._notify(self.on_step, StepRecord(batch.num_seqs, batch.num_tokens, sampled, step_time))
        self._emit(outs)
        return batch is not None or bool(outs)

    def _emit(self, outs: list[RequestOutput]) -> None:
        if not outs:
            return
        if self.on_finish is not None:
            for out in outs:
                if out.finished:
                    self._notify(self.on_finish, out)
        self._to_loop(self._deliver, outs)

    def _notify(self, fn: Callable[[Any], None], arg: Any) -> None:
        try:
            fn(arg)
        except Exception:  # noqa: BLE001 - a metrics bug must not stop the engine
            log.exception("engine callback failed")

    def _fail_batch(self, engine: LLMEngine, batch: ScheduledBatch | None, exc: Exception) -> None:
        """End the requests a failed step touched (all running ones if the failure came
        before the model ran, and everything if that is nothing, so the loop cannot spin on
        the same error). Their outputs (finish reason "error") come out of the next step."""
        sched = engine.scheduler
        if batch is not None:
            ids = [s.request_id for s in batch.seqs]
        else:
            ids = [r.request_id for r in sched.running] or list(sched.requests)
        now = engine.clock.now()
        for rid in ids:
            req = sched.requests.get(rid)
            if req is not None and not req.finished:
                req.error = f"model step failed: {type(exc).__name__}: {exc}"
                sched.finish(req, RequestStatus.FINISHED_ERROR, now)

    def _stop(self, engine: LLMEngine) -> None:
        for rid in list(engine.scheduler.requests):
            engine.abort(rid)
        for _ in range(3):  # drain the final outputs (a policy may hold some back for a step)
            if not engine.has_unfinished:
                break
            try:
                self._emit(engine.step())
            except Exception:  # noqa: BLE001 - shutting down anyway
                log.exception("engine step failed during shutdown")
                break
        self._fail_inbox(EngineStoppedError("shutting down"))

    def _fail_inbox(self, error: Exception) -> None:
        with self._cond:
            inbox, self._inbox = self._inbox, []
        for kind, item in inbox:
            if kind == "add":
                self._resolve(item.future, error=error, request_id=item.request_id)
            elif kind == "call":
                self._resolve(item[1], error=error)
