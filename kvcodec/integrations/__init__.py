"""Where kvcodec plugs into serving engines: LMCache (``lmcache``) and vLLM (``vllm``)."""
