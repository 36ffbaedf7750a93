"""SDK adapter: where the ``openai`` and ``anthropic`` SDKs resolve every call, and nothing else.

Both SDKs are generated alike: every resource method, accessor and helper (``create``,
``parse``, ``stream``, ``with_raw_response``, ``with_streaming_response``, beta resources) ends
in ``SyncAPIClient.request`` / ``AsyncAPIClient.request`` of the SDK's ``_base_client``, with
the same request options (``FinalRequestOptions``: ``url``, ``json_data``, ``headers``,
``extra_json``). The SDK looks that method up on the client at every call, so clients and
accessors created or cached before ``install()`` are tracked, and ``uninstall()`` stops tracking
on every one of them. The SDKs are optional: one that is not installed is not patched.

A second, trivial wrapper on the ``create``/``parse``/``stream`` methods only notes the list
object the caller passed, so that a compressor later handed the same list finds its session
without a ``session()`` context. Where an accessor cached the method before ``install()``, that
note is missing and nothing else changes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from ._context import ModelCall
from ._windows import api_of


@dataclass(frozen=True)
class Sdk:
    """Where one SDK funnels its calls, and the methods that receive the caller's list."""

    name: str
    client_module: str
    #: (module, method, argument holding the caller's list)
    caller_methods: tuple[tuple[str, str, str], ...]
    sync_request: str = "SyncAPIClient.request"
    async_request: str = "AsyncAPIClient.request"


_CHAT = "openai.resources.chat.completions"
_RESPONSES = "openai.resources.responses.responses"
_MESSAGES = "anthropic.resources.messages.messages"
_BETA_MESSAGES = "anthropic.resources.beta.messages.messages"

SDKS: tuple[Sdk, ...] = (
    Sdk(
        "openai",
        "openai._base_client",
        tuple(
            (module, f"{prefix}{cls}.{method}", argument)
            for module, cls, argument in (
                (_CHAT, "Completions", "messages"),
                (_RESPONSES, "Responses", "input"),
            )
            for prefix in ("", "Async")
            for method in ("create", "parse")
        ),
    ),
    Sdk(
        "anthropic",
        "anthropic._base_client",
        tuple(
            (module, f"{prefix}Messages.{method}", "messages")
            for module in (_MESSAGES, _BETA_MESSAGES)
            for prefix in ("", "Async")
            for method in ("create", "stream")
        ),
    ),
)

Wrapper = Callable[[Any, Any, tuple[Any, ...], dict[str, Any]], Any]

_caller_list: ContextVar[Any] = ContextVar("jiuwen_hooks_caller_list", default=None)


def model_call(client: Any, options: Any) -> ModelCall | None:
    """A tracked API's request (``FinalRequestOptions``) in plain terms, or ``None``."""
    if str(getattr(options, "method", "")).lower() != "post":
        return None
    api = api_of(str(getattr(options, "url", "")))
    body = getattr(options, "json_data", None)
    if api is None or not isinstance(body, dict):
        return None
    headers = getattr(options, "headers", None)
    # openai's api_key; anthropic's api_key (x-api-key) or auth_token (a Bearer token, which is
    # what vLLM checks): the release POST carries it as a Bearer token.
    api_key = getattr(client, "api_key", None) or getattr(client, "auth_token", None)
    return ModelCall(
        api=api,
        body=body,
        extra_body=getattr(options, "extra_json", None),
        headers=headers if isinstance(headers, dict) else None,
        default_headers=getattr(client, "_custom_headers", None),
        base_url=str(getattr(client, "base_url", "") or ""),
        api_key=api_key if isinstance(api_key, str) else None,
        caller_list=_caller_list.get(),
    )


def rewritten(
    options: Any, headers: dict[str, Any] | None, extra_body: dict[str, Any] | None
) -> Any:
    """A copy of the request options with new headers / extra body (the caller's are kept)."""
    update: dict[str, Any] = {}
    if headers is not None:
        update["headers"] = headers
    if extra_body is not None:
        update["extra_json"] = extra_body
    return options.model_copy(update=update) if update else options


def _options_argument(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, Callable[[Any], tuple[tuple[Any, ...], dict[str, Any]]]]:
    """``request(cast_to, options, ...)``: the options and a way to put new ones in their place."""
    if len(args) > 1:
        return args[1], lambda new: ((args[0], new, *args[2:]), kwargs)
    return kwargs.get("options"), lambda new: (args, {**kwargs, "options": new})


def request_wrapper(hook: Any) -> Wrapper:
    """``SyncAPIClient.request``: prepare (session, diff, headers), settle (a POST release, or
    wait for a compressor's), then the real request."""

    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not hook.active:
            return wrapped(*args, **kwargs)
        options, replace = _options_argument(args, kwargs)
        prepared = hook.before_call(lambda: model_call(instance, options))
        if prepared is None:
            return wrapped(*args, **kwargs)
        hook.settle(prepared)
        args, kwargs = replace(rewritten(options, prepared.headers, prepared.extra_body))
        return wrapped(*args, **kwargs)

    return wrapper


def async_request_wrapper(hook: Any) -> Wrapper:
    """``AsyncAPIClient.request``: as ``request_wrapper``, awaited."""

    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not hook.active:
            return wrapped(*args, **kwargs)

        async def call() -> Any:
            options, replace = _options_argument(args, kwargs)
            prepared = hook.before_call(lambda: model_call(instance, options))
            if prepared is None:
                return await wrapped(*args, **kwargs)
            await hook.asettle(prepared)
            new_args, new_kwargs = replace(
                rewritten(options, prepared.headers, prepared.extra_body)
            )
            return await wrapped(*new_args, **new_kwargs)

        return call()

    return wrapper


def caller_list_wrapper(hook: Any, argument: str) -> Wrapper:
    """Note the caller's own list object for the duration of the call: while the method runs
    and, when it returns a coroutine (an async ``create``), while that is awaited. What it
    returns otherwise (a stream manager, whose request starts later) is passed on unchanged."""

    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        value = kwargs.get(argument)
        if not hook.active or not isinstance(value, list):
            return wrapped(*args, **kwargs)
        token = _caller_list.set(value)
        try:
            result = wrapped(*args, **kwargs)
        finally:
            _caller_list.reset(token)
        if not inspect.iscoroutine(result):
            return result

        async def call() -> Any:
            token = _caller_list.set(value)
            try:
                return await result
            finally:
                _caller_list.reset(token)

        return call()

    return wrapper
