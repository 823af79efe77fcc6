"""Shared fixtures. Every engine a test builds through these fixtures is checked for leaked
KV blocks when the test ends: every request must be finished and every block back."""
from __future__ import annotations

import pytest

from batchserve.config import CacheConfig, EngineConfig, QueueConfig, SchedulerConfig
from batchserve.core.batch import ScheduledBatch, StepOutput
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
        return StepOutput({s.request_id: (s.start_pos + s.num_tokens) % 1000 + 3 for s in batch.seqs if s.sample},
                          self.step_time)


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
