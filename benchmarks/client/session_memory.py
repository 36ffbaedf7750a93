"""Memory per tracked session for a 100-message window, and proof that snapshots share strings.

Measured with ``tracemalloc`` in one process: the agents' own windows are built first; then the
hook's session table snapshots them (what the hook costs); for comparison, a deep copy of the
same windows through JSON (what a serialised snapshot, which copies every string, would cost).

    python -m benchmarks.client.session_memory [--sessions 1000] [--messages 100]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tracemalloc
from typing import Any

from jiuwen_hooks._diff import ReleasePolicy, Window, canonical_window
from jiuwen_hooks._sessions import SessionTable
from jiuwen_replay.output import write_json


def agent_window(session: int, messages: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": f"system prompt {session} " * 20}]
    for i in range(1, messages):
        if i % 3 == 0:
            out.append(
                {"role": "tool", "tool_call_id": f"c{i}", "content": f"result {session}/{i} " * 60}
            )
        else:
            out.append(
                {"role": "user" if i % 3 == 1 else "assistant", "content": f"turn {i} " * 30}
            )
    return out


def allocated(fn: Any) -> tuple[Any, int]:
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    result = fn()
    gc.collect()
    return result, tracemalloc.get_traced_memory()[0] - before


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--messages", type=int, default=100)
    parser.add_argument("--out", default="benchmarks/results/session_memory.json")
    args = parser.parse_args()
    tracemalloc.start()
    windows, agent_bytes = allocated(
        lambda: [agent_window(s, args.messages) for s in range(args.sessions)]
    )
    table = SessionTable(max_sessions=args.sessions, idle_ttl=3600, policy=ReleasePolicy())

    def snapshot_all() -> None:
        for s, w in enumerate(windows):
            table.observe(f"s{s}", Window(canonical_window(w)), None, w)

    _, hook_bytes = allocated(snapshot_all)
    copies, copy_bytes = allocated(lambda: json.loads(json.dumps(windows)))
    del copies
    shared = all(
        snap["content"] is msg["content"]
        for snap, msg in zip(canonical_window(windows[0]), windows[0], strict=True)
    )
    text_bytes = sum(sys.getsizeof(m["content"]) for w in windows for m in w)
    result = {
        "sessions": args.sessions,
        "messages_per_window": args.messages,
        "agent_windows_bytes_per_session": agent_bytes // args.sessions,
        "message_text_bytes_per_session": text_bytes // args.sessions,
        "hook_bytes_per_session": hook_bytes // args.sessions,
        "json_copy_bytes_per_session": copy_bytes // args.sessions,
        "hook_vs_json_copy": round(hook_bytes / copy_bytes, 3),
        "snapshot_shares_strings": shared,
    }
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
