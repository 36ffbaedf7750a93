"""Processes for the harness: free loopback ports, waiting on a condition, and children in a
process group of their own that die with their parent (no server left behind by a killed test
run or demo)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from typing import Any


def wait_until(predicate: Any, timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``predicate()`` until it returns something truthy, and return that; after
    ``timeout`` seconds fail with ``what`` (what was awaited) instead of sleeping a fixed time
    and hoping."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def core_set(cores: str) -> set[int]:
    """``"0,2-3"`` → ``{0, 2, 3}`` (the list syntax of ``VLLM_CPU_OMP_THREADS_BIND``)."""
    out: set[int] = set()
    for part in cores.split(","):
        first, _, last = part.strip().partition("-")
        if first:
            out.update(range(int(first), int(last or first) + 1))
    return out


def die_with_parent() -> None:
    """In the child: get SIGTERM when the process that started the server dies (Linux), so a
    killed test run or demo leaves no server behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def start_process_group(command: Sequence[str], **popen: Any) -> subprocess.Popen[Any]:
    """A child in a process group of its own that dies with its parent (``stop_process_group``
    stops it whole): no server is left behind by a killed test run or demo."""
    return subprocess.Popen(command, start_new_session=True, preexec_fn=die_with_parent, **popen)


def stop_process_group(
    process: subprocess.Popen[Any] | None, graceful: signal.Signals, timeout: float
) -> None:
    """Send ``graceful`` to the process's group, then SIGKILL it after ``timeout`` seconds."""
    if process is None or process.poll() is not None:
        return
    os.killpg(process.pid, graceful)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


class LoopbackServer:
    """Something serving HTTP on 127.0.0.1 at ``port``, with its OpenAI base URL."""

    port: int

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.root_url + "/v1"
