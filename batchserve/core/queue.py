"""Waiting queue: ordered by the spec's comparator (S1.4) — higher priority first, then
earlier arrival. Heap with lazy deletion, so push/pop/remove are O(log n)."""
from __future__ import annotations

import heapq
import itertools

from batchserve.request import Request


class WaitQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._live: dict[str, Request] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def push(self, req: Request) -> None:
        if req.request_id in self._live:
            raise ValueError(f"request {req.request_id} already queued")
        self._live[req.request_id] = req
        heapq.heappush(self._heap, (-req.priority, req.arrival_time, next(self._seq), req))

    def _clean(self) -> None:
        heap = self._heap
        while heap and self._live.get(heap[0][3].request_id) is not heap[0][3]:
            heapq.heappop(heap)

    def peek(self) -> Request | None:
        self._clean()
        return self._heap[0][3] if self._heap else None

    def pop(self) -> Request:
        self._clean()
        req = heapq.heappop(self._heap)[3]
        del self._live[req.request_id]
        return req

    def remove(self, request_id: str) -> Request | None:
        """Take a request out wherever it is (abort, deadline); the heap entry dies lazily."""
        return self._live.pop(request_id, None)

    def __iter__(self):
        return iter(sorted(self._live.values(), key=lambda r: (-r.priority, r.arrival_time)))
