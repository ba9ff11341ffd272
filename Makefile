# kvcodec developer commands. `make install` builds .venv/ on a fresh machine;
# TORCH pins the CPU build that lies on disk here (override for CUDA machines).
PY ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
PYTEST := $(BIN)/python -m pytest

.PHONY: install test test-interpret lint demo bench bench-threads bench-gate bench-gate-selftest bench-lmcache lmcache gpu-check clean

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

# Style, formatting, and the import rules: layers, no cycles, no private names across modules.
lint:
	$(BIN)/ruff check kvcodec kernels tests bench dev
	$(BIN)/ruff format --check kvcodec kernels tests bench dev
	$(BIN)/python dev/check_imports.py

demo:
	$(BIN)/kvcodec demo

bench:
	mkdir -p bench/results
	$(PYTEST) bench --benchmark-enable --benchmark-json=bench/results/bench-cpu.json -q

# A caller's pool of 2 vs one thread (bench/test_bench_threads.py), twice: as glibc allocates, then
# with every blob in new pages on both sides (MALLOC_MMAP_THRESHOLD_: freed blobs are unmapped),
# since glibc keeps a pool's freed blobs mapped more often than one thread's.
bench-threads:
	mkdir -p bench/results
	$(PYTEST) bench/test_bench_threads.py -k pool --benchmark-enable --benchmark-json=bench/results/threads.json -q
	MALLOC_MMAP_THRESHOLD_=131072 $(PYTEST) bench/test_bench_threads.py -k "pool and fresh" --benchmark-enable \
	  --benchmark-json=bench/results/threads-new-pages.json -q
	$(BIN)/python bench/show_pool.py bench/results/threads.json bench/results/threads-new-pages.json

# CI performance gate: kvcodec's speed as a ratio to a fixed yardstick workload timed in the same
# rounds on the thread's CPU time (see bench/_ratio.py), against the floors in bench/baseline.json;
# bench/test_bench_copy_limit.py: encode / decode / decode into vLLM blocks as fractions of a memcpy.
# KVCODEC_BENCH_GATE=1 measures only the gated figures (no LMCache / memcpy comparison).
GATE_BENCH = KVCODEC_BENCH_GATE=1 $(PYTEST) bench/test_bench_codec.py --benchmark-enable --benchmark-max-time=0.2 -q
bench-gate:
	mkdir -p bench/results
	$(GATE_BENCH) bench/test_bench_copy_limit.py -k "not compat" --benchmark-json=bench/results/bench-gate.json
	$(BIN)/python bench/gate.py bench/results/bench-gate.json

# End-to-end check of the gate itself (benchmark runs, not a test: they time things): a baseline
# from one normal run; a second normal run must pass it, a run with encode made 1.5x slower must fail.
bench-gate-selftest:
	mkdir -p bench/results
	$(GATE_BENCH) -k test_encode --benchmark-json=bench/results/selftest-base.json
	$(GATE_BENCH) -k test_encode --benchmark-json=bench/results/selftest-again.json
	KVCODEC_BENCH_SLOWDOWN=1.5 $(GATE_BENCH) -k test_encode --benchmark-json=bench/results/selftest-slow.json
	$(BIN)/python bench/gate.py bench/results/selftest-base.json --baseline bench/results/selftest-baseline.json --update
	$(BIN)/python bench/gate.py bench/results/selftest-again.json --baseline bench/results/selftest-baseline.json
	! $(BIN)/python bench/gate.py bench/results/selftest-slow.json --baseline bench/results/selftest-baseline.json
	@echo "gate self-test: a second normal run passes the gate, a 1.5x slower encode fails it"

# On a GPU machine with python3, torch and triton preinstalled (no venv, no
# registry): CUDA tests + GPU benchmarks from the source tree.
gpu-check:
	PYTHONPATH=. $(PY) dev/gpu_check.py

# Per-area targets (vLLM, LMCache, kernel audit, sanitizers) live in mk/*.mk.
-include mk/*.mk

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .benchmarks

# LMCache 0.5.6 beside kvcodec, for the byte-compatibility harness and the
# side-by-side benchmarks (its kv_codec import chain needs only these).
LMCACHE_DEPS := numba cachetools prometheus_client py-cpuinfo psutil aiohttp requests pyyaml
lmcache:
	$(BIN)/python -m pip install -q --no-deps lmcache==0.5.6
	$(BIN)/python -m pip install -q $(LMCACHE_DEPS)
	$(BIN)/python -c "import lmcache.v1.kv_codec as m; print('lmcache kv_codec importable:', m.AsymK16V8Codec)"

bench-lmcache: lmcache
	mkdir -p bench/results
	$(PYTEST) bench/test_bench_codec.py bench/test_lmcache_bytes.py --benchmark-enable \
	  --benchmark-json=bench/results/bench-codec-cpu.json -q
