"""RequestStream: one request's outputs as the event loop sees them (see async_engine.py)."""
from __future__ import annotations

import asyncio
import dataclasses

from batchserve.core.batch import RequestOutput


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one (the later state, both deltas)."""
    return dataclasses.replace(b, new_text=a.new_text + b.new_text, new_token_ids=a.new_token_ids + b.new_token_ids)


class RequestStream:
    """One request's outputs, on the event loop. Outputs that pile up between reads are
    merged, so a slow reader costs one chunk per read, not one per token."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.finished = False
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    def put(self, out: RequestOutput) -> None:
        self._queue.put_nowait(out)

    async def next(self) -> RequestOutput:
        """The next output (everything new since the last call)."""
        out = await self._queue.get()
        while not self._queue.empty():
            out = merge_outputs(out, self._queue.get_nowait())
        self.finished = out.finished
        return out

    async def collect(self) -> RequestOutput:
        """Wait for the end; the final output with all text and tokens."""
        out = await self.next()
        while not out.finished:
            out = merge_outputs(out, await self.next())
        return out
