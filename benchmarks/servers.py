"""Start, watch and stop the servers the comparison benchmarks run: `batchserve serve`, vLLM's
CPU build (`vllm serve`, installed by benchmarks.vllm_setup) and llama.cpp's `llama-server`
(built by `make bench-llamacpp`), one at a time.

    with started(start_vllm(hf_dir, extra_args=["--scheduling-policy", "priority"])) as s:
        run(items, ClientConfig(s.url, extensions=False))   # batchserve.bench.client
        print(s.startup_s, s.rss_bytes())

A server runs in its own session (process group), so that `stop` reaches the processes it
spawned (vLLM's engine core and its helpers) and `rss_bytes` sums resident memory over its whole
process tree, read from /proc. `startup_s` is the time from the start of the process to the first
200 from /health. Logs go to a file when `log_path` is given (vLLM's are the place to look when
it dies before it is healthy).
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import httpx

from benchmarks.standard import free_port
from benchmarks.vllm_setup import DEFAULT_VENV, vllm_bin

SERVED_NAME = "smollm2-135m-instruct"


def add_vllm_args(p) -> None:
    """The flags every comparison with vLLM takes: where its venv and model directory are."""
    p.add_argument("--vllm-venv", default="build/vllm-venv", help="vLLM's venv (`make bench-vllm` installs it)")
    p.add_argument("--vllm-model-dir", default="build/smollm2-135m-instruct-hf", help="the HF directory vLLM serves")


def vllm_env(threads_bind: str | None = None, kv_cache_gib: int = 4) -> dict[str, str]:
    """The environment vLLM's CPU build serves in here: offline, the CPU platform forced (see
    vllm_setup), a `kv_cache_gib` KV cache, and its model worker's OpenMP threads bound to
    `threads_bind` (default all cores: its default keeps one core for the API server and runs the
    model on the rest, which on 2 cores halves the model's share)."""
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu",
                "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_NO_USAGE_STATS": "1",
                "VLLM_CPU_OMP_THREADS_BIND": threads_bind or f"0-{(os.cpu_count() or 1) - 1}"})
    return env


@dataclass
class Server:
    """A started server process: `url` (http://127.0.0.1:PORT), `cmd` as run, `startup_s` once
    wait_healthy has seen /health answer 200."""

    name: str
    cmd: list[str]
    proc: subprocess.Popen
    url: str
    port: int
    t_start: float
    log_path: str | None = None
    startup_s: float | None = None
    _log: object = field(default=None, repr=False)

    def rss_bytes(self) -> int:
        """Resident memory summed over the server process and all its descendants, now."""
        return tree_rss_bytes(self.proc.pid)


def _popen(name: str, cmd: list[str], port: int, env: dict[str, str] | None, log_path: str | None) -> Server:
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Server(name, cmd, proc, f"http://127.0.0.1:{port}", port, time.monotonic(), log_path, _log=log)


def start_batchserve(port: int | None = None, extra_args: Sequence[str] = (), log_path: str | None = None,
                     python: str = sys.executable) -> Server:
    """`python -m batchserve serve --host 127.0.0.1 --port PORT EXTRA_ARGS` (a free port when
    None); returns at once: call wait_healthy."""
    port = port or free_port()
    cmd = [python, "-m", "batchserve", "serve", "--host", "127.0.0.1", "--port", str(port), *extra_args]
    return _popen("batchserve", cmd, port, None, log_path)


def start_vllm(model_dir: str, port: int | None = None, extra_args: Sequence[str] = (), dtype: str = "bfloat16",
               venv: str = DEFAULT_VENV, log_path: str | None = None, env: dict[str, str] | None = None) -> Server:
    """`vllm serve MODEL_DIR` from `venv` on 127.0.0.1:PORT (a free port when None) with
    `--dtype DTYPE`, prefix caching off (batchserve's default), the model served as
    SERVED_NAME, then EXTRA_ARGS (e.g. `--scheduling-policy priority`; note vLLM's `priority`
    request field is an integer, lower served first). `env` defaults to vllm_env(). Returns at
    once: call wait_healthy (a cold start takes minutes)."""
    port = port or free_port()
    cmd = [vllm_bin(venv), "serve", model_dir, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
           "--no-enable-prefix-caching", "--served-model-name", SERVED_NAME, *extra_args]
    return _popen(f"vllm {dtype}", cmd, port, env or vllm_env(), log_path)


def llamacpp_cmd(llama_server: str, model: str, slots: int, slot_ctx: int, port: int | str,
                 extra_args: Sequence[str] = (), threads: int | None = None) -> list[str]:
    """llama.cpp's `llama-server` on the GGUF file `model` with one slot per concurrent request
    (`slots`, continuous batching), each with `slot_ctx` tokens of context, `threads` (default:
    the machine's cores), flash attention off (faster than its default on these CPUs), then
    EXTRA_ARGS. (A report passes port "PORT".)"""
    t = str(threads or os.cpu_count() or 1)
    if "amx_int8" in open("/proc/cpuinfo").read():
        # this build's repacking of the weights for AMX dies at start (SIGSEGV / SIGILL) on the AMX
        # Xeon here; without it llama.cpp multiplies as on any AVX-512 CPU
        extra_args = ["--no-repack", *extra_args]
    return [llama_server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", t, "-tb", t,
            "-np", str(slots), "-c", str(slots * slot_ctx), "-b", "2048", "-ub", "512", "--no-webui", "-fa", "off",
            "--alias", SERVED_NAME, *extra_args]


def start_llamacpp(llama_server: str, model: str, slots: int, slot_ctx: int, port: int | None = None,
                   extra_args: Sequence[str] = (), threads: int | None = None, log_path: str | None = None) -> Server:
    """`llamacpp_cmd` on 127.0.0.1:PORT (a free port when None). Returns at once: call wait_healthy."""
    port = port or free_port()
    return _popen("llama.cpp", llamacpp_cmd(llama_server, model, slots, slot_ctx, port, extra_args, threads), port,
                  None, log_path)


def wait_healthy(server: Server, timeout_s: float = 600.0) -> float:
    """Poll /health until it answers 200; sets and returns server.startup_s. Raises RuntimeError
    when the process exits first (the server stopped), TimeoutError after `timeout_s` (the
    server is left running: stop it)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        code = server.proc.poll()
        if code is not None:
            stop(server)
            raise RuntimeError(f"{server.name} exited with code {code} before it was healthy"
                               + (f" (log: {server.log_path})" if server.log_path else ""))
        try:
            if httpx.get(server.url + "/health", timeout=2.0).status_code == 200:
                server.startup_s = time.monotonic() - server.t_start
                return server.startup_s
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{server.name} at {server.url} not healthy after {timeout_s:.0f} s")


def stop(server: Server, grace_s: float = 30.0) -> int | None:
    """SIGTERM to the server's process group, SIGKILL to what is left after `grace_s`; returns
    the server process's exit code. Safe to call twice."""
    pgid = server.proc.pid  # start_new_session: the group's id is the server's pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    try:
        server.proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):  # stragglers (vLLM's helpers), or the server itself
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.proc.wait(10)
    if server._log not in (None, subprocess.DEVNULL):
        server._log.close()
        server._log = None
    return server.proc.returncode


@contextlib.contextmanager
def started(server: Server, timeout_s: float = 600.0) -> Iterator[Server]:
    """Wait until `server` is healthy, yield it, stop it on exit (also when it never got healthy)."""
    try:
        wait_healthy(server, timeout_s)
        yield server
    finally:
        stop(server)


def tree_rss_bytes(pid: int) -> int:
    """Resident set size summed over `pid` and its descendants (Linux /proc; 0 where unreadable)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(d))
    page = os.sysconf("SC_PAGE_SIZE")
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            with open(f"/proc/{p}/statm") as fh:
                total += int(fh.read().split()[1]) * page
        except OSError:
            pass
    return total


class RssSampler:
    """tree_rss_bytes(pid) sampled every `interval_s` in a thread, while in a `with`: the peak,
    and every sample as (seconds since the start, bytes)."""

    def __init__(self, pid: int, interval_s: float = 0.5) -> None:
        self.pid, self.interval_s, self.peak = pid, interval_s, 0
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.monotonic()
        while True:
            rss = tree_rss_bytes(self.pid)
            self.samples.append((time.monotonic() - t0, rss))
            self.peak = max(self.peak, rss)
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, tree_rss_bytes(self.pid))
