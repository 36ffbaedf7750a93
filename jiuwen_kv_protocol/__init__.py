"""The wire protocol between agents and the vLLM plugin: header names and paths
(``headers``), the ``X-KV-Release`` codec (``hint``), and the request and answer models
(``models``). Pure: no vLLM, no HTTP client, no openai; both ``jiuwen_hooks`` and
``vllm_affinity`` import it, and neither imports the other."""

from .headers import (
    CAPABILITIES_PATH,
    NEXT_USE_HEADER,
    PARENT_HEADER,
    RELEASE_HEADER,
    RELEASE_PATH,
    SESSION_HEADER,
)
from .hint import HintError, ReleaseHint
from .models import ReleaseReceipt, ReleaseRequest

__all__ = [
    "CAPABILITIES_PATH",
    "NEXT_USE_HEADER",
    "PARENT_HEADER",
    "RELEASE_HEADER",
    "RELEASE_PATH",
    "SESSION_HEADER",
    "HintError",
    "ReleaseHint",
    "ReleaseReceipt",
    "ReleaseRequest",
]
