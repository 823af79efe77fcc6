"""AsyncEngine: the LLMEngine on a thread of its own, driven from asyncio (an EngineClient).

One engine thread owns the LLMEngine and everything under it (scheduler, queue, KV cache). The
event loop never touches that state: it posts typed commands (add, abort, call) into an inbox
that the engine thread drains between steps, and it receives each request's outputs on an
asyncio.Queue, fed by one `loop.call_soon_threadsafe` per step (not one per token).
Tokenization, scheduling, the model and detokenization all run on the engine thread, so the
event loop stays light.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from batchserve.core.batch import RequestOutput, StepRecord
from batchserve.core.stats import EngineSnapshot
from batchserve.engine.client import EngineClient, EngineStoppedError
from batchserve.engine.engine import LLMEngine, StepFailed
from batchserve.engine.request_stream import RequestStream
from batchserve.request import RequestSpec

log = logging.getLogger(__name__)
T = TypeVar("T")
_IDLE_POLL_S = 0.002  # a policy may hold work back (a batching window): look again this soon


@dataclass(frozen=True)
class _Add:
    spec: RequestSpec
    future: asyncio.Future


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
    """

    def __init__(self, source: LLMEngine | Callable[[], LLMEngine], *,
                 on_step: Callable[[StepRecord], None] | None = None,
                 on_finish: Callable[[RequestOutput], None] | None = None) -> None:
        self._source = source
        self.on_step = on_step
        self.on_finish = on_finish
        self.engine: LLMEngine | None = None
        self.load_error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # event-loop side only
        self._inbox: list[_Command] = []
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
    async def add(self, spec: RequestSpec) -> RequestStream:
        """Queue a request. Raises what `LLMEngine.add` raises (RequestError, OverloadedError),
        or EngineStoppedError."""
        if not self.ready:
            raise EngineStoppedError("the model is not loaded yet" if not self._stopping else "shutting down")
        rid = spec.request_id
        assert rid is not None, "the caller names the request"
        stream = RequestStream(rid)
        self._streams[rid] = stream
        fut = asyncio.get_running_loop().create_future()
        self._post(_Add(spec, fut))
        try:
            await fut
        except asyncio.CancelledError:
            self.abort(rid)  # the caller left while the add was in flight
            raise
        return stream

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

    def _post(self, command: _Command) -> None:
        with self._cond:
            self._inbox.append(command)
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
            for command in inbox:
                self._handle(engine, command)
            if stopping:
                self._stop(engine)
                return
            if engine.has_unfinished and not self._step(engine):
                with self._cond:  # nothing ran (e.g. a window is open): don't spin
                    if not self._inbox and not self._stopping:
                        self._cond.wait(_IDLE_POLL_S)

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
                engine.add(command.spec)
            except Exception as e:  # noqa: BLE001 - RequestError / OverloadedError go to the caller
                self._resolve(command.future, error=e, request_id=command.spec.request_id)
                return
            self._resolve(command.future, command.spec.request_id)

    def _step(self, engine: LLMEngine) -> bool:
        """One engine step; True if the model ran (or tried to)."""
        try:
            step = engine.step()
        except StepFailed as e:  # failed outside the model (the executor's faults are isolated)
            log.exception("engine step failed outside the model; failing requests %s", e.request_ids)
            engine.fail(e.request_ids, "the engine step failed (the server log has the cause)")
            return True
        except Exception:  # noqa: BLE001 - failed outside the model: end what it may have touched
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
