"""RequestStream: one request's outputs as the event loop sees them (see async_engine.py)."""
from __future__ import annotations

import asyncio
import dataclasses

from batchserve.core.batch import RequestOutput, RunningOutput


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one (the later state, both deltas)."""
    if isinstance(b, RunningOutput):
        b = b.plain()
    lp = None if b.new_logprobs is None else (a.new_logprobs or []) + b.new_logprobs
    return dataclasses.replace(b, new_text=a.new_text + b.new_text, new_token_ids=a.new_token_ids + b.new_token_ids,
                               new_logprobs=lp)


class RequestStream:
    """One request's outputs, on the event loop. Outputs that pile up between reads are
    merged, so a slow reader costs one chunk per read, not one per token.

    A list and one future for the reader, not an asyncio.Queue: the engine delivers an output
    per running request per step, so a put here is a list append and at most one future set,
    without a Queue's per-item getter and unfinished-task bookkeeping.

    `seen` is set by the reader once output has gone to the client (a stream's first chunk; a
    whole answer only at its end): until then the request may be started over elsewhere
    (`restart`) without the client noticing."""

    __slots__ = ("request_id", "finished", "seen", "_pending", "_waiter", "_epoch")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.finished = False
        self.seen = False
        self._pending: list[RequestOutput] = []
        self._waiter: asyncio.Future | None = None
        self._epoch = 0

    def restart(self) -> None:
        """Forget every output so far: the request runs again from its prompt (its engine died
        before the client saw anything). A `collect` under way starts its answer over."""
        assert not self.seen, "the client has seen output: it cannot be taken back"
        self._pending = []
        self._epoch += 1

    def put(self, out: RequestOutput) -> None:
        self._pending.append(out)
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():  # a reader that was cancelled has left its future cancelled
                w.set_result(None)

    async def next(self) -> RequestOutput:
        """The next output (everything new since the last call)."""
        while not self._pending:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        pending, self._pending = self._pending, []
        out = pending[0]
        for later in pending[1:]:
            out = merge_outputs(out, later)
        self.finished = out.finished
        return out

    async def collect(self) -> RequestOutput:
        """Wait for the end; the final output with all text and tokens."""
        out = await self.next()
        epoch = self._epoch
        while not out.finished:
            more = await self.next()
            out = more if self._epoch != epoch else merge_outputs(out, more)
            epoch = self._epoch
        return out
