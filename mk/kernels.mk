# Triton kernel targets (kernels/, dev/kernel_audit.py, kvcodec/tools/tune.py, dev/gpu_check.py).
# The audit compiles for NVIDIA GPUs ahead of time: no GPU needed, only triton
# (its bundled ptxas and cuobjdump). TRITON_INTERPRET must be unset for it.

.PHONY: kernel-audit kernel-audit-all kernel-audit-update kernel-audit-triton36 tune tune-dry-run

AUDIT := env -u TRITON_INTERPRET $(BIN)/python dev/kernel_audit.py

# CI gate: the codec's launches on its headline workloads, sm_90, against
# bench/kernel_budget.json (about a minute on 2 cores; seconds when Triton's cache is warm).
kernel-audit:
	$(AUDIT)

# sm_80, sm_90 and sm_100, every config of the tuning space (slow: ~1400 compiles).
kernel-audit-all:
	mkdir -p bench/results
	$(AUDIT) --all --rules-only --json bench/results/kernel-audit-all.json

# Rewrite this Triton version's budget from a clean run (review the diff).
kernel-audit-update:
	$(AUDIT) --update

# The audit against Triton 3.6 (what the GPU machines carry) in its own venv:
# triton==3.6.0 there, torch and kvcodec from $(VENV) through a site dir.
TRITON36_VENV ?= .venv-triton36
TRITON36 ?= triton==3.6.0
$(TRITON36_VENV)/bin/python:
	$(PY) -m venv $(TRITON36_VENV)
	$(TRITON36_VENV)/bin/python -m pip install -q "$(TRITON36)"
	echo "import site; site.addsitedir('$(abspath $(VENV))/lib/python$$($(BIN)/python -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')/site-packages')" \
	  > $$($(TRITON36_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz-kvcodec-main-venv.pth

kernel-audit-triton36: $(TRITON36_VENV)/bin/python
	env -u TRITON_INTERPRET $(TRITON36_VENV)/bin/python -c "import triton; print('triton', triton.__version__, triton.__file__)"
	env -u TRITON_INTERPRET $(TRITON36_VENV)/bin/python dev/kernel_audit.py --json bench/results/kernel-audit-triton36.json

# On a GPU: time every config, write the winners to the tuning file.
tune:
	$(BIN)/python -m kvcodec.tools.tune --model llama-3-8b

# On CPU: every config's output checked against the reference (interpreter, tiny shapes).
tune-dry-run:
	TRITON_INTERPRET=1 $(BIN)/python -m kvcodec.tools.tune --dry-run
