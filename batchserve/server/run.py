"""`batchserve serve`: uvicorn around the app, with a graceful SIGTERM.

SIGTERM: admission stops at once (new requests get 503, /health 503, so a load balancer moves
on), requests in flight get up to `grace_period_s` to finish, the rest are aborted, then the
process exits 0. A second SIGTERM, or SIGINT, exits at once (uvicorn's own behaviour). If the
engine thread dies, the requests in flight fail, /health turns 503 and the process exits 1,
so that a supervisor restarts it instead of leaving a server that can never answer.

A model that cannot load stops `serve` with status 1 and the reason on stderr: before the
server starts when its configuration already says so (not found, an unsupported architecture
or field: `loader.check_model`), else as soon as the background load fails.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from types import FrameType

import uvicorn

from batchserve.server.app import ServerState, create_app
from batchserve.server.config import load_configs, model_name
from batchserve.server.connections import uvicorn_config

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM drains the app before shutting down."""

    def __init__(self, config: uvicorn.Config, state: ServerState, grace_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.grace_s = grace_s
        self._drain_task: asyncio.Task | None = None
        state.on_fatal = self._fatal

    def _fatal(self) -> None:
        """The engine died: stop serving now (no drain: nothing could finish)."""
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        loop = self.state.loop
        if sig != signal.SIGTERM or self.state.draining or loop is None:
            super().handle_exit(sig, frame)
            return
        self.state.draining = True  # before anything else: no request is admitted from here on
        loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        await self.state.drain(self.grace_s)
        log.info("drained; shutting down")
        self.should_exit = True


def ray_client(a: argparse.Namespace, engine_cfg, server_cfg):
    """--ray: replicas (or prefill + decode workers) as Ray actors; connects to Ray here, in
    the main thread, before the HTTP server starts."""
    from batchserve.distributed.router import RayEngineClient

    return RayEngineClient(engine_cfg, replicas=a.replicas, prefill_workers=a.prefill_workers,
                           decode_workers=a.decode_workers, address=a.address, replica_cpus=a.replica_cpus,
                           replica_gpus=a.replica_gpus, object_store_mb=a.object_store_mb,
                           model_name=server_cfg.served_model_name or model_name(engine_cfg.model.model))


def serve(a: argparse.Namespace) -> int:
    """Run the server until it is told to stop (the `serve` subcommand)."""
    from batchserve.engine.engine import LLMEngine

    from batchserve.runner.loader import ModelLoadError, check_model

    engine_cfg, server_cfg = load_configs(a)
    if not getattr(a, "address", None):  # a remote Ray cluster may see other files than this machine
        try:
            check_model(engine_cfg.model)
        except ModelLoadError as e:
            print(f"error: the model cannot be loaded: {e}", file=sys.stderr)
            return 1
    source = ray_client(a, engine_cfg, server_cfg) if getattr(a, "ray", False) else \
        (lambda: LLMEngine.from_config(engine_cfg))
    app = create_app(source, server_cfg, model_name(engine_cfg.model.model))
    state: ServerState = app.state.server
    config = uvicorn_config(app, server_cfg, log_level=a.log_level.lower(), timeout_graceful_shutdown=5)
    log.info("serving %r on http://%s:%d (model loads in the background; /health turns 200 when ready)",
             state.model_name, server_cfg.host, server_cfg.port)
    DrainingServer(config, state, server_cfg.grace_period_s).run()
    return exit_status(state)


def exit_status(state: ServerState) -> int:
    """The process's exit status once the server has stopped: 1 if the engine died, else 0."""
    if state.fatal is not None:
        load_error = getattr(state.engine, "load_error", None)
        if load_error is not None:
            print(f"error: the model failed to load: {load_error}", file=sys.stderr)
            log.critical("exiting with status 1: the model failed to load")
        else:
            log.critical("exiting with status 1: the engine thread died")
        return 1
    return 0

