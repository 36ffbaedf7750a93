"""Pure core: who a request comes from (its *principal*), and session names scoped to it.

A session is named by a string its agent chose, so on a shared server a name alone proves
nothing. Every session the plugin acts on is keyed by (principal, session) instead: a caller can
reach only the sessions its own principal made, on every path (binding, in-request and POST
releases, ``agent_hint``, idle signals, subagents).

The principal is, first match wins:
- the value of ``VLLM_AFFINITY_TENANT_HEADER``, when set (a trusted gateway names the tenant);
- the API key the request authenticated with, when the server has keys (vLLM takes several);
- else nobody in particular: one anonymous principal, and session names stay as they are, as
  vLLM's own prefix cache is then shared by all.

Only digests are kept (never a key). A scoped name is ``<principal>/<session>``: principals are
fixed-length digests or ``anon``, a prefix-free set, so no two (principal, session) pairs give
one scoped name.
"""

from __future__ import annotations

import hashlib

#: The principal of requests when the server tells callers apart by nothing.
UNSCOPED = ""
#: The principal of requests without the tenant header (or key) on a server that has them.
ANONYMOUS = "anon"
_DIGEST_CHARS = 24


def key_principal(token: str) -> str:
    """The principal of an API key (a digest: the key itself is never kept)."""
    return "k" + hashlib.sha256(token.encode()).hexdigest()[: _DIGEST_CHARS - 1]


def tenant_principal(value: str) -> str:
    """The principal a gateway's tenant header names."""
    return "t" + hashlib.sha256(value.encode()).hexdigest()[: _DIGEST_CHARS - 1]


def scoped(principal: str, session: str) -> str:
    """The name the engine keys ``session`` of ``principal`` by."""
    return session if principal == UNSCOPED else f"{principal}/{session}"
