"""Shared fixtures. Every engine a test builds through these fixtures is checked for leaked
KV blocks when the test ends: every request must be finished and every block back."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest

from batchserve.config import CacheConfig, EngineConfig, QueueConfig, SchedulerConfig
from batchserve.core.batch import ScheduledBatch, StepOutput, TokenLogprob
from batchserve.engine.clock import SimClock
from batchserve.engine.engine import LLMEngine

_ENGINES: list[LLMEngine] = []  # built for one test
_SESSION_ENGINES: list[LLMEngine] = []  # shared, checked after every test


class FakeExecutor:
    """Stands in for the model: token = (request's position + 1) % 1000, fixed step time."""

    def __init__(self, num_blocks: int = 64, step_time: float = 0.01, max_model_len: int = 4096) -> None:
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.step_time = step_time
        self.batches: list[ScheduledBatch] = []

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        self.batches.append(batch)
        sampled = {s.request_id: _token(s) for s in batch.seqs if s.sample}
        lp = {s.request_id: _logprob(sampled[s.request_id], s.params.logprobs) for s in batch.seqs
              if s.sample and s.params.logprobs is not None}
        scores = {s.request_id: [_logprob(t, s.params.prompt_logprobs) for t in s.prompt_targets]
                  for s in batch.seqs if s.prompt_targets}
        return StepOutput(sampled, self.step_time, lp or None, scores or None)


def _logprob(tok: int, n: int) -> TokenLogprob:
    """The fake model's certainty: log(1/2) for its token, then log(1/4), log(1/8)... for the next ids."""
    top = ((tok, -math.log(2)), *((tok + i, -(i + 1) * math.log(2)) for i in range(1, n)))[:n]
    return TokenLogprob(tok, -math.log(2), top)


def _token(s) -> int:
    """(position + 1) % 1000 + 3, or under a structured-output mask the first allowed token from
    there on (wrapping), as a sampler honouring the mask would."""
    t = (s.start_pos + s.num_tokens) % 1000 + 3
    if s.allowed is None:
        return t
    ok = np.flatnonzero(np.unpackbits(s.allowed.view(np.uint8), bitorder="little"))
    return int(ok[np.searchsorted(ok, t) % len(ok)]) if len(ok) else t


@pytest.fixture
def make_fake_engine():
    """Factory: an LLMEngine over a FakeExecutor (or the one given) and a SimClock."""

    def make(num_blocks: int = 64, block_size: int = 4, eos: int | None = None, queue: QueueConfig | None = None,
             executor: FakeExecutor | None = None, **sched) -> LLMEngine:
        cfg = EngineConfig(cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
                           scheduler=SchedulerConfig(**sched), queue=queue or QueueConfig())
        eng = LLMEngine(cfg, executor or FakeExecutor(num_blocks), eos_token_id=eos, clock=SimClock())
        _ENGINES.append(eng)
        return eng

    return make


@pytest.fixture(scope="session")
def llm():
    """The real default model (SmolLM2-135M-Instruct from the GGUF file), loaded once."""
    from batchserve.llm import LLM

    model = LLM(kv_cache_gb=0.25)
    _SESSION_ENGINES.append(model.engine)
    return model


@pytest.fixture(autouse=True)
def kv_leak_check():
    yield
    engines = _ENGINES + _SESSION_ENGINES
    _ENGINES.clear()  # one failing test must not fail every later one
    for eng in engines:
        assert not eng.scheduler.has_unfinished, "test left requests unfinished"
        eng.kv.check_all_free()


# --- test tiers (markers: pyproject.toml; targets: Makefile) ----------------------------------
# A test may load the real model only when marked `model`, and call runner/kernels.py (which
# compiles the C++ extensions on first use: minutes on a fresh machine) only when marked `kernel`
# or `model`; otherwise it fails loudly, so that `make test-fast` stays model- and build-free.
# While the test modules are imported, kernels.py answers None (no kernel here) without
# building when the -m expression leaves out the kernel tests: a module may ask at import which
# kernels exist (to parametrize), and only kernel tests depend on the answer. Processes that a
# test starts (a server, Ray actors) are out of sight here: such tests carry `http` / `ray`.
_KERNEL_OK = ("kernel", "model")
_tier = {"item": None, "collect_builds": True}  # the test being run; kernels at import time
_violations: dict[str, list[str]] = {}  # nodeid -> what it did that its markers do not allow


class TierViolation(Exception):
    """A test did something that its markers do not declare (see the note above)."""


def _allowed(item, markers: tuple[str, ...]) -> bool:
    return any(item.get_closest_marker(m) for m in markers)


def _violation(item, what: str, markers: tuple[str, ...]) -> TierViolation:
    msg = (f"{item.nodeid} {what} but is not marked {' or '.join(markers)}: add "
           f"`pytestmark = pytest.mark.{markers[0]}` (or mark the test) so that `make test-fast` leaves it out")
    _violations.setdefault(item.nodeid, []).append(msg)
    return TierViolation(msg)


def _kernels_selected(config) -> bool:
    """Whether the -m expression can select a test marked kernel (alone or with model)."""
    expr = config.getoption("markexpr", "")
    if not expr:
        return True
    try:
        from _pytest.mark.expression import Expression

        compiled = Expression.compile(expr)
        return any(compiled.evaluate(lambda name, _on=on, **kw: name in _on)
                   for on in ({"kernel"}, {"kernel", "model"}))
    except Exception:  # pytest's private API moved: build as before
        return True


def _install_tier_guards(config) -> None:
    from batchserve.runner import kernels, loader

    get, resolve = kernels._get, loader.resolve_model_path
    _tier["collect_builds"] = _kernels_selected(config)

    def guarded_get(name):
        item = _tier["item"]
        if item is None and not _tier["collect_builds"]:
            return None
        if item is not None and not _allowed(item, _KERNEL_OK):
            raise _violation(item, f"called runner/kernels.py for the {kernels.KERNELS[name][1]}", _KERNEL_OK)
        return get(name)

    def guarded_resolve(model):
        path = resolve(model)
        item = _tier["item"]
        real = model in loader._ALIASES or os.path.basename(path) == loader.SMOLLM2_FILE
        if real and item is not None and not _allowed(item, ("model",)):
            raise _violation(item, f"loaded the real model ({model})", ("model",))
        return path

    kernels._get, loader.resolve_model_path = guarded_get, guarded_resolve


def pytest_configure(config):
    _install_tier_guards(config)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _tier["item"] = item
    yield
    _tier["item"] = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A violation fails the test even where the code under test caught the TierViolation (or
    skipped because of it)."""
    outcome = yield
    rep = outcome.get_result()
    found = _violations.pop(item.nodeid, None)
    if found and not rep.failed:
        rep.outcome, rep.longrepr = "failed", "\n".join(dict.fromkeys(found))
