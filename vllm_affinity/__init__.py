"""vllm_affinity: the vLLM plugin (server half) of agent-aware KV-cache release."""
