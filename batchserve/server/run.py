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
import logging
import sys
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable, TypeVar

from batchserve.server.config import load_configs, model_name

if TYPE_CHECKING:
    from batchserve.server.app import ServerState

T = TypeVar("T")

log = logging.getLogger(__name__)


def ray_client(a: argparse.Namespace, engine_cfg, server_cfg):
    """--ray: replicas (or prefill + decode workers) as Ray actors; connects to Ray here, in
    the main thread, before the HTTP server starts."""
    from batchserve.distributed.router import RayEngineClient

    return RayEngineClient(engine_cfg, replicas=a.replicas, prefill_workers=a.prefill_workers,
                           decode_workers=a.decode_workers, address=a.address, replica_cpus=a.replica_cpus,
                           replica_gpus=a.replica_gpus, object_store_mb=a.object_store_mb)


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
        started(lambda: LLMEngine.from_config(engine_cfg))
    from batchserve.server.app import create_app  # while the model loads (see started)
    from batchserve.server.connections import uvicorn_config
    from batchserve.server.draining import DrainingServer

    app = create_app(source, server_cfg, model_name(engine_cfg.model.model))
    state: ServerState = app.state.server
    config = uvicorn_config(app, server_cfg, log_level=a.log_level.lower(), timeout_graceful_shutdown=5)
    log.info("serving %r on http://%s:%d (model loads in the background; /health turns 200 when ready)",
             state.model_name, server_cfg.host, server_cfg.port)
    DrainingServer(config, state, server_cfg.grace_period_s).run()
    return exit_status(state)


def started(factory: Callable[[], T]) -> Callable[[], T]:
    """`factory` already running, on a thread of its own; the callable returned waits for it and
    returns what it returned or raises what it raised. `serve` gives this to the engine thread
    as the engine's source, so that the model loads while the HTTP server's modules are imported
    and the app and server are built: those need the interpreter for most of a second, the load
    mostly does not (its packing and warm-up steps run in C++ without the GIL). The thread is a
    daemon, as the engine thread is: a server stopped while loading does not wait for the load."""
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(factory())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            fut.set_exception(e)

    threading.Thread(target=run, name="batchserve-load", daemon=True).start()
    return fut.result


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

