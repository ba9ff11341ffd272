# kvcodec developer commands. `make install` builds .venv/ on a fresh machine;
# TORCH pins the CPU build that lies on disk here (override for CUDA machines).
PY ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PIP ?= pip==26.3
BIN := $(VENV)/bin
# The console script: `python -m pytest` would put the repo root on sys.path.
PYTEST := $(BIN)/pytest
# No python that make starts puts its working directory or script folder first on sys.path (3.11+):
# the root's kernels/ (installed as kvcodec.kernels) would shadow the installed `kernels` that
# transformers imports. Scripts that import files beside them add their own folder.
export PYTHONSAFEPATH := 1

.PHONY: install test test-interpret lint demo bench bench-threads bench-gate bench-gate-selftest bench-lmcache lmcache gpu-check clean

# The locked environment (requirements/dev.txt, every dependency pinned; `make lock` in mk/lock.mk):
# torch's build first, then the lock without resolving anything, then kvcodec editable, built
# with the lock's setuptools.
install: $(BIN)/python
	$(BIN)/python -m pip install -q "$(PIP)"
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q --no-deps -r requirements/dev.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .

$(BIN)/python:
	$(PY) -m venv $(VENV)

# Wall-clock bounds live in benchmarks, never in a test.
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
# bench/test_bench_copy_limit.py: encode / decode / decode into vLLM blocks as fractions of a memcpy;
# bench/test_bench_lossless.py: encode / decode with compression="lossless" as fractions of a memcpy.
# KVCODEC_BENCH_GATE=1 measures only the gated figures (no LMCache / memcpy comparison).
GATE_BENCH = KVCODEC_BENCH_GATE=1 $(PYTEST) bench/test_bench_codec.py --benchmark-enable --benchmark-max-time=0.2 -q
bench-gate:
	mkdir -p bench/results
	$(GATE_BENCH) bench/test_bench_copy_limit.py bench/test_bench_lossless.py -k "not compat" \
	  --benchmark-json=bench/results/bench-gate.json
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

# LMCache 0.5.6 beside kvcodec, for the byte-compatibility harness, the side-by-side benchmarks,
# its storage and server, and its Redis adapters. Installed --no-deps (its own metadata pulls CUDA
# builds); what those parts import is locked in requirements/lmcache.txt.
lmcache:
	$(BIN)/python -m pip install -q --no-deps lmcache==0.5.6
	$(BIN)/python -m pip install -q --no-deps -r requirements/lmcache.txt
	$(BIN)/python -c "import lmcache.v1.kv_codec as m; print('lmcache kv_codec importable:', m.AsymK16V8Codec)"

bench-lmcache: lmcache
	mkdir -p bench/results
	$(PYTEST) bench/test_bench_codec.py bench/test_lmcache_bytes.py --benchmark-enable \
	  --benchmark-json=bench/results/bench-codec-cpu.json -q
