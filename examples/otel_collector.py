"""A real OpenTelemetry collector process on loopback, for the demo and the trace tests: it
prints what it receives, and ``spans()`` parses that, so a test or the demo can show that the
agent's and the server's spans arrived in one trace. Needs ``rotel`` (the ``bench`` extra)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_affinity.testing import free_port


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass(frozen=True)
class CollectedSpan:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: str
    service: str


class OtlpCollector:
    """A real OpenTelemetry collector process (``rotel``, from PyPI) on loopback that prints
    what it receives; ``spans()`` parses that output. OTLP/gRPC on ``grpc_endpoint``, OTLP/HTTP
    on ``http_endpoint`` (``/v1/traces``). Needs ``pip install rotel``."""

    def __init__(self, log_path: str | Path | None = None) -> None:
        self.grpc_port, self.http_port = free_port(), free_port()
        if log_path is None:
            handle, log_path = tempfile.mkstemp(prefix="otel-collector-", suffix=".log")
            os.close(handle)
        self.log_path = Path(log_path)
        self._process: subprocess.Popen[bytes] | None = None

    @staticmethod
    def binary() -> str | None:
        """Path of the collector binary, or ``None`` when rotel is not installed."""
        try:
            import rotel
        except ImportError:
            return None
        path = Path(rotel.__file__).parent / "rotel-agent"
        return str(path) if path.exists() else None

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self) -> OtlpCollector:
        binary = self.binary()
        if binary is None:
            raise RuntimeError("the rotel collector is not installed: pip install rotel")
        if not os.access(binary, os.X_OK):
            raise RuntimeError(f"{binary} is not executable: reinstall rotel (pip install rotel)")
        command = [
            binary, "start",
            "--otlp-grpc-endpoint", f"127.0.0.1:{self.grpc_port}",
            "--otlp-http-endpoint", f"127.0.0.1:{self.http_port}",
            "--exporter", "blackhole",
            "--debug-log", "traces",
            "--debug-log-verbosity", "detailed",
        ]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                break
            if _listening(self.grpc_port) and _listening(self.http_port):
                time.sleep(0.2)  # a listener of another process answers too: rotel must live on
                if self._process.poll() is None:
                    return self
                break
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the collector did not start; see {self.log_path}")

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            self._process.wait(timeout=10)
        self._process = None

    def __enter__(self) -> OtlpCollector:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def spans(self) -> list[CollectedSpan]:
        with open(self.log_path, errors="replace") as f:
            text = re.sub(r"\x1b\[[0-9;]*m", "", f.read())
        spans, service = [], ""
        fields: dict[str, str] = {}
        for line in text.splitlines():
            if m := re.search(r"service\.name: Str\((.*)\)", line):
                service = m.group(1)
            elif m := re.match(r"\s+(Trace ID|Parent ID|ID|Name|Kind)\s*: ?(.*)$", line):
                fields[m.group(1)] = m.group(2).strip()
                if m.group(1) == "Kind":
                    spans.append(
                        CollectedSpan(
                            fields.get("Trace ID", ""), fields.get("ID", ""),
                            fields.get("Parent ID", ""), fields.get("Name", ""),
                            fields["Kind"], service,
                        )
                    )  # fmt: skip
                    fields = {}
        return spans

    def wait_for(
        self, predicate: Callable[[list[CollectedSpan]], bool], timeout: float = 30.0
    ) -> list[CollectedSpan]:
        """Poll until ``predicate(spans)`` is true (exporters batch for a few seconds)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans()
            if predicate(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.5)
