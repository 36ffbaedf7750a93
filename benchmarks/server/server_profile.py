"""Where the plugin's time goes: both servers sampled by py-spy under the throughput benchmark's
load, and the plugin's share of each process counted.

Two servers started the same way (one with ``--vanilla``), each pinned to its own core. After a
warm-up, one round of a ``server_throughput`` variant runs on each while ``py-spy record
--subprocesses --format raw`` samples its whole process tree. Per server: samples of the engine
core (and how many of them spin in ``sched_yield`` while the worker computes), of the model
worker and of the API server, and how many of each are the plugin's own work: a sample whose
innermost ``vllm_affinity`` frame (the launcher's excluded) is not just waiting on the vLLM
method it wraps. Samples under the plugin's wrappers, vLLM's work included, are reported too.

    python -m benchmarks.server.server_profile [--variants mixed,decode] [--rate 200]
"""

from __future__ import annotations

import argparse
import collections
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.server.server_throughput import VARIANTS, one_round
from jiuwen_replay.output import write_json
from vllm_affinity.testing import VLLMServer

PROCESSES = {"engine_core": "VLLM::EngineCore", "worker": "VLLM::Worker", "api_server": "-m"}


def py_spy() -> str:
    found = Path(sys.executable).with_name("py-spy")
    if not found.exists():
        sys.exit("py-spy is not installed: pip install py-spy (it is in the dev extra)")
    return str(found)


def record(server: VLLMServer, rate: int, out: Path) -> subprocess.Popen[bytes]:
    assert server._process is not None
    command = [py_spy(), "record", "--pid", str(server._process.pid), "--subprocesses"]
    command += ["--format", "raw", "--rate", str(rate), "--nonblocking", "-o", str(out)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def samples(path: Path) -> list[tuple[str, list[str], int]]:
    """py-spy's raw output: (process name, frames, count) per distinct stack."""
    rows = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        processes = [f for f in frames if f.startswith("process ")]
        name = re.search(r'"([^"]*)', processes[-1]).group(1) if processes else "?"  # type: ignore[union-attr]
        rows.append((name, [f for f in frames if not f.startswith("process ")], int(count)))
    return rows


#: The vLLM methods the plugin wraps: time below them is vLLM's own work, not the plugin's.
WRAPPED = {
    "KVCacheManager.allocate_slots",
    "KVCacheManager.free",
    "KVCacheManager.pop_blocks_for_free",
    "Scheduler.add_request",
    "OpenAIServingChat.create_chat_completion",
    "OpenAIServingCompletion.create_completion",
    "OpenAIServingResponses.create_responses",
    # the streams the finish-reason watcher iterates (``lifecycle._watched_stream``): vLLM's
    # own generators, suspended under the watcher's frame
    "OpenAIServingChat.chat_completion_stream_generator",
    "OpenAIServingCompletion.completion_stream_generator",
    "OpenAIServingResponses.responses_stream_generator",
}


def is_plugin(frame: str) -> bool:
    return ("vllm_affinity" in frame and "__main__" not in frame) or "wrapt" in frame


def plugin_self(frames: list[str]) -> bool:
    """The sample is the plugin's own work: below its innermost plugin frame there is nothing,
    or code the plugin called, not the vLLM method it wraps."""
    inner = [i for i, frame in enumerate(frames) if is_plugin(frame)]
    if not inner:
        return False
    below = frames[inner[-1] + 1 : inner[-1] + 2]
    return not below or below[0].split(" (")[0] not in WRAPPED


def summarise(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    plugin_functions: collections.Counter[str] = collections.Counter()
    for key, marker in PROCESSES.items():
        rows = [(f, n) for name, f, n in samples(path) if marker in name]
        total = sum(n for _, n in rows)
        under = sum(n for f, n in rows if any(is_plugin(x) for x in f))
        plugin = sum(n for f, n in rows if plugin_self(f))
        out[key] = {"samples": total, "plugin_samples": plugin, "under_plugin_frames": under}
        if key == "engine_core":
            out[key]["spinning"] = sum(n for f, n in rows if f and f[-1].startswith("sched_yield"))
        for frames, n in rows:
            if plugin_self(frames):
                inner = [x for x in frames if is_plugin(x)][-1]
                plugin_functions[inner.split(" (")[0]] += n
    out["plugin_functions"] = dict(plugin_functions.most_common(8))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="mixed,decode")
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/results/server_profile.json")
    args = parser.parse_args()
    servers = {
        "plugin": VLLMServer(plugin=True, num_blocks=512, api_key="b", cpu_cores="0", pin_process=True),  # noqa: E501
        "vanilla": VLLMServer(plugin=False, num_blocks=512, api_key="b", cpu_cores="1", pin_process=True),  # noqa: E501
    }  # fmt: skip
    result: dict[str, Any] = {"rate": args.rate, "variants": {}}
    folder = Path(tempfile.mkdtemp(prefix="server-profile-"))
    try:
        for name, server in servers.items():
            print(f"starting {name} server (log {server.log_path}) ...", file=sys.stderr)
            server.start()
        for variant in args.variants.split(","):
            v = VARIANTS[variant]
            for side, server in servers.items():
                one_round(server, f"warm-{variant}-{side}", v, 2, args.concurrency)
            result["variants"][variant] = {}
            for side, server in servers.items():
                path = folder / f"{variant}-{side}.txt"
                spy = record(server, args.rate, path)
                time.sleep(2)  # py-spy attaches to every process of the tree
                load = one_round(server, f"{variant}-{side}", v, args.sessions, args.concurrency)
                spy.send_signal(signal.SIGINT)
                spy.wait(60)
                summary = {**summarise(path), "load": {k: round(x, 2) for k, x in load.items()}}
                result["variants"][variant][side] = summary
                engine = summary["engine_core"]
                share = engine["plugin_samples"] / max(engine["samples"], 1)
                print(
                    f"{variant} {side}: engine core {engine['samples']} samples "
                    f"({engine['spinning']} spinning), plugin {engine['plugin_samples']} "
                    f"({share:.1%}); API server plugin samples "
                    f"{summary['api_server']['plugin_samples']}",
                    flush=True,
                )
    finally:
        for server in servers.values():
            server.stop()
    write_json(args.out, result, echo=False, raw_profiles=str(folder))
    print(f"wrote {args.out} (raw py-spy output in {folder})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
