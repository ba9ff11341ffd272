# kvcodec blobs in LMCache's distributed storage, with real servers on 127.0.0.1 (issue 18).
#
# `make test-fleet` installs what it needs (Debian's redis-server, LMCache 0.5.6 with its server deps,
# valkey-glide-sync for the `valkey` adapter), then runs tests/integrations/lmcache/fleet: one Redis
# behind the `resp` adapter and a 3-node Redis Cluster behind the `valkey` adapter, host A's
# `kvcodec-lmcache server` filled by LMCache's own client, fresh servers for the other hosts
# (each started in a temp dir, bounded in time, stopped by PID). When no Redis server can be had it
# prints one SKIP line and exits 0. `make bench-fleet`: bytes in Redis and a reader's fetch time per
# object, kvcodec vs no serde vs LMCache's fp8 serde, in one run (bench/results/fleet.json).

# valkey's adapter imports glide; in 0.5.6 its import chain also pulls in transformers (protobuf < 7).
FLEET_PY_DEPS := valkey-glide-sync "protobuf<7" transformers
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

.PHONY: fleet-deps test-fleet bench-fleet

# The Python side: LMCache with its server deps, the valkey adapter's client.
fleet-deps:
	$(FLEET_PIP_LOCK) $(MAKE) --no-print-directory lmcache-full
	$(FLEET_PIP_LOCK) $(BIN)/python -m pip install -q $(FLEET_PY_DEPS)
	$(BIN)/python -c "import glide_sync, lmcache.v1.distributed.l2_adapters.valkey_l2_adapter" 2>/dev/null
	@echo "fleet deps: $$(redis-server --version | cut -d' ' -f1-3), LMCache's valkey adapter importable"

test-fleet:
	@$(FLEET_REDIS); \
	$(MAKE) --no-print-directory fleet-deps && \
	KVCODEC_FLEET=1 timeout 1800 $(PYTEST) -q -p no:cacheprovider tests/integrations/lmcache/fleet

bench-fleet:
	@$(FLEET_REDIS); \
	$(MAKE) --no-print-directory fleet-deps && mkdir -p bench/results && \
	PYTHONPATH=. timeout 1800 $(BIN)/python bench/fleet/run.py --json bench/results/fleet.json
