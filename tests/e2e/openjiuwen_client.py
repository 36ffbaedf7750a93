"""Drive the real openJiuwen client, inside a virtualenv holding the ``openjiuwen`` package (run by
``test_openjiuwen_clients.py``; openJiuwen's pins cannot share the main environment).

    python openjiuwen_client.py STEP REQUEST.json

REQUEST holds ``base_url`` (the server root), ``model``, ``session`` and ``window`` (chat
messages), plus ``start`` for ``evict-range``. Steps:

- openJiuwen >= 0.1.19, ``agent_hint`` protocol (``kv_cache.mode = "affinity"``): ``invoke``,
  ``evict-range`` (messages ``[start, len)``), ``evict-session``;
- openJiuwen <= 0.1.16, the ``/release_kv_cache`` POST contract (``InferenceAffinity``):
  ``old-invoke`` (``cache_salt`` = session), ``old-release`` (from message ``start``).

Prints one JSON object: what the client returned.
"""

from __future__ import annotations

import asyncio
import json
import sys
from importlib.metadata import version
from typing import Any


def configs(request: dict[str, Any], **client: Any) -> tuple[Any, Any]:
    from openjiuwen.core.foundation.llm.schema.config import ModelClientConfig, ModelRequestConfig

    client_config = ModelClientConfig(
        api_base=request["base_url"],
        api_key="none",
        timeout=120,
        max_retries=1,
        verify_ssl=False,  # plain HTTP on loopback
        **client,
    )
    return client_config, ModelRequestConfig(model=request["model"], max_tokens=4)


async def new_protocol(step: str, request: dict[str, Any]) -> dict[str, Any]:
    from openjiuwen.core.foundation.llm.model import Model

    client_config, model_config = configs(
        {**request, "base_url": request["base_url"] + "/v1"},
        client_provider="OpenAI",
        extensions={"kv_cache": {"mode": "affinity"}},
    )
    model = Model(client_config, model_config)
    session, window = request["session"], request["window"]
    if step == "invoke":
        kwargs = model.build_kv_cache_affinity_invoke_kwargs(
            session_id=session, enable_kv_cache_affinity=True
        )
        reply = await model.invoke(window, max_tokens=4, **kwargs)
        return {"content": reply.content, "hint_kwargs": kwargs}
    if step == "evict-range":
        ok = await model.evict_kvc(
            session_id=session,
            target="messages",
            messages=window,
            msg_start=request["start"],
            msg_end=len(window),
            model=request["model"],
        )
        return {"ok": ok}
    if step == "evict-session":
        return {"ok": await model.evict_kvc(session_id=session, model=request["model"])}
    raise SystemExit(f"unknown step {step}")


async def old_protocol(step: str, request: dict[str, Any]) -> dict[str, Any]:
    from openjiuwen.core.foundation.llm.model_clients.inference_affinity_model_client import (
        InferenceAffinityModelClient,
    )

    client_config, model_config = configs(request, client_provider="InferenceAffinity")
    client = InferenceAffinityModelClient(model_config, client_config)
    session, window = request["session"], request["window"]
    if step == "old-invoke":
        reply = await client.invoke(
            window, max_tokens=4, session_id=session, enable_cache_sharing=True
        )
        return {"content": reply.content}
    if step == "old-release":
        ok = await client.release(session, window, request["start"], model=request["model"])
        return {"ok": ok}
    raise SystemExit(f"unknown step {step}")


def main() -> None:
    step, path = sys.argv[1], sys.argv[2]
    with open(path) as f:
        request = json.load(f)
    run = old_protocol if step.startswith("old-") else new_protocol
    result = asyncio.run(run(step, request))
    print(json.dumps({"openjiuwen": version("openjiuwen"), **result}))


if __name__ == "__main__":
    main()
