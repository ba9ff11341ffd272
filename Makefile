# kvcodec developer commands. `make install` builds .venv/ on a fresh machine;
# TORCH pins the CPU build that lies on disk here (override for CUDA machines).
PY ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
PYTEST := $(BIN)/python -m pytest

.PHONY: install test test-interpret lint demo bench bench-lmcache lmcache gpu-check clean

install: $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"

$(BIN)/python:
	$(PY) -m venv $(VENV)

test:
	$(PYTEST) -q

test-interpret:
	TRITON_INTERPRET=1 $(PYTEST) -q -m interpreter

lint:
	$(BIN)/ruff check kvcodec kernels tests bench

demo:
	$(BIN)/kvcodec demo

bench:
	$(PYTEST) bench --benchmark-enable --benchmark-json=bench/results/bench-cpu.json -q

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .benchmarks
