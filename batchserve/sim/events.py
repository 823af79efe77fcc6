"""Typed simulator events in a heap with a deterministic tie-break.

Events at the same instant run in kind order, then in the order they were pushed:

    STEP_END < ARRIVAL (and KV arrival) < STEP_START

so a step that ends at t has its results applied first, requests arriving at exactly t are
queued next, and a step starting at t sees both — the order the live engine's loop gives
(finish the step, drain the inbox, step again). The push counter makes every tie total, so a
run never depends on how Python compares payloads. Step events name the engine node they
belong to (`node`, 0 when there is one); arrivals are routed by the loop (sim/loop.py).
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Union


class Kind(IntEnum):
    STEP_END = 0
    ARRIVAL = 1
    STEP_START = 2


@dataclass(frozen=True)
class Arrival:
    """Workload item `index` reaches the server."""

    time: float
    index: int
    kind: Kind = field(default=Kind.ARRIVAL, init=False)


@dataclass(frozen=True)
class KVArrival:
    """Workload item `index`, prefilled elsewhere (first token `first_token` sampled, its K/V
    sent), reaches the decode side. An arrival in the tie order."""

    time: float
    index: int
    first_token: int
    kind: Kind = field(default=Kind.ARRIVAL, init=False)


@dataclass(frozen=True)
class StepStart:
    """Try a step on `node`. `generation` lets a newer wake-up supersede an older one still
    queued for the same node."""

    time: float
    generation: int
    node: int = 0
    kind: Kind = field(default=Kind.STEP_START, init=False)


@dataclass(frozen=True)
class StepEnd:
    """A step `node` started at `start` finishes; `outputs` are what the engine returned for it."""

    time: float
    start: float
    outputs: list[Any]
    node: int = 0
    kind: Kind = field(default=Kind.STEP_END, init=False)


Event = Union[Arrival, KVArrival, StepStart, StepEnd]


class EventQueue:
    """Min-heap of events keyed by (time, kind, push order)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Event]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, ev: Event) -> None:
        heapq.heappush(self._heap, (ev.time, int(ev.kind), next(self._seq), ev))

    def pop(self) -> Event:
        return heapq.heappop(self._heap)[3]

    def peek_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None
