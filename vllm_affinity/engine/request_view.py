"""vLLM adapter, engine side: what the plugin reads of a vLLM ``Request``, read once per request."""

from __future__ import annotations

from typing import Any

from ..core.request_keys import RequestKeys, read_request_keys
from .fail_open import ERRORS


def keys_of(request: Any) -> RequestKeys:
    """The request's keys of the plugin (``core/request_keys.py``), type-checked once per
    request; a malformed one is counted (``vllm_affinity_engine_malformed_args_total``) and
    ignored."""
    try:
        return request._jiuwen_keys  # type: ignore[no-any-return]
    except AttributeError:
        pass
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None)
    keys = read_request_keys(extra)
    for key in keys.malformed:
        ERRORS.malformed_value(key)
    request._jiuwen_keys = keys
    return keys
