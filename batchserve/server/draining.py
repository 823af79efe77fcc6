"""The uvicorn server `batchserve serve` runs: its first SIGTERM drains the app.

Apart from run.py so that `serve` can start loading the model before this (uvicorn and, through
the app, FastAPI) is imported.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn

from batchserve.server.app import ServerState

log = logging.getLogger("batchserve.server.run")  # the name serve's log lines have always had


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM drains the app before shutting down."""

    def __init__(self, config: uvicorn.Config, state: ServerState, grace_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.grace_s = grace_s
        self._drain_task: asyncio.Task | None = None
        state.on_fatal = self._fatal

    def _fatal(self) -> None:
        """The engine died: stop serving now (no drain: nothing could finish)."""
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        loop = self.state.loop
        if sig != signal.SIGTERM or self.state.draining or loop is None:
            super().handle_exit(sig, frame)
            return
        self.state.draining = True  # before anything else: no request is admitted from here on
        loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        await self.state.drain(self.grace_s)
        log.info("drained; shutting down")
        self.should_exit = True
