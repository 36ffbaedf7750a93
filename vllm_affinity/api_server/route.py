"""vLLM adapter, API-server side: the plugin's HTTP routes, ``POST /release_kv_cache``,
``GET /affinity/capabilities``, ``GET /affinity/stats`` and ``GET /affinity/check``, each behind
vLLM's own API keys (one dependency), and ``attach``, which adds them and wraps vLLM's serving
methods (``serving.py``)."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from jiuwen_kv_protocol.headers import CAPABILITIES_PATH, RELEASE_PATH
from jiuwen_kv_protocol.models import ReleaseError

from .._version import plugin_version
from ..settings import Settings
from .release_service import CAPABILITIES, ReleaseService, error_response, service_of
from .serving import wrap_serving

router = APIRouter()


def authorised(raw: Request) -> ReleaseService:
    """The release service, for a caller holding one of the server's API keys (when it has
    any): vLLM's own middleware does not cover the plugin's routes."""
    service = service_of(raw)
    if service.api_tokens and not service.authorised(raw):
        service.metrics.count_request("unauthorized")
        raise HTTPException(status_code=401, detail="Unauthorized")
    return service


Authorised = Annotated[ReleaseService, Depends(authorised)]


@router.post(RELEASE_PATH)
async def release_kv_cache(raw: Request, service: Authorised) -> JSONResponse:
    return await service.handle(raw)


@router.get(CAPABILITIES_PATH)
async def affinity_capabilities(service: Authorised) -> JSONResponse:
    return JSONResponse({**CAPABILITIES, "version": plugin_version()})


@router.get("/affinity/stats")
async def affinity_stats(service: Authorised) -> JSONResponse:
    try:
        return JSONResponse(await service.stats())
    except ReleaseError as exc:
        return error_response(exc.status, exc.message, exc.kind)


def from_loopback(raw: Request) -> bool:
    """Whether the caller is on this machine (a loopback address)."""
    host = raw.client.host if raw.client is not None else ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@router.get("/affinity/check")
async def affinity_check(raw: Request, service: Authorised, blocks: bool = False) -> JSONResponse:
    """The plugin's invariants in every engine (free queue, pool, session table): for soak
    tests and operators. O(blocks + bindings) in the engine core, between two scheduler steps
    (0.13 s at 400k blocks here): only for a caller holding the server's API key or, on a
    server without keys, one on this machine. ``?blocks=true`` adds each group's cached block
    hashes, to check a KV-event consumer: only on a single-tenant server (one key at most, no
    tenant header), since the list fingerprints every tenant's cache at once."""
    if not service.api_tokens and not from_loopback(raw):
        return error_response(
            403, "/affinity/check answers a caller with the server's API key or a loopback one",
            "PermissionDeniedError",
        )  # fmt: skip
    if blocks and (service.settings.tenant_header or len(service.api_tokens) > 1):
        return error_response(
            403, "the cached block list is served only on a single-tenant server",
            "PermissionDeniedError",
        )  # fmt: skip
    try:
        engines = await service.call_engines("affinity_check", blocks)
    except ReleaseError as exc:
        return error_response(exc.status, exc.message, exc.kind)
    ok = all(not e["problems"] for e in engines)
    return JSONResponse({"ok": ok, "engines": engines})


def attach(app: FastAPI, settings: Settings, count_hint: Callable[[str], None]) -> None:
    app.include_router(router)
    wrap_serving(settings, count_hint)
