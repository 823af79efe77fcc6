"""The command line generated from the config dataclasses: the same flags as when they were
written by hand, the file / flag merge with explicit flags winning, docs/flags.md in step
with the parser, and the config layer free of the CLI."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import pathlib
import subprocess
import sys
from typing import Any, Literal

import pytest

from batchserve.cli import add_config_args, build_parser, engine_config, flags_markdown
from batchserve.config import (EXPLICIT, SECTIONS, CacheConfig, ConfigError, EngineConfig, ModelConfig,
                               QueueConfig, SchedulerConfig, ServerConfig, cli_fields, from_sources,
                               flag_name, namespace_sources)
from batchserve.server.config import load_configs

ROOT = pathlib.Path(__file__).resolve().parent.parent
PINNED = pathlib.Path(__file__).with_name("cli_flags_pinned.json")


def _argparse_base(action: argparse.Action) -> str:
    """The argparse class an action is (or extends): what it does, not who records it."""
    return next(c.__name__ for c in type(action).__mro__ if c.__module__ == "argparse")


def dump_flags(p: argparse.ArgumentParser) -> dict[str, dict[str, dict[str, Any]]]:
    """{subcommand: {flag: what parsing it means}} for every subcommand of the parser."""
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, sp in sub.choices.items():
        out[name] = {
            " ".join(a.option_strings) or a.dest: {
                "dest": a.dest, "action": _argparse_base(a), "default": sp.get_default(a.dest),
                "type": None if a.type is None else getattr(a.type, "__name__", repr(a.type)),
                "choices": None if a.choices is None else list(a.choices), "nargs": a.nargs, "const": a.const,
                "metavar": a.metavar, "required": a.required}
            for a in sp._actions if not isinstance(a, argparse._HelpAction)}
    return out


def test_flags_are_the_pinned_set() -> None:
    """tests/cli_flags_pinned.json is the parser's dump from before the flags were generated:
    every subcommand keeps each flag's name, dest, action, default, type, choices and nargs.
    A flag changed on purpose changes its line there (one line a flag)."""
    pinned = json.loads(PINNED.read_text())
    now = json.loads(json.dumps(dump_flags(build_parser())))
    assert sorted(now) == sorted(pinned)
    for cmd in pinned:
        assert sorted(now[cmd]) == sorted(pinned[cmd]), cmd
        for flag, want in pinned[cmd].items():
            assert now[cmd][flag] == want, (cmd, flag)


def test_every_help_is_one_line_and_config_flags_come_from_fields() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, sp in sub.choices.items():
        for a in sp._actions:
            assert "\n" not in (a.help or ""), (name, a.option_strings)
    serve = dump_flags(build_parser())["serve"]
    for section, cls in SECTIONS.items():
        default = cls()
        for f in dataclasses.fields(cls):
            if not f.metadata.get("cli", True):
                continue
            help_ = f.metadata["help"]
            assert help_ and "\n" not in help_ and len(help_) <= 100, (section, f.name)
            flag = flag_name(f)
            assert serve[flag]["default"] == getattr(default, f.name), flag  # the default is the field's


def test_the_generator_follows_the_annotations() -> None:
    @dataclasses.dataclass(frozen=True)
    class Demo:
        count: int = dataclasses.field(default=3, metadata={"help": "an int"})
        limit: float | None = dataclasses.field(default=None, metadata={"help": "optional float"})
        mode: Literal["a", "b"] = dataclasses.field(default="a", metadata={"help": "a literal"})
        name: str = dataclasses.field(default="x", metadata={"help": "renamed", "flag": "--label",
                                                             "choices": ("x", "y")})
        fast: bool = dataclasses.field(default=False, metadata={"help": "a switch"})
        safe: bool = dataclasses.field(default=True, metadata={"help": "on unless --no-safe"})
        blob: dict = dataclasses.field(default_factory=dict, metadata={"cli": False})

    p = argparse.ArgumentParser()
    add_config_args(p, Demo)
    assert p.parse_args([]).__dict__ == {"count": 3, "limit": None, "mode": "a", "label": "x", "fast": False,
                                         "safe": True, EXPLICIT: frozenset()}
    a = p.parse_args(["--count", "4", "--limit", "0.5", "--mode", "b", "--label", "y", "--fast", "--no-safe"])
    assert (a.count, a.limit, a.mode, a.label, a.fast, a.safe) == (4, 0.5, "b", "y", True, False)
    assert getattr(a, EXPLICIT) == {"count", "limit", "mode", "label", "fast", "safe"}
    with pytest.raises(SystemExit):
        p.parse_args(["--mode", "c"])

    @dataclasses.dataclass(frozen=True)
    class Unmarked:
        blob: dict = dataclasses.field(default_factory=dict, metadata={"help": "no flag for a dict"})

    with pytest.raises(TypeError, match="cli: False"):
        add_config_args(argparse.ArgumentParser(), Unmarked)


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_defaults_per_subcommand() -> None:
    assert from_sources() == (EngineConfig(), ServerConfig())
    assert engine_config(_parse("serve")) == EngineConfig()
    assert engine_config(_parse("generate", "hi")) == EngineConfig()
    assert engine_config(_parse("profile")) == EngineConfig()
    sim = engine_config(_parse("simulate"))  # simulate's own defaults: a GPU model in float16
    assert sim == dataclasses.replace(EngineConfig(), model=ModelConfig(model="llama-2-7b", dtype="float16"))
    engine, server = load_configs(_parse("serve", "--model", "dummy", "--port", "0"))
    assert (engine.model.model, server.port) == ("dummy", 0)


def test_flags_reach_every_section() -> None:
    a = _parse("serve", "--threads", "3", "--kv-cache-dtype", "int8", "--prefix-caching", "--num-blocks", "9",
               "--policy", "cascade", "--cascade-workers", "--latency-profile", "p.json", "--queue-capacity", "4",
               "--api-key", "k", "--max-body-bytes", "2048")
    engine, server = load_configs(a)
    assert engine.model == ModelConfig(num_threads=3)
    assert engine.cache == CacheConfig(kv_cache_dtype="int8", prefix_caching=True, num_blocks=9)
    assert engine.scheduler == SchedulerConfig(policy="cascade", cascade_workers=True, latency_profile="p.json")
    assert engine.queue == QueueConfig.bounded(4)
    assert server == ServerConfig(api_key="k", max_body_bytes=2048)


def test_a_flag_given_wins_over_the_file_even_at_its_default(tmp_path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("model: {dtype: bfloat16}\ncache: {prefix_caching: true}\n"
                    "scheduler: {max_num_seqs: 32, window_ms: 10}\nserver: {port: 8080}\n"
                    "queue: {levels: [{name: all, capacity: 5}], retry_after_s: 3}\n")
    engine, server = load_configs(_parse("serve", "--config", str(path)))
    assert (engine.model.dtype, engine.cache.prefix_caching, engine.scheduler.max_num_seqs, server.port) == \
        ("bfloat16", True, 32, 8080)
    assert engine.queue.levels[0].capacity == 5 and engine.queue.retry_after_s == 3
    # the same values as the defaults, typed out: they win, where "differs from the default" would not
    engine, server = load_configs(_parse("serve", "--config", str(path), "--dtype", "float32",
                                         "--max-num-seqs", "64", "--port", "8000", "--window-ms", "50"))
    assert (engine.model.dtype, engine.scheduler.max_num_seqs, engine.scheduler.window_ms, server.port) == \
        ("float32", 64, 50.0, 8000)
    assert engine.cache.prefix_caching  # not given: the file's
    # a queue flag sets the whole queue section
    engine, _ = load_configs(_parse("serve", "--config", str(path), "--queue-capacity", "7"))
    assert engine.queue == QueueConfig.bounded(7)


def test_a_namespace_built_by_hand_counts_values_off_the_default_as_given(tmp_path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("scheduler: {max_num_seqs: 32, max_batch: 4}\n")
    a = argparse.Namespace(config=str(path), max_num_seqs=64, max_batch=8, port=9000)
    explicit, implicit = namespace_sources(a)
    assert explicit == {"scheduler": {"max_batch": 8}, "server": {"port": 9000}}
    assert implicit == {"scheduler": {"max_num_seqs": 64}}
    engine, server = load_configs(a)
    assert (engine.scheduler.max_num_seqs, engine.scheduler.max_batch, server.port) == (32, 8, 9000)


def test_file_errors_name_the_place(tmp_path) -> None:
    path = tmp_path / "bad.yaml"
    for text, match in (("[1, 2]", "config file: expected a mapping"), ("cache: 3", "cache: expected a mapping"),
                        ("scheduler: {max_batch: 0}", "max_batch"), ("queue: {levels: [{}]}", "needs a name")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=match):
            load_configs(_parse("serve", "--config", str(path)))
    with pytest.raises(ConfigError, match="--config"):
        load_configs(_parse("serve", "--config", str(tmp_path / "missing.yaml")))


def test_every_config_field_is_a_flag_or_marked_file_only() -> None:
    serve = dump_flags(build_parser())["serve"]
    dests = {v["dest"] for v in serve.values()}
    for cls in SECTIONS.values():
        for f in cli_fields(cls):
            assert f.metadata.get("flag", f.name).lstrip("-").replace("-", "_") in dests, f.name


def test_docs_flags_md_is_the_generated_table() -> None:
    """docs/flags.md is written by `python -m batchserve.cli --flags-markdown > docs/flags.md`."""
    assert (ROOT / "docs" / "flags.md").read_text() == flags_markdown()


def test_the_flags_markdown_command() -> None:
    out = subprocess.run([sys.executable, "-m", "batchserve.cli", "--flags-markdown"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert out == flags_markdown()


def test_nothing_in_the_package_imports_the_cli() -> None:
    """The config layer is below the command line: only `python -m batchserve` enters it."""
    for path in (ROOT / "batchserve").rglob("*.py"):
        if path == ROOT / "batchserve" / "__main__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [f"{node.module}.{a.name}" for a in node.names] + [node.module or ""] \
                if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "batchserve.cli" or n.startswith("batchserve.cli.") for n in names), path
