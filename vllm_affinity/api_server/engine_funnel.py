"""vLLM adapter, API-server side: nothing a caller sends reaches the engine as the plugin's own.

The engine acts on the plugin's request keys (``core.request_keys.RESERVED_KEYS`` in a request's
``SamplingParams.extra_args``: a principal, a parent, a rewrite, a release). Several of vLLM's
entry points pass a client's ``extra_args`` on as they come (``vllm_xargs`` on chat,
completions, Responses, Messages, transcription and translation; ``sampling_params`` whole on
``/inference/v1/generate`` with ``--enable-scale-out``). Rather than a wrap per entry point,
every request is checked where they all meet, ``AsyncLLM.add_request``: the reserved keys go
unless this process's plugin wrote them, which it vouches for with a per-process secret
(``vouch``), taken off again before the engine sees it.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from ..core.request_keys import RESERVED_KEYS

logger = logging.getLogger("vllm_affinity")

#: The key that carries this process's voucher alongside the plugin's own keys.
VOUCHER_KEY = "kv_vouched"
_VOUCHER = secrets.token_hex(16)
_STRIPPED = frozenset((*RESERVED_KEYS, VOUCHER_KEY))
_wrapped = False


def vouch(request: Any) -> None:
    """A request the plugin's own path handles (its client's reserved keys stripped at the
    entry): vouch for the keys the plugin writes into ``request.vllm_xargs``, now and until
    vLLM builds its parameters (every write copies the dict, voucher included)."""
    if hasattr(request, "vllm_xargs"):
        request.vllm_xargs = {**(request.vllm_xargs or {}), VOUCHER_KEY: _VOUCHER}


def checked(extra: dict[str, Any] | None) -> dict[str, Any] | None:
    """``extra`` as the engine may see it: the reserved keys kept only when vouched for, the
    voucher itself never."""
    if not extra or not any(key in extra for key in _STRIPPED):
        return extra
    if extra.get(VOUCHER_KEY) == _VOUCHER:
        return {key: value for key, value in extra.items() if key != VOUCHER_KEY}
    logger.debug("vllm_affinity: a request's own reserved keys were dropped")
    return {key: value for key, value in extra.items() if key not in _STRIPPED} or None


def wrap_engine_funnel() -> None:
    """Wrap ``AsyncLLM.add_request`` (API server process only; idempotent)."""
    global _wrapped
    if _wrapped:
        return
    import wrapt
    from vllm.v1.engine.async_llm import AsyncLLM

    def add_request(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        params = args[2] if len(args) > 2 else kwargs.get("params")
        prompt = args[1] if len(args) > 1 else kwargs.get("prompt")
        # a prebuilt EngineCoreRequest carries the parameters the engine gets
        for holder in (params, getattr(prompt, "sampling_params", None)):
            extra = getattr(holder, "extra_args", None)
            if extra:
                holder.extra_args = checked(extra)
        return wrapped(*args, **kwargs)

    wrapt.wrap_function_wrapper(AsyncLLM, "add_request", add_request)
    _wrapped = True
