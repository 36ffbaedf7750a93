"""Pure core of the server plugin: no vLLM import, no I/O."""

from jiuwen_kv_protocol.hint import HintError, ReleaseHint

from .placement import engine_rank
from .queue import IdleResult, ReleaseResult, Segment, SegmentedFreeBlockQueue
from .sessions import HOLE, ReleaseSelection, SessionBlocks
from .tokens import common_prefix_length, first_divergent_block, first_stale_block

__all__ = [
    "HOLE",
    "HintError",
    "IdleResult",
    "ReleaseHint",
    "ReleaseResult",
    "ReleaseSelection",
    "Segment",
    "SegmentedFreeBlockQueue",
    "SessionBlocks",
    "common_prefix_length",
    "engine_rank",
    "first_divergent_block",
    "first_stale_block",
]
