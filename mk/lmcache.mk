# LMCache 0.5.6's multiprocess storage and server beside kvcodec (the "kvcodec" serde).
# `make lmcache` (in the Makefile) installs LMCache with every dependency these parts import, from
# requirements/lmcache.txt; this checks that its serde registry takes kvcodec's.
.PHONY: lmcache-full test-lmcache bench-serde bench-k16v8

lmcache-full: lmcache
	$(BIN)/python -c "import kvcodec.integrations.lmcache.serde as s; print('lmcache serde types:', s.get_registered_serde_types())"

# The serde and the compat layer against the real package (skips with its reason without it).
test-lmcache: lmcache-full
	$(PYTEST) -q tests/integrations/lmcache bench/test_lmcache_bytes.py

bench-serde: lmcache-full
	mkdir -p bench/results
	$(PYTEST) bench/test_bench_serde.py --benchmark-enable --benchmark-json=bench/results/bench-serde.json -q

# kvcodec beside LMCache's own K16/V8 serde (bench/test_lmcache_k16v8.py): bytes, V's error, serialize /
# deserialize time, interleaved in one run; results in bench/results/k16v8.json.
bench-k16v8: lmcache-full
	mkdir -p bench/results
	$(PYTEST) -s bench/test_lmcache_k16v8.py --benchmark-enable --benchmark-max-time=0.2 \
	  --benchmark-json=bench/results/k16v8.json -q
