"""A replay's report: the Markdown table and the plot (the JSON is the result itself)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from statistics import mean
from typing import Any


def _fmt(value: Any, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def markdown(result: dict[str, Any]) -> str:
    trace, options = result["trace"], result["options"]
    speed = options["speed"]
    pace = "one call at a time" if speed <= 0 else f"the trace's clock x{speed:g}"
    lines = [
        f"{trace['format']} trace `{Path(trace['source']).name}`: {trace['requests']} calls, "
        f"{trace['sessions']} sessions ({trace['subagents']} subagents), "
        f"transitions {trace['transitions']}; scale {options['scale']:g}, {pace}, "
        f"concurrency {options['concurrency']}.",
        "",
        "| round | side | hit rate | simulator (policy) | infinite / Belady | computed tokens "
        "| TTFT p50 / p90 / p99 (ms) | session p50 (s) | releases in-request / POST | errors |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in result["runs"]:
        sim = run.get("simulator") or {}
        releases = run.get("releases")
        paths = f"{releases['in_request']} / {releases['post']}" if releases else "-"
        lines.append(
            f"| {run['round']} | {run['side']} | {_fmt(run['hit_rate'], '.3f')} "
            f"| {_fmt(sim.get('hit_rate'), '.3f')} ({sim.get('policy', '-')}) "
            f"| {_fmt(sim.get('infinite'), '.3f')} / {_fmt(sim.get('belady'), '.3f')} "
            f"| {_fmt(run['computed_tokens'], ',')} "
            f"| {_fmt(run['ttft_ms_p50'], '.0f')} / {_fmt(run['ttft_ms_p90'], '.0f')} / "
            f"{_fmt(run['ttft_ms_p99'], '.0f')} | {run['session_s_p50']:.1f} "
            f"| {paths} "
            f"| {run['errors']} |"
        )
    paired = [r for r in result["runs"] if r.get("ttft_paired")]
    if paired:
        lines += [
            "",
            f"TTFT call by call against {result['runs'][0]['side']} in the same round, over the "
            "calls that computed the same tokens on both sides (what a side adds per call, "
            "apart from its cache policy):",
            "",
        ]
        lines += [
            f"- round {r['round']}, {r['side']}: median {r['ttft_paired']['median_ms']:+.1f} ms, "
            f"mean {r['ttft_paired']['mean_ms']:+.1f} ms over {r['ttft_paired']['calls']} calls"
            for r in paired
        ]
    ratios = side_ratios(result)
    if ratios:
        lines += ["", "Means over rounds, second side against the first:", ""]
        lines += [f"- {name}: {value:.3f}" for name, value in ratios.items()]
    return "\n".join(lines) + "\n"


def side_ratios(result: dict[str, Any]) -> dict[str, float]:
    """Second side over first (means over rounds) for computed tokens and TTFT."""
    by_side: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for run in result["runs"]:
        by_side[run["side"]].append(run)
    if len(by_side) != 2:
        return {}
    (first, a), (second, b) = by_side.items()
    out = {}
    for key in ("computed_tokens", "ttft_ms_p50", "ttft_ms_p90"):
        va = [r[key] for r in a if r[key] is not None]
        vb = [r[key] for r in b if r[key] is not None]
        if va and vb and mean(va):
            out[f"{key} {second} / {first}"] = mean(vb) / mean(va)
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    """Hit rate, computed tokens and TTFT percentiles per side (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    labels = [f"{r['side']}\n(round {r['round']})" for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar(labels, [r["hit_rate"] or 0 for r in runs], color="tab:blue")
    axes[0].set_title("prefix-cache hit rate")
    axes[0].set_ylim(0, 1)
    axes[1].bar(labels, [r["computed_tokens"] or 0 for r in runs], color="tab:orange")
    axes[1].set_title("prompt tokens computed")
    width = 0.27
    for offset, key in zip(
        (-width, 0, width), ("ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99"), strict=True
    ):
        axes[2].bar(
            [i + offset for i in range(len(runs))],
            [r[key] or 0 for r in runs],
            width,
            label=key.removeprefix("ttft_ms_"),
        )
    axes[2].set_xticks(range(len(runs)), labels)
    axes[2].set_title("TTFT (ms)")
    axes[2].legend()
    trace = result["trace"]
    fig.suptitle(f"{trace['format']} trace replay: {trace['requests']} calls")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
