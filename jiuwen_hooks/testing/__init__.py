"""Test helpers for users' own agent tests (also used by this project's tests).

``LocalEngine`` is a real HTTP server on loopback that speaks enough of the OpenAI API for the
``openai`` client (``/v1/chat/completions`` and ``/v1/responses``, streamed or not;
``/v1/models``), and of the Anthropic Messages API (``/v1/messages``) for the ``anthropic``
client, and serves
``/release_kv_cache``, recording every request. Its release answer can be switched to any status,
a non-JSON body, a slow answer, or a connection reset mid-response. ``strict=True`` answers 400 to
any chat field outside the OpenAI API (as the OpenAI API and several gateways do);
``in_request=True`` advertises in-request releases like the vllm_affinity plugin (on
``GET /affinity/capabilities`` and in release answers) and records the ``X-KV-Release`` hints.

``TelemetryCapture`` holds an in-memory span exporter and metric reader (needs the OTel SDK:
``pip install 'jiuwen-kv-affinity[otel]'``).
"""

from __future__ import annotations

from ._engine import LocalEngine
from ._records import RecordedRequest, ReleaseAnswer
from ._telemetry_capture import TelemetryCapture

__all__ = ["LocalEngine", "RecordedRequest", "ReleaseAnswer", "TelemetryCapture"]
