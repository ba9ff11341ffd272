# The LMCKV golden vectors in tests/vectors, made by the real LMCache 0.5.6 (dev/make_vectors.py).

.PHONY: vectors vectors-check

# Rewrite tests/vectors (review the diff: the bytes change only when LMCache's or torch's do).
vectors: lmcache
	$(BIN)/python dev/make_vectors.py

# The committed vectors are what LMCache 0.5.6 writes today (no file written).
vectors-check: lmcache
	$(BIN)/python dev/make_vectors.py --check
