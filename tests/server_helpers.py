"""Helpers for the server tests: the model weights loaded once per session, and real uvicorn
servers on free 127.0.0.1 ports, each in a thread of its own."""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import httpx
import uvicorn

from batchserve.config import EngineConfig
from batchserve.engine.engine import LLMEngine
from batchserve.server.app import ServerState, create_app
from batchserve.server.config import ServerConfig
from batchserve.server.connections import uvicorn_config

MODEL = "smollm2-135m-instruct"
_LOADED: list[Any] = []


def loaded_model() -> Any:
    """The default model's weights and tokenizer, loaded on first use and shared."""
    if not _LOADED:
        from batchserve.config import ModelConfig
        from batchserve.runner.loader import load_model

        _LOADED.append(load_model(ModelConfig()))
    return _LOADED[0]


def build_engine(config: EngineConfig, wrap: Callable[[Any], Any] | None = None) -> LLMEngine:
    """A real engine on the shared weights (its own KV cache); `wrap` may wrap the runner."""
    from batchserve.runner.model_runner import ModelRunner

    loaded = loaded_model()
    runner = ModelRunner(loaded, config.model, config.cache)
    return LLMEngine(config, wrap(runner) if wrap else runner, loaded.tokenizer, loaded.config.eos_token_id)


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@dataclass
class RunningServer:
    url: str
    state: ServerState
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def engine(self) -> LLMEngine:
        return self.state.engine.engine

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def start_server(engine: Any, config: ServerConfig | None = None, timeout: float = 120.0) -> RunningServer:
    """Serve `engine` (an LLMEngine, or an engine client such as RayEngineClient) over real
    HTTP; returns once /health says 200."""
    config = config or ServerConfig()
    app = create_app(engine, config, MODEL)
    sock = free_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, config, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return RunningServer(url, app.state.server, server, thread)
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    server.should_exit = True
    raise TimeoutError("server did not become healthy")


def wait_idle(engine: LLMEngine, timeout: float = 30.0) -> None:
    """Wait until the engine has no request left (read from the test thread: counts only)."""
    end = time.monotonic() + timeout
    while engine.has_unfinished and time.monotonic() < end:
        time.sleep(0.01)
    assert not engine.has_unfinished, "engine still has requests"
