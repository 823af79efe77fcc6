"""`batchserve serve`'s configuration: the flags and, with `--config file.yaml`, a file.

The file has one section per EngineConfig field (model, cache, scheduler, queue) plus
`server`, each a mapping of that dataclass's fields:

    cache: {kv_cache_gb: 0.5}
    scheduler: {policy: continuous, max_num_seqs: 32}
    queue: {levels: [{name: high, priorities: "7-10", capacity: 100}, ...]}
    server: {port: 8080, api_key: secret, grace_period_s: 20}

A flag given on the command line wins over the file; the merge itself is
`batchserve.config.from_sources`, and ServerConfig lives there too (re-exported here).
"""
from __future__ import annotations

import os
from typing import Any

from batchserve.config import EngineConfig, ServerConfig, from_sources, namespace_sources, read_yaml

__all__ = ["ServerConfig", "load_configs", "model_name"]


def model_name(model: str) -> str:
    """What /v1/models calls a model: the alias, or the file / directory name."""
    return os.path.basename(model.rstrip("/")) or model


def load_configs(a: Any) -> tuple[EngineConfig, ServerConfig]:
    """Engine and server config from the parsed `serve` flags and, with --config, the file."""
    doc = read_yaml(a.config, "--config") if getattr(a, "config", None) else None
    return from_sources(doc, *namespace_sources(a))
