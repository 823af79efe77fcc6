"""AsyncEngine: the LLMEngine on a thread of its own, driven from asyncio (an EngineClient).

One engine thread owns the LLMEngine and everything under it (scheduler, queue, KV cache). The
event loop never touches that state: it posts typed commands (add, abort, call) into an inbox
that the engine thread drains between steps, and it receives each request's outputs on an
asyncio.Queue, fed by one `loop.call_soon_threadsafe` per step (not one per token).

The engine thread runs scheduling, the model and detokenization, nothing that one request
could make long: tokenizing and chat templating run on a tokenizer thread of their own (the
Rust tokenizer lets go of the GIL), and the admission checks (context and cache room, a full
queue level) on the event loop, so a 1 MB prompt holds up no stream and a full queue is
refused at once, not at the next step boundary.

A watchdog on the event loop keeps the engine thread honest: a step running past
`step_timeout_s` fails the requests in flight (the engine is "stalled" until the step ends),
and a thread that dies fails them too and calls `on_dead` (the server then exits non-zero), as
does a model that fails to load (`load_error`): nothing could ever be served.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from batchserve.core.batch import RequestOutput, StepRecord
from batchserve.core.stats import EngineSnapshot
from batchserve.engine.client import EngineClient, EngineHealth, EngineStoppedError
from batchserve.engine.engine import LLMEngine, StepFailed, tokenize
from batchserve.engine.request_stream import RequestStream
from batchserve.request import FinishReason, OverloadedError, RequestError, RequestSpec

log = logging.getLogger(__name__)
T = TypeVar("T")
_IDLE_POLL_S = 0.002  # a policy may hold work back (a batching window): look again this soon


@dataclass(frozen=True)
class _Add:
    spec: RequestSpec  # prepared: token ids, final max_tokens
    future: asyncio.Future
    level: str


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future


_Command = _Add | _Abort | _Call


class AsyncEngine(EngineClient):
    """Runs an LLMEngine in a background thread; `add` returns a RequestStream.

    `source` is an engine or a factory that builds one (called on the engine thread, so a slow
    model load does not hold up the caller; `ready` turns True when it is done).
    `on_step` / `on_finish` are called on the engine thread after each model step and for each
    finished request; they must be quick and thread-safe (prometheus-client metrics are).
    `step_timeout_s` (0: none) bounds a model step (see the module docstring); `on_dead`, set
    by the caller, is called on the event loop if the engine thread dies.
    """

    def __init__(self, source: LLMEngine | Callable[[], LLMEngine], *,
                 on_step: Callable[[StepRecord], None] | None = None,
                 on_finish: Callable[[RequestOutput], None] | None = None, step_timeout_s: float = 0.0) -> None:
        self._source = source
        self.on_step = on_step
        self.on_finish = on_finish
        self.on_dead: Callable[[BaseException], None] | None = None
        self.step_timeout_s = step_timeout_s
        self.engine: LLMEngine | None = None
        self.load_error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # event-loop side only
        self._inbox: list[_Command] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._tokenizer = ThreadPoolExecutor(1, thread_name_prefix="batchserve-tokenize")
        self._posted: Counter[str] = Counter()  # adds in the inbox, by queue level (under _cond)
        self._retry_after: dict[str, float] = {}  # the queue's hint for each full level, after the last step
        self._step_started: float | None = None  # monotonic start of the running step, else None
        self._stalled_step: float | None = None  # the start of the last step the watchdog failed
        self._died: BaseException | None = None
        self._watchdog: asyncio.Task | None = None
        self._arrived = False  # an add was posted since the engine thread last looked (between_layers)
        self._interjecting = False  # the engine thread is inside _between_layers
        self.num_steps = 0  # model steps run (readable from any thread)
        self.stalls = 0  # steps that ran past step_timeout_s
        self.watchdog_failed = 0  # requests failed by the watchdog (a stall or a dead thread)

    # --- lifecycle ---------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread (and the watchdog); outputs are delivered on `loop` (default:
        the running one), which start must be called in."""
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="batchserve-engine", daemon=True)
        self._thread.start()
        if self.step_timeout_s > 0:
            self._watchdog = self._loop.create_task(self._watch())

    @property
    def ready(self) -> bool:
        """True once the model is loaded and the engine thread is serving."""
        return (self._ready.is_set() and not self._stopping and self._died is None and self._thread is not None
                and self._thread.is_alive())

    def health(self) -> EngineHealth:
        eng, started = self.engine, self._step_started
        running = time.monotonic() - started if started is not None else 0.0
        counts = dict(step_running_s=running, stalls=self.stalls, watchdog_failed=self.watchdog_failed,
                      failed_steps=eng.num_failed_steps if eng is not None else 0,
                      isolated_requests=eng.num_isolated_requests if eng is not None else 0)
        if self.load_error is not None:
            return EngineHealth("failed", error="the model failed to load (the server log has the cause)", **counts)
        if self._died is not None or (self._ready.is_set() and not self._stopping and not self.ready):
            return EngineHealth("dead", error="the engine thread died (the server log has the cause)", **counts)
        if 0 < self.step_timeout_s < running:
            return EngineHealth("stalled", error=f"a model step has run for {running:.1f} s", **counts)
        return EngineHealth("ok" if self.ready else "loading", **counts)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is left, stop the thread and wait for it (blocking)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._watchdog is not None:
            self._to_loop(self._watchdog.cancel)
        if self._thread is not None:
            self._thread.join(timeout)
        self._tokenizer.shutdown(wait=False, cancel_futures=True)

    @property
    def max_model_len(self) -> int:
        return self.engine.executor.max_model_len if self.engine is not None else 0

    def now(self) -> float:
        """The engine clock (monotonic seconds), readable from any thread."""
        return self.engine.clock.now() if self.engine is not None else time.monotonic()

    # --- the event-loop side -----------------------------------------------------------
    async def add(self, spec: RequestSpec) -> RequestStream:
        """Queue a request. Raises what `LLMEngine.add` raises (RequestError, OverloadedError),
        or EngineStoppedError. Tokenized on the tokenizer thread and checked here; only a
        request that fits and finds room in its queue level goes to the engine thread."""
        if not self.ready:
            raise EngineStoppedError("the model is not loaded yet" if not self._stopping else "shutting down")
        rid = spec.request_id
        assert rid is not None, "the caller names the request"
        loop = asyncio.get_running_loop()
        spec = await loop.run_in_executor(self._tokenizer, self.engine.prepare, spec)
        level = self._admit(spec)
        stream = RequestStream(rid)
        fut = loop.create_future()
        if not self._post(_Add(spec, fut, level.name)):
            raise EngineStoppedError("the engine thread died" if self._died is not None else "shutting down")
        self._streams[rid] = stream
        try:
            await fut
        except asyncio.CancelledError:
            self.abort(rid)  # the caller left while the add was in flight
            raise
        return stream

    async def add_many(self, specs: list[RequestSpec]) -> list[RequestStream]:
        """`add` for several requests at once: all are tokenized and checked first, then handed
        to the engine thread together, so that it takes them all before its next step (copies
        of one prompt must all be queued while the first computes it, or they would not share
        its prefill). A failure raises the first error, every request already taken aborted."""
        if not self.ready:
            raise EngineStoppedError("the model is not loaded yet" if not self._stopping else "shutting down")
        loop = asyncio.get_running_loop()
        prepared = [await loop.run_in_executor(self._tokenizer, self.engine.prepare, spec) for spec in specs]
        commands = [_Add(spec, loop.create_future(), self._admit(spec).name) for spec in prepared]
        streams = [RequestStream(spec.request_id) for spec in prepared]
        if not self._post(*commands):
            raise EngineStoppedError("the engine thread died" if self._died is not None else "shutting down")
        for stream in streams:
            self._streams[stream.request_id] = stream
        try:
            results = await asyncio.gather(*(c.future for c in commands), return_exceptions=True)
        except asyncio.CancelledError:
            for stream in streams:
                self.abort(stream.request_id)  # the caller left while the adds were in flight
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for stream, r in zip(streams, results):
                if not isinstance(r, BaseException):
                    self.abort(stream.request_id)
            raise errors[0]
        return streams

    async def tokenize(self, prompt: str | None = None, messages: list[dict] | None = None,
                       add_generation_prompt: bool = True) -> list[int]:
        """On the tokenizer thread, like `add`: a long prompt never holds up a model step."""
        eng = self._serving()
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizer, tokenize, eng.tokenizer, prompt, messages, add_generation_prompt)

    async def detokenize(self, ids: list[int]) -> str:
        eng = self._serving()
        vocab = getattr(getattr(eng.executor, "cfg", None), "vocab_size", None)
        if any(t < 0 or (vocab is not None and t >= vocab) for t in ids):
            raise RequestError("tokens", f"token ids must be in [0, {vocab if vocab is not None else 'vocab'})")
        if eng.tokenizer is None:
            raise RequestError("tokens", "this model has no tokenizer")

        def decode() -> str:
            try:
                return eng.tokenizer.decode(ids, skip_special_tokens=False)
            except Exception as e:  # noqa: BLE001 - an id the tokenizer does not know
                raise RequestError("tokens", f"cannot be decoded ({type(e).__name__})") from None
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer, decode)

    @property
    def text_tokenizer(self):
        return self.engine.tokenizer if self.engine is not None else None

    def _serving(self) -> LLMEngine:
        if not self.ready:
            raise EngineStoppedError("the model is not loaded yet" if not self._stopping else "shutting down")
        return self.engine

    def _admit(self, spec: RequestSpec):
        """The request's queue level; OverloadedError at once when that level refuses and is
        full: its queued requests plus the adds in the inbox. The queue's per-level counts are
        the one piece of engine state read here: ints under fixed keys, safe to read from any
        thread. The engine thread still checks exactly when it takes the request."""
        queue = self.engine.scheduler.waiting
        level = queue.levels[next(lv.name for lv in queue.config.levels if spec.priority in lv.priorities)]
        if level.capacity is None or level.overflow != "reject":
            return level
        with self._cond:
            n = queue.lengths_by_level().get(level.name, 0) + self._posted[level.name]
            hint = self._retry_after.get(level.name, queue.config.retry_after_s)
        if n >= level.capacity:
            raise OverloadedError(f"queue level {level.name!r} is full ({level.capacity} requests waiting); "
                                  "retry later", retry_after_s=hint, level=level.name)
        return level

    def abort(self, request_id: str) -> None:
        """End a request now (client gone); its blocks are freed before the next step."""
        self._post(_Abort(request_id))

    def abort_all(self) -> None:
        """Abort every request this engine is answering (end of a shutdown grace period)."""
        for rid in list(self._streams):
            self.abort(rid)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps (consistent reads of its state)."""
        fut = asyncio.get_running_loop().create_future()
        self._post(_Call(fn, fut))
        return await fut

    async def snapshot(self) -> EngineSnapshot:
        return await self.call(LLMEngine.snapshot)

    def _post(self, *commands: _Command) -> bool:
        """Hand commands to the engine thread under one lock, so that it drains them together;
        False (no add taken) once it has stopped taking adds (shutting down, or dead), so that
        no add waits for a thread that is gone."""
        with self._cond:
            adds = [c for c in commands if isinstance(c, _Add)]
            if adds and (self._stopping or self._died is not None):
                return False
            for command in adds:
                self._posted[command.level] += 1
            if adds:
                self._arrived = True
            self._inbox.extend(commands)
            self._cond.notify()
        return True

    def _fail_streams(self, error: str) -> None:
        """End every request being answered with finish reason "error" (event loop side: the
        engine thread may be stuck); each is aborted in the engine when it takes commands again."""
        streams, self._streams = self._streams, {}
        for rid, stream in streams.items():
            stream.put(RequestOutput(rid, [], [], [], True, FinishReason.ERROR, error=error))
            self._post(_Abort(rid))
        self.watchdog_failed += len(streams)

    async def _watch(self) -> None:
        period = min(1.0, self.step_timeout_s / 4)
        while not self._stopping:
            await asyncio.sleep(period)
            self.check_stall()

    def check_stall(self) -> bool:
        """If the running step is past `step_timeout_s` and not yet reported: fail the requests
        in flight and count a stall. True if it did."""
        started = self._step_started
        if started is None or started == self._stalled_step or time.monotonic() - started <= self.step_timeout_s:
            return False
        self._stalled_step = started
        self.stalls += 1
        log.error("engine stalled: a model step has run past %.1f s; failing the %d requests in flight",
                  self.step_timeout_s, len(self._streams))
        self._fail_streams(f"the engine stalled (a model step ran past {self.step_timeout_s:g} s)")
        return True

    def _on_death(self, error: BaseException) -> None:
        self._fail_streams("the engine thread died; this server is going down")
        if self.on_dead is not None:
            self.on_dead(error)

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
            self.engine = engine
        except BaseException as e:  # noqa: BLE001 - reported through /health and the log
            log.exception("engine failed to start")
            self.load_error = e
            self._fail_inbox(EngineStoppedError(f"engine failed to start: {e}"))
            self._to_loop(self._on_death, e)  # nothing can ever be served: let the server stop
            return
        if engine.config.scheduler.interject and hasattr(engine.executor, "between_layers"):
            engine.executor.between_layers = lambda: self._between_layers(engine)
        self._ready.set()
        try:
            self._serve(engine)
        except BaseException as e:  # noqa: BLE001 - the thread must not end unnoticed
            with self._cond:  # from here on no add is posted (see _post)
                self._died = e
            log.critical("the engine thread died", exc_info=e)
            self._fail_inbox(EngineStoppedError("the engine thread died"))
            self._to_loop(self._on_death, e)

    def _serve(self, engine: LLMEngine) -> None:
        while True:
            with self._cond:
                if not self._inbox and not self._stopping and not engine.has_unfinished:
                    self._cond.wait()
                inbox, self._inbox, self._arrived = self._inbox, [], False
                self._posted.subtract(c.level for c in inbox if isinstance(c, _Add))
                stopping = self._stopping
            for command in inbox:
                self._handle(engine, command)
            if stopping:
                self._stop(engine)
                return
            ran = False
            if engine.has_unfinished:
                self._step_started = time.monotonic()
                try:
                    ran = self._step(engine)
                finally:
                    self._step_started = None
            if ran:
                self._publish_hints(engine)
            if engine.has_unfinished and not ran:
                with self._cond:  # nothing ran (e.g. a window is open): don't spin
                    if not self._inbox and not self._stopping:
                        self._cond.wait(_IDLE_POLL_S)

    def _between_layers(self, engine: LLMEngine) -> float:
        """The model runner's pause between two layers of a step: when adds were posted since
        the engine thread last looked, take them in now and let the engine run a step for one
        of them before the paused one goes on (LLMEngine.interject). Other commands wait for
        the step's end. Returns the seconds spent (0 for the usual flag test)."""
        if not self._arrived or self._interjecting:
            return 0.0
        t0 = time.perf_counter()
        self._interjecting = True
        try:
            with self._cond:
                adds = [c for c in self._inbox if isinstance(c, _Add)]
                self._inbox = [c for c in self._inbox if not isinstance(c, _Add)]
                self._posted.subtract(c.level for c in adds)
                self._arrived = False
            for command in adds:
                self._handle(engine, command)
            self._step(engine, interject=True)
        finally:
            self._interjecting = False
        return time.perf_counter() - t0

    def _publish_hints(self, engine: LLMEngine) -> None:
        """The queue's Retry-After hint for each full level, for refusals on the event loop."""
        queue = engine.scheduler.waiting
        counts = queue.lengths_by_level()
        hints = {lv.name: queue.retry_after(lv.name) for lv in queue.config.levels
                 if lv.capacity is not None and counts.get(lv.name, 0) >= lv.capacity}
        if hints or self._retry_after:
            with self._cond:
                self._retry_after = hints

    def _handle(self, engine: LLMEngine, command: _Command) -> None:
        if isinstance(command, _Abort):
            engine.abort(command.request_id)
        elif isinstance(command, _Call):
            try:
                self._resolve(command.future, command.fn(engine))
            except Exception as e:  # noqa: BLE001 - handed to the caller
                self._resolve(command.future, error=e)
        else:
            try:
                engine.add(command.spec, prepared=True)
            except Exception as e:  # noqa: BLE001 - RequestError / OverloadedError go to the caller
                self._resolve(command.future, error=e, request_id=command.spec.request_id)
                return
            self._resolve(command.future, command.spec.request_id)

    def _step(self, engine: LLMEngine, interject: bool = False) -> bool:
        """One engine step (with `interject`, the one LLMEngine.interject may run inside the
        step running now); True if the model ran (or tried to)."""
        try:
            step = engine.interject() if interject else engine.step()
            if step is None:
                return False
        except StepFailed as e:  # failed outside the model (the executor's faults are isolated)
            log.exception("engine step failed outside the model; failing requests %s", e.request_ids)
            engine.fail(e.request_ids, "the engine step failed (the server log has the cause)")
            return True
        except Exception:  # noqa: BLE001 - failed outside the model: end what it may have touched
            if interject:  # before any step ran: the paused step still writes its requests' blocks, so
                log.exception("choosing a step to interject failed; requests wait for the running step's end")
                return False  # none is freed now; what was admitted runs in the next step as usual
            sched = engine.scheduler
            rids = [r.request_id for r in sched.running] or list(sched.requests)
            log.exception("engine step failed; failing requests %s", rids)
            engine.fail(rids, "the engine step failed (the server log has the cause)")
            return True
        if step.ran is not None:
            self.num_steps += 1
            if self.on_step is not None:
                self._notify(self.on_step, step.ran)
        self._emit(step.outputs)
        return step.ran is not None or bool(step.outputs)

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

    def _stop(self, engine: LLMEngine) -> None:
        for rid in list(engine.scheduler.requests):
            engine.abort(rid)
        for _ in range(3):  # drain the final outputs (a policy may hold some back for a step)
            if not engine.has_unfinished:
                break
            try:
                self._emit(engine.step().outputs)
            except Exception:  # noqa: BLE001 - shutting down anyway
                log.exception("engine step failed during shutdown")
                break
        self._fail_inbox(EngineStoppedError("shutting down"))

    def _fail_inbox(self, error: Exception) -> None:
        with self._cond:
            inbox, self._inbox = self._inbox, []
        for command in inbox:
            if isinstance(command, _Add):
                self._resolve(command.future, error=error, request_id=command.spec.request_id)
            elif isinstance(command, _Call):
                self._resolve(command.future, error=error)
