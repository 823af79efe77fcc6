"""`batchserve serve` with a model that cannot load exits non-zero with the reason on stderr,
as a real process: before it listens when the config already says so, and as soon as the
background load fails otherwise (instead of answering 503 "not loaded yet" forever)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from server_helpers import free_socket

pytestmark = pytest.mark.http

TINY = dict(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)


def _serve(model: str, timeout: float = 120) -> tuple[int, str, float]:
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "batchserve", "serve", "--model", model, "--port", str(port),
                        "--attention-backend", "torch", "--linear-backend", "torch", "--kv-cache-gb", "0.01"],
                       capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return p.returncode, p.stderr, time.monotonic() - t0


def _hf_dir(path, config: dict, weights: dict[str, torch.Tensor] | None = None) -> str:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh)
    save_file(weights or {"model.embed_tokens.weight": torch.zeros(32, 16)}, os.path.join(path, "model.safetensors"))
    return str(path)


def test_unsupported_architecture_stops_serve_before_it_listens(tmp_path):
    rc, err, _ = _serve(_hf_dir(tmp_path / "m", {**TINY, "model_type": "gpt_neox"}))
    assert rc == 1, err
    assert "model_type 'gpt_neox' is not supported; supported: llama, mistral, qwen2, qwen3, gemma3_text" in err
    assert "Uvicorn running" not in err  # refused before the server started


def test_unsupported_field_and_missing_model_stop_serve(tmp_path):
    rc, err, _ = _serve(_hf_dir(tmp_path / "m", {**TINY, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    assert rc == 1 and "rope_scaling.rope_type='yarn' is not supported" in err, err
    rc, err, _ = _serve(str(tmp_path / "nowhere"))
    assert rc == 1 and "no such file or directory" in err, err


def test_a_load_that_fails_after_the_check_stops_serve_too(tmp_path):
    """The config is fine, the tensors are not (most are missing): the server has started, the
    background load fails, and the process exits 1 with the reason, well before any timeout."""
    rc, err, took = _serve(_hf_dir(tmp_path / "m", TINY))
    assert rc == 1, err
    assert "the model failed to load" in err and "tensors the llama config implies are missing" in err
    assert took < 100
