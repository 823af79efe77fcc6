"""Command line: `batchserve generate | serve | chat` (more subcommands plug in here).

The flags that set config fields are generated from the config dataclasses (`add_config_args`:
name, type, default, choices and help come from the field); the rest (sampling, simulation,
Ray, `--config`, the queue flags) are written here. `python -m batchserve.cli --flags-markdown`
prints docs/flags.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import logging
import os
import sys
import time
import typing
from typing import Any, Literal

from batchserve.config import (EXPLICIT, SECTIONS, CacheConfig, EngineConfig, LevelConfig, ModelConfig, QueueConfig,
                               SchedulerConfig, ServerConfig, cli_fields, flag_dest, flag_name, from_sources,
                               namespace_sources)


def _recording(base: type[argparse.Action]) -> type[argparse.Action]:
    """`base` that also adds its dest to the namespace's EXPLICIT set when the flag is given,
    which is how a config file's value is told apart from a flag typed out with the default."""

    class Recording(base):  # type: ignore[misc, valid-type]
        def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                     option_string: str | None = None) -> None:
            super().__call__(parser, namespace, values, option_string)
            setattr(namespace, EXPLICIT, getattr(namespace, EXPLICIT, frozenset()) | {self.dest})

    Recording.__name__ = Recording.__qualname__ = "Recording" + base.__name__.lstrip("_")
    return Recording


_STORE, _STORE_TRUE, _STORE_FALSE = (_recording(argparse._StoreAction), _recording(argparse._StoreTrueAction),
                                     _recording(argparse._StoreFalseAction))


def _argument(f: Any, hint: Any) -> dict[str, Any]:
    """add_argument's keywords for a config field: bool -> a switch (store_true; `--no-x`
    store_false for a True default), X | None -> X with default None, Literal or metadata
    `choices` -> choices, str / int / float -> that type."""
    kw: dict[str, Any] = {"dest": flag_dest(f), "default": f.default, "help": f.metadata["help"]}
    if hint is bool:
        return {**kw, "action": _STORE_FALSE if f.default else _STORE_TRUE}
    args = typing.get_args(hint)
    if type(None) in args:
        (hint,) = [t for t in args if t is not type(None)]
    choices = f.metadata.get("choices")
    if typing.get_origin(hint) is Literal:
        choices = choices or typing.get_args(hint)
        hint = type(typing.get_args(hint)[0])
    if hint not in (str, int, float):
        raise TypeError(f"{f.name}: no flag for a field of type {hint}; give it metadata cli: False")
    kw.update(action=_STORE, type=None if hint is str else hint)
    if choices is not None:
        kw["choices"] = list(choices)
    if "metavar" in f.metadata:
        kw["metavar"] = f.metadata["metavar"]
    return kw


def add_config_args(g: argparse._ActionsContainer, cls: type) -> None:
    """A flag for every field of the config dataclass `cls` that is one (`config.cli_fields`)."""
    g.set_defaults(**{EXPLICIT: frozenset()})  # (shared with the parser's): nothing given yet
    hints = typing.get_type_hints(cls)
    for f in cli_fields(cls):
        g.add_argument(flag_name(f), **_argument(f, hints[f.name]))


# argument group title -> the dataclass its flags set (docs/flags.md takes its notes from the docstring)
_GROUPS: dict[str, type] = {"model": ModelConfig, "kv cache": CacheConfig, "scheduling": SchedulerConfig,
                            "admission queue": QueueConfig, "server": ServerConfig}
_ENGINE_GROUPS = ("model", "kv cache", "scheduling", "admission queue")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags that map onto EngineConfig fields."""
    for title in ("model", "kv cache", "scheduling"):
        add_config_args(p.add_argument_group(title), _GROUPS[title])
    g = p.add_argument_group("admission queue")  # whole queues, not fields: config.queue_from_flags
    g.add_argument("--queue-capacity", type=int, default=None, metavar="N",
                   help="one queue level holding at most N waiting requests; more are refused (503)")
    g.add_argument("--queue-config", default=None, metavar="FILE.yaml",
                   help="priority levels, caps, overflow policies, default deadlines, urgent lane")


def engine_config(a: argparse.Namespace) -> EngineConfig:
    """EngineConfig from parsed flags (without a config file)."""
    return from_sources(None, *namespace_sources(a))[0]


def cmd_generate(a: argparse.Namespace) -> int:
    from batchserve.llm import LLM
    from batchserve.request import SamplingParams

    llm = LLM(config=engine_config(a))
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                            top_k=a.top_k, seed=a.seed)
    t0 = time.perf_counter()
    if a.raw:
        outs = llm.generate(a.prompts, params)
    else:
        outs = llm.chat([[{"role": "user", "content": p}] for p in a.prompts], params)
    dt = time.perf_counter() - t0
    ntok = sum(len(o.token_ids) for o in outs)
    for o in outs:
        print(o.text)
    print(f"[{ntok} tokens in {dt:.2f} s: {ntok / dt:.1f} tokens/s; finish: "
          f"{', '.join(o.finish_reason or '?' for o in outs)}]", file=sys.stderr)
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    import httpx

    from batchserve.chat import converse, server_stream

    try:
        stream, model = server_stream(a.url, a.model, a.api_key, a.max_tokens, a.temperature)
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        print(f"error: cannot reach a server at {a.url} ({e}); start one with `batchserve serve`", file=sys.stderr)
        return 1
    print(f"{model} at {a.url}: /reset starts over, /exit (or Ctrl-D) leaves", file=sys.stderr)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    converse(stream, input, write, a.system)
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    from batchserve.server.run import serve

    return serve(a)


def add_server_args(p: argparse.ArgumentParser) -> None:
    """Flags that map onto ServerConfig fields, --config, and the Ray deployment."""
    g = p.add_argument_group("server")
    add_config_args(g, ServerConfig)
    g.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="sections model/cache/scheduler/queue/server of config fields; flags given win")
    g = p.add_argument_group("ray (pip install 'batchserve[ray]'; docs/ray.md)")
    g.add_argument("--ray", action="store_true", help="run the engines as Ray actors behind this endpoint")
    g.add_argument("--address", default=None,
                   help="Ray cluster to join: auto, ray://host:10001 or host:6379 (default: start a local Ray)")
    g.add_argument("--replicas", type=int, default=1, help="engine replicas (each a full engine)")
    g.add_argument("--prefill-workers", type=int, default=0,
                   help="disaggregated: prefill workers (with --decode-workers; replaces --replicas)")
    g.add_argument("--decode-workers", type=int, default=0, help="disaggregated: decode workers")
    g.add_argument("--replica-cpus", type=float, default=1.0,
                   help="CPUs Ray reserves per replica / worker (also its torch threads unless --threads)")
    g.add_argument("--replica-gpus", type=float, default=0.0, help="GPUs Ray reserves per replica (with --device cuda)")
    g.add_argument("--object-store-mb", type=int, default=512, help="object store of a local Ray (KV hand-offs)")


def cmd_simulate(a: argparse.Namespace) -> int:
    from batchserve.sim.runner import run_cli

    return run_cli(a, engine_config(a))


def add_simulate_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """`batchserve simulate`: the real scheduler on a virtual clock over a cost model."""
    from batchserve.bench.traces import FORMATS as TRACE_FORMATS
    from batchserve.scenarios import CHOICES
    from batchserve.sim.hardware import GPUS, MODELS

    s = sub.add_parser("simulate", parents=[common], help="simulate a workload: real scheduler, predicted steps")
    g = s.add_argument_group("simulation")
    g.add_argument("--workload", default="chat", help="mix (chat, mixed, short-long, priority-flood) or trace.jsonl")
    g.add_argument("--trace", default=None, metavar="FILE|SAMPLE", help="replay a trace file or bundled sample "
                   "(burstgpt, azure-code, azure-conv, mooncake) instead of --workload")
    g.add_argument("--trace-format", default=None, choices=TRACE_FORMATS, help="the trace's format (default: sniffed)")
    g.add_argument("--time-scale", type=float, default=None,
                   help="multiply the trace's timestamps (0.1: ten times faster); instead of --rate")
    g.add_argument("--requests", type=int, default=None, help="requests in the workload (default 1000)")
    g.add_argument("--rate", type=float, default=None, help="mean arrival rate, requests/s (default 10; a trace: its own)")
    g.add_argument("--arrival", default=None, help="poisson | gamma | step | ramp | piecewise | onoff | replay "
                   "(default: poisson, or replay for a trace)")
    g.add_argument("--burstiness", type=float, default=None, help="gamma arrivals: CV^2 of the gaps")
    g.add_argument("--arrival-args", default=None, help='JSON of more arrival parameters, e.g. \'{"step_s": 5}\'')
    g.add_argument("--scale", type=float, default=None, help="multiply every length of the mix")
    g.add_argument("--max-tokens", type=int, default=None,
                   help="every request asks for this many; its output ends at its drawn length (EOS)")
    g.add_argument("--seed", type=int, default=0, help="workload and sampling seed")
    g.add_argument("--hardware", default=None, choices=sorted(GPUS), help="roofline GPU (default a100-80gb)")
    g.add_argument("--profile", default=None, metavar="FILE.json", help="step times from `batchserve profile`")
    g.add_argument("--max-model-len", type=int, default=None, help="override the model's context length")
    g.add_argument("--slo-ms", type=float, default=None, help="E2E target for goodput and --sweep "
                                                               "(default --slo-p99-ms)")
    g.add_argument("--slo", action="append", default=None, metavar="[CLASS:]KEY=MS,...",
                   help="SLO targets ttft_ms, tpot_ms, e2e_ms for goodput; CLASS: for one class; repeatable")
    g.add_argument("--find-max-goodput", action="store_true",
                   help="search for the highest --rate keeping --target-attainment (from --rate)")
    g.add_argument("--target-attainment", type=float, default=99.0, help="percent of requests meeting the SLO")
    g.add_argument("--sweep", default=None, metavar="FIELD=V1,V2",
                   help="rate=1,2,4 or a scheduler field (window_ms, max_batch, chunk_size, ...): "
                        "the best setting under the SLO")
    g.add_argument("--scenario", default=None, choices=CHOICES,
                   help="one of the seed's case studies (A100-80GB, Llama-2-7B FP16), or all")
    g.add_argument("--token-times", action=argparse.BooleanOptionalAction, default=None,
                   help="keep every token's time (ITL); default: on up to 20,000 requests")
    g.add_argument("--out", default=None, metavar="DIR", help="records.jsonl, summary.json, timeline, plots")
    add_engine_args(s)
    s.set_defaults(func=cmd_simulate, model="llama-2-7b", dtype="float16")
    s.epilog = f"--model takes {', '.join(sorted(MODELS))} or a config.json (roofline)."


def cmd_profile(a: argparse.Namespace) -> int:
    import dataclasses

    from batchserve.runner.profiler import TINY_MODEL, report, run_profile, save

    if a.rounds < 1 or a.reps < 1 or not a.knee_gain > 0:
        raise ValueError("profile: --rounds and --reps must be >= 1 and --knee-gain > 0")
    out_dir = os.path.dirname(os.path.abspath(a.out))
    if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):
        raise ValueError(f"--out {a.out}: {out_dir} is not a writable directory (checked before measuring)")
    cfg = engine_config(a)
    if a.quick:  # a tiny random model and a small grid: seconds, for tests and smoke checks
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, model="dummy", dummy_config=TINY_MODEL),
                                  cache=dataclasses.replace(cfg.cache, kv_cache_gb=0.01))
    prof = run_profile(cfg, quick=a.quick, reps=a.reps, rounds=a.rounds, min_gain=a.knee_gain)
    save(prof, a.out)
    print(report(prof))
    print(f"saved {a.out}")
    return 0


def add_profile_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """`batchserve profile`: step times on this machine -> latency model, memory bound, knee."""
    s = sub.add_parser("profile", parents=[common], help="measure step times, fit a latency model (JSON)")
    s.add_argument("--out", default="profile.json", metavar="FILE.json", help="where the profile is written")
    s.add_argument("--quick", action="store_true", help="tiny dummy model, small grid (seconds)")
    s.add_argument("--reps", type=int, default=3, help="timed repetitions per point and round (median)")
    s.add_argument("--rounds", type=int, default=3, help="interleaved rounds over all points, each in a new order")
    s.add_argument("--knee-gain", type=float, default=0.15,
                   help="knee: the smallest batch no larger batch beats by this fraction of throughput")
    add_engine_args(s)
    s.set_defaults(func=cmd_profile)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING, ...)")
    p = argparse.ArgumentParser(prog="batchserve", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", parents=[common], help="generate offline for one or more prompts")
    g.add_argument("prompts", nargs="+")
    g.add_argument("--raw", action="store_true", help="no chat template")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt, at most")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: smallest set of this probability")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (0: all)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: unseeded)")
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)
    s = sub.add_parser("serve", parents=[common], help="serve the OpenAI-compatible HTTP API")
    add_server_args(s)
    add_engine_args(s)
    s.set_defaults(func=cmd_serve)
    c = sub.add_parser("chat", parents=[common], help="chat in the terminal with a running server")
    c.add_argument("--url", default="http://127.0.0.1:8000", help="the server (any OpenAI-compatible one)")
    c.add_argument("--model", default=None, help="the model to ask (default: the server's first)")
    c.add_argument("--api-key", default=None, help="sent as a bearer token")
    c.add_argument("--system", default=None, help="a system message opening the conversation")
    c.add_argument("--max-tokens", type=int, default=None, help="tokens per answer, at most (default: the server's)")
    c.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the server's)")
    c.set_defaults(func=cmd_chat)
    add_simulate_parser(sub, common)
    add_profile_parser(sub, common)
    from batchserve.bench.cli import add_bench_parser

    add_bench_parser(sub, [common])
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from batchserve.config import ConfigError
    from batchserve.request import RequestError

    try:
        return a.func(a)
    except (ConfigError, RequestError, ValueError, OSError) as e:  # OSError: a file named on the command line
        print(f"error: {e}", file=sys.stderr)
        return 2


_DOC_HEAD = """# Command-line flags

Generated from the parser by `python -m batchserve.cli --flags-markdown > docs/flags.md`
(tests/test_cli_config.py fails when the two differ). The flags of the model, kv cache,
scheduling and server groups are fields of the dataclasses in `batchserve/config.py`: the
default, type and help here come from the field, the notes under each table from the class
docstring.

`batchserve serve --config FILE.yaml` takes the same fields as a file, one mapping per section
(`model`, `cache`, `scheduler`, `queue`, `server`), keys the field names:

    cache: {kv_cache_gb: 0.5}
    scheduler: {policy: continuous, max_num_seqs: 32}
    queue: {levels: [{name: high, priorities: "7-10", capacity: 100}, ...]}
    server: {port: 8080, api_key: secret, grace_period_s: 20}

Each field comes from the first of: a flag given on the command line, the file, the
subcommand's default, the dataclass default (`batchserve.config.from_sources`).
"""


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _row(a: argparse.Action) -> str:
    flag = ", ".join(a.option_strings) or a.dest
    if a.nargs == 0:
        kind = "switch"
    elif a.choices is not None:
        kind = " | ".join(map(str, a.choices))
    else:
        kind = getattr(a.type, "__name__", "str")
        kind += {"+": " ...", "*": " ..."}.get(a.nargs, "")
    default = "" if a.default is None or a.nargs == 0 else f"`{a.default}`"
    return f"| `{flag}` | {_cell(kind)} | {default} | {_cell(a.help or '')} |"


def _table(actions: list[argparse.Action]) -> list[str]:
    return ["| flag | type | default | help |", "|---|---|---|---|", *map(_row, actions)]


def _groups(p: argparse.ArgumentParser) -> list[tuple[str, list[argparse.Action]]]:
    return [(g.title or "", [a for a in g._group_actions if not isinstance(a, argparse._HelpAction)])
            for g in p._action_groups]


def flags_markdown(parser: argparse.ArgumentParser | None = None) -> str:
    """docs/flags.md: every subcommand's flags as tables, the engine groups once (with the
    subcommands that change their defaults), the config dataclasses' docstrings as notes, and
    the fields a config file may set that are no flags."""
    p = parser or build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sub._choices_actions}
    out = [_DOC_HEAD, "## Subcommands", "", *(f"- `{n}`: {helps.get(n, '')}" for n in sub.choices), ""]
    engine = {}  # group title -> actions, from the first subcommand that has the group
    for name, sp in sub.choices.items():
        for title, actions in _groups(sp):
            if title in _ENGINE_GROUPS:
                engine.setdefault(title, actions)
    users = [n for n, sp in sub.choices.items() if any(t in _ENGINE_GROUPS for t, _ in _groups(sp))]
    out += ["## Engine flags", "", f"Taken by {', '.join(f'`{n}`' for n in users)}.", ""]
    for title in _ENGINE_GROUPS:
        if title not in engine:
            continue
        out += [f"### {title}", "", *_table(engine[title]), ""]
        for name in users:
            own = {a.dest: a for t, acts in _groups(sub.choices[name]) if t == title for a in acts}
            changed = [a for a in engine[title] if a.dest in own and own[a.dest].default != a.default]
            if changed:
                out += [f"`{name}` defaults: " + ", ".join(f"`{a.option_strings[0]} {own[a.dest].default}`"
                                                          for a in changed) + ".", ""]
        if title in _GROUPS:
            out += [inspect.cleandoc(_GROUPS[title].__doc__ or ""), ""]
    for name, sp in sub.choices.items():
        out += [f"## `{name}`", ""]
        for title, actions in _groups(sp):
            if title in _ENGINE_GROUPS or not actions:
                continue
            out += [f"### {title}", "", *_table(actions), ""]
            if title in _GROUPS:
                out += [inspect.cleandoc(_GROUPS[title].__doc__ or ""), ""]
    out += ["## Config file only", "", "Fields a `--config` file (or code) may set that have no flag.", "",
            "| key | default | help |", "|---|---|---|"]
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if not f.metadata.get("cli", True):
                default = f.default_factory() if callable(f.default_factory) else f.default
                shown = f"`{default}`" if isinstance(default, (str, int, float, dict)) else ""
                out.append(f"| `{section}.{f.name}` | {shown} | {_cell(f.metadata.get('help', ''))} |")
    out += ["", "`queue.levels` entries (a list of mappings, or a mapping name -> fields; `priorities` "
            "also as one int or a range like \"7-10\"):", "", inspect.cleandoc(LevelConfig.__doc__ or "")]
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--flags-markdown"]:
        sys.stdout.write(flags_markdown())
        sys.exit(0)
    sys.exit(main())
