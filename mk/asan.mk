# `make test-asan`: the C loops' tests (tests/backends/test_cpu_backend.py with its buffer fuzz, and
# test_cpu_scatter.py: the writes into paged cache views; test_cpu_crc.py: the CRC folded into the
# encode and decode passes; test_cpu_levels.py: every level, folds emulated) against kvcodec._cpu built with
# AddressSanitizer + UBSan. Not in CI
# (a minute or two; needs gcc's libasan). The sanitized module is built into a
# copy of the package under build-asan/, so the installed one is left alone;
# python is not sanitized itself, hence libasan preloaded and leaks off.
ASAN_DIR := build-asan
ASAN_CC ?= gcc
# The C sources and flags are pyproject.toml's ext-module (the one list); read when a target runs.
CPU_EXT = $(shell $(BIN)/python -c 'import sys, tomllib; \
  m = tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["ext-modules"][0]; print(" ".join(m[sys.argv[1]]))' $(1))
CPU_SOURCES = $(call CPU_EXT,sources)
CPU_CFLAGS = $(call CPU_EXT,extra-compile-args)
CPU_INCLUDE = $$($(BIN)/python -c 'import sysconfig; print("-I" + sysconfig.get_paths()["include"])')
CPU_SUFFIX = $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
# HUFF_COUNT_CHUNK=6: huff.c's histograms added up every 6 rounds instead of every 2^30, so that the
# tests' streams take the path a stream of billions of symbols would; HUFF_NIBBLE_CHUNK=2 and
# HUFF_SET_CHUNK=2: its byte counters (nibbles, few values) every 2 blocks instead of 127 and 255, so that
# small streams cross that boundary too.
ASAN_FLAGS = $(CPU_CFLAGS) -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all \
  -Wall -shared -fPIC -DHUFF_COUNT_CHUNK=6 -DHUFF_NIBBLE_CHUNK=2 -DHUFF_SET_CHUNK=2
ASAN_ENV = LD_PRELOAD=$$($(ASAN_CC) -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 PYTHONPATH=.

.PHONY: test-asan
test-asan:
	rm -rf $(ASAN_DIR) && mkdir -p $(ASAN_DIR)
	cp -r kvcodec tests $(ASAN_DIR)/
	rm -f $(ASAN_DIR)/kvcodec/_cpu*.so
	$(ASAN_CC) $(ASAN_FLAGS) $(CPU_INCLUDE) $(CPU_SOURCES) -o $(ASAN_DIR)/kvcodec/_cpu$(CPU_SUFFIX)
	cd $(ASAN_DIR) && $(ASAN_ENV) $(abspath $(BIN))/python -c \
	  'import kvcodec._cpu as m, sys; sys.exit(0 if "$(ASAN_DIR)" in m.__file__ else "not the sanitized build: " + m.__file__)'
	cd $(ASAN_DIR) && $(ASAN_ENV) $(abspath $(BIN))/python -m pytest -q -p no:cacheprovider tests/backends/test_cpu_backend.py \
	  tests/backends/test_cpu_scatter.py tests/backends/test_cpu_crc.py tests/backends/test_cpu_levels.py \
	  tests/backends/test_cpu_planes.py tests/backends/test_cpu_huff.py tests/codec/test_lossless.py \
	  tests/backends/test_cpu_lossless_expand.py

# `make test-portable`: the same C tests against kvcodec._cpu built with -DKV_PORTABLE_ONLY (the scalar
# tier alone, as on a CPU without x86 vector extensions or another architecture: the x86 tiers' files
# compile to nothing), in build-portable/; its object is checked for ymm/zmm instructions and .arch_
# clones first.
PORTABLE_DIR := build-portable

.PHONY: test-portable
test-portable:
	rm -rf $(PORTABLE_DIR) && mkdir -p $(PORTABLE_DIR)
	cp -r kvcodec tests $(PORTABLE_DIR)/
	rm -f $(PORTABLE_DIR)/kvcodec/_cpu*.so
	$(ASAN_CC) $(CPU_CFLAGS) -Wall -Wextra -Wno-missing-field-initializers -Werror -shared -fPIC -DKV_PORTABLE_ONLY \
	  $(CPU_INCLUDE) $(CPU_SOURCES) -o $(PORTABLE_DIR)/kvcodec/_cpu$(CPU_SUFFIX)
	@so=$$(ls $(PORTABLE_DIR)/kvcodec/_cpu*.so); n=$$(objdump -d "$$so" | grep -cE '%[yz]mm|\.arch_' || true); \
	  if [ "$$n" != 0 ]; then echo "the portable build has $$n ymm/zmm or .arch_ lines: ISA-specific code in it"; exit 1; fi; \
	  echo "portable build: no ymm/zmm instruction, no .arch_ clone ($$so)"
	cd $(PORTABLE_DIR) && PYTHONPATH=. $(abspath $(BIN))/python -c \
	  'import kvcodec._cpu as m, sys; sys.exit(0 if "$(PORTABLE_DIR)" in m.__file__ and m.BEST_SIMD == 0 and m.BEST_CRC == 0 else "not the portable build")'
	cd $(PORTABLE_DIR) && PYTHONPATH=. $(abspath $(BIN))/python -m pytest -q -p no:cacheprovider \
	  tests/backends/test_cpu_backend.py tests/backends/test_cpu_scatter.py tests/backends/test_cpu_crc.py tests/backends/test_cpu_levels.py \
	  tests/backends/test_cpu_planes.py tests/backends/test_cpu_huff.py tests/codec/test_lossless.py \
	  tests/backends/test_cpu_lossless_expand.py

# `make test-cross`: the C library without Python (tests/backends/c_selftest.c: fixed inputs through every
# driver, outputs hashed) built natively and run at every row and CRC level (each capped at what the CPU
# has) and with -DKV_PORTABLE_ONLY, and, where Debian's gcc-aarch64-linux-gnu and qemu-user are
# installed, built for aarch64 and run under qemu-aarch64: every run must print the same lines.
CROSS_DIR := build/cross
CROSS_CC ?= aarch64-linux-gnu-gcc
CROSS_RUN ?= qemu-aarch64
CPU_C_SOURCES = $(filter-out %/module.c %/buffers.c %/py_codec.c %/py_scatter.c %/py_planes.c %/py_huff.c %/py_lossless.c,$(CPU_SOURCES))
CROSS_FLAGS = $(CPU_CFLAGS) -Wall -Wextra -Wno-missing-field-initializers -Werror -Ikvcodec/csrc

.PHONY: test-cross
test-cross:
	rm -rf $(CROSS_DIR) && mkdir -p $(CROSS_DIR)
	$(ASAN_CC) $(CROSS_FLAGS) tests/backends/c_selftest.c $(CPU_C_SOURCES) -o $(CROSS_DIR)/native
	$(ASAN_CC) $(CROSS_FLAGS) -DKV_PORTABLE_ONLY tests/backends/c_selftest.c $(CPU_C_SOURCES) -o $(CROSS_DIR)/portable
	$(CROSS_DIR)/portable 0 0 > $(CROSS_DIR)/portable.txt
	for s in 0 1 2; do for c in 0 1 2; do $(CROSS_DIR)/native $$s $$c > $(CROSS_DIR)/native-$$s-$$c.txt && \
	  cmp $(CROSS_DIR)/portable.txt $(CROSS_DIR)/native-$$s-$$c.txt || exit 1; done; done
	@if command -v $(CROSS_CC) >/dev/null && command -v $(CROSS_RUN) >/dev/null; then \
	  $(CROSS_CC) $(CROSS_FLAGS) -static tests/backends/c_selftest.c $(CPU_C_SOURCES) -o $(CROSS_DIR)/aarch64 && \
	  $(CROSS_RUN) $(CROSS_DIR)/aarch64 0 0 > $(CROSS_DIR)/aarch64.txt && \
	  cmp $(CROSS_DIR)/portable.txt $(CROSS_DIR)/aarch64.txt && echo "aarch64 (qemu): the same bytes"; \
	else echo "no $(CROSS_CC) / $(CROSS_RUN): aarch64 not run (apt-get install gcc-aarch64-linux-gnu qemu-user)"; fi
	@echo "test-cross: every level and build wrote the same bytes ($$(wc -l < $(CROSS_DIR)/portable.txt) lines)"
