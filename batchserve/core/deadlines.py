"""Deadlines (S3.1, S3.2), checked by the scheduler at admission, before every step and
after every step; all with `now` passed in.

Hard: a request ends with finish reason `deadline` as soon as it has missed its deadline or
the latency model predicts it cannot make it (now + predicted service >= deadline), whether
it is queued or running; its blocks are freed at once, and it is never scheduled after its
deadline. A step that ends past the deadline does not count: the request fails there.
Soft: a running request whose predicted finish passes the deadline has its effective
`max_tokens` lowered to what fits, so it ends near the deadline with finish reason
`deadline_truncated` and the text so far; it always gets at least one token.

Predictions assume a request runs to its max_tokens, and they are 0.0 until the latency
model has seen enough steps, so until then only deadlines actually passed end requests.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from batchserve.core.latency import service_time, tokens_within
from batchserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from batchserve.core.scheduler import Scheduler


def predicted_service(sched: "Scheduler", req: Request, joining: bool = False) -> float:
    """Seconds `req` still needs if it ran from now in the current batch (plus itself, when
    `joining` from the queue), to its max_tokens."""
    batch = min(sched.config.max_num_seqs, len(sched.running) + (1 if joining else 0))
    return service_time(sched.latency, req.num_tokens - req.num_computed_tokens,
                        req.max_tokens - req.num_output_tokens, batch, sched.config.max_num_batched_tokens)


def _miss(sched: "Scheduler", req: Request, now: float, predicted: float) -> None:
    assert req.deadline is not None
    if now >= req.deadline:
        req.error = (f"hard deadline of {req.deadline_ms:g} ms missed "
                     f"({1000 * (now - req.arrival_time):.0f} ms since arrival)")
    else:
        req.error = (f"cannot finish within its hard deadline of {req.deadline_ms:g} ms: "
                     f"{1000 * predicted:.0f} ms predicted, {1000 * (req.deadline - now):.0f} ms left")
    sched.finish(req, RequestStatus.FINISHED_DEADLINE, now)


def doomed_at_admission(sched: "Scheduler", req: Request, now: float) -> bool:
    """End a new hard-deadline request that cannot make it (the caller has registered it)."""
    if not req.hard_deadline:
        return False
    s = predicted_service(sched, req, joining=True)
    if now + s < req.deadline:
        return False
    _miss(sched, req, now, s)
    return True


def check_deadlines(sched: "Scheduler", now: float) -> None:
    """Before a step: end queued and running hard-deadline requests that cannot make it;
    cut soft-deadline running requests to what fits."""
    _watch_predictions(sched)
    for req in sched.waiting.refresh(now, lambda r: predicted_service(sched, r, joining=True)):
        _miss(sched, req, now, predicted_service(sched, req, joining=True))
    for req in [r for r in sched.running if r.deadline_ms is not None]:
        s = predicted_service(sched, req)
        if req.hard_deadline:
            if now + s >= req.deadline:
                _miss(sched, req, now, s)
        elif now + s > req.deadline:
            truncate(sched, req, now)


def _watch_predictions(sched: "Scheduler") -> None:
    """The queue looks at each deadline again at a time computed from the prediction of
    then; when predictions have grown by a quarter since the lowest one in use (the model
    became ready, or steps got slower), those times may be late, so look at all again.
    With no deadline in the queue there is nothing to look at again: no prediction is made
    (it would refit the latency model every step for nothing). The floor kept from before only
    makes the first look after new deadlines arrive a full one, which is safe."""
    if not sched.waiting.has_deadline_checks:
        return
    b = min(sched.config.max_num_seqs, len(sched.running) + 1)
    probe = sched.latency.predict_step(b, b)
    low = sched.prediction_floor
    if probe > 1.25 * low:
        sched.waiting.recheck_all()
        sched.prediction_floor = probe
    else:
        sched.prediction_floor = min(low, probe)


def truncate(sched: "Scheduler", req: Request, now: float) -> None:
    """Lower a soft-deadline request's max_tokens to the tokens that fit before its deadline
    (at least one in all); end it now if it already has them."""
    assert req.deadline is not None
    fit = tokens_within(sched.latency, req.deadline - now, req.num_tokens - req.num_computed_tokens,
                        len(sched.running), sched.config.max_num_batched_tokens)
    if fit is None:
        return
    cap = max(1, req.num_output_tokens + fit)
    if cap < req.max_tokens:
        if req.max_tokens == req.params.max_tokens:
            sched.waiting.metrics.on_truncate()
        req.max_tokens = cap  # no `error`: a truncated reply is a success (HTTP 200)
    if req.num_output_tokens >= req.max_tokens:
        sched.finish(req, RequestStatus.FINISHED_TRUNCATED, now)


def missed_during_step(req: Request, end: float) -> bool:
    """A hard-deadline request whose step ended after its deadline: its result is too late."""
    return req.hard_deadline and end > req.deadline  # type: ignore[operator]


def end_hard_miss(sched: "Scheduler", req: Request, end: float) -> None:
    _miss(sched, req, end, 0.0)


def length_status(req: Request) -> RequestStatus:
    """The finish status of a request that reached its effective max_tokens."""
    return RequestStatus.FINISHED_TRUNCATED if req.max_tokens < req.params.max_tokens \
        else RequestStatus.FINISHED_LENGTH
