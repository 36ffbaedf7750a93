"""The quick form of "never worse than vanilla", in the simulator (`benchmarks/never_worse_sim`):
the synthetic trace in every format, pools 0.1x to 1x, with and without ends, calls ending as a
real agent's would; the plugin's policy as shipped computes no more prompt tokens than LRU in any
cell. (The real-server form: ``tests/bench/test_trace_replay_quick.py``.)"""

from __future__ import annotations

from pathlib import Path

from benchmarks.never_worse_sim import POOLS, grid, synthetic_traces


def test_the_plugin_computes_no_more_than_vanilla_in_any_cell(tmp_path: Path) -> None:
    rows = []
    for name, trace in synthetic_traces(tmp_path).items():
        rows += grid(name, trace, POOLS, block=1)
    finish = [r for r in rows if r["signal"] == "finish"]
    assert len(finish) >= 4 * 2 * 3  # every format, with and without ends, 3+ pools that fit
    worse = [r for r in finish if r["plugin"] > r["vanilla"]]
    assert not worse, worse
    # and the plugin saves somewhere: the grid can tell the two apart
    assert any(r["plugin"] < r["vanilla"] for r in finish)
    # Belady bounds every cell: the gap-closed share the reports print is at most 100%
    assert all(r["belady"] <= min(r["plugin"], r["vanilla"], r["unguarded"]) for r in rows)
