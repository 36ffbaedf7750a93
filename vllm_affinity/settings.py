"""Server-side settings, from ``VLLM_AFFINITY_*`` environment variables (they reach every vLLM
process, which command-line flags of the plugin would not)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    #: ``False`` refuses ``cache_sharing: true``: every session keeps its own salted prefix cache.
    #: Sharing identical prefixes across sessions lets one tenant learn, from timing, whether
    #: another already sent the same prefix; deployments with mutually distrustful tenants
    #: should refuse it.
    allow_cache_sharing: bool = True
    #: Seconds between refreshes of the segment gauges on /metrics.
    stats_interval: float = 2.0

    @classmethod
    def from_env(cls) -> Settings:
        sharing = os.environ.get("VLLM_AFFINITY_CACHE_SHARING", "allow").strip().lower()
        if sharing not in ("allow", "refuse"):
            raise ValueError(
                f"VLLM_AFFINITY_CACHE_SHARING={sharing!r}: expected 'allow' or 'refuse'"
            )
        interval = os.environ.get("VLLM_AFFINITY_STATS_INTERVAL", "2")
        try:
            seconds = float(interval)
        except ValueError:
            raise ValueError(
                f"VLLM_AFFINITY_STATS_INTERVAL={interval!r}: expected seconds"
            ) from None
        return cls(allow_cache_sharing=sharing == "allow", stats_interval=seconds)
