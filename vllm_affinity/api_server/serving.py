"""vLLM adapter, API-server side: thin wrapt patches of vLLM's chat, completion, Responses (and,
through chat, Messages) entry methods. Before vLLM handles a parsed request they run it through
the request's path (``request_path.STEPS``: cache sharing, the session's source, the principal,
the compaction rule, ``X-KV-Next-Use``, the data-parallel engine, the ``X-KV-Release`` hint) and
answer openJiuwen's ``agent_hint`` management requests; after the call they watch how it ended
(``lifecycle.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..settings import Settings
from .agent_hint import AgentHintError, answer_management, read_agent_hint
from .engine_funnel import vouch, wrap_engine_funnel
from .release_service import service_of
from .request_path import (
    Refusal,
    RequestPath,
    apply_cache_sharing,
    finish,
    run_steps,
    strip_reserved_args,
)

_wrapped_serving = False


def wrap_serving(settings: Settings, count_hint: Callable[[str], None]) -> None:
    """Thin wrapt patches of vLLM's chat, completion and Responses entry methods (API server
    process only): each parsed request goes through ``request_path.STEPS`` before vLLM handles
    it; a step's refusal (a malformed hint) is answered with vLLM's own 400. Idempotent."""
    global _wrapped_serving
    if _wrapped_serving:
        return
    import wrapt
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses

    def before(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        request = args[0] if args else kwargs["request"]
        strip_reserved_args(request)
        return serve(wrapped, instance, args, kwargs)

    async def serve(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        request = args[0] if args else kwargs["request"]
        raw_request = args[1] if len(args) > 1 else kwargs.get("raw_request")
        service = getattr(raw_request.app.state, "jiuwen_affinity", None) if raw_request else None
        path = RequestPath(settings, instance, request, raw_request, service, count_hint)
        vouch(request)  # the keys the plugin writes from here on are its own
        try:
            await run_steps(path)
        except Refusal as refusal:
            refusal.count()
            return instance.create_error_response(str(refusal))
        return await finish(path, wrapped(*args, **kwargs))

    def session_rank(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        """A rank the client or router chose (``X-data-parallel-rank``) wins; else the
        session's engine, when ``before`` pinned one."""
        rank = wrapped(*args, **kwargs)
        raw_request = args[0] if args else kwargs.get("raw_request")
        if rank is not None or raw_request is None:
            return rank
        return getattr(raw_request.state, "jiuwen_engine_rank", None)

    def before_chat(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        """openJiuwen's ``agent_hint`` first (see ``agent_hint.py``), then as ``before``."""
        request = args[0] if args else kwargs["request"]
        raw_request = args[1] if len(args) > 1 else kwargs.get("raw_request")
        strip_reserved_args(request)
        try:
            agent_hint = read_agent_hint(request)
        except AgentHintError as exc:
            service_of(raw_request).metrics.count_management("none", "invalid")
            return _error(instance, str(exc))
        if agent_hint is not None and agent_hint.manage_request:
            apply_cache_sharing(request, settings.allow_cache_sharing)
            service = service_of(raw_request)
            principal = service.principal_of(raw_request)
            return answer_management(service, request, agent_hint, raw_request, principal)
        return serve(wrapped, instance, args, kwargs)

    wrap_engine_funnel()  # every entry point's request checked where they meet
    wrapt.wrap_function_wrapper(GenerateBaseServing, "_get_data_parallel_rank", session_rank)
    wrapt.wrap_function_wrapper(OpenAIServingChat, "create_chat_completion", before_chat)
    wrapt.wrap_function_wrapper(OpenAIServingCompletion, "create_completion", before)
    wrapt.wrap_function_wrapper(OpenAIServingResponses, "create_responses", before)
    _wrapped_serving = True


async def _error(serving: Any, message: str) -> Any:
    return serving.create_error_response(message)
