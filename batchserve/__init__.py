"""batchserve: an LLM inference server built around dynamic batching."""
from batchserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from batchserve.core.batch import RequestOutput
from batchserve.request import RequestError, SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":  # lazy: importing torch/transformers is slow and not needed by the core
        from batchserve.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "RequestError", "EngineConfig", "ModelConfig",
           "CacheConfig", "SchedulerConfig"]
