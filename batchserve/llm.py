"""Offline API: `LLM(model=...).generate(prompts, params)`."""
from __future__ import annotations

import dataclasses
from typing import Sequence

from batchserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from batchserve.core.batch import RequestOutput
from batchserve.engine.engine import LLMEngine
from batchserve.request import DEFAULT_PRIORITY, SamplingParams


class LLM:
    """Load a model once, then run batches of prompts through the continuous-batching engine.

    Keyword arguments are config fields (model, dtype, device, policy, max_num_seqs,
    kv_cache_gb, block_size, ...), or pass a whole `config=EngineConfig(...)`.
    """

    def __init__(self, model: str | None = None, config: EngineConfig | None = None, **kwargs) -> None:
        cfg = config or EngineConfig()
        if model is not None:
            kwargs["model"] = model
        parts = {}
        for name, cls in (("model", ModelConfig), ("cache", CacheConfig), ("scheduler", SchedulerConfig)):
            fields = {f.name for f in dataclasses.fields(cls)}
            mine = {k: kwargs.pop(k) for k in list(kwargs) if k in fields}
            parts[name] = dataclasses.replace(getattr(cfg, name), **mine)
        if kwargs:
            raise TypeError(f"LLM: unknown options {sorted(kwargs)}")
        self.config = dataclasses.replace(cfg, **parts)  # keeps the queue config
        self.engine = LLMEngine.from_config(self.config)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priorities: Sequence[int] | None = None) -> list[RequestOutput]:
        """One output per prompt, in order. A prompt is text or a list of token ids."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run([{"prompt": p} for p in prompts], params, priorities)

    def chat(self, conversations: list[dict] | Sequence[list[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Like generate, with the model's chat template applied to each message list."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self._run([{"prompt": None, "messages": m} for m in conversations], params, None)

    def prompt_logprobs(self, prompt: str | list[int]) -> list[float]:
        """log P(token i | the tokens before it) for every token of `prompt` (text, tokenized
        without special tokens, or token ids) after the first, under this engine's model and
        numerics: what perplexity is computed from. The prompt must fit the model's context and
        the KV cache. Between `generate` calls only: the engine must have no request in flight,
        since the scoring borrows free KV blocks outside the scheduler."""
        score = getattr(self.engine.executor, "prompt_logprobs", None)
        if score is None:  # e.g. the cascade policy's two worker processes
            raise RuntimeError(f"prompt_logprobs: {type(self.engine.executor).__name__} cannot score a prompt")
        ids = self.engine.tokenize(prompt)
        if self.engine.has_unfinished:
            raise RuntimeError("prompt_logprobs: the engine has requests in flight")
        kv, rid = self.engine.kv, "prompt_logprobs"
        if not kv.allocate(rid, len(ids)):
            raise ValueError(f"prompt_logprobs: {len(ids)} tokens need {kv.blocks_for(len(ids))} KV blocks, "
                             f"{kv.num_free_blocks} are free")
        try:
            return score(ids, kv.block_table(rid)).tolist()
        finally:
            kv.free(rid)

    def _run(self, items: list[dict], params, priorities) -> list[RequestOutput]:
        n = len(items)
        if params is None:
            params = SamplingParams()
        plist = [params] * n if isinstance(params, SamplingParams) else list(params)
        if len(plist) != n:
            raise ValueError(f"params: got {len(plist)} for {n} prompts")
        ids = []
        for i, (item, p) in enumerate(zip(items, plist)):
            prio = priorities[i] if priorities is not None else DEFAULT_PRIORITY
            ids.append(self.engine.add_request(params=p, priority=prio, **item).request_id)
        done: dict[str, RequestOutput] = {}
        while len(done) < n:
            for out in self.engine.step().outputs:
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]
