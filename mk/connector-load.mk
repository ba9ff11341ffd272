# The vLLM connector's CPU load path (issue 17): one 2048-token hit of a 12-layer model (96 blobs) loaded
# the old way (store.get + decode_chunk + scatter_kv per layer), the new way (get_parsed + read_chunk +
# write_chunk) and an ExampleConnector-like way (a safetensors file per layer + an indexed copy), taking
# turns in one run; medians and ratios in bench/results/connector-load.json. Standalone (no vLLM).

.PHONY: bench-connector-load

bench-connector-load:
	$(BIN)/python bench/connector_load.py
