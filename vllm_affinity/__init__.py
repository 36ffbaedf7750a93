"""vllm_affinity: the vLLM plugin (server half). Placeholder until its own issue lands."""
