"""Server settings, and `--config file.yaml`: one file mapping onto the config dataclasses.

The file has one section per EngineConfig field (model, cache, scheduler, queue, ...) plus
`server`, each a mapping of that dataclass's fields:

    cache: {kv_cache_gb: 0.5}
    scheduler: {policy: continuous, max_num_seqs: 32}
    queue: {levels: [{name: high, priorities: "7-10", capacity: 100}, ...]}
    server: {port: 8080, api_key: secret, grace_period_s: 20}

A command-line flag given with a non-default value wins over the file.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from batchserve.config import ConfigError, EngineConfig


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP layer. `served_model_name` (default: the model's alias or file name) is the
    name clients pass as `model`; `default_max_tokens` caps chat answers that set no limit."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    grace_period_s: float = 30.0
    served_model_name: str | None = None
    default_max_tokens: int = 1024

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"server.port: must be an integer in [0, 65535], got {self.port!r}")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1024:
            raise ConfigError(f"server.max_body_bytes: must be an integer >= 1024, got {self.max_body_bytes!r}")
        if not isinstance(self.grace_period_s, (int, float)) or self.grace_period_s < 0:
            raise ConfigError(f"server.grace_period_s: must be >= 0, got {self.grace_period_s!r}")
        if not isinstance(self.default_max_tokens, int) or self.default_max_tokens < 1:
            raise ConfigError(f"server.default_max_tokens: must be an integer >= 1, got {self.default_max_tokens!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ConfigError("server.api_key: must be a non-empty string")


def model_name(model: str) -> str:
    """What /v1/models calls a model: the alias, or the file / directory name."""
    return os.path.basename(model.rstrip("/")) or model


def _section(cls: type, cli: Any, default: Any, doc: Any, name: str) -> Any:
    """`cli` with the file's values for every field whose CLI value is still the default."""
    if doc is None:
        return cli
    if hasattr(cls, "from_dict"):  # a section with structure of its own (the queue's levels)
        from_file = cls.from_dict(doc)
        return cli if cli != default else from_file
    if not isinstance(doc, dict):
        raise ConfigError(f"{name}: expected a mapping, got {type(doc).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise ConfigError(f"{name}: unknown keys {unknown}; expected some of {sorted(known)}")
    chosen = {k: v for k, v in doc.items() if getattr(cli, k) == getattr(default, k)}
    try:
        return dataclasses.replace(cli, **chosen)
    except TypeError as e:
        raise ConfigError(f"{name}: {e}") from None


def merge_file(doc: dict[str, Any], cli_engine: EngineConfig, default_engine: EngineConfig,
               cli_server: ServerConfig, default_server: ServerConfig) -> tuple[EngineConfig, ServerConfig]:
    """Overlay a parsed config file on the configs built from flags (and from default flags,
    which tells which flags were given)."""
    if not isinstance(doc, dict):
        raise ConfigError(f"config file: expected a mapping, got {type(doc).__name__}")
    sections = {f.name: f for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(doc) - set(sections) - {"server"})
    if unknown:
        raise ConfigError(f"config file: unknown sections {unknown}; expected {sorted(sections) + ['server']}")
    parts = {}
    for name in sections:
        cli = getattr(cli_engine, name)
        parts[name] = _section(type(cli), cli, getattr(default_engine, name), doc.get(name), name)
    server = _section(ServerConfig, cli_server, default_server, doc.get("server"), "server")
    return dataclasses.replace(cli_engine, **parts), server


def server_config(a: Any) -> ServerConfig:
    """ServerConfig from the serve flags."""
    return ServerConfig(host=a.host, port=a.port, api_key=a.api_key, max_body_bytes=a.max_body_bytes,
                        grace_period_s=a.grace_period_s, served_model_name=a.served_model_name,
                        default_max_tokens=a.default_max_tokens)


def load_configs(a: Any) -> tuple[EngineConfig, ServerConfig]:
    """Engine and server config from the `serve` flags and, with --config, the file."""
    import yaml

    from batchserve.cli import build_parser, engine_config

    engine, server = engine_config(a), server_config(a)
    if not getattr(a, "config", None):
        return engine, server
    try:
        with open(a.config) as f:
            doc = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"--config {a.config}: {e}") from None
    d = build_parser().parse_args(["serve"])
    return merge_file(doc, engine, engine_config(d), server, server_config(d))
