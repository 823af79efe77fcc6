"""The HTTP app around a model-free engine (the fake executor and a character tokenizer),
driven in-process through httpx's ASGI transport: no model, no socket, a test in well under
a second. Engines built here join the conftest leak check."""
from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import httpx
from conftest import _ENGINES, FakeExecutor

from batchserve.config import CacheConfig, EngineConfig, QueueConfig, SchedulerConfig
from batchserve.engine.engine import LLMEngine
from batchserve.server.app import ServerState, create_app
from batchserve.server.config import ServerConfig

MODEL = "fake"


class FakeTokenizer:
    """One token per character; refuses text that is not valid Unicode, as the real one does."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        text.encode("utf-8")  # a lone surrogate raises here
        return [ord(c) % 900 + 3 for c in text]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = True) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + t % 26) for t in ids)


def byte_tokenizer() -> Any:
    """A real Hugging Face fast tokenizer, model-free: one token per byte (ids 0-255, GPT-2's
    byte-to-character table), "<eos>" = 256, and a plain chat template. What structured outputs
    need (they read the tokenizer's vocabulary), in milliseconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    keep = {*range(33, 127), *range(161, 173), *range(174, 256)}
    extra = iter(range(256, 512))
    vocab = {(chr(b) if b in keep else chr(next(extra))): b for b in range(256)}
    vocab["<eos>"] = 256
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens(["<eos>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>")
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    return tok


def fake_engine(executor: FakeExecutor | None = None, num_blocks: int = 256, queue: QueueConfig | None = None,
                tokenizer: Any = None, check_leaks: bool = True, **sched: Any) -> LLMEngine:
    """An engine on the wall clock over `executor` (default: a FakeExecutor), with a tokenizer;
    checked for leaks at the end of the test unless `check_leaks` is False."""
    cfg = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=num_blocks), scheduler=SchedulerConfig(**sched),
                       queue=queue or QueueConfig())
    eng = LLMEngine(cfg, executor or FakeExecutor(num_blocks), tokenizer or FakeTokenizer())
    if check_leaks:
        _ENGINES.append(eng)
    return eng


@asynccontextmanager
async def serve_app(engine: Any, config: ServerConfig | None = None,
                    ready: bool = True) -> AsyncIterator[tuple[httpx.AsyncClient, ServerState]]:
    """The app's lifespan around `engine`, and a client on it (base URL http://127.0.0.1);
    with `ready`, returns once /health says 200."""
    import asyncio

    app = create_app(engine, config or ServerConfig(), MODEL)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False), base_url="http://127.0.0.1",
                                     timeout=10) as client:
            for _ in range(500):
                if not ready or (await client.get("/health")).status_code == 200:
                    break
                await asyncio.sleep(0.01)
            yield client, app.state.server
