"""OpenTelemetry instrumentor, in the shape of the contrib instrumentations.

    from jiuwen_hooks.instrumentation import JiuwenHooksInstrumentor
    JiuwenHooksInstrumentor().instrument(tracer_provider=..., timeout=0.5)

Registered under the ``opentelemetry_instrumentor`` entry point, so
``opentelemetry-instrument python agent.py`` installs the hook with no code change; options then
come from ``JIUWEN_*`` environment variables. ``instrument()`` is ``jiuwen_hooks.install()`` and
``uninstrument()`` is ``jiuwen_hooks.uninstall()``: one hook per process, whichever way it came.
Needs ``opentelemetry-instrumentation`` (the ``otel`` extra).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import fields
from typing import Any

from opentelemetry.instrumentation.instrumentor import (  # type: ignore[attr-defined]
    BaseInstrumentor,
)

from ._hook import Hook
from ._install import install, uninstall
from ._options import Options
from ._telemetry import logger

_OPTION_NAMES = frozenset(f.name for f in fields(Options))

#: What the hook patches: the SDK's request funnel exists in every openai release since 1.40.
INSTRUMENTS = ("openai >= 1.40",)


class JiuwenHooksInstrumentor(BaseInstrumentor):  # type: ignore[misc]
    """``instrument(**options)`` installs the hook; keyword arguments that are not hook options
    (other instrumentors' settings passed to all of them) are ignored with a debug line."""

    hook: Hook | None = None

    def instrumentation_dependencies(self) -> Collection[str]:
        return INSTRUMENTS

    def _instrument(self, **kwargs: Any) -> None:
        options = {k: v for k, v in kwargs.items() if k in _OPTION_NAMES}
        ignored = sorted(set(kwargs) - _OPTION_NAMES)
        if ignored:
            logger.debug("jiuwen_hooks: instrument() ignores %s", ", ".join(ignored))
        self.hook = install(**options)

    def _uninstrument(self, **kwargs: Any) -> None:
        uninstall()
        self.hook = None
