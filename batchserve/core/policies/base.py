"""Policy: the part of scheduling that differs between batching modes."""
from __future__ import annotations

from typing import TYPE_CHECKING

from batchserve.config import SchedulerConfig
from batchserve.core.batch import ScheduledBatch, StepOutput
from batchserve.request import Request

if TYPE_CHECKING:
    from batchserve.core.scheduler import Scheduler


class Policy:
    """Decides who runs in the next step and with how many tokens. Subclasses override
    `schedule`, and the hooks when they keep state of their own.

    `window_ms` and `max_batch` are the policy's current collection window and batch cap
    (metrics read them; adaptive policies change them as they run).
    """

    name = "base"
    # whether a waiting request may preempt a running one it outranks (Scheduler.priority_victim):
    # the token-level policies, where a request can leave and rejoin the batch at any step
    preemptive = False

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.window_ms: float = 0.0
        self.max_batch: int = self.config.max_num_seqs
        self.padding_tokens = 0  # running total of virtual padding (request-level policies)

    def schedule(self, sched: "Scheduler", now: float) -> ScheduledBatch:
        raise NotImplementedError

    def on_add(self, sched: "Scheduler", req: Request, now: float) -> None:
        """A request entered the waiting queue."""

    def on_update(self, sched: "Scheduler", batch: ScheduledBatch, output: StepOutput, now: float) -> None:
        """A step's results were applied."""

    def release(self, sched: "Scheduler", finished: list[Request], now: float) -> list[Request]:
        """Of the requests that just finished, those whose results the engine returns now.
        A request held back is offered again on a later call (with an empty `finished` list
        if need be) and must be released once nothing it waits for is unfinished."""
        return finished

    def next_step_due(self, sched: "Scheduler", now: float) -> float | None:
        """After a step that scheduled nothing at `now`: the earliest time a step could run
        something if no new request arrives (e.g. a collection window closing). Early is
        harmless (the loop asks again), late delays work. None: the policy cannot tell, and
        the loop polls. Read by `LLMEngine.next_step_due` (the simulator jumps to it)."""
        return None
