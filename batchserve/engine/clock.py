"""Clocks: the engine reads one; the core only ever receives `now`."""
from __future__ import annotations

import time


class WallClock:
    simulated = False

    def now(self) -> float:
        return time.monotonic()


class SimClock:
    """A virtual clock that only moves when told to (simulator, tests)."""

    simulated = True

    def __init__(self, start: float = 0.0) -> None:
        self._t = start

    def now(self) -> float:
        return self._t

    def advance(self, dt: float) -> None:
        if dt < 0:
            raise ValueError("time cannot go backwards")
        self._t += dt

    def set(self, t: float) -> None:
        if t < self._t:
            raise ValueError("time cannot go backwards")
        self._t = t
