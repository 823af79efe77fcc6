"""Deadline rules: what to do with a request whose deadline is near or gone. They decide; the
scheduler applies (`Scheduler.apply`), so no rule edits a queue, the running set or the KV pool.

Hard: a request ends with finish reason `deadline` as soon as it has missed its deadline or
the latency model predicts it cannot make it (now + predicted service >= deadline), whether
it is queued or running; its blocks are freed at once, and it is never scheduled after its
deadline. A step that ends past the deadline does not count: the request fails there.
Soft: a running request whose predicted finish passes the deadline has its effective
`max_tokens` lowered to what fits, so it ends near the deadline with finish reason
`deadline_truncated` and the text so far; it always gets at least one token.

Predictions assume a request runs to its max_tokens, and they are 0.0 until the latency
model has seen enough steps, so until then only deadlines actually passed end requests.
All times are passed in.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from batchserve.config import SchedulerConfig
from batchserve.core.latency import LatencyModel, service_time, tokens_within
from batchserve.core.queue import AdmissionQueue
from batchserve.request import Request, RequestStatus


@dataclass(frozen=True)
class Miss:
    """End `req` as a missed hard deadline, with `error` saying why."""

    req: Request
    error: str


@dataclass(frozen=True)
class Truncate:
    """Lower a soft-deadline request's effective max_tokens to `max_tokens` (None: keep it);
    `finish`: it already has them, so it ends now."""

    req: Request
    max_tokens: int | None
    finish: bool


Decision = Miss | Truncate


def _miss(req: Request, now: float, predicted: float) -> Miss:
    assert req.deadline is not None
    if now >= req.deadline:
        return Miss(req, f"hard deadline of {req.deadline_ms:g} ms missed "
                         f"({1000 * (now - req.arrival_time):.0f} ms since arrival)")
    return Miss(req, f"cannot finish within its hard deadline of {req.deadline_ms:g} ms: "
                     f"{1000 * predicted:.0f} ms predicted, {1000 * (req.deadline - now):.0f} ms left")


class DeadlineRules:
    """The deadline decisions of one scheduler, from its latency model and config.

    `prediction_floor` is the lowest step prediction the queue's deadline look-at times rest
    on (see `_watch_predictions`)."""

    def __init__(self, config: SchedulerConfig, latency: LatencyModel) -> None:
        self.config = config
        self.latency = latency
        self.prediction_floor = 0.0

    def service(self, req: Request, num_running: int, joining: bool = False) -> float:
        """Seconds `req` still needs if it ran from now beside `num_running` others (plus
        itself, when `joining` from the queue), to its max_tokens."""
        cfg = self.config
        batch = min(cfg.max_num_seqs, num_running + (1 if joining else 0))
        return service_time(self.latency, req.num_tokens - req.num_computed_tokens,
                            req.max_tokens - req.num_output_tokens, batch, cfg.max_num_batched_tokens)

    def at_admission(self, req: Request, num_running: int, now: float) -> Miss | None:
        """A new hard-deadline request that cannot make it."""
        if not req.hard_deadline:
            return None
        s = self.service(req, num_running, joining=True)
        return None if now + s < req.deadline else _miss(req, now, s)

    def before_step(self, waiting: AdmissionQueue, running: list[Request], now: float) -> Iterator[Decision]:
        """Queued and running hard-deadline requests that cannot make it; soft-deadline running
        requests cut to what fits. A generator: each decision is applied before the next is
        made, so later predictions see the running set the earlier ones left."""
        self._watch_predictions(waiting, len(running))
        for req in waiting.refresh(now, lambda r: self.service(r, len(running), joining=True)):
            yield _miss(req, now, self.service(req, len(running), joining=True))
        for req in [r for r in running if r.deadline_ms is not None]:
            s = self.service(req, len(running))
            if req.hard_deadline:
                if now + s >= req.deadline:
                    yield _miss(req, now, s)
            elif now + s > req.deadline:
                yield self._truncate(req, len(running), now)

    def after_step(self, req: Request, end: float) -> Miss | None:
        """A hard-deadline request whose step ended after its deadline: its result is too late."""
        if req.hard_deadline and end > req.deadline:  # type: ignore[operator]
            return _miss(req, end, 0.0)
        return None

    def _watch_predictions(self, waiting: AdmissionQueue, num_running: int) -> None:
        """The queue looks at each deadline again at a time computed from the prediction of
        then; when predictions have grown by a quarter since the lowest one in use (the model
        became ready, or steps got slower), those times may be late, so look at all again.
        With no deadline in the queue there is nothing to look at again: no prediction is made
        (it would refit the latency model every step for nothing). The floor kept from before only
        makes the first look after new deadlines arrive a full one, which is safe."""
        if not waiting.has_deadline_checks:
            return
        b = min(self.config.max_num_seqs, num_running + 1)
        probe = self.latency.predict_step(b, b)
        low = self.prediction_floor
        if probe > 1.25 * low:
            waiting.recheck_all()
            self.prediction_floor = probe
        else:
            self.prediction_floor = min(low, probe)

    def _truncate(self, req: Request, num_running: int, now: float) -> Truncate:
        """The tokens that fit before the deadline (at least one in all)."""
        assert req.deadline is not None
        fit = tokens_within(self.latency, req.deadline - now, req.num_tokens - req.num_computed_tokens,
                            num_running, self.config.max_num_batched_tokens)
        if fit is None:
            return Truncate(req, None, False)
        cap = max(1, req.num_output_tokens + fit)
        new = cap if cap < req.max_tokens else None
        return Truncate(req, new, req.num_output_tokens >= (req.max_tokens if new is None else new))


def length_status(req: Request) -> RequestStatus:
    """The finish status of a request that reached its effective max_tokens."""
    return RequestStatus.FINISHED_TRUNCATED if req.max_tokens < req.params.max_tokens \
        else RequestStatus.FINISHED_LENGTH
