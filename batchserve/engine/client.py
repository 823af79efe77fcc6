"""EngineClient: what the HTTP server needs of an engine, whether it runs on a thread of this
process (`AsyncEngine`) or as replicas elsewhere (`distributed.RayEngineClient`).

All methods are called from the event loop; `start` is called once, inside it.
"""
from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass
from typing import Callable

from batchserve.core.batch import RequestOutput, StepRecord
from batchserve.core.stats import EngineSnapshot
from batchserve.engine.request_stream import RequestStream
from batchserve.request import RequestSpec


class EngineStoppedError(RuntimeError):
    """The engine is not running (still loading, failed to load, or shut down)."""


@dataclass(frozen=True)
class EngineHealth:
    """An engine's liveness, for /health and /metrics. `state`: loading, ok, failed (did not
    load), stalled (a model step has run past its bound; it may still come back) or dead (the
    engine thread ended unasked: nothing will be served again). `step_running_s` is how long
    the current step has run (0 between steps); the counters are totals since start."""

    state: str
    step_running_s: float = 0.0
    stalls: int = 0
    failed_steps: int = 0
    isolated_requests: int = 0
    watchdog_failed: int = 0
    error: str | None = None

    @property
    def live(self) -> bool:
        """Worth keeping: false only when serving cannot resume (stalled, dead, failed to load)."""
        return self.state in ("loading", "ok")


class EngineClient(abc.ABC):
    """An engine as the server sees it.

    `load_error` is the exception that stopped the engine from starting (None otherwise);
    `ready` is True once it serves. `on_step` / `on_finish` (set by `attach`) are called for each
    model step and each finished request; they must be quick and thread-safe."""

    load_error: BaseException | None = None
    on_dead: Callable[[BaseException], None] | None = None  # called on the loop if the engine dies
    on_step: Callable[[StepRecord], None] | None = None
    on_finish: Callable[[RequestOutput], None] | None = None

    def attach(self, on_step: Callable[[StepRecord], None] | None,
               on_finish: Callable[[RequestOutput], None] | None) -> None:
        """The server's metric callbacks."""
        self.on_step, self.on_finish = on_step, on_finish

    def token_text(self, token_id: int) -> str:
        """One token's text, as logprobs report it (decoded alone; cached per token id)."""
        cache = self.__dict__.setdefault("_token_texts", {})
        t = cache.get(token_id)
        if t is None:
            tok = self.text_tokenizer
            try:
                t = tok.decode([token_id], skip_special_tokens=False) if tok is not None else str(token_id)
            except Exception:  # noqa: BLE001 - an id the tokenizer does not know
                t = ""
            if len(cache) < 1 << 20:
                cache[token_id] = t
        return t

    @property
    def text_tokenizer(self):
        """The tokenizer token_text decodes with (None: token ids are shown as numbers)."""
        return None

    @abc.abstractmethod
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start serving; outputs are delivered on `loop` (default: the running one)."""

    @abc.abstractmethod
    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is left and stop (blocking)."""

    @property
    @abc.abstractmethod
    def ready(self) -> bool: ...

    @property
    @abc.abstractmethod
    def max_model_len(self) -> int: ...

    @abc.abstractmethod
    def now(self) -> float:
        """The engine clock (monotonic seconds): the time base of `RequestSpec.arrival_time`."""

    @abc.abstractmethod
    async def add(self, spec: RequestSpec) -> RequestStream:
        """Queue a request (`spec.request_id` set). Raises RequestError, OverloadedError or
        EngineStoppedError."""

    async def add_many(self, specs: list[RequestSpec]) -> list[RequestStream]:
        """Queue several requests (copies of one prompt among them), raising the first error
        with every one already queued aborted. An engine that can take them all before its next
        step should (AsyncEngine does): the copies of a prompt then share its prefill."""
        streams: list[RequestStream] = []
        try:
            for spec in specs:
                streams.append(await self.add(spec))
        except BaseException:
            for s in streams:
                self.abort(s.request_id)
            raise
        return streams

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """End a request now (the client left)."""

    @abc.abstractmethod
    def abort_all(self) -> None:
        """Abort every request being answered (the end of a shutdown grace period)."""

    @abc.abstractmethod
    async def snapshot(self) -> EngineSnapshot:
        """Engine state for the /metrics gauges."""

    async def tokenize(self, prompt: str | None = None, messages: list[dict] | None = None,
                       add_generation_prompt: bool = True) -> list[int]:
        """A text prompt, or chat messages through the chat template, as the model's token ids,
        tokenized off the engine thread. Raises RequestError naming the field at fault, or
        EngineStoppedError; NotImplementedError where a client cannot tokenize locally."""
        raise NotImplementedError

    async def detokenize(self, ids: list[int]) -> str:
        """Token ids as text; RequestError ("tokens") for an id outside the vocabulary."""
        raise NotImplementedError

    def health(self) -> EngineHealth:
        """Liveness as /health reports it (a client without a watchdog: loaded or not)."""
        if self.load_error is not None:
            return EngineHealth("failed", error=str(self.load_error))
        return EngineHealth("ok" if self.ready else "loading")

    def metrics_text(self) -> str:
        """Prometheus text of metrics of the client's own, appended to /metrics."""
        return ""
