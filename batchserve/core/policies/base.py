"""Policy: the part of scheduling that differs between batching modes."""
from __future__ import annotations

from typing import TYPE_CHECKING

from batchserve.core.batch import ScheduledBatch, StepOutput
from batchserve.request import Request

if TYPE_CHECKING:
    from batchserve.core.scheduler import Scheduler


class Policy:
    """Decides who runs in the next step and with how many tokens. Subclasses override
    `schedule`, and the hooks when they keep state of their own."""

    name = "base"

    def schedule(self, sched: "Scheduler", now: float) -> ScheduledBatch:
        raise NotImplementedError

    def on_add(self, sched: "Scheduler", req: Request, now: float) -> None:
        """A request entered the waiting queue."""

    def on_update(self, sched: "Scheduler", batch: ScheduledBatch, output: StepOutput, now: float) -> None:
        """A step's results were applied."""
